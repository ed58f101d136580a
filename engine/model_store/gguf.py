"""A GGUF (v2/v3) reader with numpy dequantisation, and conversion to the Hugging Face layout.

Written from the format description (llama.cpp's ggml docs), so the engine needs neither llama.cpp nor
the `gguf` package at run time. The file is memory-mapped once; metadata is parsed eagerly (small),
tensor data is only touched when a tensor is dequantised, one at a time, so peak memory stays near one
fp32 tensor plus the output the caller keeps.
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.model_store.gguf_tokenizer import byte_alphabet, tokenizer_files  # noqa: F401  (re-exported)

_MAGIC = b"GGUF"
_DEFAULT_ALIGNMENT = 32

# Metadata value types: id -> (struct format, numpy dtype) for the fixed-size scalars.
_SCALARS: dict[int, tuple[str, str]] = {
    0: ("<B", "<u1"), 1: ("<b", "<i1"), 2: ("<H", "<u2"), 3: ("<h", "<i2"), 4: ("<I", "<u4"),
    5: ("<i", "<i4"), 6: ("<f", "<f4"), 7: ("<?", "<u1"), 10: ("<Q", "<u8"), 11: ("<q", "<i8"),
    12: ("<d", "<f8"),
}
_T_STRING, _T_ARRAY, _T_BOOL = 8, 9, 7


@dataclass(frozen=True)
class QuantType:
    """A ggml tensor type: how many elements one block holds and how many bytes it takes."""

    name: str
    block_elems: int
    block_bytes: int


# ggml type ids. Only the types we can dequantise are listed; others raise a clear error.
QUANT_TYPES: dict[int, QuantType] = {
    0: QuantType("F32", 1, 4), 1: QuantType("F16", 1, 2), 2: QuantType("Q4_0", 32, 18),
    3: QuantType("Q4_1", 32, 20), 6: QuantType("Q5_0", 32, 22), 7: QuantType("Q5_1", 32, 24),
    8: QuantType("Q8_0", 32, 34), 12: QuantType("Q4_K", 256, 144), 13: QuantType("Q5_K", 256, 176),
    14: QuantType("Q6_K", 256, 210), 30: QuantType("BF16", 1, 2),
}


@dataclass(frozen=True)
class TensorInfo:
    """One tensor's description. `shape` is numpy order (outermost first): GGUF lists dims innermost
    first, so it is the reverse of the file's `ne`."""

    name: str
    shape: tuple[int, ...]
    type_id: int
    offset: int  # absolute byte offset into the file

    @property
    def n_elements(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64))

    @property
    def type_name(self) -> str:
        qt = QUANT_TYPES.get(self.type_id)
        return qt.name if qt else f"type{self.type_id}"

    @property
    def n_bytes(self) -> int:
        qt = QUANT_TYPES.get(self.type_id)
        if qt is None:
            raise NotImplementedError(f"{self.name}: ggml tensor type {self.type_id} is not supported")
        return self.n_elements // qt.block_elems * qt.block_bytes


class _Cursor:
    """Sequential little-endian reads over the memory map (metadata only; small)."""

    def __init__(self, buf: np.ndarray, pos: int = 0) -> None:
        self.buf, self.pos = buf, pos

    def scalar(self, fmt: str) -> Any:
        (value,) = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def value(self, vtype: int) -> Any:
        if vtype == _T_STRING:
            return self.string()
        if vtype == _T_BOOL:
            return bool(self.scalar("<?"))
        if vtype == _T_ARRAY:
            item_type, count = self.scalar("<I"), self.scalar("<Q")
            if item_type in _SCALARS:  # numeric arrays in one vectorised read
                dt = np.dtype(_SCALARS[item_type][1])
                arr = np.frombuffer(self.buf, dtype=dt, count=count, offset=self.pos)
                self.pos += count * dt.itemsize
                return [bool(x) for x in arr] if item_type == _T_BOOL else arr.tolist()
            return [self.value(item_type) for _ in range(count)]
        if vtype in _SCALARS:
            return self.scalar(_SCALARS[vtype][0])
        raise ValueError(f"unknown GGUF metadata type {vtype} at byte {self.pos}")


# ---------------------------------------------------------------- dequantisation (vectorised numpy)

def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """Column `start:start+2` of a (n, block_bytes) uint8 array as a (n, 1) float32 scale."""
    return np.ascontiguousarray(blocks[:, start:start + 2]).view(np.float16).astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """(n, 16) packed bytes -> (n, 32): low nibbles are elements 0..15, high nibbles 16..31."""
    return np.concatenate([qs & 0x0F, qs >> 4], axis=1)


def _q5_high_bits(blocks: np.ndarray, start: int) -> np.ndarray:
    """The 32 fifth bits of a Q5_0/Q5_1 block, stored as one little-endian uint32, as (n, 32) uint8."""
    qh = np.ascontiguousarray(blocks[:, start:start + 4]).view("<u4")
    return ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _k_scales(s: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Unpack the 12-byte, 6-bit (scale, min) pairs of Q4_K/Q5_K into two (n, 8) arrays."""
    sc = np.empty((s.shape[0], 8), np.uint8)
    mn = np.empty((s.shape[0], 8), np.uint8)
    sc[:, :4] = s[:, 0:4] & 63
    mn[:, :4] = s[:, 4:8] & 63
    sc[:, 4:] = (s[:, 8:12] & 0x0F) | ((s[:, 0:4] >> 6) << 4)
    mn[:, 4:] = (s[:, 8:12] >> 4) | ((s[:, 4:8] >> 6) << 4)
    return sc.astype(np.float32), mn.astype(np.float32)


def _deq_q4_0(b: np.ndarray) -> np.ndarray:
    return (_nibbles(b[:, 2:18]).astype(np.float32) - 8.0) * _f16(b, 0)


def _deq_q4_1(b: np.ndarray) -> np.ndarray:
    return _nibbles(b[:, 4:20]).astype(np.float32) * _f16(b, 0) + _f16(b, 2)


def _deq_q5_0(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 6:22]) | (_q5_high_bits(b, 2) << 4)
    return (q.astype(np.float32) - 16.0) * _f16(b, 0)


def _deq_q5_1(b: np.ndarray) -> np.ndarray:
    q = _nibbles(b[:, 8:24]) | (_q5_high_bits(b, 4) << 4)
    return q.astype(np.float32) * _f16(b, 0) + _f16(b, 2)


def _deq_q8_0(b: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(b[:, 2:34]).view(np.int8).astype(np.float32) * _f16(b, 0)


def _deq_q4_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    qs = b[:, 16:144].reshape(n, 4, 1, 32)  # 4 chunks of 64 values: low nibbles, then high nibbles
    q = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32).astype(np.float32)
    out = (_f16(b, 0) * sc)[:, :, None] * q - (_f16(b, 2) * mn)[:, :, None]
    return out.reshape(n, 256)


def _deq_q5_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    sc, mn = _k_scales(b[:, 4:16])
    qh = b[:, 16:48]  # bit s of qh[l] is the fifth bit of element l of sub-block s
    qs = b[:, 48:176].reshape(n, 4, 1, 32)
    low = np.concatenate([qs & 0x0F, qs >> 4], axis=2).reshape(n, 8, 32)
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    q = (low | (high << 4)).astype(np.float32)
    out = (_f16(b, 0) * sc)[:, :, None] * q - (_f16(b, 2) * mn)[:, :, None]
    return out.reshape(n, 256)


def _deq_q6_k(b: np.ndarray) -> np.ndarray:
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 2, 32)  # [half, first/second 32 bytes, l]
    qh = b[:, 128:192].reshape(n, 2, 1, 32)
    scales = np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)
    # Each half of 128 values is 4 groups of 32: low nibbles of ql[0:32], ql[32:64], then high nibbles;
    # group g takes bits 2g..2g+1 of qh.
    nib = np.concatenate([ql & 0x0F, ql >> 4], axis=2)  # (n, 2, 4, 32)
    hb = (qh >> np.array([0, 2, 4, 6], np.uint8)[None, None, :, None]) & 3
    q = (nib | (hb << 4)).astype(np.float32).reshape(n, 16, 16) - 32.0
    return (q * (scales * _f16(b, 208))[:, :, None]).reshape(n, 256)


_BLOCK_DEQUANT = {2: _deq_q4_0, 3: _deq_q4_1, 6: _deq_q5_0, 7: _deq_q5_1, 8: _deq_q8_0,
                  12: _deq_q4_k, 13: _deq_q5_k, 14: _deq_q6_k}


def dequantize(raw: np.ndarray, type_id: int, shape: tuple[int, ...]) -> np.ndarray:
    """Raw tensor bytes (uint8) of ggml type `type_id` -> float32 array of `shape` (numpy order)."""
    raw = np.asarray(raw, dtype=np.uint8)
    if type_id == 0:
        out = raw.view("<f4").astype(np.float32)
    elif type_id == 1:
        out = raw.view("<f2").astype(np.float32)
    elif type_id == 30:
        out = (raw.view("<u2").astype(np.uint32) << 16).view(np.float32)
    elif type_id in _BLOCK_DEQUANT:
        qt = QUANT_TYPES[type_id]
        out = _BLOCK_DEQUANT[type_id](raw.reshape(-1, qt.block_bytes))
    else:
        raise NotImplementedError(f"ggml tensor type {type_id} is not supported")
    return out.reshape(shape)


# ---------------------------------------------------------------- the file

_LAYER_NAMES = {
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_SKIPPED = {"rope_freqs.weight"}  # llama.cpp's precomputed rope factors; HF derives them from config
_ARCHS = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}


def hf_tensor_name(name: str) -> str:
    """GGUF tensor name -> Hugging Face name (llama/qwen2 layout)."""
    stem, _, suffix = name.rpartition(".")
    if stem in _TOP_NAMES:
        return f"{_TOP_NAMES[stem]}.{suffix}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER_NAMES:
        return f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}.{suffix}"
    raise KeyError(f"no Hugging Face name for GGUF tensor {name!r}")


def unpermute_rope_rows(w: np.ndarray, n_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row order. Per head, llama.cpp interleaves the two rotary halves
    (rows 2i, 2i+1 = HF rows i, i + d/2); HF keeps the halves contiguous."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


@dataclass
class GGUFFile:
    """A parsed GGUF file: metadata, tensor infos, and lazy access to the tensor data."""

    path: Path
    version: int
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    _mm: np.ndarray = field(repr=False)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))

    def _arch_key(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def raw(self, name: str) -> np.ndarray:
        """The tensor's bytes, a zero-copy view of the memory map."""
        info = self.tensors[name]
        return self._mm[info.offset:info.offset + info.n_bytes]

    def load(self, name: str) -> np.ndarray:
        """One tensor dequantised to float32, in the file's own (GGUF) row order."""
        info = self.tensors[name]
        return dequantize(self.raw(name), info.type_id, info.shape)

    def iter_tensors(self, dtype: torch.dtype = torch.float32) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) for every tensor, in file order, with llama q/k rows back in HF order."""
        if self.architecture not in _ARCHS:
            raise NotImplementedError(f"GGUF architecture {self.architecture!r} is not supported")
        n_head = int(self._arch_key("attention.head_count"))
        n_kv = int(self._arch_key("attention.head_count_kv", n_head))
        for name in self.tensors:
            if name in _SKIPPED:
                continue
            hf_name = hf_tensor_name(name)
            arr = self.load(name)
            if self.architecture == "llama" and ".attn_q." in name:
                arr = unpermute_rope_rows(arr, n_head)
            elif self.architecture == "llama" and ".attn_k." in name:
                arr = unpermute_rope_rows(arr, n_kv)
            yield hf_name, torch.from_numpy(np.ascontiguousarray(arr)).to(dtype)

    def hf_config(self) -> dict[str, Any]:
        """A Hugging Face config.json dict built from the `{arch}.*` metadata."""
        arch = self.architecture
        if arch not in _ARCHS:
            raise NotImplementedError(f"GGUF architecture {arch!r} is not supported")
        hidden = int(self._arch_key("embedding_length"))
        n_head = int(self._arch_key("attention.head_count"))
        tokens = self.metadata.get("tokenizer.ggml.tokens") or []
        vocab = self._arch_key("vocab_size") or self.tensors["token_embd.weight"].shape[0] or len(tokens)
        cfg: dict[str, Any] = {
            "architectures": [_ARCHS[arch]],
            "model_type": arch,
            "hidden_size": hidden,
            "intermediate_size": int(self._arch_key("feed_forward_length")),
            "num_hidden_layers": int(self._arch_key("block_count")),
            "num_attention_heads": n_head,
            "num_key_value_heads": int(self._arch_key("attention.head_count_kv", n_head)),
            "head_dim": int(self._arch_key("attention.key_length", hidden // n_head)),
            "vocab_size": int(vocab),
            # float32 metadata -> shortest decimal, so 1e-5 reads back as 1e-05, not 9.99999974e-06.
            "rms_norm_eps": float(str(np.float32(self._arch_key("attention.layer_norm_rms_epsilon", 1e-6)))),
            "rope_theta": float(str(np.float32(self._arch_key("rope.freq_base", 10000.0)))),
            "max_position_embeddings": int(self._arch_key("context_length", 2048)),
            "tie_word_embeddings": "output.weight" not in self.tensors,
            "hidden_act": "silu",
            "bos_token_id": self.metadata.get("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self.metadata.get("tokenizer.ggml.eos_token_id"),
            "torch_dtype": "float32",
        }
        if arch == "llama":
            cfg["attention_bias"] = "blk.0.attn_q.bias" in self.tensors
            cfg["mlp_bias"] = False
        return cfg

    def hf_tokenizer_files(self) -> dict[str, str]:
        """tokenizer.json, tokenizer_config.json and generation_config.json, as text."""
        return tokenizer_files(self.metadata, self.hf_config())


def read_gguf(path: str | Path) -> GGUFFile:
    """Parse a GGUF v2/v3 file's header, metadata and tensor infos; tensor data stays memory-mapped."""
    path = Path(path)
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    if bytes(mm[:4]) != _MAGIC:
        raise ValueError(f"{path} is not a GGUF file (magic {bytes(mm[:4])!r})")
    cur = _Cursor(mm, 4)
    version = cur.scalar("<I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported (only 2 and 3)")
    n_tensors, n_kv = cur.scalar("<Q"), cur.scalar("<Q")
    metadata: dict[str, Any] = {}
    for _ in range(n_kv):
        key = cur.string()
        metadata[key] = cur.value(cur.scalar("<I"))
    raw_infos = []
    for _ in range(n_tensors):
        name = cur.string()
        ne = [cur.scalar("<Q") for _ in range(cur.scalar("<I"))]
        raw_infos.append((name, tuple(reversed(ne)), cur.scalar("<I"), cur.scalar("<Q")))
    align = int(metadata.get("general.alignment", _DEFAULT_ALIGNMENT))
    data_start = (cur.pos + align - 1) // align * align
    tensors = {n: TensorInfo(n, shape, t, data_start + off) for n, shape, t, off in raw_infos}
    for info in tensors.values():
        if info.type_id in QUANT_TYPES and info.offset + info.n_bytes > mm.shape[0]:
            raise ValueError(f"{path}: tensor {info.name} runs past the end of the file (truncated?)")
    return GGUFFile(path, version, metadata, tensors, mm)

