"""Mixture-of-experts decoders against HF transformers on the same weights (fp32): log-probabilities and
router choices (top-k expert ids at every MoE layer and position) through the paged KV path, on tiny
random Qwen3-MoE / Mixtral checkpoints and on a Mixtral-style MoE upcycled from SmolLM2 (real text).
The shared prefill/decode/bf16/reload checks run for the MoE archs too, in test_model_oracle.py; the
whole-engine check is test_engine_archs.py."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from tests.tiny_models import (
    MOE,
    NEW_ARCHS,
    PagedRunner,
    load_model,
    make_tiny_checkpoint,
    random_prompt,
    tiny_with_oracle,
)
from workers.models.checkpoint import iter_safetensors, load_hf_config
from workers.models.registry import build_model

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.timeout(300)

LOGPROB_TOL = 1e-4
# A router choice is only well defined when the k-th and (k+1)-th probabilities differ by more than the
# arithmetic noise between two implementations (well under 1e-6 in fp32 here); the fixtures keep clear of
# it (the upcycled model's closest call on SENTENCE is a gap of 4.6e-6, and still agrees).
MIN_MARGIN = 1e-6


@pytest.fixture(scope="module", params=[pytest.param(a, marks=pytest.mark.slow) if a in NEW_ARCHS else a
                                        for a in sorted(MOE)])
def tiny(request, tmp_path_factory) -> tuple[str, Path, object]:
    return tiny_with_oracle(request.param, tmp_path_factory.mktemp(request.param))


def hf_reference(hf, ids: list[int], top_k: int) -> tuple[torch.Tensor, torch.Tensor, float]:
    """HF's log-probs [len, V], its routed experts [len, moe_layers, k] (top-k of the fp32 router softmax,
    as its router computes them) and the smallest gap between the k-th and (k+1)-th probability."""
    with torch.no_grad():
        out = hf(torch.tensor([ids]), output_router_logits=True)
    routes, margin = [], math.inf
    for logits in out.router_logits:  # one [len, E] per MoE layer, in layer order
        probs = torch.softmax(logits.float(), dim=-1)
        top = probs.topk(min(top_k + 1, probs.shape[-1]), dim=-1)
        routes.append(top.indices[:, :top_k])
        if probs.shape[-1] > top_k:
            margin = min(margin, (top.values[:, top_k - 1] - top.values[:, top_k]).min().item())
    return out.logits[0].float().log_softmax(-1), torch.stack(routes, dim=1), margin


class Capture:
    """Drives a PagedRunner step by step and files each token's log-probs and routes under its sequence."""

    def __init__(self, runner: PagedRunner) -> None:
        self.runner = runner
        self.fed: dict[int, list[int]] = {}
        self.logprobs: dict[int, list[torch.Tensor]] = {}
        self.routes: dict[int, list[torch.Tensor]] = {}

    def step(self, decodes=(), prefills=()) -> torch.Tensor:
        routed: list[torch.Tensor] = []
        logits = self.runner.step(decodes, prefills, routed_experts=routed)
        model = self.runner.model
        assert len(routed) == model.num_moe_layers
        for r in routed:
            assert r.shape == (logits.shape[0], model.moe_top_k) and r.dtype == torch.int64
        per_row = torch.stack(routed, dim=1)  # [T, moe_layers, k]
        rows = [(s, [t]) for s, t in decodes] + list(prefills)
        i = 0
        for s, toks in rows:
            self.fed.setdefault(s, []).extend(toks)
            self.logprobs.setdefault(s, []).append(logits[i : i + len(toks)].log_softmax(-1))
            self.routes.setdefault(s, []).append(per_row[i : i + len(toks)])
            i += len(toks)
        return logits

    def compare(self, hf, seq: int) -> tuple[float, float, int]:
        """Max |Δ logprob| against HF, router agreement (fraction of (position, layer, slot) equal) and
        the number of positions compared, for everything `seq` was fed."""
        ids = self.fed[seq]
        ref_lp, ref_routes, margin = hf_reference(hf, ids, self.runner.model.moe_top_k)
        assert margin > MIN_MARGIN, f"near-tie in HF's router (gap {margin:.2e}); pick other weights"
        lp, routes = torch.cat(self.logprobs[seq]), torch.cat(self.routes[seq])
        agree = (routes == ref_routes).float().mean().item()
        return (lp - ref_lp).abs().max().item(), agree, len(ids)


def test_router_capture_and_logprobs_match_hf(tiny) -> None:
    """Chunked prefills mixed with decodes of another sequence, then batched greedy decoding: every
    token's log-probs within 1e-4 of HF and its routed experts, in order, equal to HF's router top-k."""
    arch, folder, hf = tiny
    model = load_model(folder)
    v = model.cfg.vocab_size
    a, b = random_prompt(13, v, 1), random_prompt(22, v, 2)
    cap = Capture(PagedRunner(model, block_size=4))
    cap.step(prefills=[(0, a), (1, b[:9])])
    nxt = cap.step(decodes=[(0, 7)], prefills=[(1, b[9:])])  # 7: an arbitrary forced token
    last = {0: nxt[0], 1: nxt[-1]}
    for _ in range(10):
        toks = {s: int(row.argmax()) for s, row in last.items()}
        out = cap.step(decodes=list(toks.items()))
        last = {0: out[0], 1: out[1]}
    for seq in (0, 1):
        dlp, agree, n = cap.compare(hf, seq)
        assert dlp < LOGPROB_TOL, f"{arch} seq {seq}: max |Δ logprob| {dlp:.2e}"
        assert agree == 1.0, f"{arch} seq {seq}: routed experts agree on only {agree:.1%} of {n} positions"
    used = torch.cat([torch.cat(r) for r in cap.routes.values()]).unique()
    assert len(used) == model.num_experts, "the fixture should exercise every expert"


def test_moe_properties_and_dense_layers(tiny) -> None:
    arch, folder, hf = tiny
    model = load_model(folder)
    c = hf.config
    n_experts = c.num_local_experts if arch == "mixtral" else c.num_experts
    assert (model.num_experts, model.moe_top_k) == (n_experts, c.num_experts_per_tok)
    sparse = [i for i, layer in enumerate(hf.model.layers) if hasattr(layer.mlp, "experts")]
    assert list(model.cfg.sparse_layers) == sparse and model.num_moe_layers == len(sparse)
    if arch.startswith("qwen"):
        assert len(sparse) < c.num_hidden_layers, "the Qwen MoE fixtures include a dense layer"
    # A dense model says it has no MoE layers and records nothing.
    dense = load_model(make_tiny_checkpoint("qwen3", folder.parent / "dense"))
    assert (dense.num_moe_layers, dense.num_experts, dense.moe_top_k) == (0, 0, 0)
    routed: list[torch.Tensor] = []
    PagedRunner(dense).step(prefills=[(0, [1, 2, 3])], routed_experts=routed)
    assert routed == []


def test_between_layers_still_runs_with_capture(tiny) -> None:
    _, folder, _ = tiny
    model = load_model(folder)
    calls: list[int] = []
    routed: list[torch.Tensor] = []
    PagedRunner(model).step(prefills=[(0, [5, 6, 7])], routed_experts=routed,
                            between_layers=lambda: calls.append(len(routed)))
    # between_layers runs after every layer, and sees the routes of the MoE layers before it.
    want = [sum(1 for s in model.cfg.sparse_layers if s <= i) for i in range(model.cfg.num_layers)]
    assert calls == want


def test_expert_weight_names(tiny) -> None:
    """Per-expert checkpoint pieces land in slices of the stacked tensors; HF's in-memory stacked names
    (a transformers 5 state_dict) load to the same parameters; unknown experts are KeyErrors."""
    arch, folder, hf = tiny
    model = load_model(folder)
    li = model.cfg.sparse_layers[-1]
    i = model.cfg.moe_intermediate_size
    ckpt, (g, u, d) = ((f"model.layers.{li}.block_sparse_moe", ("w1", "w3", "w2")) if arch == "mixtral"
                       else (f"model.layers.{li}.mlp", ("gate_proj", "up_proj", "down_proj")))
    stacked = model.get_parameter(f"model.layers.{li}.mlp.experts.gate_up_proj")
    e = model.num_experts - 1
    dst = model.weight_destination(f"{ckpt}.experts.{e}.{u}.weight")
    assert dst.shape == (i, model.cfg.hidden_size)
    assert dst.data_ptr() == stacked[e, i:].data_ptr()
    down = model.weight_destination(f"{ckpt}.experts.{e}.{d}.weight")
    assert down.shape == (model.cfg.hidden_size, i)
    assert model.weight_destination(f"{ckpt}.experts.0.{g}.weight").data_ptr() == stacked.data_ptr()
    with pytest.raises(KeyError):
        model.weight_destination(f"{ckpt}.experts.{model.num_experts}.{g}.weight")
    with pytest.raises(KeyError):
        model.weight_destination(f"model.layers.{li}.mlp.gate_proj.weight")  # a sparse layer has no dense MLP
    with pytest.raises(ValueError, match="expected"):
        model.load_weights([(f"{ckpt}.experts.0.{d}.weight", torch.zeros(i, i))])
    # The stacked form, as HF holds it in memory, loads into a fresh model to the same parameters.
    other = build_model(load_hf_config(folder), torch.float32, "cpu")
    loaded = other.load_weights(hf.state_dict().items())
    assert any(n.endswith("experts.gate_up_proj") for n in loaded)
    mine = dict(model.named_parameters())
    for n, p in other.named_parameters():
        assert torch.equal(p, mine[n]), n
    # The names a complete checkpoint must provide are exactly those HF save_pretrained wrote.
    names = {n for n, _ in iter_safetensors(folder)}
    assert model.required_weight_names() == names


def test_bf16_loads_and_routes(tiny) -> None:
    """bf16 weights load and run; routes mostly agree with fp32 (bf16 moves some near choices)."""
    _, folder, _ = tiny
    ids = random_prompt(24, 900, 5)
    got = {}
    for dt in (torch.float32, torch.bfloat16):
        model = load_model(folder, dt)
        routed: list[torch.Tensor] = []
        logits = PagedRunner(model).step(prefills=[(0, ids)], routed_experts=routed)
        assert torch.isfinite(logits).all()
        got[dt] = torch.stack(routed, 1)
    agree = (got[torch.float32] == got[torch.bfloat16]).float().mean().item()
    assert agree > 0.8


# ---------------------------------------------------------------- the MoE upcycled from SmolLM2

SENTENCE = ("The Eiffel Tower is a wrought-iron lattice tower on the Champ de Mars in Paris, France. It is named "
            "after the engineer Gustave Eiffel, whose company designed and built the tower from 1887 to 1889.")


@pytest.fixture(scope="module")
def upcycled(smollm2_moe_dir):
    hf = transformers.AutoModelForCausalLM.from_pretrained(smollm2_moe_dir, dtype=torch.float32).eval()
    tok = transformers.AutoTokenizer.from_pretrained(smollm2_moe_dir)
    return smollm2_moe_dir, hf, tok, load_model(smollm2_moe_dir)


@pytest.mark.slow
@pytest.mark.timeout(900)  # the first run in a cache builds the folder
def test_upcycled_smollm2_routes_match_hf(upcycled) -> None:
    """Real English text: log-probs within 1e-4 and routed experts equal to HF's at all 30 layers and
    every position, through a chunked prefill and greedy decode steps."""
    folder, hf, tok, model = upcycled
    assert model.num_moe_layers == 30 and (model.num_experts, model.moe_top_k) == (4, 2)
    ids = tok(SENTENCE)["input_ids"]
    cap = Capture(PagedRunner(model, num_blocks=32, block_size=16))
    cap.step(prefills=[(0, ids[:17])])
    last = cap.step(prefills=[(0, ids[17:])])[-1]
    for _ in range(6):
        last = cap.step(decodes=[(0, int(last.argmax()))])[0]
    dlp, agree, n = cap.compare(hf, 0)
    assert dlp < LOGPROB_TOL, f"max |Δ logprob| {dlp:.2e}"
    assert agree == 1.0, f"routed experts agree on {agree:.2%} of {n} positions x 30 layers"
    counts = torch.bincount(torch.cat(cap.routes[0]).flatten(), minlength=4)
    assert (counts > 0).all(), f"every expert is used: {counts.tolist()}"


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_upcycled_smollm2_is_fluent(upcycled, smollm2_dir) -> None:
    """The noisy experts change the logits but not the language: Paris, and a perplexity close to the
    dense model's on the same text."""
    _, _, tok, model = upcycled
    prompt = tok("The capital of France is")["input_ids"]
    toks, _ = PagedRunner(model, num_blocks=16, block_size=16).greedy({0: prompt}, 6)
    assert "Paris" in tok.decode(toks[0])
    ids = tok(SENTENCE)["input_ids"]

    def perplexity(m) -> tuple[float, torch.Tensor]:
        logits = PagedRunner(m, num_blocks=16, block_size=16).step(prefills=[(0, ids)])
        nll = -logits.log_softmax(-1)[:-1].gather(1, torch.tensor(ids[1:])[:, None]).mean().item()
        return math.exp(nll), logits

    moe_ppl, moe_logits = perplexity(model)
    dense_ppl, dense_logits = perplexity(load_model(smollm2_dir))
    assert moe_ppl < 1.1 * dense_ppl, (moe_ppl, dense_ppl)
    assert (moe_logits - dense_logits).abs().max().item() > 0.1, "the routing should change the output"


# ---------------------------------------------------------------- the experts' bf16 rounding

@pytest.mark.parametrize("arch", [pytest.param(a, marks=pytest.mark.slow) if a in NEW_ARCHS else a
                                  for a in ("mixtral", "qwen3_moe", "glm4_moe", "deepseek_v3")])
def test_bf16_moe_block_is_hf_bit_for_bit(arch, tmp_path) -> None:
    """In bf16, each sparse MoE block fed HF's own input returns HF's output bit for bit: the same experts,
    and a token's k weighted products summed in the weights' dtype and rounded to bf16 once, as HF's default
    experts (grouped_mm) do. With fp32 routing weights (Mixtral, GLM, DeepSeek-V3) rounding each product
    first moved 20-35% of the block's outputs by up to 0.0625 (one bf16 step at |x| 8-16)."""
    folder = make_tiny_checkpoint(arch, tmp_path)
    hf = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.bfloat16).eval()
    if getattr(hf.config, "_experts_implementation", None) != "grouped_mm":
        pytest.skip(f"transformers {transformers.__version__} sums experts another way (not grouped_mm)")
    model = load_model(folder, torch.bfloat16)
    ids = random_prompt(40, model.cfg.vocab_size, 3)
    seen: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    for i in model.cfg.sparse_layers:
        hf.model.layers[i].mlp.register_forward_hook(
            lambda m, a, o, i=i: seen.__setitem__(i, (a[0][0], (o[0] if isinstance(o, tuple) else o)[0])))
    with torch.no_grad():
        hf(torch.tensor([ids]))
    assert set(seen) == set(model.cfg.sparse_layers)
    for i, (x, want) in seen.items():
        got = model.model.layers[i].mlp(x)
        assert torch.equal(got, want), f"layer {i}: max |Δ| {(got.float() - want.float()).abs().max().item():.3e}"
