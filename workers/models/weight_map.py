"""Checkpoint names -> the parameters (and slices of them) they fill, for loads and weight updates."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple


class Split(NamedTuple):
    """The part of a full checkpoint tensor one tp rank holds: along `dim` (of `full` elements), the
    concatenation of the (start, length) ranges in `parts`."""

    dim: int
    full: int
    parts: tuple[tuple[int, int], ...]


class _Target(NamedTuple):
    """Where one checkpoint tensor goes: parameter `param`, index `expert` of its first dim when >= 0 (one
    expert of a stacked tensor), then rows [start, start + rows) when rows >= 0; with tensor parallelism,
    `split` says which part of the full tensor this rank takes (None: all of it)."""

    param: str
    start: int = 0
    rows: int = -1
    expert: int = -1
    split: Split | None = None


class WeightMap:
    """Accepted checkpoint name -> _Target, and the names a complete standard checkpoint provides.

    Every parameter is accepted under its own name (a trainer may send our fused tensors). `add` registers
    how a standard HF checkpoint provides (a piece of) a parameter: those names are required instead of
    the parameter's own. `alias` registers an optional alternative name (e.g. a tied lm_head).
    """

    def __init__(self, params: Iterable[str]) -> None:
        self.targets: dict[str, _Target] = {n: _Target(n) for n in params}
        self.required: set[str] = set(self.targets)

    def add(self, name: str, param: str, start: int = 0, rows: int = -1, expert: int = -1,
            split: Split | None = None) -> None:
        self.targets[name] = _Target(param, start, rows, expert, split)
        self.required.discard(param)
        self.required.add(name)

    def split(self, name: str, split: Split | None, rows: int = -1) -> None:
        """Shard a parameter taken under its own name (tp > 1): this rank's part of the full tensor."""
        if split is not None:
            self.targets[name] = self.targets[name]._replace(split=split, rows=rows)

    def alias(self, name: str, param: str) -> None:
        self.targets[name] = self.targets[param]  # the same place, and the same tp part
