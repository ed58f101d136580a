"""Recurrent-state checkpoints of hybrid models (Qwen3-Next / Qwen3.5) for prefix caching. Pure policy: ids only.

A Gated DeltaNet layer's state after position p sums up every token before it, so a prefix-cache hit on a
hybrid model can resume only where that state was kept. As vLLM's "align" mamba cache mode does, the state is
kept at block boundaries the scheduler makes a prefill chunk end on, and a hit is cut back to the longest
matched block whose boundary has a checkpoint. Here that boundary is the end of each prompt's last full block
(`checkpoint_boundary`: the position a later identical prompt's hit ends at, since a hit always leaves one
prompt token to compute), so a prompt that comes back (GRPO's samples after the first round, a preempted
request, the same system prompt + question) resumes there; a prefix shared only in part hits nothing, unless
--mamba-block-size N asks for checkpoints every N tokens of a prompt too (`next_checkpoint`), as vLLM's
mamba blocks are: a shared system prompt then resumes at its last multiple of N.

A checkpoint is a slot of the workers' checkpoint pool (workers.kv_cache: beside the running sequences'
state slots, from the same memory budget), keyed by the hash of the block that ends at its boundary. It is
taken when a plan asks the workers to save a sequence's state after the step (`take`; not when that block's
state is kept or being saved already, by requests with the same prefix: that one is used again instead),
made findable when that step's result is applied and the block's hash is known (`commit`; given back if the
step failed, `release`), and forgotten with its block: when the block manager hands the block out for other content,
when the prefix cache is reset, or, when the pool is full, for a new save: least recently used first among
those no other request asked for (a prefix that many requests share, such as a system prompt computed by a
batch of prompts running together, outlives each prompt's own end), never one the plan being built restores;
with no such victim the save is skipped.
"""

from __future__ import annotations

from collections import OrderedDict


def checkpoint_boundary(num_prompt_tokens: int, block_size: int) -> int:
    """The position whose state is checkpointed for a prompt: the end of its last full block that a prefix hit
    can reach (match_prefix leaves the last prompt token to compute). 0: none (a prompt of one block or less)."""
    return (num_prompt_tokens - 1) // block_size * block_size


def next_checkpoint(num_prompt_tokens: int, block_size: int, computed: int, every: int = 0) -> int:
    """The first checkpoint boundary of a prompt after position `computed` (0: none left): every `every` tokens
    (--mamba-block-size, 0: none) before its last full block, then that block's end (`checkpoint_boundary`)."""
    last = checkpoint_boundary(num_prompt_tokens, block_size)
    if computed >= last:
        return 0
    if every:
        nxt = (computed // every + 1) * every
        if nxt < last:
            return nxt
    return last


class StateCheckpoints:
    def __init__(self, num: int) -> None:
        self.num = num
        self.free: list[int] = list(range(num - 1, -1, -1))  # popped from the end: slot 0 first
        self.by_hash: OrderedDict[int, int] = OrderedDict()  # block hash -> slot, least recently used first
        self.hash_of: dict[int, int] = {}  # slot -> block hash (findable ones)
        self.pending: dict[int, int] = {}  # slot -> block hash of saves planned, not yet made findable
        self.pinned: set[int] = set()  # hashes loaded by the plan being built: not evicted for its saves
        # hashes asked for again (loaded, or saved by one more request): evicted after the others (below)
        self.shared: set[int] = set()
        self.asked: set[int] = set()  # pending hashes another request also wanted saved
        self.num_saved = 0
        self.num_loaded = 0

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.by_hash

    def take(self, block_hash: int) -> int | None:
        """A slot for a save of the state at the end of block `block_hash`, planned now (evicting the least
        recently used checkpoint if none is free); None when that state is kept or being saved already (it is
        used again instead), or the pool is all pending saves."""
        if block_hash in self.by_hash:
            self.by_hash.move_to_end(block_hash)
            self.shared.add(block_hash)
            return None
        if block_hash in self.pending.values():
            self.asked.add(block_hash)
            return None
        if not self.free:
            victim = self._victim()
            if victim is None:
                return None
            self.forget(victim)
        slot = self.free.pop()
        self.pending[slot] = block_hash
        return slot

    def _victim(self) -> int | None:
        """Which checkpoint a new save replaces (segmented LRU): the least recently used one nobody asked for
        again; else, while those asked for again hold more than half the pool, the least recently used of
        them; else none (the save is skipped: a prefix many requests share outlives any one prompt's end).
        Never one the plan being built restores."""
        for h in self.by_hash:
            if h not in self.shared and h not in self.pinned:
                return h
        if len(self.shared) > self.num // 2:
            return next((h for h in self.by_hash if h not in self.pinned), None)
        return None

    def commit(self, slot: int, block_hash: int) -> None:
        """The save into `slot` happened: findable under `block_hash` (a checkpoint already there wins, and is
        used again: a prefix computed once more, by requests that ran together, is a shared one)."""
        self.pending.pop(slot, None)
        if block_hash in self.asked:
            self.asked.discard(block_hash)
            self.shared.add(block_hash)
        if block_hash in self.by_hash:
            self.by_hash.move_to_end(block_hash)
            self.shared.add(block_hash)
            self.free.append(slot)
            return
        self.by_hash[block_hash] = slot
        self.hash_of[slot] = block_hash
        self.num_saved += 1

    def release(self, slot: int) -> None:
        """A save that did not happen (its step failed, was interrupted, or its sequence left it)."""
        self.asked.discard(self.pending.pop(slot, 0))
        self.free.append(slot)

    def begin_plan(self) -> None:
        """A new plan is being built: what earlier plans loaded may be evicted again."""
        self.pinned.clear()

    def load(self, block_hash: int) -> int:
        """The slot to restore a prefix hit ending at `block_hash` from (most recently used now, and kept while
        this plan is built: a save planned after it evicts something else or is skipped)."""
        self.by_hash.move_to_end(block_hash)
        self.pinned.add(block_hash)
        self.shared.add(block_hash)
        self.num_loaded += 1
        return self.by_hash[block_hash]

    def forget(self, block_hash: int) -> None:
        """Its block was evicted (or the pool needs the slot): the checkpoint is no longer findable."""
        slot = self.by_hash.pop(block_hash, None)
        self.shared.discard(block_hash)
        if slot is not None:
            del self.hash_of[slot]
            self.free.append(slot)

    def clear(self) -> None:
        for h in list(self.by_hash):
            self.forget(h)
