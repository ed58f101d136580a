"""workers.sleep on a tiny model, in process: the KV blocks of frozen requests survive a release of the KV
cache (offload_kv) bitwise, and /weight_checker reset zeroes every weight and counts them all as missing."""

from __future__ import annotations

import pytest
import torch

from ascend_ops.platform import current_platform
from tests.tiny_models import load_model, make_tiny_checkpoint
from workers.kv_cache import KVCache
from workers.sleep import SleepManager

pytestmark = pytest.mark.unit


@pytest.fixture()
def parts(tmp_path):
    model = load_model(make_tiny_checkpoint("qwen3", tmp_path / "m"))
    kv = KVCache(2, 1, 8, 4, 16, torch.float32, torch.device("cpu"))
    return model, kv, SleepManager(model, kv, current_platform())


def test_offloaded_blocks_come_back_bitwise_and_the_rest_is_released(parts):
    model, kv, sm = parts
    kv.tensor.copy_(torch.randn(kv.shape))
    held = [3, 7, 8, 3]  # a shared block appears twice in the scheduler's answer: copied once
    before = kv.tensor[:, :, [3, 7, 8]].clone()
    block = kv.bytes_per_block(2, 1, 8, 4, torch.float32)
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    released = sm.sleep(2, held)
    assert kv.tensor is None and sm.asleep == {"weights", "kv_cache"}
    assert released == 13 * block + weights  # on CPU the host copy of the 3 held blocks is all that stays
    sm.wake(["weights"])
    assert sm.missing == len(dict(model.named_parameters()))  # level 2: the sync must refill every parameter
    sm.wake(["kv_cache"])
    assert torch.equal(kv.tensor[:, :, [3, 7, 8]], before)
    assert not kv.tensor[:, :, [0, 1, 2, 4]].any()  # free blocks come back empty
    sm.sleep(1)  # a plain sleep after it keeps nothing
    sm.wake(None)
    assert not kv.tensor.any()


def test_zero_weights_zeroes_every_parameter_until_loaded_again(parts):
    model, _, sm = parts
    names = sm.zero_weights()
    assert names == sm.missing == len(dict(model.named_parameters()))
    assert all(not p.any() for p in model.parameters())
    some = sorted(model.required_weight_names())
    assert sm.mark_loaded(some[:1]) > 0  # a partial update: still missing
    assert sm.mark_loaded(some) == 0  # every tensor: served again


def test_a_mixed_window_models_groups_are_both_offloaded(tmp_path):
    """gpt-oss / Gemma 3 (engine.window_blocks): the sliding layers' block b comes as -2 - b and is kept too."""
    model = load_model(make_tiny_checkpoint("qwen3", tmp_path / "m"))
    kv = KVCache(2, 1, 8, 4, 16, torch.float32, torch.device("cpu"), window_layers=(0,), window_blocks=6)
    sm = SleepManager(model, kv, current_platform())
    kv.tensor.normal_()
    kv.window_tensor.normal_()
    full, win = kv.tensor[:, :, [3, 7]].clone(), kv.window_tensor[:, :, [1, 5]].clone()
    sm.sleep(1, [3, -3, 7, -7])
    assert kv.tensor is None and kv.window_tensor is None
    sm.wake(None)
    assert torch.equal(kv.tensor[:, :, [3, 7]], full) and torch.equal(kv.window_tensor[:, :, [1, 5]], win)
    assert not kv.tensor[:, :, [0, 1, 2]].any() and not kv.window_tensor[:, :, [0, 2, 3, 4]].any()
