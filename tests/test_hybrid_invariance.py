"""Batch invariance for the hybrid models (Qwen3-Next, Qwen3.5): a sequence's logits are the same bits alone,
among other sequences with its prompt chunked, and as one long prefill (a generated token's position computed
in a prefill equals it decoded), in fp32 and bf16; the start-up self-check measures the Gated DeltaNet layer
and names it where it is not invariant (the default kernels: chunked delta rule, torch's sigmoid / softplus /
silu); invariant mode stays within 1e-4 of HF."""

from __future__ import annotations

import pytest
import torch

from ascend_ops.batch_invariant import DEFAULT, INVARIANT
from ascend_ops.batch_invariant_check import BatchInvarianceUnavailable, self_check
from tests.test_batch_invariance import _load, _three_ways, same
from tests.tiny_models import PagedRunner, make_tiny_checkpoint, random_prompt
from workers.models.gated_deltanet import gdn_invariant

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def hybrid_folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("hybrid-bi")
    return {a: make_tiny_checkpoint(a, root / a) for a in ("qwen3_next", "qwen3_5")}


@pytest.mark.parametrize("arch, dtype", [("qwen3_next", torch.float32), ("qwen3_5", torch.bfloat16)])
def test_a_hybrid_sequence_gets_the_same_bits_alone_mixed_chunked_and_as_one_prefill(hybrid_folders, arch, dtype):
    model = _load(hybrid_folders[arch], dtype, INVARIANT)
    prompt = random_prompt(13, model.cfg.vocab_size, 1)
    alone, mixed, prefilled, alone_routes, full_routes = _three_ways(model, prompt, 10)
    assert same(alone, mixed), "decoding among other sequences / chunked prefill changed the bits"
    assert same(alone, prefilled), "a position computed in a prefill differs from the same position decoded"
    if alone_routes is not None:  # Qwen3-Next's MoE layers: the prompt's routes alone vs inside the long prefill
        assert torch.equal(alone_routes, torch.stack(full_routes, 1)[:len(prompt)])


def test_the_self_check_measures_the_gated_deltanet_and_refuses_the_default_kernels(hybrid_folders):
    checked = self_check(_load(hybrid_folders["qwen3_5"], torch.float32, INVARIANT), block_size=4)
    assert "gated_deltanet" in checked and "paged_attention" in checked
    default = _load(hybrid_folders["qwen3_5"], torch.float32, DEFAULT)
    gen = torch.Generator().manual_seed(0)
    assert not gdn_invariant(default.model.layers[0].linear_attn, lambda *s: torch.randn(*s, generator=gen))
    with pytest.raises(BatchInvarianceUnavailable, match="cpu \\(float32\\)"):
        self_check(default, block_size=4)


def test_invariant_mode_equals_hf_across_chunks_and_decodes(hybrid_folders):
    folder = hybrid_folders["qwen3_next"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    ids = random_prompt(100, 1000, 9)
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0].log_softmax(-1)
    r = PagedRunner(_load(folder, torch.float32, INVARIANT), num_blocks=40)
    rows = [r.step(prefills=[(0, ids[:1])]), r.step(prefills=[(0, ids[1:64])]), r.step(prefills=[(0, ids[64:94])])]
    rows += [r.step(decodes=[(0, t)]) for t in ids[94:]]
    assert (torch.cat(rows).log_softmax(-1) - want).abs().max().item() < 1e-4
