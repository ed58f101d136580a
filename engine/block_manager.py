"""KV-cache block accounting with prefix caching. Pure policy: block ids only, no tensors.

A block is free (ref 0) or used by one or more sequences (ref > 0). A full block may carry a hash of
(previous block's hash, its tokens, weight epoch): identical prefixes computed under the same weights
share blocks, and a block computed under other weights never matches (the epoch is in the key).
Freed blocks keep their hash and stay findable until the free list hands them out again (LRU order),
so a prompt that comes back soon is still cached.

Callers pair `can_allocate` with `allocate` so they never see a half-done allocation.

With `record_events` the manager also returns what it did to the cache as vLLM's KV events
(engine.kv_events; the scheduler actor publishes them, `take_events`): BlockStored when blocks of the
current weights become findable, BlockRemoved when a block announced that way is evicted, AllBlocksCleared
when the cache is reset or the weights change (blocks of older weights can no longer be matched by a new
request, so a router should stop counting them).

Sliding-window models (every attention layer with the same window, `release_before`): a running sequence gives
back the blocks wholly before its window as the window moves; their block_table entries become FREED, so the
table keeps its length and positions (block i still holds positions [i*bs, (i+1)*bs)) and the attention, which
reads only the window's blocks, never reads one (a read of FREED is an index error, not a silent wrong key).
A released block goes back to the free list like a finished sequence's: its hash stays findable until the block
is handed out for new content, which evicts the hash, so a prefix hit never finds a rewritten block. With
prefix caching only blocks already hashed are released (async scheduling plans the next step before this one's
hashes are committed), so a prompt's full blocks all become findable, as for full attention.

Models whose attention layers mix windows (gpt-oss, Gemma 3): this manager's pool and Sequence.block_table are the
full-attention layers'; `windows` is the sliding-window layers' own pool and table (engine.window_blocks), which
every allocation, prefix hit, hash commit, release and free here also updates. KV events describe this pool only.

Hybrid models (`checkpoints`, engine.state_checkpoints): a prefix hit is cut back to the longest matched block
whose boundary has a recurrent-state checkpoint (none: no hit), and a checkpoint is forgotten when its block's
hash is evicted or the cache is reset.
"""

from __future__ import annotations

import hashlib

from engine.block_pool import FREED, BlockPool
from engine.kv_events import MEDIUM, AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent, external_hash
from engine.request import Sequence
from engine.state_checkpoints import StateCheckpoints
from engine.window_blocks import WindowBlocks

__all__ = ["FREED", "BlockManager", "block_hash", "chain_root", "salt_root"]


def block_hash(parent: int | None, tokens: tuple[int, ...], weight_epoch: int) -> int:
    # Python's hash of a tuple of ints is deterministic across processes (no hash randomisation for
    # ints), 64-bit; the scheduler is the only process that compares these.
    return hash((parent, tokens, weight_epoch))


def chain_root(seq: Sequence) -> int | None:
    """The 'parent' of a sequence's first block: its cache_salt and its LoRA adapter (id and version, as vLLM
    puts the adapter into the block hash), so a block computed with other weights never matches."""
    lora = seq.sampling.lora
    if lora is None:
        return salt_root(seq.sampling.cache_salt)
    return salt_root(f"{seq.sampling.cache_salt or ''}\0lora:{lora.id}:{lora.version}")


def salt_root(salt: str | None) -> int | None:
    """The 'parent' of a salted sequence's first block (vLLM's cache_salt): requests with different salts
    never share a block, because every later hash chains from this one. A stable 64-bit digest, so it
    cannot collide with an unsalted chain by Python's per-process string hashing."""
    if not salt:
        return None
    return int.from_bytes(hashlib.sha256(salt.encode()).digest()[:8], "little") | (1 << 64)


class BlockManager(BlockPool):
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 record_events: bool = False, windows: WindowBlocks | None = None,
                 checkpoints: StateCheckpoints | None = None):
        super().__init__(num_blocks, block_size)
        self.caching = enable_prefix_caching
        self.windows = windows  # a mixed-window model's sliding-window group (module docstring)
        self.num_prefix_hits = 0
        self.num_prefix_queries = 0
        self.checkpoints = checkpoints  # hybrid models: recurrent-state checkpoints (None: attention only)
        # KV events (record_events): pending events, the hashes announced since the last clear, and the
        # weight epoch they belong to
        self.record_events = record_events and enable_prefix_caching
        self.events: list[KVCacheEvent] = []
        self.announced: set[int] = set()
        self.events_epoch = 0

    @property
    def usage(self) -> float:
        """The fraction of blocks in use (of the fuller group, for a mixed-window model)."""
        used = 1.0 - len(self.free) / self.num_blocks if self.num_blocks else 0.0
        w = self.windows
        return max(used, 1.0 - w.num_free / w.num_blocks) if w is not None and w.num_blocks else used

    def blocks_needed(self, seq: Sequence, num_tokens: int) -> int:
        """New blocks `seq` needs to hold `num_tokens` tokens of KV."""
        want = (num_tokens + self.block_size - 1) // self.block_size
        return max(0, want - len(seq.block_table))

    def can_allocate(self, seq: Sequence, num_tokens: int) -> bool:
        return (self.blocks_needed(seq, num_tokens) <= len(self.free)
                and (self.windows is None or not self.windows.short(seq, num_tokens)))

    def allocate(self, seq: Sequence, num_tokens: int) -> None:
        for _ in range(self.blocks_needed(seq, num_tokens)):
            seq.block_table.append(self._take_fresh())
        if self.windows is not None:
            self.windows.allocate(seq, num_tokens)

    def lookup(self, seq: Sequence, weight_epoch: int) -> tuple[list[int], int | None]:
        """Looks only: the hashes of the prompt's leading full blocks the cache holds, and the hash of the first
        one it does not (None: all are cached, or the prompt has none). At least one prompt token is always left
        to compute, since its logits start the output, so the last full block before it is the last looked up."""
        if not self.caching:
            return [], None
        bs, prompt = self.block_size, seq.prompt_token_ids
        parent: int | None = chain_root(seq)
        found: list[int] = []
        for i in range((seq.num_prompt_tokens - 1) // bs):
            h = block_hash(parent, tuple(prompt[i * bs:(i + 1) * bs]), weight_epoch)
            if h not in self.cached:
                return found, h
            found.append(h)
            parent = h
        return found, None

    def match_prefix(self, seq: Sequence, weight_epoch: int, looked_up: list[int] | None = None) -> int:
        """At admission: reuse cached blocks of the prompt's leading full blocks (`looked_up`: `lookup`'s hashes,
        when the caller has them). Returns tokens reused.

        Not counted here: a sequence turned away for lack of blocks is looked up again next step (count_lookup)."""
        if not self.caching:
            return 0
        bs = self.block_size
        found = list(looked_up) if looked_up is not None else self.lookup(seq, weight_epoch)[0]
        if self.checkpoints is not None:  # a hybrid resumes only where a recurrent state was kept
            while found and found[-1] not in self.checkpoints:
                found.pop()
        if self.windows is not None:  # the window group must hold the hit's tail (engine.window_blocks)
            del found[self.windows.longest_hit(found):]
            self.windows.reuse_tail(seq, found)
        for h in found:
            bid = self.cached[h]
            self._reuse(bid)
            seq.block_table.append(bid)
            seq.block_hashes.append(h)
        return len(found) * bs

    def count_lookup(self, seq: Sequence, hit_tokens: int) -> None:
        """The prefix-cache counters, once per sequence, when it is admitted (vLLM records a request's lookup
        when it is scheduled): its prompt's full blocks before the last token, and the `hit_tokens` reused."""
        if self.caching:
            self.num_prefix_queries += (seq.num_prompt_tokens - 1) // self.block_size
            self.num_prefix_hits += hit_tokens // self.block_size

    def hash_through(self, seq: Sequence, num_blocks: int, weight_epoch: int) -> int:
        """The hash block `num_blocks - 1` of `seq` will be committed under (commit_full_blocks), before it is
        computed: its committed hashes, then the chain over its tokens."""
        return self.hashes_to(seq, num_blocks, weight_epoch)[num_blocks - 1]

    def hashes_to(self, seq: Sequence, num_blocks: int, weight_epoch: int) -> list[int]:
        """The hashes `seq`'s first `num_blocks` blocks are (or will be) committed under: its committed hashes,
        then the chain over its tokens."""
        bs, hashes = self.block_size, seq.block_hashes
        if len(hashes) >= num_blocks:
            return hashes[:num_blocks]
        out = list(hashes)
        parent = hashes[-1] if hashes else chain_root(seq)
        for i in range(len(hashes), num_blocks):
            parent = block_hash(parent, tuple(seq.tokens(i * bs, (i + 1) * bs)), weight_epoch)
            out.append(parent)
        return out

    def commit_full_blocks(self, seq: Sequence, weight_epoch: int) -> None:
        """After a step: hash blocks that just became full so later requests can share them."""
        if not self.caching:
            return
        bs = self.block_size
        full = seq.num_computed // bs
        stored: list[int] = []  # indexes of the blocks this call made findable (recorded as events)
        while len(seq.block_hashes) < full:
            i = len(seq.block_hashes)
            parent = seq.block_hashes[-1] if seq.block_hashes else chain_root(seq)
            h = block_hash(parent, tuple(seq.tokens(i * bs, (i + 1) * bs)), weight_epoch)
            seq.block_hashes.append(h)
            bid = seq.block_table[i]
            if h not in self.cached and self.hash_of[bid] is None:
                self.cached[h] = bid
                self.hash_of[bid] = h
                stored.append(i)
            if self.windows is not None:
                self.windows.store(seq, i, h)
        if self.record_events and stored:
            self._record_stored(seq, stored, weight_epoch)

    def _record_stored(self, seq: Sequence, stored: list[int], weight_epoch: int) -> None:
        """BlockStored events for the blocks at `stored` (indexes into seq's blocks), one per contiguous run,
        each naming the block before it as parent. Blocks of older weights than the newest seen are not
        announced: no new request can match them."""
        if weight_epoch > self.events_epoch:
            self._record_clear()
            self.events_epoch = weight_epoch
        elif weight_epoch < self.events_epoch:
            return
        bs, hashes = self.block_size, seq.block_hashes
        start = 0
        while start < len(stored):
            end = start + 1
            while end < len(stored) and stored[end] == stored[end - 1] + 1:
                end += 1
            run = stored[start:end]
            first = run[0]
            parent = external_hash(hashes[first - 1]) if first > 0 else None
            ext = [external_hash(hashes[i]) for i in run]
            self.announced.update(ext)
            self.events.append(BlockStored(ext, parent, seq.tokens(first * bs, (run[-1] + 1) * bs), bs,
                                           None, MEDIUM, None))
            start = end

    def _record_removed(self, h: int) -> None:
        ext = external_hash(h)
        if ext not in self.announced:
            return
        self.announced.discard(ext)
        last = self.events[-1] if self.events else None
        if isinstance(last, BlockRemoved):
            last.block_hashes.append(ext)
        else:
            self.events.append(BlockRemoved([ext], MEDIUM))

    def _record_clear(self) -> None:
        self.announced.clear()
        self.events.append(AllBlocksCleared())

    def take_events(self) -> list[KVCacheEvent]:
        """The events recorded since the last call (the scheduler publishes them once per loop turn)."""
        events, self.events = self.events, []
        return events

    def release_before(self, seq: Sequence, pos: int) -> None:
        """Sliding-window models: give back `seq`'s blocks that lie wholly before position `pos` (the first key
        any of its later queries can see); their entries become FREED (module docstring)."""
        end = pos // self.block_size
        if self.caching:
            end = min(end, len(seq.block_hashes))  # hashed first (module docstring)
        if self.windows is not None:  # a mixed-window model: only the window group's table
            self.windows.release_before(seq, end)
            return
        self._release_leading(seq, seq.block_table, end)

    def num_held(self, seq: Sequence) -> int:
        """Blocks `seq` holds (its tables' entries not released), in both groups of a mixed-window model."""
        return len(seq.block_table) + len(seq.window_table) - seq.num_released

    def held_blocks(self) -> list[int]:
        """The blocks some sequence holds; a mixed-window model's window-group block b as -2 - b (below FREED:
        never a full-group id, whatever each worker's block count; workers.kv_cache.KVCache.copy_blocks)."""
        extra = [-2 - b for b in self.windows.held()] if self.windows is not None else []
        return self.held() + extra

    def free_seq(self, seq: Sequence) -> None:
        if self.windows is not None:
            self.windows.free_seq(seq)
        # Release in reverse so a sequence's tail blocks are reused before its (more shareable) head.
        for bid in reversed(seq.block_table[0 if self.windows is not None else seq.num_released:]):
            self._give_back(bid)
        seq.block_table = []
        seq.block_hashes = []
        seq.num_released = 0

    def reset_prefix_cache(self) -> None:
        """Forget every hash (e.g. after a weight update with clear_cache); used blocks stay allocated."""
        self._forget_hashes()
        if self.windows is not None:
            self.windows.reset_prefix_cache()
        if self.checkpoints is not None:
            self.checkpoints.clear()
        if self.record_events:
            self._record_clear()

    def _evicted(self, h: int) -> None:
        if self.checkpoints is not None:  # the state at the evicted block's end goes with it
            self.checkpoints.forget(h)
        if self.record_events:
            self._record_removed(h)
