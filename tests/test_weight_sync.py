"""Weight sync end to end: a trainer (HF transformers in this process) changes its model, pushes it into a
real `rollbus serve` through each backend and path, and the engine's logprobs then equal the trainer's.
Failures leave the previous weights in service bit for bit."""

from __future__ import annotations

import base64
import json
import threading
import time

import httpx
import pytest
import torch
import zmq

from ascend_ops import packed_linear
from bus.codec import decode
from bus.endpoints import WEIGHTS_TOPIC, Endpoints
from bus.messages import WeightVersionCommitted
from engine.trainer import WeightSyncClient, WeightSyncFailed, weight_checksums
from engine.weights.ipc import SharedBuffer
from engine.weights.protocol import ParamMeta, UpdateMeta
from tests.server_helpers import metric, start_server, tiny_model_with_tokenizer
from tests.waits import holds, recv_topic, wait_subscribed

pytestmark = pytest.mark.timeout(300)
RL = '{"rl_config": {"enabled": true}}'
PROMPT = [5, 17, 99, 250, 31, 8, 77]


@pytest.fixture(scope="module")
def folder(tmp_path_factory, smollm2_dir):
    return tiny_model_with_tokenizer("qwen2", tmp_path_factory.mktemp("wsync") / "qwen2", smollm2_dir)


def serve(tmp_path_factory, folder, backend: str, *extra: str):
    cfg = json.dumps({"backend": backend, "timeout_s": 20})
    # the product's default malloc on huge pages (test servers default to 4 KiB pages: tests/serve_process.py),
    # which test_cpu_packed_weights_never_serve_the_previous_version checks
    return start_server(tmp_path_factory.mktemp(backend), str(folder), "--additional-config", RL,
                        "--weight-transfer-config", cfg, "--max-model-len", "128", "--block-size", "4", *extra,
                        env={"ROLLBUS_CPU_HUGE_PAGES": "1"})


@pytest.fixture(scope="module")
def ipc_server(tmp_path_factory, folder):
    s = serve(tmp_path_factory, folder, "ipc", "--enable-sleep-mode")
    yield s
    s.stop()


@pytest.fixture(scope="module")
def gloo_server(tmp_path_factory, folder):
    s = serve(tmp_path_factory, folder, "gloo", "--enable-sleep-mode", "--additional-config",
              '{"rl_config": {"enabled": true, "sleep_mode_extra_cleanup": true}}')
    yield s
    s.stop()


@pytest.fixture(scope="module")
def trainer(folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()


def perturb(model, seed: int, scale: float = 0.05) -> None:
    """A stand-in for optimizer steps: every parameter moves."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in model.named_parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)


def engine_greedy(url: str, n: int = 8) -> tuple[list[int], list[float]]:
    r = httpx.post(url + "/v1/completions", timeout=60, json={
        "prompt": PROMPT, "max_tokens": n, "temperature": 0, "ignore_eos": True, "logprobs": 0,
        "return_tokens_as_token_ids": True})
    assert r.status_code == 200, r.text
    lp = r.json()["choices"][0]["logprobs"]
    return [int(t.removeprefix("token_id:")) for t in lp["tokens"]], lp["token_logprobs"]


def trainer_logprobs(model, ids: list[int]) -> tuple[list[int], list[float]]:
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([PROMPT + ids])).logits[0].float(), -1)
    rows = lp[len(PROMPT) - 1:-1]
    return rows.argmax(-1).tolist(), [rows[k, t].item() for k, t in enumerate(ids)]


def assert_engine_matches(url: str, model) -> None:
    ids, lps = engine_greedy(url)
    want_ids, want_lps = trainer_logprobs(model, ids)
    assert ids == want_ids, "engine's greedy tokens differ from the trainer's model"
    assert max(abs(a - b) for a, b in zip(lps, want_lps)) < 1e-4


def version(url: str) -> str:
    return httpx.get(url + "/weight_info").json()["weight_version"]


@pytest.mark.parametrize("packed", [True, False])
def test_ipc_update_makes_the_engine_compute_the_trainers_logprobs(ipc_server, trainer, packed):
    url = ipc_server.url
    perturb(trainer, seed=1 + packed)
    with WeightSyncClient(url, backend="ipc", packed=packed, packed_buffer_size_bytes=96 << 10) as client:
        client.send_weights(trainer.named_parameters(), version=f"ipc-{packed}", pause="keep")
    assert version(url) == f"ipc-{packed}"
    assert_engine_matches(url, trainer)
    # bitwise: the engine holds exactly the trainer's tensors
    sums = weight_checksums(trainer.named_parameters())
    r = httpx.post(url + "/weight_checker", json={"action": "compare", "baseline": sums}).json()
    assert r == {"match": True, "mismatches": []}
    checksum = httpx.post(url + "/weight_checker", json={"action": "checksum"}).json()["checksums"]
    assert checksum["dp0:pp0:pcp0:tp0:model.embed_tokens.weight"] == sums["model.embed_tokens.weight"]


def test_cpu_packed_weights_never_serve_the_previous_version(ipc_server, trainer):
    """The CPU workers multiply on pre-packed copies of the weights (ascend_ops.packed_linear): generate
    first, so every copy exists, then update; the engine must compute with the new weights at once."""
    url = ipc_server.url
    workers = httpx.get(url + "/server_info").json()["workers"]
    # packed on this CPU's fp32 backend (MKL's on Intel, oneDNN's elsewhere; ascend_ops.packed_linear)
    assert all(w["cpu_linear"] == f"{packed_linear.fp32_backend()}-prepacked" for w in workers.values()), workers
    # the start-up warm-up made every pack before the first request (workers.model_runner.warm_up)
    assert all(w["warm_up_s"] > 0 for w in workers.values()), workers
    # and the launcher started them with malloc on huge pages (ascend_ops.host_env.huge_pages_env)
    assert all("glibc.malloc.hugetlb=1" in w["host_huge_pages"] or w["host_huge_pages"].startswith("unavailable")
               for w in workers.values()), workers
    assert_engine_matches(url, trainer)  # packs made from the weights in service
    # Two updates with no step between: staging swaps each parameter's storage to the other buffer and
    # back, so the storage address alone would say the packs from before the first update still hold.
    with WeightSyncClient(url, backend="ipc") as client:
        for k in range(2):
            perturb(trainer, seed=7 + k, scale=0.2)
            client.send_weights(trainer.named_parameters(), version=f"after-packing-{k}", pause="keep")
    assert_engine_matches(url, trainer)
    sums = weight_checksums(trainer.named_parameters())
    assert httpx.post(url + "/weight_checker", json={"action": "compare", "baseline": sums}).json()["match"]


@pytest.mark.parametrize("packed", [True, False])
def test_collective_update_through_gloo(gloo_server, trainer, packed):
    url = gloo_server.url
    assert httpx.get(url + "/get_world_size").json() == {"world_size": 1}
    perturb(trainer, seed=10 + packed)
    with WeightSyncClient(url, backend="nccl", packed=packed, packed_buffer_size_bytes=96 << 10) as client:
        client.send_weights(trainer.named_parameters(), version=f"gloo-{packed}", pause="abort")
        assert version(url) == f"gloo-{packed}"
        assert_engine_matches(url, trainer)
        perturb(trainer, seed=20 + packed)  # a second version over the same group
        client.send_weights(trainer.named_parameters(), version=f"gloo-{packed}-2", pause=None)
    assert version(url) == f"gloo-{packed}-2"
    assert_engine_matches(url, trainer)


def test_collective_share_memory_broadcasts_packed_chunks_from_the_trainers_memory(gloo_server, trainer):
    """share_memory=True (collective, packed): the trainer's parameters move once into one buffer laid out as
    packed chunks are, so every chunk is broadcast from it and nothing is packed; the engine still computes
    the trainer's logprobs, and a later in-place step is sent the same way."""
    url = gloo_server.url
    with WeightSyncClient(url, backend="gloo", packed=True, share_memory=True,
                          packed_buffer_size_bytes=96 << 10) as client:
        first = next(trainer.parameters())
        perturb(trainer, seed=30)
        client.send_weights(trainer.named_parameters(), version="flat-1", pause="keep")
        storage = first.untyped_storage().data_ptr()
        assert all(p.untyped_storage().data_ptr() == storage for p in trainer.parameters())
        assert client.sender._pack_bufs == []  # every chunk went out as a view of the trainer's buffer
        assert_engine_matches(url, trainer)
        perturb(trainer, seed=31)  # an optimizer step writes in place: the buffer stays
        client.send_weights(trainer.named_parameters(), version="flat-2", pause=None)
        assert first.untyped_storage().data_ptr() == storage and client.sender._pack_bufs == []
    assert version(url) == "flat-2"
    assert_engine_matches(url, trainer)


@pytest.mark.unit
@pytest.mark.parametrize("backend, packed", [("ipc", True), ("gloo", False)])
def test_share_memory_with_the_other_packing_is_refused_naming_it(backend, packed):
    with pytest.raises(ValueError, match=f"share_memory=True works with packed={not packed}"):
        WeightSyncClient("http://127.0.0.1:9", backend=backend, packed=packed, share_memory=True)


def post(url: str, path: str, body=None) -> httpx.Response:
    return httpx.post(url + path, json=body, timeout=60)


def test_a_failure_midway_leaves_the_previous_weights_bitwise(ipc_server, trainer):
    """Chunk 1 is written (staged), chunk 2 has a wrong shape: the update aborts everywhere and the
    engine's outputs are bit for bit what they were."""
    url = ipc_server.url
    engine_greedy(url)  # the prompt's KV is cached now: before and after take the same (cached) path
    before, before_version = engine_greedy(url), version(url)
    params = [(n, p.detach() + 1.0) for n, p in trainer.named_parameters()]
    half = len(params) // 2
    buf = SharedBuffer(sum(p.numel() * 4 for _, p in params))
    try:
        def chunk(items, offset, shape_override=None):
            metas, off = [], offset
            for i, (n, t) in enumerate(items):
                buf.tensor[off:off + t.numel() * 4].copy_(t.reshape(-1).view(torch.uint8))
                off += t.numel() * 4
                shape = list(t.shape) if shape_override != i else [t.numel()]
                metas.append(ParamMeta(n, t.dtype, tuple(shape)))
            return {**UpdateMeta(metas).to_info(), "ipc_handles": buf.handle(offset, off - offset)}, off

        first, off = chunk(params[:half], 0)
        second, _ = chunk(params[half:], off, shape_override=1)
        assert post(url, "/start_weight_update").status_code == 200
        assert post(url, "/update_weights", {"update_info": first}).status_code == 200
        r = post(url, "/update_weights", {"update_info": second})
        assert r.status_code == 400, r.text
        bad = params[half + 1][0]
        assert bad in r.json()["error"]["message"] and "shape" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "shapes"
    finally:
        buf.close()
    assert engine_greedy(url) == before and version(url) == before_version
    # the update ended: a new one may start, and an update without start is refused
    assert post(url, "/update_weights", {"update_info": first}).status_code == 409


BAD_UPDATES = [
    ({"names": ["model.nope.weight"], "dtype_names": ["float32"], "shapes": [[4]]}, "unknown parameter name"),
    ({"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[3]]}, "shape [3] does not match"),
    ({"names": ["model.norm.weight"], "dtype_names": ["int32"], "shapes": [[64]]},
     "tensor 'model.norm.weight': dtype int32 cannot be cast to the engine's float32"),
    ({"names": ["model.norm.weight"], "dtype_names": ["bool"], "shapes": [[64]]}, "dtype bool cannot be cast"),
    ({"names": ["model.norm.weight", "model.norm.weight"], "dtype_names": ["float32"] * 2, "shapes": [[64]] * 2},
     "duplicate tensor name"),
    ({"names": ["model.norm.weight"], "dtype_names": ["float32", "float32"], "shapes": [[64]]}, "differ in length"),
    ({"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[64]],
      "ipc_handles_pickled": "gASV"}, "without VLLM_ALLOW_INSECURE_SERIALIZATION=1: set it in the environment"),
    ({"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[64]],
      "ipc_handles": {"kind": "shm", "name": "../etc/passwd", "offset": 0, "nbytes": 256, "size": 256}},
     "ipc_handles"),
]


def test_bad_updates_are_400s_naming_the_problem_and_serving_goes_on(ipc_server):
    url = ipc_server.url
    engine_greedy(url)
    before = engine_greedy(url)
    for info, words in BAD_UPDATES:
        assert post(url, "/start_weight_update").status_code == 200
        r = post(url, "/update_weights", {"update_info": info})
        assert r.status_code == 400 and words in r.json()["error"]["message"], (info, r.text)
        assert r.json()["error"]["type"] == "BadRequestError"
    assert post(url, "/update_weights", {}).status_code == 400  # no update_info
    assert post(url, "/init_weight_transfer_engine", {}).json()["error"]["message"] == \
        "Missing 'init_info' in request body"
    assert engine_greedy(url) == before


def test_state_machine_conflicts_are_409s(ipc_server):
    url = ipc_server.url
    assert post(url, "/finish_weight_update").status_code == 409
    assert post(url, "/start_weight_update").status_code == 200
    r = post(url, "/start_weight_update")
    assert r.status_code == 409 and "already active" in r.json()["error"]["message"]
    assert post(url, "/shutdown_weight_transfer_engine").status_code == 409  # during an update
    assert post(url, "/finish_weight_update", {"weight_version": "empty"}).status_code == 200  # nothing sent
    assert version(url) == "empty"
    assert post(url, "/shutdown_weight_transfer_engine").status_code == 200
    r = post(url, "/start_weight_update")
    assert r.status_code == 409 and "shut down" in r.json()["error"]["message"]
    assert post(url, "/init_weight_transfer_engine", {"init_info": {"packed": True}}).status_code == 200
    assert post(url, "/start_weight_update").status_code == 200
    assert post(url, "/finish_weight_update").status_code == 200


def test_a_start_refused_by_a_worker_closes_the_update_window(ipc_server):
    """Weights asleep: the worker refuses the start (409). Its broadcast had opened the update window, which
    holds every step; the refusal used to leave it open until someone aborted by hand."""
    url = ipc_server.url
    before = engine_greedy(url)
    assert post(url, "/sleep?level=1&mode=keep").status_code == 200
    r = post(url, "/start_weight_update")
    assert r.status_code == 409 and "asleep" in r.json()["error"]["message"], r.text
    assert post(url, "/wake_up").status_code == 200
    assert engine_greedy(url) == before  # served: the window is closed
    assert post(url, "/start_weight_update").status_code == 200  # and a new update may start
    r = post(url, "/start_weight_update")  # one while it is active: refused, and the active one kept
    assert r.status_code == 409 and "already active" in r.json()["error"]["message"], r.text
    assert post(url, "/finish_weight_update").status_code == 200


def test_requests_wait_while_an_update_is_active(ipc_server):
    """From start to commit no step runs: a request sent meanwhile completes after finish."""
    url = ipc_server.url
    assert post(url, "/start_weight_update").status_code == 200
    done: list[float] = []
    t = threading.Thread(target=lambda: (engine_greedy(url, 2), done.append(time.monotonic())))
    t.start()
    # nothing observable tells that the request reached the scheduler, so watch a window for a step
    holds(lambda: not done, 1.0, "no step during the weight update")
    finished = time.monotonic()
    assert post(url, "/finish_weight_update").status_code == 200
    t.join(60)
    assert done and done[0] >= finished


def test_rendezvous_that_never_completes_is_a_504(gloo_server):
    t0 = time.monotonic()
    r = post(gloo_server.url, "/init_weight_transfer_engine", {"init_info": {
        "master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2, "timeout_s": 2}})
    assert r.status_code == 504, r.text
    assert "127.0.0.1" in r.json()["error"]["message"]
    assert time.monotonic() - t0 < 30
    assert engine_greedy(gloo_server.url)  # still serving


@pytest.mark.parametrize("level", [1, 2])
def test_colocated_recipe_sleep_wake_weights_ipc_wake_kv(ipc_server, trainer, level):
    url = ipc_server.url
    perturb(trainer, seed=30 + level)
    assert post(url, f"/sleep?level={level}").status_code == 200
    assert post(url, "/wake_up?tags=weights").status_code == 200
    with WeightSyncClient(url, backend="ipc") as client:
        client.send_weights(trainer.named_parameters(), version=f"sleep-{level}", pause=None)
    assert post(url, "/wake_up?tags=kv_cache").json()["status"] == "awake"
    assert version(url) == f"sleep-{level}"
    assert_engine_matches(url, trainer)


@pytest.mark.parametrize("backend", ["ipc", "hccl"])
def test_weight_version_event_on_the_bus(ipc_server, gloo_server, trainer, backend):
    server = ipc_server if backend == "ipc" else gloo_server
    bus_dir = server.log_path.parent / f"bus-{server.port}"
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    sub.connect(Endpoints.from_url(f"ipc://{bus_dir}").commands)
    sub.setsockopt(zmq.SUBSCRIBE, WEIGHTS_TOPIC)
    perturb(trainer, seed=40)
    try:
        wait_subscribed(sub)
        with WeightSyncClient(None, backend=backend, bus=f"ipc://{bus_dir}") as client:
            client.send_weights(trainer.named_parameters(), version=f"bus-{backend}", pause="keep")
            # the coordinator timed each step it drove, inside the client's own round trip
            steps = {k: v for k, v in client.timings.items() if k.startswith("engine_")}
            assert steps["engine_commit_weight_update"] > 0 and sum(steps.values()) <= client.timings["sync"], \
                client.timings
        msg = decode(recv_topic(sub, WEIGHTS_TOPIC, 5))
        assert isinstance(msg, WeightVersionCommitted) and msg.version == f"bus-{backend}"
    finally:
        ctx.destroy(linger=0)
    assert version(server.url) == f"bus-{backend}"
    assert_engine_matches(server.url, trainer)


def test_bus_update_with_a_bad_tensor_fails_cleanly(ipc_server, trainer):
    url = ipc_server.url
    engine_greedy(url)
    before, v = engine_greedy(url), version(url)
    bus = f"ipc://{ipc_server.log_path.parent / f'bus-{ipc_server.port}'}"
    bad = [(n, p.detach()[..., :1] if n == "model.norm.weight" else p.detach() + 1)
           for n, p in trainer.named_parameters()]
    # clear_cache=False: the prompt's KV stays cached, so both measurements take the same (cached) path
    with WeightSyncClient(None, backend="ipc", bus=bus, clear_cache=False) as client, \
            pytest.raises(WeightSyncFailed) as e:
        client.send_weights(bad, version="never")
    assert e.value.status == 400 and "model.norm.weight" in str(e.value)
    assert engine_greedy(url) == before and version(url) == v
    assert not httpx.get(url + "/is_paused").json()["is_paused"]


def test_sleep_with_extra_cleanup_releases_the_group_and_the_client_forms_it_again(gloo_server, trainer):
    url = gloo_server.url
    with WeightSyncClient(url, backend="hccl") as client:
        client.send_weights(trainer.named_parameters(), version="before-sleep")
        r = post(url, "/sleep?level=1")
        assert r.status_code == 200
        assert post(url, "/wake_up").json()["status"] == "awake"
        r = post(url, "/start_weight_update")
        assert r.status_code == 409 and "sleep_mode_extra_cleanup" in r.json()["error"]["message"]
        assert r.json()["error"]["param"] == "init_info"  # the field the client re-forms its group on
        perturb(trainer, seed=50)
        client.send_weights(trainer.named_parameters(), version="after-sleep")
    assert version(url) == "after-sleep"
    assert_engine_matches(url, trainer)


def test_prefix_cache_never_serves_blocks_of_the_previous_version(ipc_server, trainer):
    url = ipc_server.url
    engine_greedy(url)
    hits = metric(ipc_server, "vllm:prefix_cache_hits_total")
    engine_greedy(url)
    assert metric(ipc_server, "vllm:prefix_cache_hits_total") > hits  # cached under this version
    perturb(trainer, seed=60)
    with WeightSyncClient(url, backend="ipc") as client:
        client.send_weights(trainer.named_parameters(), version="no-reuse", pause=None)  # no pause: no clear
    hits = metric(ipc_server, "vllm:prefix_cache_hits_total")
    assert_engine_matches(url, trainer)
    assert metric(ipc_server, "vllm:prefix_cache_hits_total") == hits


def test_ipc_share_memory_sends_the_trainers_own_memory(ipc_server, trainer):
    """share_memory=True: the trainer's parameters move into shared memory once; later versions are
    read by the engine straight from them (no staging copy on the trainer side)."""
    url = ipc_server.url
    with WeightSyncClient(url, backend="ipc", packed=False, share_memory=True) as client:
        perturb(trainer, seed=70)
        client.send_weights(trainer.named_parameters(), version="shared-1", pause="keep")
        arena = client.sender._arena
        assert arena is not None
        first = next(trainer.parameters())
        assert client.sender._arena_offset(first) is not None  # the parameter now lives in the segment
        assert_engine_matches(url, trainer)
        perturb(trainer, seed=71)  # in-place updates, as an optimizer step makes
        client.send_weights(trainer.named_parameters(), version="shared-2", pause="keep")
        assert client.sender._arena is arena and not client.sender._buffers  # nothing re-shared, nothing staged
    assert version(url) == "shared-2"
    assert_engine_matches(url, trainer)
    with torch.no_grad():  # the trainer's tensors outlive the client's segment name
        assert torch.isfinite(first.add_(0.0)).all()


@pytest.mark.parametrize("packed", [True, False])
def test_ipc_lent_segments_become_the_engines_weights_and_come_back(ipc_server, trainer, packed):
    """A CPU trainer lends its staging segments: the worker serves from them (no copy out) and lets go of
    one update's segments when a later update replaces them, so the trainer writes two sets in turn; a
    failed update's segments come back at once; the engine's weights outlive the client's names."""
    url = ipc_server.url
    client = WeightSyncClient(url, backend="ipc", packed=packed, packed_buffer_size_bytes=96 << 10)
    try:
        sets = []
        for k in range(3):
            perturb(trainer, seed=80 + k)
            client.send_weights(trainer.named_parameters(), version=f"lent-{k}", pause="keep")
            held = {b.name for b in client.sender._lent if b.held()}
            assert held, "the worker copied instead of taking the lent segments"
            sets.append(held)
        assert sets[0].isdisjoint(sets[1]) and sets[2] == sets[0]  # two sets in turn, none allocated anew
        assert {b.name for b in client.sender._lent} == sets[0] | sets[1]
        assert_engine_matches(url, trainer)
        named, _ = _wrong_shape_mid_list(trainer)
        with pytest.raises(WeightSyncFailed):
            client.send_weights(named, version="lent-bad", pause="keep")
        assert {b.name for b in client.sender._lent if b.held()} == sets[2]  # the failed update's came back
        assert version(url) == "lent-2"
    finally:
        client.close()  # unlinks every name; the worker keeps what it serves from
    assert_engine_matches(url, trainer)
    sums = weight_checksums(trainer.named_parameters())
    assert httpx.post(url + "/weight_checker", json={"action": "compare", "baseline": sums}).json()["match"]


# --- collective refusals: the trainer is never left blocked ----------------------------------------------


def _wrong_shape_mid_list(model) -> tuple[list[tuple[str, torch.Tensor]], str]:
    named = [(n, p.detach() + 1.0) for n, p in model.named_parameters()]
    mid = len(named) // 2
    name, t = named[mid]
    named[mid] = (name, t.reshape(-1)[: t.numel() // 2].clone())
    return named, name


@pytest.mark.parametrize("packed", [True, False])
def test_a_refused_collective_update_returns_to_the_trainer_within_seconds(gloo_server, trainer, packed):
    """Wrong shape mid-list: the workers still take part in every broadcast (and discard it), so our client
    returns with the 400 at once; the previous weights stay bitwise and the group stays usable."""
    url = gloo_server.url
    with WeightSyncClient(url, backend="nccl", packed=packed, packed_buffer_size_bytes=96 << 10) as client:
        perturb(trainer, seed=70 + packed)
        client.send_weights(trainer.named_parameters(), version=f"kept-{packed}", pause=None)
        baseline = weight_checksums(trainer.named_parameters())
        bad, bad_name = _wrong_shape_mid_list(trainer)
        t0 = time.monotonic()
        with pytest.raises(WeightSyncFailed) as e:
            client.send_weights(bad, version="never", pause="keep")
        took = time.monotonic() - t0
        print(f"\nrefused update (packed={packed}) returned to WeightSyncClient in {took:.2f} s")
        assert took < 5, f"the refused update kept the trainer {took:.1f} s"
        assert e.value.status == 400 and bad_name in str(e.value) and "discarded" in str(e.value), str(e.value)
        assert version(url) == f"kept-{packed}"
        r = httpx.post(url + "/weight_checker", json={"action": "compare", "baseline": baseline}).json()
        assert r == {"match": True, "mismatches": []}
        assert not httpx.get(url + "/is_paused").json()["is_paused"]
        perturb(trainer, seed=80 + packed)  # the same group, still lined up with the trainer
        client.send_weights(trainer.named_parameters(), version=f"after-refusal-{packed}", pause=None)
    assert version(url) == f"after-refusal-{packed}"
    assert_engine_matches(url, trainer)


def test_unreadable_metadata_tears_the_group_down_and_the_client_forms_it_again(gloo_server, trainer):
    url = gloo_server.url
    with WeightSyncClient(url, backend="nccl") as client:
        client.init_transfer()
        assert post(url, "/start_weight_update").status_code == 200
        r = post(url, "/update_weights", {"update_info": {
            "names": ["model.norm.weight"], "dtype_names": ["float32", "float32"], "shapes": [[64]]}})
        assert r.status_code == 400 and "torn down" in r.json()["error"]["message"], r.text
        r = post(url, "/start_weight_update")
        assert r.status_code == 409 and "torn down" in r.json()["error"]["message"], r.text
        perturb(trainer, seed=90)
        client.send_weights(trainer.named_parameters(), version="re-formed", pause=None)  # re-initialises
    assert version(url) == "re-formed"
    assert_engine_matches(url, trainer)


def _store(port: int):
    """A trainer's store (rank 0 of 2) that a test fills by hand."""
    import datetime

    import torch.distributed as dist

    return dist.TCPStore("127.0.0.1", port, 2, True, timeout=datetime.timedelta(seconds=30),
                         wait_for_workers=False, use_libuv=False)


from tests.serve_process import free_port as _free_port  # noqa: E402  (outside the ephemeral ports)


def test_a_store_object_naming_another_global_is_refused_by_name(gloo_server):
    import pickle

    port = _free_port()
    store = _store(port)
    store.set("broadcast_from/0/0", pickle.dumps(print))  # where the CPU group's prefix (a str) belongs
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "timeout_s": 10}
    r = post(gloo_server.url, "/init_weight_transfer_engine", {"init_info": init})
    assert r.status_code == 400, r.text
    assert "'builtins.print'" in r.json()["error"]["message"] and f"127.0.0.1:{port}" in r.json()["error"]["message"]
    del store
    assert engine_greedy(gloo_server.url)  # still serving


@pytest.mark.parametrize("key, words", [("rollbus/rank/1", "rank 1 is already taken"),
                                        ("rollbus/formed", "already complete")])
def test_store_key_collisions_are_409s_naming_the_store(gloo_server, key, words):
    port = _free_port()
    store = _store(port)
    store.add(key, 1)  # a second engine holds rank 1, or the group on this store formed before
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "timeout_s": 10}
    r = post(gloo_server.url, "/init_weight_transfer_engine", {"init_info": init})
    assert r.status_code == 409 and words in r.json()["error"]["message"], r.text
    assert f"127.0.0.1:{port}" in r.json()["error"]["message"]
    del store
    assert engine_greedy(gloo_server.url)


def test_init_info_fields_are_vllms(gloo_server):
    url = gloo_server.url
    base = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2}
    for extra, words, status in [
        ({"backend": "nccl"}, "unknown field(s) ['backend']", 400),
        ({"nccl_unique_id_b64": "AAAA"}, "not both", 400),
        ({"world_size": 1}, "outside world_size 1", 400),
    ]:
        r = post(url, "/init_weight_transfer_engine", {"init_info": {**base, **extra}})
        assert r.status_code == status and words in r.json()["error"]["message"], (extra, r.text)
    r = post(url, "/init_weight_transfer_engine", {"init_info": {
        "nccl_unique_id_b64": base64.b64encode(bytes(128)).decode(), "rank_offset": 1, "world_size": 2}})
    assert r.status_code == 400 and "CUDA" in r.json()["error"]["message"], r.text


def test_a_trainer_that_never_publishes_its_communicator_id_is_a_504_naming_the_key(gloo_server):
    port = _free_port()
    store = _store(port)  # the store answers, but rank 0 never writes broadcast_from/0/0
    t0 = time.monotonic()
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1, "world_size": 2, "timeout_s": 2}
    r = post(gloo_server.url, "/init_weight_transfer_engine", {"init_info": init})
    assert r.status_code == 504, r.text
    msg = r.json()["error"]["message"]
    assert "'broadcast_from/0/0'" in msg and f"127.0.0.1:{port}" in msg, msg
    assert time.monotonic() - t0 < 15
    del store
    assert engine_greedy(gloo_server.url)


def test_rank_offset_places_the_engine_after_other_ranks(gloo_server, trainer):
    """SkyRL's layout for a second engine: rank_offset 2 (rank 1 is another engine's worker, played here by a
    thread), world 3; the update lands and the other rank received the same bytes."""
    from engine.weights.collective import WeightGroup

    url, port = gloo_server.url, _free_port()
    init = {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 2, "world_size": 3, "timeout_s": 30}
    groups: dict[int, WeightGroup] = {}
    replies: list[httpx.Response] = []

    def call(path, body):
        replies.append(post(url, path, body))

    def join(rank):
        groups[rank] = WeightGroup.create("127.0.0.1", port, rank, 3, 30.0, op_timeout_s=30)

    threads = [threading.Thread(target=call, args=("/init_weight_transfer_engine", {"init_info": init})),
               *(threading.Thread(target=join, args=(r,)) for r in (0, 1))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(60)
    assert replies[0].status_code == 200, replies[0].text
    perturb(trainer, seed=95)
    named = [(n, p.detach().contiguous()) for n, p in trainer.named_parameters()]
    info = UpdateMeta([ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in named]).to_info()
    assert post(url, "/start_weight_update").status_code == 200
    engine_side = threading.Thread(target=call, args=("/update_weights", {"update_info": info}))
    other = [torch.empty_like(t) for _, t in named]
    other_side = threading.Thread(target=lambda: [groups[1].broadcast(t, 0) for t in other])
    engine_side.start()
    other_side.start()
    for _, t in named:
        groups[0].broadcast(t, 0)
    engine_side.join(60)
    other_side.join(60)
    assert replies[1].status_code == 200, replies[1].text
    assert post(url, "/finish_weight_update", {"weight_version": "offset-2"}).status_code == 200
    assert all(torch.equal(a, b) for a, (_, b) in zip(other, named))
    for g in groups.values():
        g.destroy()
    assert version(url) == "offset-2"
    assert_engine_matches(url, trainer)
