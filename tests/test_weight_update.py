"""The pure weight-update protocol: metadata validation, packed chunking, the sync step sequence and the
--weight-transfer-config flag."""

from __future__ import annotations

import pytest
import torch

from bus.messages import ErrorInfo
from engine.weights.config import parse_weight_transfer_config
from engine.weights.lifecycle import StepReply, SyncOutcome, reply_status, sync_steps
from engine.weights.protocol import ParamMeta, UpdateMeta, WeightSyncError, byte_views, plan_chunks, tensor_checksum

pytestmark = pytest.mark.unit


def info(names, dtypes=None, shapes=None):
    return {"names": names, "dtype_names": dtypes or ["float32"] * len(names), "shapes": shapes or [[2]] * len(names)}


def test_update_meta_parses_vllm_fields_and_round_trips():
    m = UpdateMeta.parse(info(["a", "b"], ["bfloat16", "torch.float32"], [[2, 3], [4]]))
    assert [p.dtype for p in m.params] == [torch.bfloat16, torch.float32]
    assert m.nbytes == 2 * 6 + 4 * 4
    assert m.to_info() == info(["a", "b"], ["bfloat16", "float32"], [[2, 3], [4]])


@pytest.mark.parametrize("bad, field, words", [
    ({"names": "a", "dtype_names": [], "shapes": []}, "names", "must be a list"),
    (info(["a", "b"], ["float32"], [[1], [1]]), "names", "differ in length"),
    (info(["a", "a"]), "names", "duplicate tensor name 'a'"),
    (info([]), "names", "empty"),
    (info(["a"], ["float7"]), "dtype_names", "unknown dtype 'float7'"),
    (info(["a"], shapes=[[2, -1]]), "shapes", "non-negative ints"),
    (info(["a"], shapes=["2"]), "shapes", "non-negative ints"),
    (info([3]), "names", "non-string"),
])
def test_update_meta_rejects_bad_metadata_naming_the_field(bad, field, words):
    with pytest.raises(WeightSyncError) as e:
        UpdateMeta.parse(bad)
    assert e.value.status == 400 and e.value.param == field and words in str(e.value)


def metas(*sizes):
    return [ParamMeta(f"t{i}", torch.uint8, (n,)) for i, n in enumerate(sizes)]


def test_plan_chunks_follows_vllms_exceed_rule_for_collectives():
    # a chunk closes once its total exceeds the buffer, so it may overshoot by less than one tensor
    assert plan_chunks(metas(4, 4, 4, 4, 1), 8) == [[0, 1, 2], [3, 4]]
    assert plan_chunks(metas(20, 1), 8) == [[0], [1]]
    assert plan_chunks(metas(3), 8) == [[0]]


def test_plan_chunks_fit_never_overflows_a_shared_buffer():
    assert plan_chunks(metas(4, 4, 4, 4, 1), 8, fit=True) == [[0, 1], [2, 3], [4]]
    with pytest.raises(WeightSyncError, match="'t1' .* larger than packed_buffer_size_bytes=8"):
        plan_chunks(metas(4, 9), 8, fit=True)
    with pytest.raises(WeightSyncError):
        plan_chunks(metas(4), 0)


def test_byte_views_read_packed_tensors_even_when_misaligned():
    a = torch.tensor([1.5, -2.0], dtype=torch.bfloat16)  # 4 bytes
    b = torch.tensor([3], dtype=torch.uint8)  # 1 byte: what follows is misaligned for fp32
    c = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    buf = torch.cat([t.reshape(-1).view(torch.uint8) for t in (a, b, c)])
    ps = [ParamMeta("a", a.dtype, (2,)), ParamMeta("b", b.dtype, (1,)), ParamMeta("c", c.dtype, (2, 3))]
    va, vb, vc = byte_views(buf, ps)
    assert torch.equal(va, a) and torch.equal(vb, b) and torch.equal(vc, c)


def test_tensor_checksum_is_bitwise():
    t = torch.randn(5, 3)
    assert tensor_checksum(t) == tensor_checksum(t.clone())
    u = t.clone()
    u[2, 1] = torch.nextafter(u[2, 1], torch.tensor(10.0))
    assert tensor_checksum(t) != tensor_checksum(u)
    assert tensor_checksum(t.t()) == tensor_checksum(t.t().contiguous())


def run(gen, fail_at: str | None = None, status: int = 400):
    """Drive the generator, failing the named step; returns (commands, outcome)."""
    seen = []
    try:
        step = next(gen)
        while True:
            seen.append(step.name)
            ok = step.name != fail_at
            step = gen.send(StepReply(ok, "" if ok else "boom", 200 if ok else status))
    except StopIteration as stop:
        return seen, stop.value


def test_sync_steps_in_order_with_commit():
    cmds, out = run(sync_steps("v1", "keep", True, [{}, {}], 10, 60))
    assert cmds == ["pause", "start_weight_update", "update_weights", "update_weights", "finish_weight_update",
                    "commit_weight_update", "resume"]
    assert out.ok


def test_sync_steps_abort_and_resume_on_a_failed_update():
    cmds, out = run(sync_steps("v1", "abort", True, [{}, {}], 10, 60), fail_at="update_weights")
    assert cmds == ["pause", "start_weight_update", "update_weights", "abort_weight_update", "resume"]
    assert not out.ok and out.failed_step == "update_weights" and out.status == 400


def test_sync_steps_a_refused_start_is_aborted():
    """A worker's refusal of the start (409: its weights are asleep) still opened the update window on
    every member; without the abort every later step was held. (A start while another update is active
    never gets here: the coordinator refuses the event before driving these steps.)"""
    cmds, out = run(sync_steps("v1", "none", True, [{}], 10, 60), fail_at="start_weight_update", status=409)
    assert cmds == ["start_weight_update", "abort_weight_update"] and out.status == 409


def test_a_failed_outcome_travels_as_one_typed_error():
    bad = ErrorInfo("WeightSyncError", "tensor 'w' has the wrong shape", "worker-0", 400, "shapes", "w")
    out = SyncOutcome(False, "worker-0: tensor 'w' has the wrong shape", 400, "update_weights", [bad])
    e = out.error_info()
    assert (e.kind, e.status, e.param, e.tensor) == ("WeightSyncError", 400, "shapes", "w")
    assert e.text() == "update_weights failed: worker-0: tensor 'w' has the wrong shape"  # as the HTTP route says
    assert SyncOutcome(False, "no ack from worker-1", 504, "pause").error_info().kind == "Timeout"
    assert SyncOutcome(True).error_info() is None


def test_reply_status_picks_the_members_status():
    assert reply_status(True, [], []) == 200
    assert reply_status(False, ["worker-1"], []) == 504
    assert reply_status(False, [], [ErrorInfo("WeightSyncError", "bad", "worker-0", 400),
                                    ErrorInfo("WeightSyncError", "busy", "worker-1", 409)]) == 409
    assert reply_status(False, [], [ErrorInfo("RuntimeError", "boom", "worker-0")]) == 500


def test_weight_transfer_config():
    assert parse_weight_transfer_config(None) is None
    c = parse_weight_transfer_config('{"backend": "nccl"}')
    assert (c.backend, c.name, c.stage_updates, c.pause_mode) == ("hccl", "nccl", True, "keep")
    assert parse_weight_transfer_config('{"backend": "npu_ipc", "stage_updates": false}').backend == "ipc"
    with pytest.raises(ValueError, match=r"Invalid weight transfer backend: None"):  # explicit null, as vLLM
        parse_weight_transfer_config('{"backend": null}')
    with pytest.raises(ValueError, match=r"Invalid weight transfer backend: foo. Available engines: \['gloo'"):
        parse_weight_transfer_config('{"backend": "foo"}')
    for bad in ('[1]', '{"backend": "ipc", "x": 1}', '{"backend": "ipc", "stage_updates": 1}',
                '{"backend": "ipc", "timeout_s": 0}', '{"backend": "ipc", "pause_mode": "later"}', "{"):
        with pytest.raises(ValueError):
            parse_weight_transfer_config(bad)


def test_weight_transfer_config_defaults_the_backend_by_platform(monkeypatch):
    """'{}' takes the platform's collective, as vLLM's default backend is nccl (issue 32 item 8)."""
    for device, name in (("cpu", "gloo"), ("cuda", "nccl"), ("npu", "hccl")):
        monkeypatch.setattr("engine.weights.config.platform_name", lambda d=device: d)
        c = parse_weight_transfer_config("{}")
        assert (c.backend, c.name, c.stage_updates) == ("hccl", name, True)
    monkeypatch.undo()
    monkeypatch.setenv("ROLLBUS_DEVICE", "cpu")
    assert parse_weight_transfer_config('{"timeout_s": 30}').name == "gloo"


def test_the_edge_decodes_payloads_into_the_backends_structs():
    """engine.weights.wire: init_info / update_info become the backend's typed struct where they enter the
    engine, or a 400 naming the field; a refused update_info becomes a RefusedUpdate that still says how to
    size the trainer's broadcasts, so the workers can drain them."""
    from bus.codec import CodecError
    from bus.messages import CollectiveInitInfo, CollectiveUpdateInfo, IpcUpdateInfo, RefusedUpdate
    from engine.weights.wire import decode_init, decode_update

    init = decode_init({"master_address": "h", "master_port": 5, "world_size": 2}, CollectiveInitInfo)
    assert (init.rank_offset, init.packed, init.timeout_s) == (1, False, None)
    for raw, param, words in [({"master_address": "h", "master_port": 5, "world_size": 2, "backend": "x"}, "backend",
                               "unknown field(s) ['backend']"),
                              ({"master_address": "h", "world_size": 2}, "master_port", "must be a port number"),
                              ({"master_address": "h", "master_port": 5, "world_size": -1}, "world_size",
                               "non-negative integer"),
                              ({"nccl_unique_id_b64": "AAAA", "master_port": 5, "world_size": 2},
                               "nccl_unique_id_b64", "not both")]:
        with pytest.raises(WeightSyncError) as e:
            decode_init(raw, CollectiveInitInfo)
        assert e.value.status == 400 and e.value.param == param and words in str(e.value), (raw, str(e.value))
    with pytest.raises(CodecError):
        decode_init({"x": 2**70}, CollectiveInitInfo)

    assert decode_update(info(["a"]), CollectiveUpdateInfo) == CollectiveUpdateInfo(["a"], ["float32"], [[2]])
    assert decode_update(info([]), CollectiveUpdateInfo) == CollectiveUpdateInfo([], [], [])  # vLLM 0.33's reuse
    assert isinstance(decode_update(info([]), IpcUpdateInfo), RefusedUpdate)  # nothing to reuse over ipc
    dup = decode_update({**info(["a", "a"]), "packed": True}, CollectiveUpdateInfo)
    assert isinstance(dup, RefusedUpdate) and dup.param == "names" and "duplicate tensor name 'a'" in dup.message
    assert dup.wire == CollectiveUpdateInfo(["a", "a"], ["float32"] * 2, [[2]] * 2, True)  # drained, not torn down
    odd = decode_update(info(["a"], ["float32", "float32"]), CollectiveUpdateInfo)
    assert odd.param == "names" and "differ in length" in odd.message and odd.wire is None  # cannot be sized
    other = decode_update(IpcUpdateInfo(["a"], ["float32"], [[2]]), CollectiveUpdateInfo)  # off the bus
    assert isinstance(other, RefusedUpdate) and other.param == "update_info"
    bad = decode_update({**info(["a"]), "ipc_handles": [{"k": 1.5}]}, IpcUpdateInfo)
    assert bad.param == "ipc_handles" and "must be a list of handles" in bad.message
