"""Decode throughput with LoRA adapters mixed in one batch vs the base model alone, in process (the model and
the grouped LoRA product of workers/lora.py; no scheduler or sockets): SmolLM2, B sequences decoding together,
the same run timing the base and then the batch split over N rank-R adapters on every projection.

    python bench/lora_decode.py                      # 64 sequences, 4 adapters of rank 16, fp32, 3 rounds
    python bench/lora_decode.py --cpu-time           # 1 thread timed on its CPU time: ratios hold on a loaded host
    python bench/lora_decode.py --cpu-time --torch-path   # the torch product (accelerators' path) instead
    python bench/lora_decode.py --seqs 64 --adapters 4 --rank 16 --steps 32 --dtype bfloat16

Each round times the base, then the mixed batch, on the same runner; the ratios of all rounds are printed.

Needs peft (the adapters are random PEFT folders made under a temporary folder).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bus.sampling_params import LoraRef  # noqa: E402
from engine.model_store import resolve_model  # noqa: E402
from tests.lora_helpers import make_adapter  # noqa: E402
from tests.tiny_models import PagedRunner, load_model, random_prompt  # noqa: E402
from workers.lora import LoraSlots, attach, model_shape  # noqa: E402


def decode_tokens_per_s(model, slots, keys, prompt_len: int, steps: int, clock=time.perf_counter) -> float:
    runner = PagedRunner(model, num_blocks=len(keys) * ((prompt_len + steps) // 16 + 2), block_size=16)
    prompts = [random_prompt(prompt_len, model.cfg.vocab_size, i) for i in range(len(keys))]
    slots.begin_step([k for k, p in zip(keys, prompts) for _ in p])
    logits = runner.step(prefills=list(enumerate(prompts)))
    toks = logits[torch.tensor([prompt_len * (i + 1) - 1 for i in range(len(keys))])].argmax(-1).tolist()
    slots.begin_step(keys)
    t0 = clock()
    for _ in range(steps):
        toks = runner.step(decodes=list(enumerate(toks))).argmax(-1).tolist()
    dt = clock() - t0
    slots.end_step()
    return len(keys) * steps / dt


def build_times(slots, ref) -> None:
    """What a worker spends on an in-place reload of one adapter: read and build from its folder, or build from
    tensors a trainer pushed (workers/lora_stage.py hands them over at commit)."""
    from safetensors.torch import load_file

    from engine.lora import inspect_adapter
    from workers.lora import AdapterWeights

    args = (slots.hf_config, slots.max_rank, slots.dtype, slots.device, slots.kernel)
    t0 = time.perf_counter()
    AdapterWeights.from_folder(ref, *args)
    t1 = time.perf_counter()
    tensors = load_file(str(Path(ref.path) / "adapter_model.safetensors"))
    spec = inspect_adapter(ref.name, ref.path, slots.hf_config, slots.max_rank)
    t2 = time.perf_counter()
    AdapterWeights(tensors, spec, slots.hf_config, slots.dtype, slots.device, slots.kernel)
    t3 = time.perf_counter()
    print(f"one adapter's build on a worker: from its folder {1e3 * (t1 - t0):.0f} ms, from pushed tensors "
          f"{1e3 * (t3 - t2):.0f} ms", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqs", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--torch-path", action="store_true", help="the torch LoRA product, not the CPU kernel")
    ap.add_argument("--cpu-time", action="store_true", help="one thread, timed on its CPU time (time.thread_time)")
    args = ap.parse_args()
    clock = time.perf_counter
    if args.cpu_time:
        torch.set_num_threads(1)
        clock = time.thread_time
    base = resolve_model(None, progress=False)
    dtype = getattr(torch, args.dtype)
    model = load_model(base, dtype)
    slots = LoraSlots(model_shape(model), model.kern, max_rank=args.rank, max_cached=args.adapters, dtype=dtype,
                      device=torch.device("cpu"), kernel=not args.torch_path)
    attach(model, slots)
    with tempfile.TemporaryDirectory() as tmp:
        refs = [LoraRef(i + 1, f"l{i}", str(make_adapter(base, Path(tmp) / f"l{i}", rank=args.rank,
                                                            alpha=2 * args.rank, seed=i, std=0.01)), 1)
                for i in range(args.adapters)]
        keys = [slots.acquire(r) for r in refs]
        build_times(slots, refs[0])
        mixed = [keys[i % len(keys)] for i in range(args.seqs)]
        decode_tokens_per_s(model, slots, [None] * 4, args.prompt_len, 2)  # warm-up
        decode_tokens_per_s(model, slots, mixed, args.prompt_len, 2)
        for r in range(args.rounds):
            base_tps = decode_tokens_per_s(model, slots, [None] * args.seqs, args.prompt_len, args.steps, clock)
            lora_tps = decode_tokens_per_s(model, slots, mixed, args.prompt_len, args.steps, clock)
            print(f"round {r + 1}: SmolLM2 {args.dtype}, {args.seqs} sequences, {torch.get_num_threads()} threads"
                  f"{' (CPU time)' if args.cpu_time else ''}, LoRA {'kernel' if slots.kernel else 'torch'}: base "
                  f"{base_tps:.0f} tok/s; {args.adapters} rank-{args.rank} adapters mixed {lora_tps:.0f} tok/s "
                  f"({100 * lora_tps / base_tps:.1f}% of base)", flush=True)


if __name__ == "__main__":
    main()
