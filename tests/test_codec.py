import numpy as np
import pytest
import torch

from bus.codec import CodecError, decode, encode
from bus.messages import Ack, AddRequest, NewSeq, OutputBatch, RequestOutput, StepPlan, StepResult, message_kinds

pytestmark = pytest.mark.unit


def roundtrip(msg):
    return decode([bytes(f) for f in encode(msg)])


def test_nested_messages_roundtrip():
    plan = StepPlan(7, [NewSeq("a", [1, 2, 3], {"temperature": 0.5, "stop": ["x"]}, [2])], ["a"], [0], [3],
                    [[4, 5]], ["old"], 3)
    assert roundtrip(plan) == plan
    batch = OutputBatch([RequestOutput("r", [1], [-0.5], [[[1, -0.5], [2, -1.0]]], True, "stop", None, None,
                                       3, 0, 1)], {"kv_usage": 0.25})
    assert roundtrip(batch) == batch


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
    back = roundtrip(Ack(1, "w", True, "", {"t": t, "empty": torch.empty(0, 4, dtype=dtype)}))
    assert back.result["t"].dtype == dtype
    assert torch.equal(back.result["t"], t)
    assert back.result["empty"].shape == (0, 4)


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
        encode(Ack(1, "w", True, "", {"x": Thing()}))
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
                     np.zeros((1, 0), np.float32), 0, "", 0.0, np.array([1]), np.array([0.5], np.float32), [pl])
    back = roundtrip(res)
    assert back.prompt_logprobs[0].seq_id == "s" and back.prompt_logprobs[0].topk_ids.tolist() == [[4, 5], [6, 7]]
    assert back.sampling_mass.tolist() == [0.5] and back.ranks.tolist() == [1]
    out = RequestOutput("r", [1], [-0.5], None, False, None, None, None, 3, 0, 1, False, [2], [0.9], pl, None)
    again = roundtrip(OutputBatch([out], {})).outputs[0]
    assert again.prompt_logprobs.logprobs.tolist() == [-0.5, -1.5] and again.routed_experts is None
