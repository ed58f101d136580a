"""What the bus costs per decode step: the real scheduler and worker processes on real sockets, driven
directly over the requests socket (no HTTP), against the same step executed in one process.

The model is a 2-layer random model with SmolLM2's shapes, so compute is small and the per-step
difference is the bus: plan encode -> PUB/SUB -> decode, result encode -> PUSH/PULL -> decode, and the
wake-ups in between.

    python bench/bus_hop.py [--seqs 64] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import torch
import zmq
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bus.codec import decode, encode  # noqa: E402
from bus.endpoints import Endpoints  # noqa: E402
from bus.messages import AddRequest, NewSeq, OutputBatch, StepPlan  # noqa: E402
from bus.sampling_params import SamplingParams  # noqa: E402
from bus.sockets import make_socket, send  # noqa: E402
from engine.block_manager import BlockManager  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.request import Sequence  # noqa: E402
from engine.scheduler import Scheduler  # noqa: E402
from workers.kv_cache import KVCache  # noqa: E402
from workers.model_runner import ModelRunner  # noqa: E402
from workers.models.registry import build_model  # noqa: E402

CONFIG = {"architectures": ["LlamaForCausalLM"], "hidden_size": 576, "intermediate_size": 1536,
          "num_hidden_layers": 2, "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64,
          "vocab_size": 49152, "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 2048,
          "tie_word_embeddings": True, "torch_dtype": "float32"}


def make_model(folder: Path) -> None:
    h, i, v, kv = CONFIG["hidden_size"], CONFIG["intermediate_size"], CONFIG["vocab_size"], 3 * 64
    g = torch.Generator().manual_seed(0)
    w = {"model.embed_tokens.weight": torch.randn(v, h, generator=g) * 0.05, "model.norm.weight": torch.ones(h)}
    for n in range(CONFIG["num_hidden_layers"]):
        p = f"model.layers.{n}."
        for name, shape in (("self_attn.q_proj", (h, h)), ("self_attn.k_proj", (kv, h)), ("self_attn.v_proj", (kv, h)),
                            ("self_attn.o_proj", (h, h)), ("mlp.gate_proj", (i, h)), ("mlp.up_proj", (i, h)),
                            ("mlp.down_proj", (h, i))):
            w[p + name + ".weight"] = torch.randn(*shape, generator=g) * 0.05
        w[p + "input_layernorm.weight"] = torch.ones(h)
        w[p + "post_attention_layernorm.weight"] = torch.ones(h)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(w, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(CONFIG))


def prompts(n: int) -> list[list[int]]:
    return [[(31 * k + j) % 40000 + 10 for j in range(32)] for k in range(n)]


def in_process(folder: Path, seqs: int, tokens: int) -> tuple[float, float]:
    """(mean execute ms per step, mean codec ms per step) with no sockets at all."""
    from workers.models.checkpoint import iter_checkpoint

    model = build_model(CONFIG, torch.float32, torch.device("cpu"))
    model.load_weights(iter_checkpoint(folder))
    kv = KVCache(*model.kv_spec, 16, 1024, torch.float32, torch.device("cpu"))
    runner = ModelRunner(model, kv, rank=0, block_size=16, device=torch.device("cpu"))
    sched = Scheduler(BlockManager(1024, 16), 256, 4096, 2048)
    for k, p in enumerate(prompts(seqs)):
        sp = SamplingParams(temperature=1.0, seed=k, max_tokens=tokens, ignore_eos=True)
        sched.add(Sequence(f"r{k}", p, sp, [2]))
    exec_t, codec_t, steps = 0.0, 0.0, 0
    while sched.has_work():
        step = sched.schedule()
        plan = StepPlan(steps, [NewSeq(q.seq_id, q.prompt_token_ids, q.sampling, q.eos_token_ids)
                                for q in step.new_seqs], [q.seq_id for q in step.seqs], step.num_computed,
                        step.num_new, [q.block_table for q in step.seqs], step.finished_ids, 0)
        t0 = time.perf_counter()
        res = runner.execute(plan)
        t1 = time.perf_counter()
        decode([bytes(f) for f in encode(plan)])
        decode([bytes(f) for f in encode(res)])
        t2 = time.perf_counter()
        if steps:  # skip the prefill step
            exec_t += t1 - t0
            codec_t += t2 - t1
        steps += 1
        sched.update(step, {s: (int(t), float(lp), None) for s, t, lp in zip(res.seq_ids, res.token_ids, res.logprobs)})
    return 1e3 * exec_t / (steps - 1), 1e3 * codec_t / (steps - 1)


def start_engine(folder: Path, bus_dir: Path) -> tuple[EngineConfig, list[subprocess.Popen]]:
    """The coordinator, scheduler and one worker (no gateway) on `folder`, their sockets under bus_dir."""
    cfg = EngineConfig.from_flags(model=str(folder), bus_dir=str(bus_dir), port=0, max_model_len=2048,
                       num_gpu_blocks_override=1024)
    argv = cfg.to_argv()
    procs = [subprocess.Popen([sys.executable, "-m", "engine.cli", *role, *argv])
             for role in (["coordinator"], ["scheduler"], ["worker", "--rank", "0"])]
    return cfg, procs


def over_the_bus(folder: Path, seqs: int, tokens: int) -> dict[str, float]:
    cfg, procs = start_engine(folder, Path(tempfile.mkdtemp(prefix="rollbus-hop-")))
    ctx = zmq.Context()
    try:
        sock = make_socket(ctx, zmq.DEALER, connect=Endpoints.from_config(cfg).requests, identity="bench")

        def run(n: int, max_tokens: int) -> dict[str, float]:
            ids = [uuid.uuid4().hex for _ in range(n)]
            for k, (rid, p) in enumerate(zip(ids, prompts(n))):
                sp = SamplingParams(temperature=1.0, seed=k, max_tokens=max_tokens, ignore_eos=True)
                send(sock, AddRequest(rid, p, sp, [2], time.time()))
            left = set(ids)
            stats: dict[str, float] = {}
            while left:
                if not sock.poll(120_000):
                    raise TimeoutError("no output from the scheduler (is it up?)")
                batch = decode(sock.recv_multipart())
                if isinstance(batch, OutputBatch):
                    stats = batch.stats
                    left -= {o.request_id for o in batch.outputs if o.finished}
            return stats

        run(1, 2)  # warm-up: waits for start-up too
        before = run(seqs, 1)  # after this, only the measured decode steps differ
        after = run(seqs, tokens)
        steps = after["steps"] - before["steps"]
        wall = after["step_time_total"] - before["step_time_total"]
        compute = after["step_compute_total"] - before["step_compute_total"]
        return {"steps": steps, "step_ms": 1e3 * wall / steps, "compute_ms": 1e3 * compute / steps,
                "hop_ms": 1e3 * (wall - compute) / steps}
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(10)
        ctx.destroy(linger=0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="rollbus-hop-model-"))
    print("building a 2-layer random model with SmolLM2's shapes ...", file=sys.stderr)
    make_model(folder)
    print("in one process ...", file=sys.stderr)
    exec_ms, codec_ms = in_process(folder, args.seqs, args.tokens)
    print("over the bus (coordinator, scheduler, worker processes) ...", file=sys.stderr)
    bus = over_the_bus(folder, args.seqs, args.tokens)
    print(f"\nPer decode step, {args.seqs} sequences ({bus['steps']:.0f} steps over the bus)")
    print(f"  in one process: execute            {exec_ms:8.3f} ms"
          f"  (+ encode/decode of plan and result {codec_ms:.3f} ms)")
    print(f"  over the bus:   scheduler wall     {bus['step_ms']:8.3f} ms")
    print(f"                  worker compute     {bus['compute_ms']:8.3f} ms")
    print(f"                  bus hop            {bus['hop_ms']:8.3f} ms   (wall - compute)")


if __name__ == "__main__":
    main()
