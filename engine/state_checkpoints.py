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
taken when a plan asks the workers to save a sequence's state after the step (`take`), made findable when
that step's result is applied and the block's hash is known (`commit`; given back if the step failed,
`release`), and forgotten with its block: when the block manager hands the block out for other content,
when the prefix cache is reset, or, when the pool is full, least recently used first.
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
        self.num_saved = 0
        self.num_loaded = 0

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self.by_hash

    def take(self) -> int | None:
        """A slot for a save planned now (evicting the least recently used checkpoint if none is free);
        None with a pool of zero slots."""
        if not self.free:
            if not self.by_hash:
                return None
            self.forget(next(iter(self.by_hash)))
        return self.free.pop()

    def commit(self, slot: int, block_hash: int) -> None:
        """The save into `slot` happened: findable under `block_hash` (a checkpoint already there wins)."""
        if block_hash in self.by_hash:
            self.free.append(slot)
            return
        self.by_hash[block_hash] = slot
        self.hash_of[slot] = block_hash
        self.num_saved += 1

    def release(self, slot: int) -> None:
        """A save that did not happen (its step failed, was interrupted, or its sequence left it)."""
        self.free.append(slot)

    def load(self, block_hash: int) -> int:
        """The slot to restore a prefix hit ending at `block_hash` from (most recently used now)."""
        self.by_hash.move_to_end(block_hash)
        self.num_loaded += 1
        return self.by_hash[block_hash]

    def forget(self, block_hash: int) -> None:
        """Its block was evicted (or the pool needs the slot): the checkpoint is no longer findable."""
        slot = self.by_hash.pop(block_hash, None)
        if slot is not None:
            del self.hash_of[slot]
            self.free.append(slot)

    def clear(self) -> None:
        for h in list(self.by_hash):
            self.forget(h)
