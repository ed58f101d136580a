"""Routed experts (`--enable-return-routed-experts`): the experts an MoE model's router picked for each token,
as they travel worker -> scheduler -> gateway, and vLLM's wire encoding of them.

A sequence's routes form one array [positions, num_moe_layers, top_k] (best expert first), uint8 when the
model has at most 256 experts, else uint16. They travel in pieces (first position, rows): each step's rows
of the positions it computed, plus, for a prefix-cache hit, the positions the hit skipped. A recompute
after preemption sends positions again; a later piece replaces what an earlier one said about a position,
so nothing is counted twice. Pure numpy; no torch, no sockets.
"""

from __future__ import annotations

import base64
import io
from typing import Any

import numpy as np

Piece = tuple[int, Any]  # (first position, rows np.ndarray [n, num_moe_layers, top_k])


def wire_dtype(num_experts: int) -> np.dtype:
    """vLLM's dtype: uint8 when every expert id fits, else uint16."""
    return np.dtype(np.uint8 if num_experts <= 256 else np.uint16)


def end(pieces: list[Piece]) -> int:
    """One past the last position any piece covers (0 for none)."""
    return max((s + len(a) for s, a in pieces), default=0)


def assemble(pieces: list[Piece], lo: int, hi: int) -> np.ndarray:
    """Rows of positions [lo, hi), later pieces winning where pieces overlap. The usual case (pieces that
    follow each other in order, as a sequence is computed) is one concatenate (none for a single piece)."""
    first = pieces[0][1]
    hi = max(hi, lo)
    pos, tiled = pieces[0][0], True
    for s, a in pieces:
        if s != pos:
            tiled = False
            break
        pos += len(a)
    if tiled and pieces[0][0] <= lo and pos >= hi:
        inside = [(s, a) for s, a in pieces if s < hi and s + len(a) > lo] or pieces[:1]
        start = inside[0][0]
        rows = inside[0][1] if len(inside) == 1 else np.concatenate([a for _, a in inside])
        return rows[lo - start:hi - start]
    out = np.zeros((hi - lo, *first.shape[1:]), first.dtype)
    for s, a in pieces:
        a0, a1 = max(s, lo), min(s + len(a), hi)
        if a1 > a0:
            out[a0 - lo:a1 - lo] = a[a0 - s:a1 - s]
    return out


def merge(pieces: list[Piece]) -> Piece | None:
    """One piece saying everything `pieces` say (None for no pieces)."""
    if not pieces:
        return None
    if len(pieces) == 1:
        return pieces[0]
    lo = min(s for s, _ in pieces)
    return lo, assemble(pieces, lo, end(pieces))


def to_b64(rows: np.ndarray) -> str:
    """vLLM's `routed_experts` string: base64 of a `.npy` file (np.save, no pickle)."""
    buf = io.BytesIO()
    np.save(buf, rows, allow_pickle=False)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def from_b64(value: str) -> np.ndarray:
    """The client side: the array back from a `routed_experts` string."""
    return np.load(io.BytesIO(base64.b64decode(value)), allow_pickle=False)
