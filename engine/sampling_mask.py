"""The sampling mask (--return-sampling-mask, vLLM's): per generated token, the token ids the sampler could
have drawn (workers/sampler.py computes it). Pure helpers for its compact wire form, shared by the scheduler
(which cuts a step's rows per request) and the gateway (which writes vLLM's JSON, a list of ids per token).

Wire form: `ids` (int32, the rows' ids one after another) and `counts` (int32, one per row): a count c >= 0
means the row kept the next c ids; c < 0 means it kept every id of the vocabulary except the next -c-1
(a row nothing filtered is the count -1 and no ids).
"""

from __future__ import annotations

import numpy as np


def sizes(counts: np.ndarray) -> np.ndarray:
    """How many ids each row has on the wire."""
    c = counts.astype(np.int64)
    return np.where(c >= 0, c, -c - 1)


def starts(counts: np.ndarray) -> list[int]:
    """Where each row's ids begin in `ids`, and (last) where they end: row i is ids[s[i]:s[i + 1]]."""
    return [0, *np.cumsum(sizes(counts)).tolist()]


def expand(ids: np.ndarray, counts: np.ndarray, vocab: int) -> list[list[int]]:
    """vLLM's `sampling_mask`: per row, the kept ids in ascending order."""
    out: list[list[int]] = []
    at = 0
    for c in counts.tolist():
        if c >= 0:
            out.append(np.sort(ids[at:at + c]).tolist())
            at += c
        else:
            dropped = ids[at:at - c - 1]
            at += -c - 1
            keep = np.ones(vocab, dtype=bool)
            keep[dropped] = False
            out.append(np.flatnonzero(keep).tolist())
    return out


def consistent(ids: np.ndarray, counts: np.ndarray, vocab: int) -> str | None:
    """None when the wire form is well made for `len(counts)` rows over `vocab` ids, else what is wrong."""
    if counts.ndim != 1 or ids.ndim != 1:
        return "sampling mask ids and counts must be vectors"
    if int(sizes(counts).sum()) != len(ids):
        return f"sampling mask counts announce {int(sizes(counts).sum())} ids, got {len(ids)}"
    if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        return "sampling mask id outside the vocabulary"
    if len(counts) and int(counts.min()) < -vocab - 1:
        return "sampling mask count below -vocab - 1"
    return None
