"""The "GEMM ceiling": how many tokens/s a workload could reach if every FLOP it must compute ran at the
machine's large-GEMM rate, measured in the same run as the engine.

    python bench/gemm_ceiling.py                       # the default model, fp32: rate and per-token FLOPs
    python bench/gemm_ceiling.py --dtype bfloat16 --threads 2

What a rollout must compute (and what rollbus computes; HF and vLLM compute at least as much):
- every prompt token and every generated token but the last goes through each layer once (matrix
  products 2 x the layer weights' elements, plus attention: 4 x heads x head_dim x the keys it attends);
- the LM head runs once per sampled token (2 x vocab x hidden), not for every prompt position.
Embedding lookups, norms, rotary, activations and sampling have no matrix products and count zero: the
ceiling is what the GEMMs alone would allow, so the engine's fraction of it says how much of its step
is something else.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Shape:
    """The per-token cost of a decoder-only model (dense, or MoE counting the active experts only)."""

    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    mlp_elements: int  # weight elements of one layer's MLP a token goes through (active experts, router)
    vocab: int

    @classmethod
    def from_config(cls, cfg: dict) -> Shape:
        hidden, heads = cfg["hidden_size"], cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or hidden // heads
        if cfg.get("num_experts") or cfg.get("num_local_experts"):
            experts = cfg.get("num_experts") or cfg["num_local_experts"]
            inter = cfg.get("moe_intermediate_size") or cfg["intermediate_size"]
            mlp = 3 * hidden * inter * cfg["num_experts_per_tok"] + hidden * experts
        else:
            mlp = 3 * hidden * cfg["intermediate_size"]
        return cls(cfg["num_hidden_layers"], hidden, heads, cfg.get("num_key_value_heads") or heads, head_dim,
                   mlp, cfg["vocab_size"])

    @classmethod
    def from_folder(cls, folder: Path) -> Shape:
        """The shape of the model whose config.json is in `folder`."""
        return cls.from_config(json.loads((Path(folder) / "config.json").read_text()))

    @property
    def layer_elements(self) -> int:
        attn = self.hidden * self.head_dim * (2 * self.heads + 2 * self.kv_heads)  # q, o, k, v
        return attn + self.mlp_elements

    def token_flops(self, keys: int) -> float:
        """One token through every layer, attending `keys` positions (itself included)."""
        return self.layers * (2.0 * self.layer_elements + 4.0 * self.heads * self.head_dim * keys)

    def sample_flops(self) -> float:
        return 2.0 * self.vocab * self.hidden

    def rollout_flops(self, prompt_lens: list[int], new_tokens: int, n: int = 1) -> float:
        """Prompts (each computed once, however many samples share it, as a prefix cache allows) and
        n x new_tokens generated tokens per prompt."""
        total = 0.0
        for p in prompt_lens:
            total += sum(self.token_flops(k + 1) for k in range(p))
            total += n * sum(self.token_flops(p + k + 1) for k in range(new_tokens - 1))
            total += n * new_tokens * self.sample_flops()
        return total


def gemm_rate(shape: Shape, dtype: str = "float32", threads: int | None = None, m: int = 2048,
              repeats: int = 5, warmup_s: float = 0.5) -> float:
    """FLOP/s of torch's own matrix products over one layer of this model (q, k, v, o, gate, up, down) at a
    large M (a wide prefill), the best of `repeats` after `warmup_s` of warm-up (the cores' clocks and
    the allocator settle). On CPU also on oneDNN pre-packed weights (where oneDNN takes the dtype), in fp32 on
    MKL's packed sgemm, and in fp32 and bf16 on the panel kernels (what rollbus multiplies on there,
    ascend_ops.packed_linear): the ceiling takes the fastest, the machine's best."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    dt = getattr(torch, dtype)
    h, d = shape.hidden, shape.head_dim
    inter = shape.mlp_elements // (3 * h) or 1
    outs = [(shape.heads * d, h), (shape.kv_heads * d, h), (shape.kv_heads * d, h), (h, shape.heads * d),
            (inter, h), (inter, h), (h, inter)]
    weights = [torch.randn(o, i, dtype=dt) for o, i in outs]
    inputs = {i: torch.randn(m, i, dtype=dt) for _, i in outs}
    flops = sum(2.0 * m * o * i for o, i in outs)

    def plain() -> None:
        for w in weights:
            torch.nn.functional.linear(inputs[w.shape[1]], w)

    kernels = [plain]
    mkldnn = torch.ops.mkldnn
    bf16 = getattr(mkldnn, "_is_mkldnn_bf16_supported", lambda: False)()  # oneDNN has no bf16 path on some CPUs
    onednn_dtypes = (torch.float32, torch.bfloat16) if bf16 else (torch.float32,)
    if torch.backends.mkldnn.is_available() and hasattr(mkldnn, "_reorder_linear_weight") and dt in onednn_dtypes:
        packed = [(w.shape[1], mkldnn._reorder_linear_weight(w)) for w in weights]

        def prepacked() -> None:
            for k, w in packed:
                mkldnn._linear_pointwise(inputs[k], w, None, "none", [], "")

        kernels.append(prepacked)
    if dt == torch.float32:  # MKL's packed sgemm too (rollbus's fp32 product on Intel CPUs), where it loads
        from ascend_ops import packed_linear

        if packed_linear.mkl_unavailable() is None:
            from ascend_ops import cpu_kernels

            ops = cpu_kernels.ops()
            mkl = [(w.shape[1], w.shape[0], ops.mkl_pack(w, packed_linear.MKL_PACK_ROWS)) for w in weights]

            def mkl_packed() -> None:
                for k, n, w in mkl:
                    ops.mkl_packed_linear(inputs[k], w, n, k, None)

            kernels.append(mkl_packed)
    if dt in (torch.float32, torch.bfloat16):  # our panel kernels: rollbus's fp32 on some CPUs, bf16 on those without
        from ascend_ops import packed_linear  # native bf16 (bf16 weights widened to fp32 in registers)

        for backend, width in packed_linear.PANEL_WIDTHS.items():
            if packed_linear.panel_unavailable(backend) is None:
                from ascend_ops import cpu_kernels

                ops = cpu_kernels.ops()
                panel = [(w.shape[1], w.shape[0], ops.panel_pack(w, width)) for w in weights]

                def panel_packed(panel=panel, width=width) -> None:
                    for k, n, w in panel:
                        ops.panel_linear(inputs[k], w, n, k, None, width)

                kernels.append(panel_packed)
    best = float("inf")
    for kernel in kernels:
        end = time.perf_counter() + warmup_s
        while time.perf_counter() < end:
            kernel()
        for _ in range(repeats):
            t0 = time.perf_counter()
            kernel()
            best = min(best, time.perf_counter() - t0)
    return flops / best


def ceiling_tok_s(shape: Shape, prompt_lens: list[int], new_tokens: int, n: int, rate: float) -> float:
    return len(prompt_lens) * n * new_tokens / (shape.rollout_flops(prompt_lens, new_tokens, n) / rate)


def prefill_ceiling_tok_s(shape: Shape, prompt_lens: list[int], rate: float) -> float:
    """Prompt tokens per second at `rate` when prefill alone ran: every prompt token through the layers, one
    LM head row per prompt (its first sampled token)."""
    flops = sum(sum(shape.token_flops(k + 1) for k in range(p)) + shape.sample_flops() for p in prompt_lens)
    return sum(prompt_lens) / (flops / rate)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", help="Model folder with config.json (default: the default model).")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--threads", type=int, help="torch threads (default: torch's, i.e. the cores).")
    p.add_argument("--prompt-len", type=int, default=40)
    p.add_argument("--prompts", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("-n", type=int, default=1)
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    if args.model:
        folder = Path(args.model)
    else:
        from engine.model_store import resolve_model

        folder = resolve_model(None, progress=True)
    shape = Shape.from_folder(folder)
    rate = gemm_rate(shape, args.dtype, args.threads)
    lens = [args.prompt_len] * args.prompts
    from bench.fma_peak import fma_peak

    peak = fma_peak(args.threads)
    print(f"large-GEMM rate ({args.dtype}): {rate / 1e9:.1f} GFLOP/s; fp32 FMA peak {peak['flops'] / 1e9:.1f} GFLOP/s "
          f"({peak['clock_ghz']:.2f} GHz x 2 FMA pipes x {peak['lanes']} lanes x {peak['threads']} cores): the GEMM "
          f"rate is {rate / peak['flops']:.0%} of it")
    print(f"per generated token: {shape.token_flops(args.prompt_len) / 1e6:.1f} MFLOP layers + "
          f"{shape.sample_flops() / 1e6:.1f} MFLOP LM head")
    print(f"GEMM ceiling, {args.prompts} x {args.prompt_len}-token prompts, n={args.n}, {args.new_tokens} new tokens: "
          f"{ceiling_tok_s(shape, lens, args.new_tokens, args.n, rate):.0f} tok/s")


if __name__ == "__main__":
    main()
