"""A pool of KV block ids with prefix-cache hashes: the part the full-attention group (engine.block_manager) and
a mixed-window model's sliding-window group (engine.window_blocks) share. Pure policy: ids only.

A block is free (ref 0) or used by one or more sequences (ref > 0); a block may carry the chain hash of the
tokens it holds (`cached` maps it back). A freed block keeps its hash and stays findable until the free list
hands it out again for new content (LRU order), which evicts the hash.
"""

from __future__ import annotations

from collections import OrderedDict

FREED = -1  # a block-table entry whose block slid out of the attention window and was given back


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    def held(self) -> list[int]:
        """The blocks some sequence holds."""
        return [b for b, r in enumerate(self.ref) if r]

    def _forget_hashes(self) -> None:
        self.cached.clear()
        self.hash_of = [None] * self.num_blocks

    def _evicted(self, h: int) -> None:
        """A cached hash whose block was handed out for new content (BlockManager records it as an event)."""

    def _take_fresh(self) -> int:
        """Hand out the least recently freed block for new content, evicting its cached hash."""
        bid, _ = self.free.popitem(last=False)
        h = self.hash_of[bid]
        if h is not None:
            self.hash_of[bid] = None
            if self.cached.get(h) == bid:
                del self.cached[h]
                self._evicted(h)
        self.ref[bid] = 1
        return bid

    def _reuse(self, bid: int) -> None:
        """Share a cached block (content kept)."""
        if self.ref[bid] == 0:
            del self.free[bid]
        self.ref[bid] += 1

    def _release_leading(self, seq, table: list[int], end: int) -> None:
        """Give back the entries of `table` (one of seq's) before index `end` not given back yet; they become FREED
        and seq.num_released counts them."""
        end = min(end, len(table))
        for i in range(seq.num_released, end):
            self._give_back(table[i])
            table[i] = FREED
        seq.num_released = max(seq.num_released, end)

    def _give_back(self, bid: int) -> None:
        self.ref[bid] -= 1
        if self.ref[bid] == 0:
            self.free[bid] = None
