"""The sliding-window layers' KV blocks of a model whose attention layers mix windows. Pure policy: ids only.

gpt-oss alternates sliding-window and full-attention layers, Gemma 3 has five local layers to one global. With
one block table for every layer, a full-attention layer reads every block, so none can be given back. Such a
model has two layer groups instead, each with its own block table and pool (as vLLM's hybrid KV cache manager
gives each group of layers its own): the full-attention layers' (Sequence.block_table, the BlockManager's pool:
they keep every block) and the sliding-window layers' (Sequence.window_table, this pool). The window group
frees with the largest window W of its layers (a layer with a smaller one reads a subset of what W keeps): as
a sequence moves, the blocks wholly before its window are given back and their entries become FREED, as in a
model whose layers all share one window (engine.block_manager). A long sequence then holds about
W / block_size + 1 blocks here; the workers size this pool for that (workers.kv_cache.window_pool_blocks), so
the full group gets the rest of the KV budget.

The pools' ids are separate: block 3 here is other memory than block 3 of the full group (the workers keep one
tensor per group). Prefix caching: both pools map the same chain hashes (they hash tokens, not layers) to the
blocks holding them. A hit of k blocks needs all k in the full group, and here only the window's tail, the
blocks a query at position k * block_size can still see: [first_kept(k * block_size), k). `longest_hit` finds
the longest k whose tail is here; the entries before the tail start FREED. A released block keeps its hash
until it is handed out for new content, as in the full group.
"""

from __future__ import annotations

from engine.block_pool import FREED, BlockPool
from engine.request import Sequence


class WindowBlocks(BlockPool):
    def __init__(self, num_blocks: int, block_size: int, window: int):
        if window <= 0:
            raise ValueError(f"a window group needs a sliding window > 0, not {window}")
        super().__init__(num_blocks, block_size)
        self.window = window

    def first_kept(self, pos: int) -> int:
        """The first block a query at position `pos` or later can see (keys (p - W, p])."""
        return max(0, pos - self.window + 1) // self.block_size

    def short(self, seq: Sequence, num_tokens: int) -> bool:
        """Whether `seq` needs more new blocks here than are free to hold `num_tokens` tokens."""
        return (num_tokens + self.block_size - 1) // self.block_size - len(seq.window_table) > len(self.free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        for _ in range((num_tokens + self.block_size - 1) // self.block_size - len(seq.window_table)):
            seq.window_table.append(self._take_fresh())

    def store(self, seq: Sequence, i: int, h: int) -> None:
        """Block i of `seq` just got chain hash `h` (BlockManager.commit_full_blocks): make it findable."""
        bid = seq.window_table[i]
        if bid != FREED and h not in self.cached and self.hash_of[bid] is None:
            self.cached[h] = bid
            self.hash_of[bid] = h

    def longest_hit(self, hashes: list[int]) -> int:
        """The most leading blocks of `hashes` (all found in the full group) whose window tail is here."""
        k = len(hashes)
        while k:
            missing = [i for i in range(self.first_kept(k * self.block_size), k) if hashes[i] not in self.cached]
            if not missing:
                return k
            k = missing[-1]  # any longer hit's tail would hold that block too
        return 0

    def reuse_tail(self, seq: Sequence, hashes: list[int]) -> None:
        """Admission with a prefix hit of len(hashes) blocks (checked by longest_hit): share the window's tail."""
        first = self.first_kept(len(hashes) * self.block_size)
        seq.window_table = [FREED] * first
        for h in hashes[first:]:
            bid = self.cached[h]
            self._reuse(bid)
            seq.window_table.append(bid)
        seq.num_released = first

    def release_before(self, seq: Sequence, end: int) -> None:
        """Give back `seq`'s blocks before block index `end`; their entries become FREED."""
        self._release_leading(seq, seq.window_table, end)

    def free_seq(self, seq: Sequence) -> None:
        for bid in reversed(seq.window_table[seq.num_released:]):
            self._give_back(bid)
        seq.window_table = []

    def reset_prefix_cache(self) -> None:
        self._forget_hashes()
