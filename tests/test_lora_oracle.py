"""LoRA in process: each adapter's logits equal HF + PEFT's (fp32, 1e-4), a mixed step (two adapters and the
base in one batch) gives every row the logits it has alone, and bad adapter folders are refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from bus.sampling_params import LoraRef
from engine.lora import LoraError, inspect_adapter
from tests.lora_helpers import make_adapter, peft_oracle
from tests.tiny_models import PagedRunner, load_model, make_tiny_checkpoint, random_prompt
from workers.lora import LoraSlots, attach, model_shape

pytest.importorskip("peft")
TOL = 1e-4


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    base = make_tiny_checkpoint("qwen3", root / "base")
    a = make_adapter(base, root / "a", rank=4, alpha=8, seed=1)
    b = make_adapter(base, root / "b", rank=8, alpha=16, seed=2, targets=["q_proj", "v_proj", "down_proj"],
                     rslora=True)
    return base, {"a": a, "b": b}


def _model_with_slots(base, kernel: bool = True):
    model = load_model(base)
    slots = LoraSlots(model_shape(model), model.kern, max_rank=16, max_cached=4, dtype=torch.float32,
                      device=torch.device("cpu"), kernel=kernel)
    attach(model, slots)
    return model, slots


def _prefill_logits(model, slots, prompts: list[tuple[list[int], LoraRef | None]]) -> list[torch.Tensor]:
    """One step prefilling every prompt (each with its adapter); the logits of each prompt's rows."""
    runner = PagedRunner(model)
    keys = [slots.acquire(ref) if ref is not None else None for _, ref in prompts]
    slots.begin_step([k for (ids, _), k in zip(prompts, keys) for _ in ids])
    try:
        logits = runner.step(prefills=[(i, ids) for i, (ids, _) in enumerate(prompts)])
    finally:
        slots.end_step()
    out, at = [], 0
    for ids, _ in prompts:
        out.append(logits[at:at + len(ids)])
        at += len(ids)
    return out


@pytest.mark.parametrize("kernel", [True, False], ids=["cpu-kernel", "torch"])
def test_each_adapter_matches_hf_peft_and_mixed_rows_are_their_own(setup, kernel):
    base, adapters = setup
    model, slots = _model_with_slots(base, kernel)
    if kernel and not slots.kernel:
        pytest.skip("the CPU kernels are unavailable here")
    vocab = model.cfg.vocab_size
    refs = {n: LoraRef(i + 1, n, str(p), 1) for i, (n, p) in enumerate(adapters.items())}
    prompts = [random_prompt(n, vocab, seed) for n, seed in ((9, 1), (13, 2), (6, 3))]
    for name, ref in refs.items():
        oracle = peft_oracle(base, adapters[name])
        (ours,) = _prefill_logits(model, slots, [(prompts[0], ref)])
        with torch.no_grad():
            ref_logits = oracle(torch.tensor([prompts[0]])).logits[0].float()
        ref_lp, our_lp = torch.log_softmax(ref_logits, -1), torch.log_softmax(ours, -1)
        assert (our_lp - ref_lp).abs().max().item() < TOL, name
    alone = [_prefill_logits(model, slots, [(p, r)])[0]
             for p, r in zip(prompts, (refs["a"], refs["b"], None))]
    mixed = _prefill_logits(model, slots, list(zip(prompts, (refs["a"], refs["b"], None))))
    for x, y in zip(alone, mixed):
        assert torch.allclose(x, y, atol=1e-5, rtol=0)
    base_only = load_model(base)
    base_logits = PagedRunner(base_only).step(prefills=[(0, prompts[2])])
    assert torch.allclose(mixed[2], base_logits, atol=1e-5, rtol=0)  # base rows untouched by the others


def test_bad_adapters_are_refused_naming_adapter_and_cause(setup, tmp_path):
    base, adapters = setup
    hf = json.loads((base / "config.json").read_text())
    with pytest.raises(LoraError, match=r"lora a failed: LoRA rank 4 is greater than max_lora_rank 2"):
        inspect_adapter("a", str(adapters["a"]), hf, 2)
    with pytest.raises(FileNotFoundError):
        inspect_adapter("x", str(tmp_path / "missing"), hf, 16)
    other = make_tiny_checkpoint("qwen3", tmp_path / "wide", hidden_size=32, num_attention_heads=2,
                                 num_key_value_heads=1)
    wide = json.loads((other / "config.json").read_text())
    with pytest.raises(LoraError, match=r"lora a failed: .*has shape"):
        inspect_adapter("a", str(adapters["a"]), wide, 16)
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "adapter_config.json").write_text((adapters["a"] / "adapter_config.json").read_text())
    (broken / "adapter_model.safetensors").write_bytes(b"\x01\x02")
    with pytest.raises(LoraError, match=r"lora z failed: cannot read"):
        inspect_adapter("z", str(broken), hf, 16)
    emb = make_adapter(base, tmp_path / "emb", targets=["q_proj", "embed_tokens"])
    with pytest.raises(LoraError, match=r"expected target modules"):
        inspect_adapter("e", str(emb), hf, 16)


def test_a_replaced_version_is_never_read_from_the_new_folder(setup):
    base, adapters = setup
    model, slots = _model_with_slots(base)
    slots.max_cached = 1
    v1, v2 = LoraRef(1, "a", str(adapters["a"]), 1), LoraRef(1, "a", str(adapters["b"]), 2)
    slots.release(slots.acquire(v1))
    slots.release(slots.acquire(v2))  # v1, idle, is dropped
    assert list(slots.loaded) == [(1, 2)]
    with pytest.raises(LoraError, match="version 1 of LoRA adapter 'a' was replaced by version 2"):
        slots.acquire(v1)
