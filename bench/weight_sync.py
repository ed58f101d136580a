"""Weight-sync benchmark (issue 4, "Bars"): how fast a trainer's weights get into a running `rollbus serve`,
against a peer measured in the same run, and what a failed update leaves behind.

The default model (SmolLM2-135M-Instruct, fp32, about 540 MB) is the trainer's copy (HF transformers in
this process) and the engine's. Every bar is a ratio against a peer timed in the same run, round by round
(the peer and the contenders alternate, so a noisy shared host hits them alike); median and best of N.

  1. ipc: WeightSyncClient.send_weights(..., pause="keep"), pause to resume, packed and unpacked, after one
     warm-up each, against one memcpy of the same bytes (dst.copy_(src), preallocated and pre-faulted).
     Bar (issue 31): ipc update <= 1.5x memcpy. Per-phase breakdown from client.timings.
  2. collective (hccl backend, Gloo on CPU): the transfer phase and the whole send, packed, unpacked and
     packed with share_memory=True (the trainer's tensors moved once into one buffer in packed order),
     against a raw torch.distributed broadcast of the same bytes between this process and a subprocess
     (init_process_group("gloo")): one flat tensor, and per tensor as unpacked sends them.
     Bar (issue 31): collective throughput >= 75% of the raw broadcast's.
  3. a failed update (packed chunk written and staged, then a chunk whose middle tensor has a wrong shape):
     greedy tokens + top-5 logprobs, /weight_info and /weight_checker checksums bitwise unchanged.
  Also the worker's memory before the first update and after (the stage_updates copy).

    python bench/weight_sync.py                  # 1.5 to 5 minutes on a shared 2-core host
    python bench/weight_sync.py --quick          # smoke run, fewer repeats
    python bench/weight_sync.py --json out.json --plot out.png [--profile] [--omp-passive]
"""

from __future__ import annotations

import argparse
import copy
import cProfile
import datetime
import io
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.model_store import resolve_model  # noqa: E402
from engine.trainer import WeightSyncClient  # noqa: E402
from engine.weights.ipc import SharedBuffer  # noqa: E402
from engine.weights.protocol import ParamMeta, UpdateMeta  # noqa: E402
from tests.serve_process import Server, free_port, start_server  # noqa: E402

RL = '{"rl_config": {"enabled": true}}'
PHASES = ("prepare", "pause", "start", "transfer", "finish", "resume", "total")
EXTRA = ("update_calls", "n_update_calls")  # the /update_weights replies within transfer: sum of durations, count
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
SERVE_ARGS = ("--additional-config", RL, "--dtype", "float32", "--max-model-len", "2048",
              "--kv-cache-memory-bytes", str(256 << 20))

# The receiving end of the raw broadcast (rank 1). Rank 0 announces each round with a one-element
# broadcast: 1 = one flat tensor, 2 = per tensor, 0 = stop; a barrier closes each round, so rank 0's clock
# stops when the bytes have arrived, as the engine's update_weights reply does.
RAW_PEER = """
import datetime, json, sys, torch, torch.distributed as dist
sizes = json.loads(open(sys.argv[2]).read())
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=1, world_size=2,
                        timeout=datetime.timedelta(seconds=900))
flat = torch.zeros(sum(sizes), dtype=torch.uint8)  # pre-faulted, as the engine's staging copies are
parts = [torch.zeros(n, dtype=torch.uint8) for n in sizes]
cmd = torch.zeros(1, dtype=torch.int64)
while True:
    dist.broadcast(cmd, 0)
    if int(cmd) == 0:
        break
    if int(cmd) == 1:
        dist.broadcast(flat, 0)
    else:
        for p in parts:
            dist.broadcast(p, 0)
    dist.barrier()
dist.destroy_process_group()
"""


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def med(xs: list[float]) -> float:
    return statistics.median(xs)


def mem(pid: int) -> dict[str, int]:
    """VmRSS split into anonymous (the worker's own tensors: weights, staging, KV), file and shared memory
    (the trainer's shared-memory buffers mapped read-only: the trainer's memory, counted in both RSSes)."""
    out = {}
    for line in open(f"/proc/{pid}/status"):
        key = line.split(":")[0]
        if key in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            out[key] = int(line.split()[1]) * 1024
    return out


def instrument(client: WeightSyncClient) -> dict[str, list[float]]:
    """Time each HTTP call the client makes (wraps this instance's _post; the client is unchanged): the
    /update_weights replies are the engine's share of the transfer phase."""
    calls: dict[str, list[float]] = {}
    post = client._post

    def timed(path, body, url=None):
        t = time.perf_counter()
        try:
            return post(path, body, url)
        finally:
            calls.setdefault(path.split("?")[0], []).append(time.perf_counter() - t)

    client._post = timed
    return calls


def timed_send(client: WeightSyncClient, calls: dict[str, list[float]], model: torch.nn.Module, version: str,
               phases: dict[str, list[float]]) -> float:
    calls.clear()
    t0 = time.perf_counter()
    client.send_weights(model.named_parameters(), version=version, pause="keep")
    dt = time.perf_counter() - t0
    for p in PHASES:
        phases[p].append(client.timings.get(p, 0.0))
    phases["update_calls"].append(sum(calls.get("/update_weights", [])))
    phases["n_update_calls"].append(len(calls.get("/update_weights", [])))
    return dt


def profile_call(fn, top: int = 18) -> str:
    prof = cProfile.Profile()
    prof.enable()
    fn()
    prof.disable()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(top)
    return s.getvalue()


# --- outputs ---------------------------------------------------------------------------------------------

def greedy_outputs(url: str, model: str) -> list[dict]:
    """Tokens, logprobs and top-5 alternatives of greedy completions, as the server's JSON gives them
    (floats round-trip exactly through JSON, so equality here is bitwise equality of the values)."""
    out = []
    for p in PROMPTS:
        r = httpx.post(url + "/v1/completions", timeout=120, json={
            "model": model, "prompt": p, "max_tokens": 16, "temperature": 0, "logprobs": 5, "ignore_eos": True,
            "return_tokens_as_token_ids": True})
        r.raise_for_status()
        c = r.json()["choices"][0]
        out.append({"text": c["text"], "logprobs": c["logprobs"]})
    return out


def weight_state(url: str) -> tuple[str, dict[str, str]]:
    version = httpx.get(url + "/weight_info", timeout=60).json()["weight_version"]
    # (no /weight_checker reset here: it zeroes the weights, as vLLM's; the gateway's cached checksums are
    # dropped by any command that follows them, a failed update's abort included)
    sums = httpx.post(url + "/weight_checker", json={"action": "checksum"}, timeout=300).json()["checksums"]
    return version, sums


# --- 1. ipc ----------------------------------------------------------------------------------------------

def bench_ipc(server: Server, model: torch.nn.Module, nbytes: int, rounds: int, profile: bool) -> dict:
    url, worker = server.url, server.child_pids()["worker-0"]
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    out: dict = {"rss_before": mem(worker)}
    src = torch.cat([t.detach().reshape(-1).view(torch.uint8) for _, t in named])
    dst = torch.zeros_like(src)  # pre-faulted
    assert src.numel() == nbytes
    # "shared": share_memory=True moves the trainer's tensors into shared memory at the first send, so
    # later sends copy nothing on the trainer side (the other two then read that memory too: same bytes).
    clients = {"packed": WeightSyncClient(url, backend="ipc", packed=True),
               "unpacked": WeightSyncClient(url, backend="ipc", packed=False),
               "shared": WeightSyncClient(url, backend="ipc", packed=False, share_memory=True)}
    calls = {m: instrument(c) for m, c in clients.items()}
    try:
        for mode, c in clients.items():
            say(f"[ipc] warm-up update, {mode} ...")
            t0 = time.perf_counter()
            c.send_weights(model.named_parameters(), version=f"ipc-warm-{mode}", pause="keep")
            out[f"{mode}_first_s"] = time.perf_counter() - t0
            out[f"rss_after_first_{mode}"] = mem(worker)
        copies: list[float] = []
        sends: dict[str, list[float]] = {m: [] for m in clients}
        phases: dict[str, dict[str, list[float]]] = {m: {p: [] for p in PHASES + EXTRA} for m in clients}
        loads: list[float] = []
        for r in range(rounds):
            loads.append(os.getloadavg()[0])
            dst.fill_(0)  # not timed: the copy below writes cached-cold, resident pages
            t0 = time.perf_counter()
            dst.copy_(src)
            copies.append(time.perf_counter() - t0)
            order = list(clients) if r % 2 == 0 else list(clients)[::-1]
            for mode in order:
                sends[mode].append(timed_send(clients[mode], calls[mode], model, f"ipc-{mode}-{r}", phases[mode]))
            say(f"[ipc] round {r + 1}/{rounds}: memcpy {1e3 * copies[-1]:.0f} ms, "
                + ", ".join(f"{m} {1e3 * sends[m][-1]:.0f} ms" for m in clients))
        out["memcpy_s"] = copies
        out["load1"] = loads
        out["send_s"] = sends
        out["phases_s"] = phases
        out["rss_after"] = mem(worker)
        if profile:
            for mode, c in clients.items():
                say(f"[ipc] cProfile of one {mode} send (client side) ...")
                out[f"profile_{mode}"] = profile_call(
                    lambda c=c, mode=mode: c.send_weights(model.named_parameters(), version=f"ipc-prof-{mode}"))
    finally:
        for c in clients.values():
            c.close()
    return out


# --- 2. collective ---------------------------------------------------------------------------------------

class RawBroadcast:
    """This process (rank 0) and one subprocess (rank 1) in a plain init_process_group("gloo")."""

    def __init__(self, named: list[tuple[str, torch.Tensor]], work: Path):
        sizes = [t.numel() * t.element_size() for _, t in named]
        (work / "sizes.json").write_text(json.dumps(sizes))
        port = free_port()
        self.proc = subprocess.Popen([sys.executable, "-c", RAW_PEER, str(port), str(work / "sizes.json")])
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=2,
                                timeout=datetime.timedelta(seconds=900))
        self.flat = torch.cat([t.detach().reshape(-1).view(torch.uint8) for _, t in named])
        self.parts = [t.detach().reshape(-1).view(torch.uint8) for _, t in named]

    def run(self, kind: int) -> float:
        dist.broadcast(torch.tensor([kind], dtype=torch.int64), 0)
        t0 = time.perf_counter()
        for t in ([self.flat] if kind == 1 else self.parts):
            dist.broadcast(t, 0)
        dist.barrier()
        return time.perf_counter() - t0

    def close(self) -> None:
        try:
            dist.broadcast(torch.tensor([0], dtype=torch.int64), 0)
            dist.destroy_process_group()
        finally:
            self.proc.wait(60)


def bench_collective(server: Server, model: torch.nn.Module, rounds: int, work: Path, profile: bool) -> dict:
    url, worker = server.url, server.child_pids()["worker-0"]
    named = [(n, p.detach()) for n, p in model.named_parameters()]
    out: dict = {"rss_before": mem(worker)}
    say("[collective] raw gloo peer: init_process_group with one subprocess ...")
    raw = RawBroadcast(named, work)
    # One client, one group on the engine: `packed` travels with each update_weights call (update_info.packed),
    # so flipping the client's flag between sends lets the modes alternate round by round. "shared" is packed
    # with share_memory=True: a copy of the trainer (the original stays as a trainer's tensors usually lie)
    # moves into one buffer in packed order at its first send, so its chunks are broadcast without packing.
    client = WeightSyncClient(url, backend="hccl", packed=True)
    calls = instrument(client)
    modes = ("packed", "unpacked", "shared")
    source = {"packed": model, "unpacked": model, "shared": copy.deepcopy(model)}

    def use(mode: str) -> None:
        client.packed, client.share_memory = mode != "unpacked", mode == "shared"

    try:
        for mode in modes:
            use(mode)
            forms = ' (forms the group)' if client.sender.group is None else ''
            say(f"[collective] warm-up update, {mode}{forms} ...")
            t0 = time.perf_counter()
            client.send_weights(source[mode].named_parameters(), version=f"coll-warm-{mode}", pause="keep")
            out[f"{mode}_first_s"] = time.perf_counter() - t0
            out[f"rss_after_first_{mode}"] = mem(worker)
        raw.run(1)
        raw.run(2)  # warm the raw peer's connections too
        res: dict[str, list[float]] = {k: [] for k in ("raw_flat", "raw_per_tensor")}
        sends: dict[str, list[float]] = {m: [] for m in modes}
        phases: dict[str, dict[str, list[float]]] = {m: {p: [] for p in PHASES + EXTRA} for m in modes}
        loads: list[float] = []
        for r in range(rounds):
            loads.append(os.getloadavg()[0])
            res["raw_flat"].append(raw.run(1))
            res["raw_per_tensor"].append(raw.run(2))
            for mode in (modes if r % 2 == 0 else modes[::-1]):
                use(mode)
                sends[mode].append(timed_send(client, calls, source[mode], f"coll-{mode}-{r}", phases[mode]))
            say(f"[collective] round {r + 1}/{rounds}: raw flat {1e3 * res['raw_flat'][-1]:.0f} ms, "
                f"raw per-tensor {1e3 * res['raw_per_tensor'][-1]:.0f} ms, "
                + ", ".join(f"{m} transfer {1e3 * phases[m]['transfer'][-1]:.0f} / send {1e3 * sends[m][-1]:.0f} ms"
                            for m in modes))
        out.update(res)
        out["load1"] = loads
        out["send_s"] = sends
        out["phases_s"] = phases
        out["rss_after"] = mem(worker)
        if profile:
            for mode in modes:
                use(mode)
                say(f"[collective] cProfile of one {mode} send (client side) ...")
                out[f"profile_{mode}"] = profile_call(
                    lambda mode=mode: client.send_weights(source[mode].named_parameters(),
                                                          version=f"coll-prof-{mode}"))
    finally:
        client.close()
        raw.close()
    return out


# --- 3. failed update ------------------------------------------------------------------------------------

def bench_failure(server: Server, named: list[tuple[str, torch.Tensor]], model: str) -> dict:
    """start -> a valid packed chunk (the first half, every value + 1: bytes are staged) -> a packed chunk
    whose first tensor, the middle one of the model, has a wrong shape -> 400; then compare."""
    url = server.url
    say("[failure] outputs and checksums before ...")
    before, (v_before, sums_before) = greedy_outputs(url, model), weight_state(url)
    half = len(named) // 2
    buf = SharedBuffer(sum(t.numel() * t.element_size() for _, t in named))
    out: dict = {"bad_tensor": named[half][0]}
    try:
        def chunk(items, offset, bad=None):
            metas, off = [], offset
            for i, (n, t) in enumerate(items):
                k = t.numel() * t.element_size()
                buf.tensor[off:off + k].copy_((t.detach() + 1.0).reshape(-1).view(torch.uint8))
                off += k
                metas.append(ParamMeta(n, t.dtype, (t.numel(),) if i == bad else tuple(t.shape)))
            return {**UpdateMeta(metas).to_info(), "ipc_handles": buf.handle(offset, off - offset)}, off

        first, off = chunk(named[:half], 0)
        second, _ = chunk(named[half:], off, bad=0)
        say("[failure] start, a valid chunk, then the chunk with the wrong shape ...")
        t0 = time.perf_counter()
        r0 = httpx.post(url + "/start_weight_update", timeout=60)
        r1 = httpx.post(url + "/update_weights", json={"update_info": first}, timeout=300)
        r2 = httpx.post(url + "/update_weights", json={"update_info": second}, timeout=300)
        out["failed_update_s"] = time.perf_counter() - t0
        out["statuses"] = [r0.status_code, r1.status_code, r2.status_code]
        out["error"] = r2.json().get("error", {}).get("message", r2.text) if r2.status_code != 200 else ""
        r3 = httpx.post(url + "/update_weights", json={"update_info": first}, timeout=300)
        out["update_after_failure_status"] = r3.status_code  # the update ended: 409
    finally:
        buf.close()
    say("[failure] outputs and checksums after ...")
    after, (v_after, sums_after) = greedy_outputs(url, model), weight_state(url)
    out["outputs_identical"] = after == before
    out["version_unchanged"] = v_after == v_before
    out["checksums_unchanged"] = sums_after == sums_before
    out["version"] = v_before
    out["rejected_naming_tensor"] = (out["statuses"] == [200, 200, 400] and named[half][0] in out["error"]
                                     and "shape" in out["error"])
    out["pass"] = all(out[k] for k in ("outputs_identical", "version_unchanged", "checksums_unchanged",
                                       "rejected_naming_tensor")) and out["update_after_failure_status"] == 409
    return out


# --- report ----------------------------------------------------------------------------------------------

def md(rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]

    def line(r: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |"

    return "\n".join([line(rows[0]), "|" + "|".join("-" * (w + 2) for w in widths) + "|"] + [line(r) for r in rows[1:]])


def ms(x: float) -> str:
    return f"{1e3 * x:.0f}"


def gbps(nbytes: int, s: float) -> str:
    return f"{nbytes / s / 1e9:.2f}"


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def phase_table(r: dict, first: str) -> str:
    rows = [["mode", *PHASES, "update_weights calls (n, sum)", "transfer - calls", first]]
    for mode, ph in r["phases_s"].items():
        rest = [t - u for t, u in zip(ph["transfer"], ph["update_calls"])]
        rows.append([mode, *[ms(med(ph[p])) for p in PHASES],
                     f"{med(ph['n_update_calls']):.0f}, {ms(med(ph['update_calls']))}", ms(med(rest)),
                     ms(r[f"{mode}_first_s"])])
    load = r["load1"]
    return md(rows) + f"\n\n1-min load average over the rounds: {min(load):.1f}..{max(load):.1f} (2 cores)"


def report(res: dict, nbytes: int, n_tensors: int, rounds: int) -> str:
    threads = f"torch intra-op threads: {res['threads']}, OMP_WAIT_POLICY: {res['omp_wait_policy']}"
    parts = [f"Model: SmolLM2-135M-Instruct fp32, {n_tensors} tensors, {nbytes / 1e6:.1f} MB; {rounds} timed rounds "
             f"after one warm-up update per mode; contenders and peers alternate within each round; {threads}."]
    if "ipc" in res:
        r = res["ipc"]
        cm, cb = med(r["memcpy_s"]), min(r["memcpy_s"])
        rows = [["measure", "median ms", "best ms", "median / memcpy median", "best / memcpy best", "bar", "result"],
                ["memcpy of the same bytes", ms(cm), ms(cb), "1.00x", "1.00x", "-", "-"]]
        for mode, xs in r["send_s"].items():
            rows.append([f"ipc update, {mode} (pause..resume)", ms(med(xs)), ms(min(xs)), f"{med(xs) / cm:.2f}x",
                         f"{min(xs) / cb:.2f}x", "<= 1.5x memcpy", verdict(med(xs) / cm <= 1.5)])
        parts.append("### 1. IPC update against one memcpy\n\n" + md(rows))
        parts.append("IPC per-phase medians (ms, client.timings)\n\n" + phase_table(r, "first (cold) update"))
    if "collective" in res:
        r = res["collective"]
        flat, per = med(r["raw_flat"]), med(r["raw_per_tensor"])
        rows = [["measure", "median ms", "best ms", "GB/s (median)", "vs raw flat", "vs raw per-tensor", "bar",
                 "result"],
                ["raw gloo broadcast, one flat tensor", ms(flat), ms(min(r["raw_flat"])), gbps(nbytes, flat), "100%",
                 f"{100 * per / flat:.0f}%", "-", "-"],
                ["raw gloo broadcast, per tensor", ms(per), ms(min(r["raw_per_tensor"])), gbps(nbytes, per),
                 f"{100 * flat / per:.0f}%", "100%", "-", "-"]]
        for mode in r["send_s"]:
            peer = per if mode == "unpacked" else flat
            peer_name = "raw per-tensor" if mode == "unpacked" else "raw flat"
            for what, xs in (("transfer phase", r["phases_s"][mode]["transfer"]), ("whole send", r["send_s"][mode])):
                m = med(xs)
                rows.append([f"collective {mode}, {what}", ms(m), ms(min(xs)), gbps(nbytes, m),
                             f"{100 * flat / m:.0f}%", f"{100 * per / m:.0f}%", f">= 75% of {peer_name}",
                             verdict(peer / m >= 0.75)])
        parts.append("### 2. Collective (hccl backend = Gloo on CPU) against a raw broadcast\n\n" + md(rows))
        parts.append("Collective per-phase medians (ms, client.timings)\n\n"
                     + phase_table(r, "first update (incl. rendezvous)"))
    if "failure" in res:
        f = res["failure"]
        rows = [["check", "result"],
                [f"update rejected (start/update/update = {f['statuses']}), naming {f['bad_tensor']}",
                 verdict(f["rejected_naming_tensor"])],
                ["greedy tokens + logprobs (top 5), 3 prompts x 16 tokens: bitwise identical",
                 verdict(f["outputs_identical"])],
                [f"/weight_info unchanged ({f['version']!r})", verdict(f["version_unchanged"])],
                ["/weight_checker checksums unchanged (every tensor)", verdict(f["checksums_unchanged"])],
                [f"update_weights after the failure -> {f['update_after_failure_status']} (update ended)",
                 verdict(f["update_after_failure_status"] == 409)],
                ["failed update, overall", verdict(f["pass"])]]
        parts.append("### 3. Failed update (wrong shape in the middle, after a staged chunk)\n\n" + md(rows)
                     + f"\n\nerror: {f['error']}")
    rows = [["server", "when", "VmRSS MB", "RssAnon MB", "RssShmem MB", "RssAnon delta MB"]]
    for name in ("ipc", "collective"):
        if name not in res:
            continue
        r = res[name]
        base = r["rss_before"]["RssAnon"]
        keys = ["rss_before", *[k for k in r if k.startswith("rss_after_first_")], "rss_after"]
        for k in keys:
            m = r[k]
            rows.append([name, k.removeprefix("rss_").replace("_", " "), f"{m['VmRSS'] / 1e6:.0f}",
                         f"{m['RssAnon'] / 1e6:.0f}", f"{m['RssShmem'] / 1e6:.0f}",
                         f"{(m['RssAnon'] - base) / 1e6:+.0f}"])
    parts.append(f"### Worker memory (stage_updates on; weights = {nbytes / 1e6:.0f} MB)\n\n" + md(rows)
                 + "\n\nRssAnon: the worker's own memory (weights, staging copies, KV pages touched). RssShmem: the "
                 "trainer's shared buffers mapped read-only (the trainer's memory, not extra).")
    return "\n\n".join(parts)


def plot(res: dict, nbytes: int, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        say("matplotlib is not installed: no plot")
        return
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    if "ipc" in res:
        r = res["ipc"]
        labels = ["memcpy", *[f"ipc {m}" for m in r["send_s"]]]
        vals = [med(r["memcpy_s"]), *[med(x) for x in r["send_s"].values()]]
        axes[0].bar(labels, [1e3 * v for v in vals])
        axes[0].axhline(1.5e3 * vals[0], ls="--", color="r", label="bar: 1.5x memcpy")
        axes[0].set_ylabel("ms (median)")
        axes[0].legend()
    if "collective" in res:
        r = res["collective"]
        labels = ["raw flat", "raw per-tensor", "packed xfer", "unpacked xfer", "packed send", "unpacked send"]
        vals = [med(r["raw_flat"]), med(r["raw_per_tensor"]), med(r["phases_s"]["packed"]["transfer"]),
                med(r["phases_s"]["unpacked"]["transfer"]), med(r["send_s"]["packed"]), med(r["send_s"]["unpacked"])]
        axes[1].bar(labels, [nbytes / v / 1e9 for v in vals])
        axes[1].axhline(0.75 * nbytes / vals[0] / 1e9, ls="--", color="r", label="bar: 75% of raw flat")
        axes[1].set_ylabel("GB/s (median)")
        axes[1].tick_params(axis="x", rotation=30)
        axes[1].legend()
    fig.tight_layout()
    fig.savefig(path)
    say(f"plot saved to {path}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=None, help="Timed rounds per section (default 10; --quick 3).")
    ap.add_argument("--quick", action="store_true", help="Smoke run: 3 rounds.")
    ap.add_argument("--only", nargs="+", choices=["ipc", "collective", "failure"],
                    default=["ipc", "collective", "failure"])
    ap.add_argument("--profile", action="store_true", help="Print a client-side cProfile of one send per mode.")
    ap.add_argument("--omp-passive", action="store_true",
                    help="Diagnostic: OMP_WAIT_POLICY=PASSIVE for the engine and this process (re-executes itself), "
                         "so idle OpenMP threads sleep instead of spinning between ops.")
    ap.add_argument("--json", help="Write all numbers to this file.")
    ap.add_argument("--plot", help="Save a bar chart (needs matplotlib).")
    args = ap.parse_args()
    rounds = args.rounds or (3 if args.quick else 10)
    if args.omp_passive and os.environ.get("OMP_WAIT_POLICY", "").upper() != "PASSIVE":
        # libgomp reads it when torch loads: start again with it set (rollbus serve inherits it)
        os.execve(sys.executable, [sys.executable, *sys.argv], {**os.environ, "OMP_WAIT_POLICY": "PASSIVE"})
    t_start = time.perf_counter()

    from transformers import AutoModelForCausalLM

    folder = resolve_model(None, progress=True)
    say(f"loading the trainer's copy from {folder} (fp32) ...")
    trainer = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    named = [(n, p.detach()) for n, p in trainer.named_parameters()]
    nbytes = sum(t.numel() * t.element_size() for _, t in named)
    work = Path(tempfile.mkdtemp(prefix="rollbus-wsync-bench-"))
    res: dict = {"nbytes": nbytes, "tensors": len(named), "rounds": rounds, "threads": torch.get_num_threads(),
                 "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY", "default")}

    if "ipc" in args.only or "failure" in args.only:
        say("starting rollbus serve with the ipc backend ...")
        s = start_server(work, *SERVE_ARGS, "--weight-transfer-config", '{"backend": "ipc"}')
        try:
            if "ipc" in args.only:
                res["ipc"] = bench_ipc(s, trainer, nbytes, rounds, args.profile)
            if "failure" in args.only:
                model = httpx.get(s.url + "/v1/models").json()["data"][0]["id"]
                res["failure"] = bench_failure(s, named, model)
        finally:
            s.stop()
    if "collective" in args.only:
        say("starting rollbus serve with the hccl backend (Gloo on CPU) ...")
        s = start_server(work, *SERVE_ARGS, "--weight-transfer-config", '{"backend": "hccl"}')
        try:
            res["collective"] = bench_collective(s, trainer, rounds, work, args.profile)
        finally:
            s.stop()

    res["runtime_s"] = time.perf_counter() - t_start
    print(report(res, nbytes, len(named), rounds))
    for sec in ("ipc", "collective"):
        for k, v in res.get(sec, {}).items():
            if k.startswith("profile_"):
                print(f"\n#### cProfile, {sec} {k.removeprefix('profile_')} (client side)\n\n```\n{v}```")
    print(f"\nBench runtime: {res['runtime_s']:.0f} s")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    if args.plot:
        plot(res, nbytes, args.plot)


if __name__ == "__main__":
    main()
