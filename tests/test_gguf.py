"""The GGUF reader against the `gguf` package (dequantisation) and transformers (tensor layout, config,
tokenizer), on the real SmolLM2 file and on tiny synthetic files."""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import pytest
import torch

from engine.model_store.gguf import QUANT_TYPES, dequantize, hf_tensor_name, read_gguf
from tests.fixtures_models import smollm2_dir, smollm2_gguf, write_tiny_gguf  # noqa: F401

gguf = pytest.importorskip("gguf")
from gguf import GGMLQuantizationType as QT
from gguf import quants

# The unit lane takes the reader's own tests on synthetic files; those against the real SmolLM2 file or
# transformers' GGUF loader (seconds each: its first use imports a lot) run in the full suite.
unit = pytest.mark.unit

# Byte offsets of the f16 scale fields inside one block, per K-type (random bytes there could be NaN).
_K_SCALE_FIELDS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def _random_blocks(name: str, rows: int, cols: int, rng: np.random.Generator) -> np.ndarray:
    """Quantised bytes for (rows, cols): real quantisation where `gguf` has it, else random blocks
    with finite f16 scales (gguf 0.19 can only dequantise the K-types)."""
    qtype = QT[name]
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    try:
        return np.asarray(quants.quantize(x, qtype))
    except NotImplementedError:
        qt = next(q for q in QUANT_TYPES.values() if q.name == name)
        blocks = rng.integers(0, 256, (rows * cols // qt.block_elems, qt.block_bytes), dtype=np.uint8)
        for off in _K_SCALE_FIELDS[name]:
            scale = (rng.random(blocks.shape[0]) * 0.01 + 1e-4).astype(np.float16)
            blocks[:, off:off + 2] = scale.view(np.uint8).reshape(-1, 2)
        return blocks.reshape(rows, -1)


@unit
@pytest.mark.parametrize("name", [q.name for q in QUANT_TYPES.values()])
def test_dequantize_matches_gguf_package(name: str) -> None:
    rng = np.random.default_rng(zlib.crc32(name.encode()))  # the same blocks every run (hash() is salted)
    raw = _random_blocks(name, 6, 512, rng)
    expected = quants.dequantize(raw, QT[name]).astype(np.float32)
    type_id = int(QT[name])
    got = dequantize(raw.view(np.uint8).reshape(-1), type_id, expected.shape)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got, expected)


def test_real_file_header_and_config(smollm2_gguf: Path) -> None:  # noqa: F811
    f = read_gguf(smollm2_gguf)
    assert f.version == 3 and f.architecture == "llama" and len(f.tensors) == 272
    counts: dict[str, int] = {}
    for t in f.tensors.values():
        counts[t.type_name] = counts.get(t.type_name, 0) + 1
    assert counts == {"Q4_1": 210, "Q8_0": 1, "F32": 61}
    assert f.tensors["token_embd.weight"].shape == (49152, 576)
    cfg = f.hf_config()
    assert cfg["architectures"] == ["LlamaForCausalLM"]
    expected = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
                "rms_norm_eps": 1e-5, "rope_theta": 100000.0, "max_position_embeddings": 8192,
                "tie_word_embeddings": True, "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}
    assert {k: cfg[k] for k in expected} == expected


def test_real_file_dequant_matches_gguf_package(smollm2_gguf: Path) -> None:  # noqa: F811
    """Every type in the file (Q8_0 embedding, Q4_1 layers, F32 norms); two layers keep it fast."""
    f = read_gguf(smollm2_gguf)
    reader = gguf.GGUFReader(str(smollm2_gguf))
    chosen = [t for t in reader.tensors if not t.name.startswith("blk.") or t.name.split(".")[1] in ("0", "29")]
    assert {t.tensor_type.name for t in chosen} == {"Q8_0", "Q4_1", "F32"}
    for t in chosen:
        expected = quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        np.testing.assert_array_equal(f.load(t.name), expected, err_msg=t.name)


@unit
@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("quant", [None, "Q8_0", "Q4_1"])
def test_tiny_roundtrip_restores_hf_layout(tmp_path: Path, arch: str, quant: str | None) -> None:
    """The reader inverts the writer: same names, llama q/k rows un-permuted, values exact (F32) or
    equal to the gguf package's own quantise->dequantise (rows quantise independently)."""
    made = write_tiny_gguf(tmp_path / "m.gguf", arch, quant=quant)
    got = dict(read_gguf(tmp_path / "m.gguf").iter_tensors())
    assert set(got) == set(made["state"])
    for name, want in made["state"].items():
        if quant and want.ndim == 2 and "proj" in name:
            want = quants.dequantize(quants.quantize(want, QT[quant]), QT[quant])
        np.testing.assert_array_equal(got[name].numpy(), want, err_msg=name)
        assert got[name].dtype == torch.float32


@unit
def test_iter_tensors_dtype(tmp_path: Path) -> None:
    write_tiny_gguf(tmp_path / "m.gguf", "llama")
    assert all(t.dtype == torch.bfloat16 for _, t in read_gguf(tmp_path / "m.gguf").iter_tensors(torch.bfloat16))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_config_and_logits_match_transformers_gguf_loader(tmp_path: Path, arch: str) -> None:
    transformers = pytest.importorskip("transformers")
    from engine.model_store import convert_gguf_to_hf

    write_tiny_gguf(tmp_path / "m.gguf", arch)
    folder = convert_gguf_to_hf(tmp_path / "m.gguf", tmp_path / "hf", progress=False)
    ref = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="m.gguf", dtype=torch.float32)
    mine = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    assert type(mine).__name__ == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    assert mine.config.tie_word_embeddings == (arch == "llama")
    x = torch.tensor([[5, 6, 7, 100, 200, 3, 9, 40]])
    with torch.no_grad():
        torch.testing.assert_close(mine(x).logits, ref(x).logits, rtol=0, atol=1e-5)


TOKENIZER_STRINGS = [
    "Hello world", "12345 + 678 = 99999", " leading space", "héllo naïve café — “quotes”",
    "日本語のテキスト、中文", "emoji 😀🎉👍🏽 family 👨‍👩‍👧", "def f(x):\n    return x**2  # c\n\ttab",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", "  multiple   spaces\n\n\nnewlines",
    "don't I'll WE'RE", "<|endoftext|>x<|im_end|>", "3.14159e-10, 1,000,000", "Привет мир", "مرحبا", "",
    "<think>\nreasoning</think>", "{\"a\": [1, 2.5, null]}", "\u00a0nbsp\u3000ideographic space",
]


def test_tokenizer_matches_transformers_gguf_loader(smollm2_gguf: Path) -> None:  # noqa: F811
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    files = read_gguf(smollm2_gguf).hf_tokenizer_files()
    mine = Tokenizer.from_str(files["tokenizer.json"])
    ref = transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)
    for s in TOKENIZER_STRINGS:
        ids = mine.encode(s, add_special_tokens=False).ids
        assert ids == ref.encode(s, add_special_tokens=False), s
        assert mine.decode(ids, skip_special_tokens=False) == s


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_tiny_tokenizer_matches_transformers_gguf_loader(tmp_path: Path, arch: str) -> None:
    transformers = pytest.importorskip("transformers")
    from tokenizers import Tokenizer

    write_tiny_gguf(tmp_path / "m.gguf", arch)
    mine = Tokenizer.from_str(read_gguf(tmp_path / "m.gguf").hf_tokenizer_files()["tokenizer.json"])
    ref = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="m.gguf")
    for s in TOKENIZER_STRINGS:
        assert mine.encode(s, add_special_tokens=False).ids == ref.encode(s, add_special_tokens=False), s
    think = mine.token_to_id("<think>")
    assert mine.encode("a<think>b").ids[1] == think  # user-defined: matched whole ...
    assert mine.decode([think], skip_special_tokens=True) == "<think>"  # ... but not special
    assert mine.decode([2], skip_special_tokens=True) == ""  # control tokens are special


@unit
def test_smollm_pre_tokenizer_splits_digits(tmp_path: Path) -> None:
    """smollm isolates every digit (its HF tokenizer.json has Digits(individual_digits=True))."""
    from tokenizers import Tokenizer

    write_tiny_gguf(tmp_path / "m.gguf", "llama")
    tok = Tokenizer.from_str(read_gguf(tmp_path / "m.gguf").hf_tokenizer_files()["tokenizer.json"])
    pieces = [p for p, _ in tok.pre_tokenizer.pre_tokenize_str("ab 2024x")]
    assert pieces == ["ab", "Ġ", "2", "0", "2", "4", "x"]


def test_tokenizer_config_files(smollm2_gguf: Path) -> None:  # noqa: F811
    import json

    files = read_gguf(smollm2_gguf).hf_tokenizer_files()
    cfg = json.loads(files["tokenizer_config.json"])
    assert cfg["bos_token"] == "<|im_start|>" and cfg["eos_token"] == "<|im_end|>"
    assert cfg["model_max_length"] == 8192 and "<|im_start|>" in cfg["chat_template"]
    assert cfg["added_tokens_decoder"]["2"]["special"] is True
    gen = json.loads(files["generation_config.json"])
    assert gen["eos_token_id"] == 2 and gen["bos_token_id"] == 1


@unit
def test_hf_tensor_names() -> None:
    assert hf_tensor_name("token_embd.weight") == "model.embed_tokens.weight"
    assert hf_tensor_name("output.weight") == "lm_head.weight"
    assert hf_tensor_name("output_norm.weight") == "model.norm.weight"
    assert hf_tensor_name("blk.7.attn_q.bias") == "model.layers.7.self_attn.q_proj.bias"
    assert hf_tensor_name("blk.0.ffn_norm.weight") == "model.layers.0.post_attention_layernorm.weight"
    with pytest.raises(KeyError):
        hf_tensor_name("blk.0.ffn_gate_exps.weight")


@unit
def test_rejects_bad_files(tmp_path: Path) -> None:
    (tmp_path / "bad.gguf").write_bytes(b"NOPE" + bytes(60))
    with pytest.raises(ValueError, match="not a GGUF"):
        read_gguf(tmp_path / "bad.gguf")
    write_tiny_gguf(tmp_path / "m.gguf", "llama")
    data = (tmp_path / "m.gguf").read_bytes()
    (tmp_path / "v9.gguf").write_bytes(data[:4] + (9).to_bytes(4, "little") + data[8:])
    with pytest.raises(ValueError, match="version 9"):
        read_gguf(tmp_path / "v9.gguf")
    (tmp_path / "cut.gguf").write_bytes(data[: len(data) - 1000])
    with pytest.raises(ValueError, match="truncated"):
        read_gguf(tmp_path / "cut.gguf")
