"""The architectures added after the first five (issue 34), each against HF transformers on one tiny random
checkpoint with every feature on (sliding windows shorter than the prompts, shared experts, full-projection
QK-norm, ...): 4 prompts prefilled together (one of them in chunks), then 32 greedy tokens decoded as one
batch; the tokens equal HF's greedy choices, every prompt and sampled logprob is within 1e-4 of HF's (the
engine in fp32; HF in fp64 for the dense archs, fp32 for MoE), and at every MoE layer each token's routed
experts are HF's router's. Then the checkpoint contract: HF names (weight updates write the tensors they
name), a missing / extra / misshapen tensor refused naming it, an unimplemented config value refused naming
the key. The exhaustive per-arch oracle suite
(test_model_oracle.py, test_moe_oracle.py) runs these archs in the slow lane."""

from __future__ import annotations

import re
import threading
import weakref
from pathlib import Path

import pytest
import torch

from ascend_ops.tp_group import Layout
from tests.tiny_models import HYBRID, NEW_ARCHS, PagedRunner, load_model, random_prompt, tiny_with_oracle
from workers.models.checkpoint import iter_checkpoint, iter_safetensors, load_hf_config
from workers.models.decoder_config import sliding_windows
from workers.models.registry import ARCHITECTURES, build_model
from workers.models.tp_layout import layout_error

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

LOGPROB_TOL = 1e-4
STEPS = 32


@pytest.fixture(scope="module", params=NEW_ARCHS)
def tiny(request, tmp_path_factory) -> tuple[str, Path, object]:
    return tiny_with_oracle(request.param, tmp_path_factory.mktemp(request.param))


def hf_routes(hf, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """HF's log-probs [len, V] and its routers' choices [len, moe_layers, k] (each token's expert ids sorted:
    some HF routers return their top-k unsorted), read from the router modules' outputs."""
    picks: list[torch.Tensor] = []

    def grab(_m, _i, out):
        if isinstance(out, tuple) and len(out) == 3 and out[2].dtype == torch.int64:
            picks.append(out[2].reshape(len(ids), -1).sort(-1).values)

    hooks = [m.register_forward_hook(grab) for n, m in hf.named_modules() if n.endswith(("mlp.gate", "mlp.router"))]
    try:
        with torch.no_grad():
            logits = hf(torch.tensor([ids])).logits[0].float()
    finally:
        for h in hooks:
            h.remove()
    return logits.log_softmax(-1), (torch.stack(picks, 1) if picks else None)


_HF64: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # HF model -> its fp64 copy


def hf_logprobs64(hf, ids: list[int]) -> torch.Tensor:
    """HF's log-probs [len, V] from an fp64 copy of the model: the oracle for dense archs, as it is the same on
    every host (HF's fp32 SDPA and GEMMs pick their kernels by CPU; MoE archs stay fp32: HF's grouped expert
    GEMM takes no fp64)."""
    import copy

    if hf not in _HF64:
        _HF64[hf] = copy.deepcopy(hf).double()
    with torch.no_grad():
        return _HF64[hf](torch.tensor([ids])).logits[0].log_softmax(-1).float()


def test_greedy_logprobs_and_routes_equal_hf(tiny) -> None:
    arch, folder, hf = tiny
    model = load_model(folder)
    v = model.cfg.vocab_size
    prompts = {s: random_prompt(n, v, 20 + s) for s, n in enumerate((5, 11, 17, 26))}
    r = PagedRunner(model, num_blocks=160, block_size=4)
    lps: dict[int, list[torch.Tensor]] = {s: [] for s in prompts}
    routes: dict[int, list[torch.Tensor]] = {s: [] for s in prompts}

    def step(decodes=(), prefills=()) -> torch.Tensor:
        routed: list[torch.Tensor] = []
        logits = r.step(decodes, prefills, routed_experts=routed)
        per_row = torch.stack(routed, 1).sort(-1).values if routed else None
        i = 0
        for s, n in [(s, 1) for s, _ in decodes] + [(s, len(t)) for s, t in prefills]:
            lps[s].append(logits[i:i + n].log_softmax(-1))
            if per_row is not None:
                routes[s].append(per_row[i:i + n])
            i += n
        return logits

    last = step(prefills=[(0, prompts[0]), (1, prompts[1]), (2, prompts[2]), (3, prompts[3][:9])])
    last = step(decodes=[(0, int(lps[0][-1][-1].argmax()))], prefills=[(3, prompts[3][9:])])
    gen = {s: [int(lps[s][-1][-1].argmax())] for s in (1, 2, 3)}
    gen[0] = [int(lps[0][0][-1].argmax()), int(last[0].argmax())]
    for _ in range(STEPS - 1):
        seqs = [s for s in prompts if len(gen[s]) < STEPS]
        out = step(decodes=[(s, gen[s][-1]) for s in seqs])
        for row, s in enumerate(seqs):
            gen[s].append(int(out[row].argmax()))
    for s, p in prompts.items():
        ids = p + gen[s]
        hf32, ref_routes = hf_routes(hf, ids)
        ref_lp = hf32 if model.num_moe_layers else hf_logprobs64(hf, ids)
        ours = torch.cat(lps[s])[: len(ids) - 1]  # the last generated token is never fed
        assert gen[s] == ref_lp[len(p) - 1:-1].argmax(-1).tolist(), f"{arch} prompt {s}: greedy differs from HF"
        assert len(set(gen[s])) > 3, "greedy collapsed; pick other weights"
        picked = ref_lp[torch.arange(1, len(ids)) - 1, torch.tensor(ids[1:])]  # prompt and sampled logprobs
        mine = ours[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
        off = (picked - mine).abs()
        assert off.max().item() < LOGPROB_TOL, (
            f"{arch} prompt {s} ({len(p)} tokens): positions off by more than {LOGPROB_TOL}: "
            f"{(off >= LOGPROB_TOL).nonzero().flatten().tolist()} (largest {off.max().item():.3g}; HF fp32 is "
            f"{(hf32 - ref_lp).abs().max().item():.3g} from the oracle)")
        assert (ours - ref_lp[:-1]).abs().max().item() < LOGPROB_TOL, f"{arch} prompt {s}: full rows"
        if model.num_moe_layers:
            got = torch.cat(routes[s])[: len(ids) - 1]
            assert ref_routes is not None and ref_routes.shape[1] == model.num_moe_layers
            assert torch.equal(got, ref_routes[:-1]), f"{arch} prompt {s}: routed experts differ from HF's"


def test_hf_names_load_update_and_are_checked(tiny) -> None:
    """Every saved tensor is required; an update by an HF name writes exactly that tensor's place; a
    missing, extra or misshapen tensor is refused naming it."""
    arch, folder, hf = tiny
    model = load_model(folder)
    saved = dict(iter_safetensors(folder))
    assert model.required_weight_names() == set(saved)
    before = {n: p.clone() for n, p in model.named_parameters()}
    kinds = {re.sub(r"\.\d+\.", ".N.", n): n for n in saved}  # one tensor of each kind (the last layer's)
    for name in kinds.values():  # each HF tensor moved alone: only its destination changes
        t = saved[name]
        new = t + 1.0
        model.load_weights([(name, new)])
        dst = model.weight_destination(name)
        assert torch.equal(dst, new), name
        changed = [n for n, p in model.named_parameters() if not torch.equal(p, before[n])]
        assert len(changed) == 1, (name, changed)
        model.load_weights([(name, t)])
    name = next(n for n in saved if n.endswith("o_proj.weight"))
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        model.load_weights([(name, torch.zeros(3, 3))])
    with pytest.raises(KeyError, match="model.layers.0.extra.weight"):
        model.load_weights([("model.layers.0.extra.weight", torch.zeros(3))])
    fresh = build_model(load_hf_config(folder), torch.float32, "cpu")
    missing = fresh.required_weight_names() - fresh.load_weights((n, t) for n, t in saved.items() if n != name)
    assert missing == {name}


def test_unimplemented_config_values_are_refused_naming_them(tiny) -> None:
    arch, folder, _ = tiny
    cfg = load_hf_config(folder)
    act = "hidden_activation" if cfg.get("hidden_activation") else "hidden_act"  # Gemma 3 reads the former
    for key, value in [(act, "relu2"), ("quantization_config", {"quant_method": "fp8"})]:
        with pytest.raises(NotImplementedError, match=f"{key}.*{value if isinstance(value, str) else 'fp8'}"):
            build_model({**cfg, key: value}, torch.float32, "meta")
    rope = {**(cfg.get("rope_parameters") or {}), "rope_type": "dynamic", "factor": 2.0}
    if "full_attention" in rope:  # Gemma 3: one set per layer type
        rope = {**rope, "full_attention": {**rope["full_attention"], "rope_type": "dynamic"}}
    with pytest.raises(NotImplementedError, match="dynamic"):
        build_model({**cfg, "rope_parameters": rope, "rope_scaling": rope}, torch.float32, "meta")
    if arch in HYBRID:  # a -tp that does not divide the linear-attention heads is refused naming them
        assert "linear_num_key_heads" in (layout_error(cfg, 4) or "")
        assert "linear_num_value_heads" in (layout_error({**cfg, "linear_num_key_heads": 8}, 8) or "")
        with pytest.raises(NotImplementedError, match="2 linear-attention heads"):
            build_model(cfg, torch.float32, "meta", tp=Layout(0, 4))
        assert layout_error(cfg, 2) is None
        return
    assert layout_error(cfg, 2) is None
    heads = cfg["num_attention_heads"]
    assert "num_attention_heads" in (layout_error(cfg, heads + 1) or "")


class _ThreadGroup(Layout):
    """Rank `rank` of a tensor-parallel group whose ranks are threads of this process (tests only): the
    collectives meet at a barrier and sum / collect in rank order, as Gloo's would."""

    def __init__(self, rank: int, size: int, shared: dict, barrier: threading.Barrier) -> None:
        super().__init__(rank, size)
        self.shared, self.barrier = shared, barrier

    def _exchange(self, t: torch.Tensor) -> list[torch.Tensor]:
        self.shared[self.rank] = t
        self.barrier.wait()
        parts = [self.shared[r] for r in range(self.size)]
        self.barrier.wait()
        return parts

    def all_reduce(self, t: torch.Tensor) -> torch.Tensor:
        return torch.stack(self._exchange(t)).sum(0)

    def gather(self, t: torch.Tensor) -> list[torch.Tensor] | None:
        parts = self._exchange(t)
        return parts if self.rank == 0 else None


def on_two_thread_ranks(folder, run) -> dict:
    """`run(model)` on each rank of a -tp 2 group whose ranks are threads holding their shards (loaded from the
    whole HF tensors of `folder`): {rank: what it returned}."""
    cfg = load_hf_config(folder)
    shared: dict = {}
    barrier = threading.Barrier(2, timeout=60)
    got: dict = {}

    def rank(r: int) -> None:
        model = build_model(cfg, torch.float32, "cpu", tp=_ThreadGroup(r, 2, shared, barrier))
        model.load_weights(iter_checkpoint(folder))
        got[r] = run(model)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    return got


def test_two_tensor_parallel_ranks_compute_what_one_does(tiny) -> None:
    """-tp 2, each rank a thread holding its shard (loaded from the whole HF tensors): the logits equal
    the unsharded model's (fp32 noise)."""
    arch, folder, _ = tiny
    prompt = random_prompt(19, load_hf_config(folder)["vocab_size"], 3)
    want = PagedRunner(load_model(folder)).step(prefills=[(0, prompt)])
    got = on_two_thread_ranks(folder, lambda model: PagedRunner(model).step(prefills=[(0, prompt)]))
    assert got[1] is None and got[0] is not None
    assert (got[0] - want).abs().max().item() < 1e-4


def test_the_docs_table_lists_exactly_the_registered_architectures() -> None:
    text = (Path(__file__).resolve().parent.parent / "docs" / "serving.md").read_text()
    listed = set(re.findall(r"^  \| `(\w+ForCausalLM)` \|", text, re.M))
    assert listed == set(ARCHITECTURES)


@pytest.mark.unit
def test_sliding_windows_follow_each_familys_rule_without_layer_types() -> None:
    """(With layer_types in config.json, as transformers 5 saves it, they decide; checked against HF above.)"""
    base = {"num_hidden_layers": 4, "sliding_window": 5, "max_window_layers": 2}
    assert sliding_windows("MistralForCausalLM", base) == (5, 5, 5, 5)
    assert sliding_windows("Qwen2ForCausalLM", base) == (0, 0, 0, 0)  # use_sliding_window off
    on = {**base, "use_sliding_window": True}
    assert sliding_windows("Qwen2ForCausalLM", on) == (0, 0, 5, 5)
    assert sliding_windows("Qwen2MoeForCausalLM", on) == (5, 0, 0, 0)
    assert sliding_windows("Qwen3MoeForCausalLM", on) == (5, 5, 5, 5)
    assert sliding_windows("LlamaForCausalLM", {**base, "sliding_window": None}) == (0, 0, 0, 0)
    with pytest.raises(NotImplementedError, match="layer_types 'chunked_attention'"):
        sliding_windows("MistralForCausalLM", {**base, "layer_types": ["chunked_attention"] * 4})
    with pytest.raises(NotImplementedError, match="sliding_window 5"):
        sliding_windows("LlamaForCausalLM", base)


@pytest.mark.unit
def test_glm_mtp_layers_in_the_checkpoint_are_skipped_as_hf_skips_them() -> None:
    from tests.tiny_models import TINY_CONFIGS

    cfg = {**TINY_CONFIGS["glm4_moe"][1], "architectures": ["Glm4MoeForCausalLM"], "hidden_size": 64,
           "intermediate_size": 160, "num_attention_heads": 4, "num_key_value_heads": 2, "num_nextn_predict_layers": 1}
    model = build_model(cfg, torch.float32, "meta")
    assert model.load_weights([("model.layers.3.mlp.gate.weight", torch.zeros(8, 64))]) == set()
    with pytest.raises(KeyError, match="model.layers.4.mlp.gate.weight"):
        model.load_weights([("model.layers.4.mlp.gate.weight", torch.zeros(8, 64))])


def test_load_format_dummy_builds_and_runs(tiny) -> None:
    """--load-format dummy: every parameter filled (vLLM's uniform [-1e-3, 1e-3]), and a step runs finite."""
    from workers.loader import initialize_dummy_weights

    _, folder, _ = tiny
    model = build_model(load_hf_config(folder), torch.float32, "cpu")
    assert initialize_dummy_weights(model) == len(list(model.parameters()))
    assert torch.isfinite(PagedRunner(model).step(prefills=[(0, [1, 2, 3, 4, 5])])).all()


@pytest.mark.unit
def test_mla_caches_one_latent_row_per_token_and_layer() -> None:
    """DeepSeek-V3's real shapes (DeepseekV3Config's defaults, built on the meta device): its KV cache holds one
    plane of kv_lora_rank + qk_rope_head_dim = 576 values per token and layer, 1,152 bytes in bf16, where K
    and V of its 128 heads (192 + 128 dims) would take 81,920 (docs/serving.md)."""
    from workers.kv_cache import KVCache

    cfg = {**transformers.DeepseekV3Config().to_dict(), "architectures": ["DeepseekV3ForCausalLM"]}
    model = build_model(cfg, torch.bfloat16, "meta")
    assert tuple(model.kv_spec) == (61, 1, 576) and model.kv_planes == 1
    per_token_layer = KVCache.bytes_per_block(*model.kv_spec, 1, torch.bfloat16, model.kv_planes) // 61
    mha = KVCache.bytes_per_block(61, 128, 192 + 128, 1, torch.bfloat16, planes=1) // 61
    assert (per_token_layer, mha, mha // per_token_layer) == (1152, 81920, 71)
    kv = KVCache(*model.kv_spec, 4, 3, torch.float32, torch.device("cpu"), planes=model.kv_planes)
    assert kv.tensor.shape == (61, 1, 3, 4, 1, 576) and kv.views[0][0].data_ptr() == kv.views[0][1].data_ptr()


def test_deepseek_v3_variants_equal_hf(tmp_path) -> None:
    """The DeepSeek-V3 variants the tiny fixture leaves out (DeepSeek-V2-Lite-style q_proj without a q LoRA
    rank, rotary dims not interleaved, attention biases, one expert group as Kimi-K2, plain rope): one
    prefill's log-probs equal HF's."""
    from tests.tiny_models import make_tiny_checkpoint

    folder = make_tiny_checkpoint("deepseek_v3", tmp_path, q_lora_rank=None, rope_interleave=False, n_group=1,
                                  topk_group=1, attention_bias=True,
                                  rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompt = random_prompt(40, 1000, 5)
    with torch.no_grad():
        want = hf(torch.tensor([prompt])).logits[0].log_softmax(-1)
    got = PagedRunner(load_model(folder)).step(prefills=[(0, prompt)]).log_softmax(-1)
    assert (got - want).abs().max().item() < LOGPROB_TOL
