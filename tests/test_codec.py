import msgspec
import numpy as np
import pytest
import torch

from bus.codec import CodecError, decode, encode
from bus.control_state import reduce
from bus.messages import (
    PROTOCOL_FINGERPRINT,
    PROTOCOL_VERSION,
    Ack,
    AddRequest,
    AnyCommand,
    AnyResult,
    CollectiveUpdateInfo,
    Command,
    ControlReply,
    ControlRequest,
    ControlState,
    ErrorInfo,
    ExtensionReturned,
    IpcInitInfo,
    IpcUpdateInfo,
    NewSeq,
    OutputBatch,
    Pause,
    RequestOutput,
    StepPlan,
    StepResult,
    UpdateWeights,
    WeightsZeroed,
    WeightUpdateResult,
    Welcome,
    message_kinds,
    protocol_fingerprint,
)
from bus.sampling_params import SamplingParams

pytestmark = pytest.mark.unit


def roundtrip(msg):
    return decode([bytes(f) for f in encode(msg)])


def test_nested_messages_roundtrip():
    plan = StepPlan(7, [NewSeq("a", [1, 2, 3], SamplingParams(temperature=0.5, stop=["x"]), [2])], ["a"], [0],
                    [3], [[4, 5]], ["old"], 3)
    assert roundtrip(plan) == plan
    batch = OutputBatch([RequestOutput("r", [1], [-0.5], [[(1, -0.5), (2, -1.0)]], True, "stop", None, None,
                                       3, 0, 1)], {"kv_usage": 0.25, "steps": 3})
    back = roundtrip(batch)
    assert back == batch and isinstance(back.stats["steps"], int)
    assert isinstance(back.outputs[0].top_logprobs[0][0][0], int)  # token ids stay ints


def test_arrays_travel_out_of_band_with_dtype_and_shape():
    ids = np.arange(12, dtype=np.int64).reshape(3, 4)
    res = StepResult(1, 0, ["a", "b", "c"], ids, np.ones(3, np.float32), ids, np.zeros((3, 4), np.float32), 0)
    frames = encode(res)
    assert len(frames) == 5  # header + 4 arrays
    assert len(frames[0]) < 200  # the array bytes are not inside the msgpack header
    back = decode([bytes(f) for f in frames])
    assert back.token_ids.dtype == np.int64 and back.token_ids.shape == (3, 4)
    np.testing.assert_array_equal(back.token_ids, ids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.uint8])
def test_tensors_keep_dtype_and_values(dtype):
    t = (torch.randn(5, 3) * 10).to(dtype)
    back = roundtrip(Ack(1, "w", True, None, ExtensionReturned({"t": t, "empty": torch.empty(0, 4, dtype=dtype)})))
    assert back.result.value["t"].dtype == dtype
    assert torch.equal(back.result.value["t"], t)
    assert back.result.value["empty"].shape == (0, 4)


def test_garbage_is_a_codec_error_not_a_crash():
    for frames in ([b""], [b"\xff" + b"junk"], [bytes([AddRequest.KIND]) + b"\x93\x01"], []):
        with pytest.raises(CodecError):
            decode(frames)
    # an array pointing at a frame that is not there
    frames = encode(StepResult(1, 0, [], np.zeros(2), np.zeros(2), np.zeros(2), np.zeros(2), 0))
    with pytest.raises(CodecError):
        decode([bytes(frames[0])])


def test_unknown_objects_are_refused():
    class Thing:
        pass

    with pytest.raises(CodecError):
        encode(Ack(1, "w", True, None, ExtensionReturned({"x": Thing()})))
    with pytest.raises(CodecError):
        encode(Thing())


def test_kinds_are_unique_and_stable():
    kinds = message_kinds()
    assert kinds[1] == "Hello" and kinds[20] == "AddRequest" and kinds[31] == "StepPlan"
    assert len(set(kinds.values())) == len(kinds)


def test_prompt_logprobs_travel_nested_with_their_arrays():
    from bus.messages import PromptLogprobs

    pl = PromptLogprobs("s", np.array([-0.5, -1.5], np.float32), np.array([1, 3]), np.array([[4, 5], [6, 7]]),
                        np.zeros((2, 2), np.float32))
    res = StepResult(2, 0, ["s"], np.array([9]), np.array([-0.1], np.float32), np.zeros((1, 0), np.int64),
                     np.zeros((1, 0), np.float32), 0, None, 0.0, np.array([1]), np.array([0.5], np.float32), [pl])
    back = roundtrip(res)
    assert back.prompt_logprobs[0].seq_id == "s" and back.prompt_logprobs[0].topk_ids.tolist() == [[4, 5], [6, 7]]
    assert back.sampling_mass.tolist() == [0.5] and back.ranks.tolist() == [1]
    out = RequestOutput("r", [1], [-0.5], None, False, None, None, None, 3, 0, 1, False, [2], [0.9], pl, None)
    again = roundtrip(OutputBatch([out], {})).outputs[0]
    assert again.prompt_logprobs.logprobs.tolist() == [-0.5, -1.5] and again.routed_experts is None


def test_protocol_version_tracks_every_struct():
    """Change any wire struct (or SamplingParams) and this fails until PROTOCOL_VERSION is bumped and the
    new fingerprint recorded in bus/messages.py."""
    assert protocol_fingerprint() == PROTOCOL_FINGERPRINT, (
        f"the wire structs changed: bump PROTOCOL_VERSION (now {PROTOCOL_VERSION}) and set "
        f"PROTOCOL_FINGERPRINT = {protocol_fingerprint()!r}")


def test_the_fingerprint_sees_a_field_change(monkeypatch):
    import bus.messages as m

    class Pause2(m.CommandBody):  # what Pause would be with one more field
        mode: str
        clear_cache: bool = True
        extra: int = 0

    before = protocol_fingerprint()
    monkeypatch.setattr(m, "AnyCommand", m.Union[tuple(c for c in AnyCommand.__args__ if c is not Pause) + (Pause2,)])
    assert protocol_fingerprint() != before


def test_commands_travel_as_typed_structs():
    for body in AnyCommand.__args__:
        fields = {f: v for f, v in {"mode": "keep", "level": 1, "name": "w", "role": "worker", "why": "x",
                                    "new_version": "v", "init_info": IpcInitInfo(),
                                    "update_info": [CollectiveUpdateInfo([], [], [])],
                                    "method": "m", "count": 3}.items() if f in body.__struct_fields__}
        cmd = Command(3, body(**fields))
        assert roundtrip(cmd) == cmd
    req = ControlRequest("r", UpdateWeights(IpcUpdateInfo(["a"], ["float32"], [[2]])), 5.0)
    assert roundtrip(req) == req
    reply = ControlReply("r", False, 4, {"worker-0": None}, [ErrorInfo("WeightSyncError", "bad shape", "worker-0", 400,
                                                                  "shapes", "w.0")], ["worker-1"])
    back = roundtrip(reply)
    assert back.errors[0].status == 400 and back.errors[0].tensor == "w.0"
    assert back.error == "worker-0: bad shape; no ack from worker-1"
    state = reduce(ControlState(), Pause("keep", False))
    assert roundtrip(Welcome(True, "", 9, state)).snapshot.paused.mode == "keep"


def test_failures_travel_as_typed_errors_not_strings():
    """A failed step, an interrupted step, a failed request and a failed weight update each carry an
    ErrorInfo (or the interrupted flag); a bare string where the error goes is a decode error."""
    failed = StepResult(3, 1, [], None, None, None, None, 0, ErrorInfo("RuntimeError", "boom", "worker-1"))
    back = roundtrip(failed)
    assert back.error == ErrorInfo("RuntimeError", "boom", "worker-1") and not back.interrupted
    cut = StepResult(3, 0, [], None, None, None, None, 0)
    cut.interrupted = True
    back = roundtrip(cut)
    assert back.interrupted and back.error is None
    out = RequestOutput("r", [], None, None, True, "error", None, ErrorInfo("Paused", "paused", status=503), 3, 0, 0)
    assert roundtrip(OutputBatch([out], {})).outputs[0].error.status == 503
    wr = WeightUpdateResult("w", False, "v2", 1, {}, ErrorInfo("WeightSyncError", "update_weights failed: x",
                                                               status=400, param="shapes"))
    back = roundtrip(wr)
    assert back.error.status == 400 and back.error.param == "shapes" and back.error.text() == "update_weights failed: x"
    assert roundtrip(WeightUpdateResult("w", True, "v2", 2)).error is None
    for legacy in (_raw(StepResult.KIND, [3, 0, [], None, None, None, None, 0, "interrupted"]),
                   _raw(WeightUpdateResult.KIND, ["w", False, "v", 1, {}, "boom"]),
                   _raw(OutputBatch.KIND, [[["r", [], None, None, True, "error", None, "boom", 3, 0, 0]], {}])):
        with pytest.raises(CodecError):
            decode(legacy)


def _raw(kind: int, body) -> list[bytes]:
    return [bytes([kind]) + msgspec.msgpack.encode(body)]


def test_a_hello_of_another_protocol_version_decodes_enough_to_be_refused():
    """Version 11 sent Hello.info as a dict: its Hello still decodes (its leading fields), so the coordinator
    can refuse it naming both versions; a bad Hello of our own version stays a decode error."""
    from bus.messages import Hello

    old = decode(_raw(Hello.KIND, ["worker", "worker-0", 7, 11, {"num_blocks": 4}, "22a06d03303c"]))
    assert isinstance(old, Hello) and (old.protocol_version, old.protocol_fingerprint) == (11, "22a06d03303c")
    assert old.info is None and old.name == "worker-0"
    with pytest.raises(CodecError):
        decode(_raw(Hello.KIND, ["worker", "worker-0", 7, PROTOCOL_VERSION, {"num_blocks": 4}, PROTOCOL_FINGERPRINT]))


def test_unknown_missing_and_mistyped_fields_are_decode_errors():
    good = encode(Command(1, Pause("abort")))[0]
    assert decode([good]).body.mode == "abort"
    bad = [
        _raw(Command.KIND, [1, ["pause", "abort", True], "extra"]),  # unknown trailing field
        _raw(Command.KIND, [1, ["pause", "abort", True, 7]]),  # unknown field in the command
        _raw(Command.KIND, [1]),  # missing field
        _raw(Command.KIND, ["one", ["pause", "abort", True]]),  # wrong type
        _raw(Command.KIND, [1, ["no_such_command"]]),  # unknown command
        _raw(Command.KIND, [1, ["pause", 5]]),  # wrong type inside the command
        _raw(AddRequest.KIND, ["r", [1], {"temperature": 0.5}, [0], 1.0]),  # sampling params as a dict
        _raw(200, []),  # unknown kind
    ]
    for frames in bad:
        with pytest.raises(CodecError):
            decode(frames)


def test_array_frames_must_be_arrays_and_whole():
    res = StepResult(1, 0, ["a"], np.arange(4, dtype=np.int64), np.zeros(4, np.float32), np.zeros((4, 2), np.int64),
                     np.zeros((4, 2), np.float32), 0)
    frames = [bytes(f) for f in encode(res)]
    with pytest.raises(CodecError, match="bad array"):  # a truncated array frame
        decode([frames[0], frames[1][:-3], *frames[2:]])
    with pytest.raises(CodecError):  # an int where an array must be
        decode(_raw(StepResult.KIND, [1, 0, ["a"], 5, None, None, None, 0]))
    ext = msgspec.msgpack.Ext(1, msgspec.msgpack.encode([1, "np:<q8", [2]]))
    with pytest.raises(CodecError):  # an array header with a dtype numpy does not know
        decode([bytes([StepResult.KIND]) + msgspec.msgpack.encode([1, 0, [], ext, None, None, None, 0]), b"\0" * 16])
    torch_ext = msgspec.msgpack.Ext(1, msgspec.msgpack.encode([1, "torch:no_such_dtype", [2]]))
    with pytest.raises(CodecError):
        result = ["extension_returned", {"t": torch_ext}, None]
        decode([bytes([Ack.KIND]) + msgspec.msgpack.encode([1, "w", True, None, result]), b"\0" * 4])


def test_array_frames_are_exactly_their_shape_and_never_objects():
    """The decoder builds each numpy array straight on its frame: a frame longer than its shape, a shape
    that does not fit, and an object dtype (raw bytes read as pointers) are decode errors."""
    res = StepResult(1, 0, ["a"], np.arange(4, dtype=np.int64), np.zeros(4, np.float32), np.zeros((4, 2), np.int64),
                     np.zeros((4, 2), np.float32), 0)
    frames = [bytes(f) for f in encode(res)]
    with pytest.raises(CodecError, match="bad array"):  # 8 bytes too many
        decode([frames[0], frames[1] + b"\0" * 8, *frames[2:]])
    with pytest.raises(CodecError, match="bad array"):  # not a whole number of items
        decode([frames[0], frames[1][:-3] + b"\0", *frames[2:]])
    for dtype, shape in (("np:|O", [2]), ("np:[('a', 'O')]", [2]), ("np:<i8", [-1]), ("np:<i8", [-2]),
                         ("np:<i8", [1 << 62, 1 << 62])):
        ext = msgspec.msgpack.Ext(1, msgspec.msgpack.encode([1, dtype, shape]))
        with pytest.raises(CodecError):
            body = msgspec.msgpack.encode([1, 0, [], ext, None, None, None, 0])
            decode([bytes([StepResult.KIND]) + body, b"\0" * 16])
    ext = msgspec.msgpack.Ext(1, msgspec.msgpack.encode([1, "np:<i8", ["2"]]))
    with pytest.raises(CodecError, match="bad array header"):  # a shape that is not a list of ints
        decode([bytes([StepResult.KIND]) + msgspec.msgpack.encode([1, 0, [], ext, None, None, None, 0]), b"\0" * 16])
    back = decode(frames)
    assert back.topk_ids.shape == (4, 2) and not back.token_ids.flags.writeable  # read-only views of the frames
    np.testing.assert_array_equal(back.token_ids, np.arange(4))


def test_the_architecture_doc_lists_every_kind_and_every_command_with_its_results():
    """docs/architecture.md is drawn from bus/messages.py: the protocol version, each message kind, and a row per
    command naming each result struct its members may ack it with."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parent.parent / "docs" / "architecture.md").read_text()
    assert f"`PROTOCOL_VERSION` ({PROTOCOL_VERSION})" in doc
    kinds = " ".join(f"{k} {name}" for k, name in sorted(message_kinds().items()))  # "1 Hello 2 Welcome ..."
    assert kinds in " ".join(doc.replace(",", " ").replace(".", " ").split()), kinds
    rows = {line.split("|")[1].strip(" `"): line for line in doc.splitlines() if line.startswith("  | `")}
    for body in AnyCommand.__args__:
        row = rows.get(body.__struct_config__.tag)
        assert row is not None and f"`{body.__name__}(" in row, body
        for result in body.RESULTS:
            assert result.__name__ in row, (body, result)


@pytest.mark.unit
def test_every_declared_result_decodes_in_an_ack():
    """A result a command declares but AnyResult lacks encodes on the worker and fails to decode at the
    coordinator: the ack is lost and the call times out (WeightsZeroed, /weight_checker reset, once did)."""
    for body in AnyCommand.__args__:
        for result in body.RESULTS:
            assert result in AnyResult.__args__, (body, result)
    back = roundtrip(Ack(1, "worker-0", True, None, WeightsZeroed(3)))
    assert back.result == WeightsZeroed(3)
