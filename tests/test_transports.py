"""Weight-transfer primitives with real processes: shared-memory IPC handles (engine.weights.ipc) and the stateless
broadcast group (engine.weights.collective). Only the CPU paths (shared memory, Gloo) run here.

Child processes are this module run with ``python -c`` (see ``_child_main``); they talk JSON over pipes and
print one ``RESULT {...}`` line. Nothing is pickled, the test harness included.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch

import engine.weights.ipc as ipc
from engine.weights.collective import StoreCollision, WeightGroup
from engine.weights.ipc import HandleImporter, SharedBuffer, device_key, export_handle

pytestmark = pytest.mark.timeout(180)

ROOT = Path(__file__).resolve().parent.parent
MIB = 1 << 20


# --- shared helpers ------------------------------------------------------------------------------


from tests.serve_process import free_port as _free_port  # noqa: E402  (outside the ephemeral ports)


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "fp32": torch.randn(257, 129, generator=g),
        "bf16": torch.randn(1000, 3, generator=g).to(torch.bfloat16),
    }


def _big(seed: int, nbytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _bytes_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.contiguous().reshape(-1).view(torch.uint8), b.contiguous().reshape(-1).view(torch.uint8))


class Child:
    """A child process running ``_child_main(role, args)``; stderr (c10d logs) goes to a temp file."""

    def __init__(self, role: str, **args: object) -> None:
        self.err = tempfile.TemporaryFile()
        code = "from tests.test_transports import _child_main; _child_main()"
        self.proc = subprocess.Popen([sys.executable, "-c", code, role, json.dumps(args)], cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.err, text=True)

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def result(self, timeout: float = 120) -> dict:
        """The next RESULT line (other stdout lines are skipped)."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if line.startswith("RESULT "):
                return json.loads(line[len("RESULT "):])
        raise AssertionError(f"child gave no result (rc={self.proc.poll()}): {self.stderr()[-3000:]}")

    def stderr(self) -> str:
        self.err.seek(0)
        return self.err.read().decode(errors="replace")

    def finish(self, timeout: float = 60) -> None:
        try:
            if self.proc.stdin:
                self.proc.stdin.close()
            rc = self.proc.wait(timeout)
            assert rc == 0, f"child exited {rc}: {self.stderr()[-3000:]}"
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait()
            self.err.close()


def _emit(**kw: object) -> None:
    print("RESULT " + json.dumps(kw), flush=True)


# --- child roles ---------------------------------------------------------------------------------------


def _child_shm_producer(args: dict) -> None:
    ts = _tensors(args["seed"])
    fp32, bf16 = ts["fp32"], ts["bf16"]
    off = (fp32.nbytes + 63) // 64 * 64
    buf = SharedBuffer(off + bf16.nbytes)
    buf.tensor[: fp32.nbytes].copy_(fp32.reshape(-1).view(torch.uint8))
    buf.tensor[off: off + bf16.nbytes].copy_(bf16.reshape(-1).view(torch.uint8))
    leaked = SharedBuffer(4096)  # never closed: the interpreter-exit finalizer must unlink it
    _emit(fp32=buf.handle(0, fp32.nbytes), bf16=buf.handle(off, bf16.nbytes), path=buf.path,
          leaked_path=leaked.path, device_key=device_key("cpu"), prefault_s=buf.prefault_s,
          prefault_method=buf.prefault_method)
    assert sys.stdin.readline().strip() == "close"
    buf.close()
    buf.close()  # idempotent
    _emit(closed=not os.path.exists(buf.path))
    sys.stdin.readline()  # EOF: exit


def _recv_round(group: WeightGroup, seed: int) -> dict:
    shas = {}
    for name, like in _tensors(seed).items():
        t = torch.zeros_like(like)
        group.broadcast(t, 0)
        shas[name] = _sha(t)
    big = torch.zeros(args_big_nbytes(), dtype=torch.uint8)
    half = big.numel() // 2
    w1 = group.broadcast_async(big[:half], 0)  # two packed buffers in flight at once
    w2 = group.broadcast_async(big[half:], 0)
    w1.wait()
    w2.wait()
    shas["big"] = _sha(big)
    return shas


def _send_round(group: WeightGroup, seed: int) -> dict:
    shas = {}
    for name, t in _tensors(seed).items():
        group.broadcast(t, 0)
        shas[name] = _sha(t)
    big = _big(seed, args_big_nbytes())
    half = big.numel() // 2
    works = [group.broadcast_async(big[:half], 0), group.broadcast_async(big[half:], 0)]
    for w in works:
        w.wait()
    shas["big"] = _sha(big)
    return shas


def args_big_nbytes() -> int:
    return 64 * MIB


def _child_wg_receiver(args: dict) -> None:
    for rnd in range(args["rounds"]):
        group = WeightGroup.create("127.0.0.1", args["port"], args["rank"], args["world"], 60.0, op_timeout_s=120)
        shas = _recv_round(group, seed=rnd)
        group.barrier()
        group.destroy()
        group.destroy()  # idempotent
        _emit(round=rnd, rank=group.rank, shas=shas)


def _child_wg_with_default_group(args: dict) -> None:
    """A trainer that already lives in a torchrun-style default group (gloo, world 1) is rank 0 here."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args['default_port']}", rank=0, world_size=1)
    group = WeightGroup.create("127.0.0.1", args["port"], 0, 2, 60.0, op_timeout_s=120)
    sent = _tensors(7)["fp32"]
    group.broadcast(sent, 0)
    group.destroy()
    x = torch.ones(3)
    dist.all_reduce(x)  # the default group still works and is untouched
    _emit(sha=_sha(sent), default_world=dist.get_world_size(), default_rank=dist.get_rank(),
          all_reduce=x.tolist())
    dist.destroy_process_group()


def _child_bench(args: dict) -> None:
    import torch.distributed as dist

    rank, world, nbytes = args["rank"], args["world"], args["nbytes"]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{args['raw_port']}", rank=rank,
                            world_size=world)
    group = WeightGroup.create("127.0.0.1", args["port"], rank, world, 60.0, op_timeout_s=120)
    buf = _big(0, nbytes) if rank == 0 else torch.zeros(nbytes, dtype=torch.uint8)
    raw, ours = [], []
    for _ in range(args["reps"]):
        dist.barrier()
        t0 = time.perf_counter()
        dist.broadcast(buf, 0)
        dist.barrier()
        raw.append(time.perf_counter() - t0)
        group.barrier()
        t0 = time.perf_counter()
        group.broadcast(buf, 0)
        group.barrier()
        ours.append(time.perf_counter() - t0)
    _emit(rank=rank, raw_s=raw, ours_s=ours, sha=_sha(buf))
    group.destroy()
    dist.destroy_process_group()


_ROLES = {
    "shm_producer": _child_shm_producer,
    "wg_receiver": _child_wg_receiver,
    "wg_with_default_group": _child_wg_with_default_group,
    "bench": _child_bench,
}


def _child_main() -> None:
    role, args = sys.argv[1], json.loads(sys.argv[2])
    _ROLES[role](args)


# --- ipc: shared memory ---------------------------------------------------------------------------------


def test_shm_handles_across_processes():
    producer = Child("shm_producer", seed=3)
    try:
        info = producer.result()
        expected = _tensors(3)
        # the handles crossed a pipe as JSON text and are plain data
        assert json.loads(json.dumps(info["fp32"])) == info["fp32"]
        assert info["fp32"]["kind"] == "shm" and info["fp32"]["name"].startswith("rollbus-")
        assert os.path.exists(info["path"])
        assert info["prefault_method"] in ("madv_populate_write", "touch") and info["prefault_s"] > 0
        print(f"\nSharedBuffer prefault: {info['prefault_method']} {info['prefault_s'] * 1e3:.2f} ms")

        imp = HandleImporter()
        fp32 = imp.open(info["fp32"], "cpu")
        bf16 = imp.open(info["bf16"], torch.device("cpu"))
        assert fp32.dtype == torch.uint8 and fp32.numel() == info["fp32"]["nbytes"]
        assert _bytes_equal(fp32, expected["fp32"])
        assert _bytes_equal(bf16, expected["bf16"])
        assert torch.equal(bf16.view(torch.bfloat16).reshape(expected["bf16"].shape), expected["bf16"])

        # one mapping per segment, reused by every later open
        assert imp.maps_created == 1
        again = imp.open(info["fp32"])
        assert imp.maps_created == 1 and again.data_ptr() == fp32.data_ptr()
        assert bf16.data_ptr() - fp32.data_ptr() == info["bf16"]["offset"]

        # a multi-device mapping {device_key: handle}: this host's key picks the entry
        by_key = imp.open({"some-other-host": info["bf16"], device_key("cpu"): info["fp32"]})
        assert by_key.data_ptr() == fp32.data_ptr() and imp.maps_created == 1
        with pytest.raises(ValueError, match="available device keys: \\['elsewhere'\\]"):
            imp.open({"elsewhere": info["fp32"]})

        producer.send("close")
        assert producer.result() == {"closed": True}
        assert not os.path.exists(info["path"])
        with pytest.raises(ValueError, match="no shared-memory segment"):
            imp.open(info["fp32"])
        assert _bytes_equal(fp32, expected["fp32"])  # mapped views stay valid after the unlink
        imp.close()
        producer.finish()
        assert not os.path.exists(info["leaked_path"]), "interpreter exit must unlink an unclosed SharedBuffer"
    finally:
        if producer.proc.poll() is None:
            producer.proc.kill()


def test_shm_remapped_when_segment_replaced():
    imp = HandleImporter()
    a = SharedBuffer(8192)
    a.tensor.fill_(1)
    h = a.handle(0, 4096)
    assert int(imp.open(h).sum()) == 4096
    # the same name, a new file (a restarted producer): the cache must not serve the old inode
    a.close()
    fd = os.open(a.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, 8192)
        os.pwrite(fd, b"\x02" * 4096, 0)
    finally:
        os.close(fd)
    try:
        assert int(imp.open(h).sum()) == 2 * 4096
        assert imp.maps_created == 2
    finally:
        os.unlink(a.path)


def test_shared_buffer_lifecycle():
    buf = SharedBuffer(3 * 4096 + 5)
    assert os.stat(buf.path).st_size == buf.size
    assert buf.tensor.numel() == buf.size and buf.tensor.dtype == torch.uint8
    assert buf.handle() == {"kind": "shm", "name": buf.name, "offset": 0, "nbytes": buf.size, "size": buf.size}
    assert buf.handle(10)["nbytes"] == buf.size - 10
    with pytest.raises(ValueError, match="runs past the end"):
        buf.handle(10, buf.size)
    with pytest.raises(ValueError, match=">= 0"):
        buf.handle(-1, 1)
    other = SharedBuffer(4096, prefault=False)
    assert other.name != buf.name and other.prefault_method == "none"
    with other:
        pass
    assert other.closed and not os.path.exists(other.path)
    buf.close()
    buf.close()
    assert buf.closed and not os.path.exists(buf.path)
    with pytest.raises(ValueError, match="closed"):
        buf.tensor
    with pytest.raises(ValueError, match="closed"):
        buf.handle()
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match="positive"):
            SharedBuffer(bad)  # type: ignore[arg-type]


def test_bad_handles():
    imp = HandleImporter()
    with SharedBuffer(4096) as buf:
        good = buf.handle(0, 4096)
        cases = [
            ({**good, "name": "../../etc/passwd"}, "bad shared-memory name"),
            ({**good, "name": "a/b"}, "bad shared-memory name"),
            ({**good, "name": ".."}, "bad shared-memory name"),
            ({**good, "name": "x..y"}, "bad shared-memory name"),
            ({**good, "name": ""}, "bad shared-memory name"),
            ({**good, "name": "."}, "bad shared-memory name"),
            ({**good, "name": ".hidden"}, "bad shared-memory name"),
            ({**good, "name": 5}, "bad shared-memory name"),
            ({**good, "offset": 4096, "nbytes": 1}, "runs past the end"),
            ({**good, "offset": 1}, "runs past the end"),
            ({**good, "offset": -1, "nbytes": 1}, ">= 0"),
            ({**good, "offset": True}, "must be an integer"),
            ({**good, "nbytes": "10"}, "must be an integer"),
            ({**good, "size": 8192, "nbytes": 8192}, "is 4096 bytes, the handle says 8192"),
            ({**good, "size": 0, "nbytes": 0}, "size must be positive"),
            ({**good, "name": "rollbus-no-such-segment"}, "no shared-memory segment"),
            ({**good, "kind": "tcp"}, "unknown handle kind 'tcp'; known kinds: shm, cuda, npu"),
            ({"name": buf.name}, "no handle for this device"),  # no kind: read as a device-key mapping
            ({}, "empty IPC handle mapping"),
            ({device_key("cpu"): "not a dict"}, "must be a JSON object"),
            ("rollbus-1-0", "must be a JSON object"),
            ([good], "must be a JSON object"),
        ]
        for handle, msg in cases:
            with pytest.raises(ValueError, match=re.escape(msg)):
                imp.open(handle)
        # a device handle on the CPU: clear refusal, nothing rebuilt
        with pytest.raises(ValueError, match="cannot be opened on a cpu device"):
            imp.open({"kind": "cuda", "offset": 0, "nbytes": 4})
        assert imp.maps_created == 0 and imp.imports_created == 0
        assert imp.open(good).numel() == 4096
    with pytest.raises(ValueError, match="SharedBuffer"):
        export_handle(torch.zeros(4))


def test_import_copy_speed_vs_memcpy():
    """Through a warm cached mapping, open + copy of 64 MiB costs at most ~3x a plain memcpy (best of 5)."""
    n = 64 * MIB
    src = _big(1, n)
    dst = torch.empty(n, dtype=torch.uint8)

    def best(fn, reps: int = 5) -> float:
        fn()  # warm: page faults of dst and of the mapping are not what is measured
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return min(out)

    # producer side: the first copy into a fresh buffer runs near memcpy speed because the pages are prefaulted
    first, prefault = [], []
    for _ in range(3):
        with SharedBuffer(n) as fresh:
            t0 = time.perf_counter()
            fresh.tensor.copy_(src)
            first.append(time.perf_counter() - t0)
            prefault.append(fresh.prefault_s)

    with SharedBuffer(n) as buf:
        buf.tensor.copy_(src)
        handle = json.loads(json.dumps(buf.handle()))
        imp = HandleImporter()
        memcpy_s = best(lambda: dst.copy_(src))
        ipc_s = best(lambda: dst.copy_(imp.open(handle)))
        assert imp.maps_created == 1
        assert torch.equal(dst, src)
    ratio, first_ratio = ipc_s / memcpy_s, min(first) / memcpy_s
    print(f"\n64 MiB: memcpy {memcpy_s * 1e3:.1f} ms ({n / memcpy_s / 1e9:.2f} GB/s), "
          f"import+copy {ipc_s * 1e3:.1f} ms ({n / ipc_s / 1e9:.2f} GB/s), ratio {ratio:.2f}; "
          f"SharedBuffer prefault {min(prefault) * 1e3:.1f} ms, first copy into it {min(first) * 1e3:.1f} ms "
          f"(ratio {first_ratio:.2f})")
    assert ratio <= 3.0
    assert first_ratio <= 3.0


def test_device_handle_plain_data_roundtrip(monkeypatch, request):
    """The CUDA/NPU handle path without a device: torch's 15-field IPC tuple becomes JSON and back, the consumer
    puts its own device index in, and one import per exported allocation is kept (a re-sent handle is not
    rebuilt; a fresh export of the same allocation is rebuilt once, which lets torch release its counter)."""

    def rebuild_cuda_tensor(*args):  # stands in for torch.multiprocessing.reductions.rebuild_cuda_tensor
        calls.append(args)
        return (torch.arange(8192) % 251).to(torch.uint8)[args[3]: args[3] + args[1][0]]

    calls: list[tuple] = []
    counter = f"/torch_{os.getpid()}_test_refcounter"  # the producer's ref-counter segment the rebuild maps
    with open(f"/dev/shm{counter}", "wb") as f:
        f.truncate(8 * ipc.CUDA_IPC_REF_COUNTER_FILE_SIZE)
    request.addfinalizer(lambda: os.unlink(f"/dev/shm{counter}"))
    args = (torch.Tensor, torch.Size([4096]), (1,), 512, torch.storage.TypedStorage, torch.uint8, 0,
            bytes(range(64)), 8192, 256, False, counter.encode(), 3, b"\x00" * 64, False)
    handle = json.loads(json.dumps(ipc._handle_from_reduction("cuda", rebuild_cuda_tensor, args, "GPU-abc")))
    assert handle["kind"] == "cuda" and handle["nbytes"] == 4096 and handle["device_key"] == "GPU-abc"
    monkeypatch.setattr(ipc, "_rebuild", lambda kind: rebuild_cuda_tensor)
    monkeypatch.setattr(ipc, "device_key", lambda device=None: "GPU-abc" if "cuda" in str(device) else "host")

    imp = HandleImporter()
    view = imp.open(handle, "cuda:1")
    assert len(calls) == 1 and calls[0][6] == 1  # the consumer's device index replaces the producer's
    assert [a for i, a in enumerate(calls[0]) if i not in (1, 6)] == [a for i, a in enumerate(args) if i not in (1, 6)]
    assert tuple(calls[0][1]) == (4096,)
    assert view.numel() == 4096 and int(view[0]) == 512 % 251
    assert imp.open(handle, "cuda:1").data_ptr() == view.data_ptr() and len(calls) == 1  # re-sent: cached
    again = imp.open({**handle, "ref_counter_offset": 4, "offset": 100, "nbytes": 10}, "cuda:1")  # new export
    assert len(calls) == 2 and imp.imports_created == 1
    assert again.data_ptr() == view.data_ptr() + 100 and again.numel() == 10
    assert imp.open({"GPU-abc": handle, "GPU-other": handle}, "cuda:1").data_ptr() == view.data_ptr()
    with pytest.raises(ValueError, match="available device keys: \\['GPU-other'\\]"):
        imp.open({"GPU-other": handle}, "cuda:1")
    for bad, msg in [
        ({**handle, "offset": 4000, "nbytes": 200}, "runs past the end"),
        ({**handle, "shape": [9000]}, "runs past its storage"),
        ({**handle, "dtype": "float32"}, "flat uint8"),
        ({**handle, "stride": [2]}, "flat uint8"),
        ({**handle, "storage_cls": "os.system"}, "unknown storage class"),
        ({**handle, "handle": "%%%"}, "not valid base64"),
        ({**handle, "event_sync_required": "no"}, "must be a boolean"),
        ({k: v for k, v in handle.items() if k != "ref_counter_handle"}, "lacks ref_counter_handle"),
        ({**handle, "ref_counter_offset": ipc.CUDA_IPC_REF_COUNTER_FILE_SIZE}, "outside the ref-counter file"),
        ({**handle, "ref_counter_handle": ipc._b64(b"/torch_no_such_segment")}, "no ref-counter segment"),
        ({**handle, "ref_counter_handle": ipc._b64(b"/../etc/passwd")}, "not a shared-memory name"),
    ]:
        with pytest.raises(ValueError, match=msg):
            imp.open(bad, "cuda:1")
    with pytest.raises(ValueError, match="cannot be opened on a cpu device"):
        imp.open(handle, "cpu")
    with pytest.raises(RuntimeError, match="unexpected IPC reduction"):
        ipc._handle_from_reduction("npu", rebuild_cuda_tensor, args, "x")
    assert len(calls) == 2


# --- collective ------------------------------------------------------------------------------------------


def test_weight_group_broadcast_three_ranks_and_recreate_on_same_port():
    port, rounds = _free_port(), 2
    receivers = [Child("wg_receiver", port=port, rank=r, world=3, rounds=rounds) for r in (1, 2)]
    try:
        for rnd in range(rounds):
            group = WeightGroup.create("127.0.0.1", port, 0, 3, 60.0, op_timeout_s=120)
            assert (group.rank, group.world_size, group.backend) == (0, 3, "gloo")
            sent = _send_round(group, seed=rnd)
            group.barrier()
            group.destroy()
            assert group.destroyed
            for child in receivers:
                got = child.result()
                assert got["round"] == rnd
                assert got["shas"] == sent, f"rank {got['rank']} round {rnd} received different bytes"
        for child in receivers:
            child.finish()
    finally:
        for child in receivers:
            if child.proc.poll() is None:
                child.proc.kill()


def test_weight_group_with_existing_default_group():
    port = _free_port()
    trainer = Child("wg_with_default_group", port=port, default_port=_free_port())
    try:
        group = WeightGroup.create("127.0.0.1", port, 1, 2, 60.0, op_timeout_s=120)
        t = torch.zeros(257, 129)
        group.broadcast(t, 0)
        group.destroy()
        got = trainer.result()
        assert got["sha"] == _sha(t) == _sha(_tensors(7)["fp32"])
        assert (got["default_world"], got["default_rank"], got["all_reduce"]) == (1, 0, [1.0, 1.0, 1.0])
        trainer.finish()
    finally:
        if trainer.proc.poll() is None:
            trainer.proc.kill()


def test_rendezvous_timeout_names_the_group():
    port = _free_port()
    t0 = time.monotonic()
    with pytest.raises(TimeoutError) as e:  # a worker waiting for a trainer that never comes
        WeightGroup.create("127.0.0.1", port, 1, 3, 2.0)
    took = time.monotonic() - t0
    msg = str(e.value)
    assert 1.5 <= took <= 3.0, took
    assert f"127.0.0.1:{port}" in msg and "rank 1" in msg and "world size 3" in msg

    t0 = time.monotonic()
    with pytest.raises(TimeoutError, match=r"1/3 clients joined") as e:  # a trainer alone
        WeightGroup.create("127.0.0.1", port, 0, 3, 1.5)
    assert time.monotonic() - t0 <= 3.0  # TCPStore's own deadline, whole seconds
    assert f"127.0.0.1:{port}" in str(e.value) and "rank 0" in str(e.value)

    # the port is free again: a complete group forms on it, and a second claim of rank 1 is refused
    groups: dict[int, WeightGroup] = {}
    errors: list[BaseException] = []

    def make(rank: int) -> None:
        try:
            groups[rank] = WeightGroup.create("127.0.0.1", port, rank, 2, 20.0)
        except BaseException as exc:  # reported below, not lost in the thread
            errors.append(exc)

    threads = [threading.Thread(target=make, args=(r,)) for r in (0, 1)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30)
    assert not errors and sorted(groups) == [0, 1]
    with pytest.raises(StoreCollision, match="rank 1 is already taken"):  # a second engine, same rank_offset
        WeightGroup.create("127.0.0.1", port, 1, 2, 5.0)
    for g in groups.values():
        g.destroy()
    with pytest.raises(RuntimeError, match="destroyed"):
        groups[0].broadcast(torch.zeros(1))


def test_create_argument_errors():
    for args, msg in [
        (("127.0.0.1", 29500, 3, 3, 1.0), "outside world size"),
        (("127.0.0.1", 29500, -1, 3, 1.0), "outside world size"),
        (("127.0.0.1", 0, 0, 3, 1.0), "master_port"),
        (("127.0.0.1", 29500, 0, 3, 0.0), "timeouts must be positive"),
        (("", 29500, 0, 3, 1.0), "master_address"),
        (("127.0.0.1", 29500, True, 3, 1.0), "rank must be an integer"),
    ]:
        with pytest.raises(ValueError, match=msg):
            WeightGroup.create(*args)


@pytest.mark.slow  # a throughput run (256 MiB x 5 rounds x 2 ways); bench/weight_sync.py measures the bar
def test_broadcast_throughput_vs_raw_torch_distributed():
    """WeightGroup.broadcast of 256 MiB against torch.distributed.broadcast in an init_process_group gloo group of
    the same three processes, interleaved in the same run. The issue's bar is >= 50%; asserted loosely here."""
    nbytes, world = 256 * MIB, 3
    port, raw_port = _free_port(), _free_port()
    kids = [Child("bench", rank=r, world=world, port=port, raw_port=raw_port, nbytes=nbytes, reps=5)
            for r in range(world)]
    try:
        res = sorted((k.result(timeout=150) for k in kids), key=lambda r: r["rank"])
        for k in kids:
            k.finish()
    finally:
        for k in kids:
            if k.proc.poll() is None:
                k.proc.kill()
    assert len({r["sha"] for r in res}) == 1
    raw_gbs = nbytes / min(res[0]["raw_s"]) / 1e9
    ours_gbs = nbytes / min(res[0]["ours_s"]) / 1e9
    ratio = ours_gbs / raw_gbs
    print(f"\n256 MiB broadcast to 2 receivers (gloo, best of 5): raw torch.distributed {raw_gbs:.2f} GB/s, "
          f"WeightGroup {ours_gbs:.2f} GB/s, ratio {ratio:.2f}")
    assert ratio >= 0.25


def test_importer_prunes_mappings_of_closed_segments():
    from engine.weights.ipc import HandleImporter, SharedBuffer

    imp = HandleImporter()
    keep, gone = SharedBuffer(4096), SharedBuffer(4096)
    try:
        imp.open(keep.handle(0, 16))
        imp.open(gone.handle(0, 16))
        gone.close()
        assert imp.prune() == 1
        assert imp.prune() == 0
        imp.open(keep.handle(0, 16))
        assert imp.maps_created == 2  # the live one stayed cached
    finally:
        keep.close()
        imp.close()


def test_unique_id_pickles_admit_only_the_id_struct():
    """The NCCL/HCCL unique id arrives as vLLM's pickled ctypes struct: exactly its two globals are admitted
    (as local stand-ins, nothing from the pickle is called); anything else is refused by name."""
    import ctypes
    import os
    import pickle

    from engine.weights.pyccl import HCCL_ID, NCCL_ID, dumps_unique_id, loads_unique_id
    from engine.weights.safe_pickle import UnsafePickleError

    raw = bytes(range(128))
    assert loads_unique_id(NCCL_ID, dumps_unique_id(NCCL_ID, raw), "t") == raw
    hraw = os.urandom(4108)
    assert loads_unique_id(HCCL_ID, dumps_unique_id(HCCL_ID, hraw), "t") == hraw

    class Other(ctypes.Structure):
        _fields_ = [("internal", ctypes.c_byte * 128)]

    Other.__module__, Other.__qualname__ = "ctypes", "Other"
    ctypes.Other = Other  # so that pickle can name it
    try:
        other = pickle.dumps(Other.from_buffer_copy(raw))
    finally:
        del ctypes.Other
    for data, name in [(pickle.dumps(os.system), "posix.system"), (pickle.dumps(print), "builtins.print"),
                       (other, "ctypes.Other"), (dumps_unique_id(HCCL_ID, hraw), "hcclUniqueId")]:
        with pytest.raises(UnsafePickleError, match=name):
            loads_unique_id(NCCL_ID, data, "the store key")
    with pytest.raises(ValueError, match="not a ncclUniqueId"):  # the right globals, the wrong size
        loads_unique_id(NCCL_ID, dumps_unique_id(NCCL_ID, raw).replace(b"B\x80\x00\x00\x00" + raw,
                                                                       b"B\x04\x00\x00\x00" + raw[:4]), "t")
    with pytest.raises(ValueError, match="128 bytes"):
        dumps_unique_id(NCCL_ID, raw[:5])
