"""KV-cache block accounting with prefix caching. Pure policy: block ids only, no tensors.

A block is free (ref 0) or used by one or more sequences (ref > 0). A full block may carry a hash of
(previous block's hash, its tokens, weight version): identical prefixes computed under the same weights
share blocks, and a block computed under other weights never matches (the version is in the key).
Freed blocks keep their hash and stay findable until the free list hands them out again (LRU order),
so a prompt that comes back soon is still cached.

Callers pair `can_allocate` with `allocate` so they never see a half-done allocation.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

from engine.request import Sequence


def block_hash(parent: int | None, tokens: tuple[int, ...], weight_epoch: int) -> int:
    # Python's hash of a tuple of ints is deterministic across processes (no hash randomisation for
    # ints), 64-bit; the scheduler is the only process that compares these.
    return hash((parent, tokens, weight_epoch))


def salt_root(salt: str | None) -> int | None:
    """The 'parent' of a salted sequence's first block (vLLM's cache_salt): requests with different salts
    never share a block, because every later hash chains from this one. A stable 64-bit digest, so it
    cannot collide with an unsalted chain by Python's per-process string hashing."""
    if not salt:
        return None
    return int.from_bytes(hashlib.sha256(salt.encode()).digest()[:8], "little") | (1 << 64)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.caching = enable_prefix_caching
        self.ref = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash -> block id
        self.free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self.num_prefix_hits = 0
        self.num_prefix_queries = 0

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / self.num_blocks if self.num_blocks else 0.0

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` needs to hold `num_tokens` tokens of KV."""
        want = (num_tokens + self.block_size - 1) // self.block_size
        return max(0, want - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return self.blocks_needed(seq, num_tokens) <= len(self.free)

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        for _ in range(self.blocks_needed(seq, num_tokens)):
            seq.block_table.append(self._take_fresh())

    def match_prefix(self, seq: Sequence, weight_epoch: int) -> int:
        """At admission: reuse cached blocks of the prompt's leading full blocks. Returns tokens reused.

        At least one prompt token is always left to compute, since its logits start the output."""
        if not self.caching:
            return 0
        bs = self.block_size
        max_blocks = (seq.num_prompt_tokens - 1) // bs
        parent: int | None = salt_root(seq.sampling.cache_salt)
        hits = 0
        for i in range(max_blocks):
            h = block_hash(parent, tuple(seq.prompt_token_ids[i * bs:(i + 1) * bs]), weight_epoch)
            bid = self.cached.get(h)
            if bid is None:
                break
            self._reuse(bid)
            seq.block_table.append(bid)
            seq.block_hashes.append(h)
            parent, hits = h, hits + 1
        self.num_prefix_queries += max_blocks
        self.num_prefix_hits += hits
        return hits * bs

    def commit_full_blocks(self, seq: Sequence, weight_epoch: int) -> None:
        """After a step: hash blocks that just became full so later requests can share them."""
        if not self.caching:
            return
        bs = self.block_size
        full = seq.num_computed // bs
        while len(seq.block_hashes) < full:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else salt_root(seq.sampling.cache_salt)
            h = block_hash(parent, tuple(seq.tokens(i * bs, (i + 1) * bs)), weight_epoch)
            seq.block_hashes.append(h)
            bid = seq.block_table[i]
            if h not in self.cached and self.hash_of[bid] is None:
                self.cached[h] = bid
                self.hash_of[bid] = h

    def free_seq(self, seq: Sequence) -> None:
        # Release in reverse so a sequence's tail blocks are reused before its (more shareable) head.
        for bid in reversed(seq.block_table):
            self.ref[bid] -= 1
            if self.ref[bid] == 0:
                self.free[bid] = None
        seq.block_table = []
        seq.block_hashes = []

    def reset_prefix_cache(self) -> None:
        """Forget every hash (e.g. after a weight update with clear_cache); used blocks stay allocated."""
        self.cached.clear()
        self.hash_of = [None] * self.num_blocks

    def _take_fresh(self) -> int:
        """Hand out the least recently freed block for new content, evicting its cached hash."""
        bid, _ = self.free.popitem(last=False)
        h = self.hash_of[bid]
        if h is not None:
            self.hash_of[bid] = None
            if self.cached.get(h) == bid:
                del self.cached[h]
        self.ref[bid] = 1
        return bid

    def _reuse(self, bid: int) -> None:
        """Share a cached block (content kept)."""
        if self.ref[bid] == 0:
            del self.free[bid]
        self.ref[bid] += 1
