"""Continuous-batching scheduler. Pure policy: sequences and block ids in, a step plan out.

Each step (vLLM v1 style, one token budget for everything):
  1. running sequences first, in arrival order: each gets the rest of its known tokens (1 for a
     decode, a chunk for an unfinished prefill), capped by the budget; when blocks run out the
     latest-arrived running sequence is preempted (blocks freed, recomputed later) until it fits;
  2. then waiting sequences, oldest first, while budget, blocks and --max-num-seqs allow; a prompt
     longer than the budget is chunked over several steps.
Two limits on prefill chunks, on top of the budget (engine/scheduler/chunk_limits.py): beside decodes (rollbus's
--prefill-tokens-beside-decodes: long prompts' chunks share a bounded part of a step while anything decodes, the
first of them a larger part while few sequences decode) and per request (vLLM's --long-prefill-token-threshold).
A sequence is sampled in the step that computes its last known token. Outputs are appended by
`update`, which also applies the stop rules and frees finished sequences' blocks.

In-batch prefix sharing (`in_batch_sharing`, --in-batch-prefix-sharing, with prefix caching; SGLang's in-batch
prefix caching): a waiting sequence whose first uncached prompt block is one that a running sequence computes in
this plan or in the step in flight is skipped for this step (it keeps its place; later ones may go first). Once
that step's blocks are committed it is admitted with them as a prefix hit, so requests sent together that share
a prefix (a system prompt; the n samples of a GRPO group sent as separate requests) compute it once instead of
once each, for one step of delay. Prompt-logprob requests, which never read the cache, and hybrid models, whose
hits need a recurrent-state checkpoint at the hit's end, are never deferred.

--scheduling-policy priority (vLLM's): the waiting queue and the running list are ordered by (priority,
arrival time), lower first, instead of by arrival alone: the next waiting sequence is the one with the
lowest value (a trainer resumes its partial rollouts ahead of new ones by giving them a lower value), a
preempted sequence goes back to its place in that order, and the victim of a preemption is the running
sequence with the highest (priority, arrival time), as vLLM's priority policy picks it. Keeping
`running` in that order makes the victim always its last entry, as under fcfs. As in vLLM v1, a waiting
sequence never preempts a running one: priority decides who is admitted, and who is preempted when
blocks run out.

Hybrid models (Qwen3-Next / Qwen3.5, `state_slots` > 0): every running sequence also holds one of the workers'
recurrent-state slots (workers.kv_cache), taken at admission and given back when it is preempted or
finishes; there is one per --max-num-seqs sequence, so admission never waits for one. Like blocks, a slot
freed may go to another sequence in the next plan: that sequence starts at position 0, and the workers zero
the slot before they compute it (after the step in flight, which may still write the old sequence's state).
With prefix caching on (the workers' checkpoint pool is not empty, `blocks.checkpoints`): a prefill chunk that
would cross a prompt's next checkpoint boundary (engine.state_checkpoints: its last full block's end, and every
`checkpoint_every` tokens with --mamba-block-size) ends on it, and the plan asks the workers
to save the sequence's state there after the step (`ScheduledStep.saves`, made findable by `update` under the
hash of the block that ends there, or given back by `discard_saves` when the step failed); a sequence admitted
with a prefix hit gets its state slot filled from the checkpoint of the hit's last block before the step
(`ScheduledStep.loads`).

Sliding-window models (`window` > 0: every attention layer of the model sees the same last `window` keys):
before a running sequence is planned, its blocks wholly before the window of its next position are given
back (BlockManager.release_before), so a long sequence holds about window / block_size + 1 blocks, not
its whole length. The step in flight may still read them: the workers run plans in order, so it is done
before the next plan writes them (as for a preempted sequence's blocks, below). Models whose layers mix
windows (gpt-oss, Gemma 3, Qwen2-MoE's lower-layer windows) have two layer groups, each with its own block
table (engine.window_blocks): `window` is then the sliding group's, and only its table gives blocks back;
the full-attention layers keep every block.

Async scheduling (--async-scheduling): the next step may be planned while one is still computing. A sequence
in that step counts its positions and its sample as if they were done (`inflight_tokens`,
`inflight_samples`, vLLM's output placeholders): the next plan decodes the token the workers are sampling
now, which they append to their own copy before they run it. A sequence that the step in flight will
finish for certain (max_tokens, max_model_len) is not planned again; one that stops at EOS or a stop token
is, and that one extra token is dropped by `update` (the sequence is finished by then). Blocks a finished or
preempted sequence frees may go to another sequence in the next plan: the workers run plans in order, so
the step in flight writes them before the next one does, and it never writes a full block (the only kind
the prefix cache shares).
"""

from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field

import msgspec

from engine.block_manager import BlockManager
from engine.request import SeqStatus, Sequence
from engine.scheduler.chunk_limits import PREFILL_BESIDE_STREAMS, PREFILL_KEYS_PER_TOKEN, chunk_limits, cost, fit
from engine.state_checkpoints import next_checkpoint


@dataclass(slots=True)
class ScheduledStep:
    seqs: list[Sequence]  # decodes (1 new token) first, then prefill chunks
    num_new: list[int]
    num_computed: list[int]  # before this step
    new_seqs: list[Sequence]  # first time the workers see these
    finished_ids: list[str]  # workers may forget these
    weight_epoch: int
    # hybrid models' state checkpoints: (sequence, checkpoint, index of the block its boundary ends) saved after
    # the step; (sequence, checkpoint) restored into the sequence's state slot before it
    saves: list[tuple[Sequence, int, int]] = field(default_factory=list)
    loads: list[tuple[Sequence, int]] = field(default_factory=list)
    _ids: list[str] | None = field(default=None, repr=False, compare=False)

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new)

    @property
    def seq_ids(self) -> list[str]:
        """The ids of `seqs`, in order (built once: the plan and the result check both read them)."""
        if self._ids is None:
            self._ids = [s.seq_id for s in self.seqs]
        return self._ids


class SeqUpdate(msgspec.Struct):
    """What one step did to one sampled sequence (the scheduler actor turns it into a RequestOutput).

    A msgspec Struct only for its constructor, which runs in C: one is made per running sequence per step,
    between the workers' results and the next plan, and a dataclass's __init__ cost 3x as much. It never
    travels (wire structs are bus.messages')."""

    seq: Sequence
    token_id: int
    logprob: float
    top: list[list[float]] | None
    finished: bool
    kv_epoch: int | None = None  # the sequence's kv_epoch right after the update (a later preemption resets it)


@dataclass(slots=True)
class Scheduler:
    blocks: BlockManager
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    weight_epoch: int = 0
    max_loras: int = 0  # --max-loras with --enable-lora: different adapters running at once (0: no limit)
    waiting: deque[Sequence] = field(default_factory=deque)
    running: list[Sequence] = field(default_factory=list)
    seqs: dict[str, Sequence] = field(default_factory=dict)
    _finished_ids: list[str] = field(default_factory=list)
    num_preemptions: int = 0
    policy: str = "fcfs"  # or "priority" (--scheduling-policy)
    prefill_beside_decodes: int = 0  # a step's prefill tokens while anything decodes (0: no limit)
    prefill_beside_streams: int = PREFILL_BESIDE_STREAMS  # decodes at which that limit holds as given (0: always)
    prefill_keys_per_token: int = PREFILL_KEYS_PER_TOKEN  # keys attended costing one token's layers (0: unweighed)
    long_prefill_token_threshold: int = 0  # vLLM's: one sequence's chunk per step (0: no limit)
    long_prefill_adaptive: bool = False  # vLLM's --long-prefill-token-threshold-adaptive
    _added: int = 0  # sequences added so far: the last tie-break of the priority order
    state_slots: int = 0  # hybrid models: the workers' recurrent-state slots (0: none, attention only)
    free_slots: list[int] = field(default_factory=list)
    checkpoint_every: int = 0  # hybrid prefix caching: --mamba-block-size (0: each prompt's last full block only)
    window: int = 0  # the sliding window whose blocks are freed: every layer's, or a mixed model's window group's
    in_batch_sharing: bool = False  # --in-batch-prefix-sharing: defer a prompt whose next block another computes

    def __post_init__(self) -> None:
        self.free_slots = list(range(self.state_slots - 1, -1, -1))  # popped from the end: slot 0 first

    def _lora_slot_full(self, seq: Sequence) -> bool:
        lora = seq.sampling.lora
        if lora is None:
            return False
        running = {(s.sampling.lora.id, s.sampling.lora.version) for s in self.running if s.sampling.lora is not None}
        return (lora.id, lora.version) not in running and len(running) >= self.max_loras

    # --- what a quiet (engine.scheduler.step_gate) does to the sequences ------------------------------------

    def abort_all(self) -> list[Sequence]:
        """An abort pause or sleep: every request ends now (finish_reason abort). Returns them."""
        aborted = list(self.running) + list(self.waiting)
        for seq in aborted:
            self._finish(seq, "abort")
        return aborted

    def drop_kv(self) -> None:
        """clear_cache: kept requests lose their KV (recomputed when the quiet ends) and the prefix cache
        is emptied, so nothing computed under the old weights is reused. Call with no step in flight."""
        for seq in list(self.running):
            self._preempt(seq)
        self.blocks.reset_prefix_cache()

    def keep_kv(self) -> list[int]:
        """The KV cache is about to be released with the kept requests' blocks offloaded: forget the cached
        prefixes (free blocks' content is not kept) and return the blocks the requests hold. Call with no
        step in flight."""
        self.blocks.reset_prefix_cache()
        return self.blocks.held_blocks()

    def reset_prefix_cache(self, reset_running: bool) -> bool:
        """vLLM's: forget every cached prefix, only once no block is held (False otherwise: retry later).
        reset_running first preempts the running requests (recomputed later, FIFO order kept)."""
        if reset_running:
            for seq in reversed(list(self.running)):
                self._preempt(seq)  # safe with a step in flight: see update()
        if any(self.blocks.ref):
            return False
        self.blocks.reset_prefix_cache()
        return True

    def add(self, seq: Sequence) -> None:
        self.seqs[seq.seq_id] = seq
        seq.order = self._added
        self._added += 1
        if self.policy == "priority":
            self._insort(self.waiting, seq)
        else:
            self.waiting.append(seq)

    @staticmethod
    def _insort(queue: deque[Sequence] | list[Sequence], seq: Sequence) -> None:
        """Into `queue`, kept in (priority, arrival time, order added) order: after its equals."""
        queue.insert(bisect.bisect_right(queue, _priority_key(seq), key=_priority_key), seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def abort(self, seq_id: str) -> Sequence | None:
        seq = self.seqs.get(seq_id)
        if seq is None:
            return None
        self._finish(seq, "abort")
        return seq

    def _chunk_limits(self) -> tuple[float, float, int, int]:
        """This step's (weight left for long prompts' chunks, the weight its first long chunk may take, the length
        over which a prompt is long, one sequence's chunk): engine/scheduler/chunk_limits.py."""
        decoding = 0
        if 0 < self.prefill_beside_decodes < self.max_num_batched_tokens:
            enough = max(1, self.prefill_beside_streams)  # past it the count changes nothing: stop there
            for s in self.running:
                if len(s.prompt_token_ids) + len(s.output_token_ids) + s.inflight_samples \
                        - s.num_computed - s.inflight_tokens == 1:
                    decoding += 1
                    if decoding == enough:
                        break
        return chunk_limits(self.max_num_batched_tokens, self.prefill_beside_decodes, self.prefill_beside_streams,
                            decoding, self.long_prefill_token_threshold, self.long_prefill_adaptive,
                            len(self.running) + len(self.waiting))

    def schedule(self) -> ScheduledStep:
        budget = self.max_num_batched_tokens
        long_left, long_first, long_over, per_seq = self._chunk_limits()
        seqs: list[Sequence] = []
        num_new: list[int] = []
        num_computed: list[int] = []
        preempted = False
        blocks = self.blocks
        bs = blocks.block_size
        free = blocks.free
        wins = blocks.windows
        running = self.running
        window = self.window
        add_seq, add_new, add_computed = seqs.append, num_new.append, num_computed.append
        ckpts = blocks.checkpoints if blocks.caching else None
        if ckpts is not None:
            ckpts.begin_plan()
        saves: list[tuple[Sequence, int, int]] = []
        loads: list[tuple[Sequence, int]] = []
        i = 0
        while i < len(running) and budget > 0:
            seq = running[i]
            computed = seq.num_computed + seq.inflight_tokens
            known = len(seq.prompt_token_ids) + len(seq.output_token_ids) + seq.inflight_samples
            if seq.inflight_samples and self._finishes_for_sure(seq):
                i += 1  # the step in flight samples its last token
                continue
            n = min(known - computed, budget)
            if n <= 0:
                i += 1  # everything it has is being computed (and nothing sampled)
                continue
            if window and computed - window + 1 >= (seq.num_released + 1) * bs:
                blocks.release_before(seq, computed - window + 1)  # keys its next queries can no longer see
            if n > 1:  # a prefill chunk
                n = min(n, per_seq)
                if known > long_over:
                    n = fit(max(long_left, long_first), computed, n, self.prefill_keys_per_token)
                    if n <= 0:
                        i += 1  # the long prompts' share of this step is spent
                        continue
                    long_left -= cost(computed, n, self.prefill_keys_per_token)
                    long_first = 0
            if ckpts is not None:
                n = self._to_checkpoint(seq, computed, n, None)
            # blocks_needed, inlined: most steps need none (a decode fills a block every block_size steps)
            need = (computed + n + bs - 1) // bs - len(seq.block_table)
            if need > len(free) or (wins is not None and wins.short(seq, computed + n)):
                while not blocks.can_allocate(seq, computed + n):
                    victim = running[-1]
                    self._preempt(victim)
                    preempted = True
                    if victim is seq:
                        break
                if seq.status is not SeqStatus.RUNNING:
                    break
                blocks.allocate(seq, computed + n)
            elif need > 0 or wins is not None:
                blocks.allocate(seq, computed + n)
            add_seq(seq)
            add_new(n)
            add_computed(computed)
            if ckpts is not None:
                self._to_checkpoint(seq, computed, n, saves)
            seq.inflight_tokens += n
            if computed + n == known:
                seq.inflight_samples += 1
            budget -= n
            i += 1
        new_seqs: list[Sequence] = []
        waiting = self.waiting
        share = self.in_batch_sharing and blocks.caching and ckpts is None
        computing: set[int] | None = None  # in-batch sharing: the prompt blocks being computed (built on demand)
        w = 0  # the next waiting sequence to look at: those before it are deferred (in-batch sharing)
        while w < len(waiting) and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            if self.state_slots and not self.free_slots:
                break  # (not reached: one slot per --max-num-seqs sequence)
            seq = waiting[w]
            if seq.inflight_tokens:
                break  # preempted while a step of it was computing: it comes back once that step is in
            if self.max_loras and self._lora_slot_full(seq):
                break  # vLLM's --max-loras: it waits until a running adapter's sequences are done
            long = seq.num_tokens > long_over
            if long and long_left <= 0:
                break  # the long prompts' share of this step is spent
            # vLLM: prompt logprobs need the hidden state of every prompt position, so such a request
            # never reads the prefix cache (its blocks are still shared with later requests).
            want_prompt_lp = seq.sampling.prompt_logprobs is not None
            looked_up = None
            if share and not want_prompt_lp:
                looked_up, uncached = blocks.lookup(seq, self.weight_epoch)
                if uncached is not None:
                    if computing is None:
                        computing = self._computing()
                    if uncached in computing:
                        w += 1  # a sequence computes that block now: next step it is a prefix hit here
                        continue
            seq.num_computed = 0 if want_prompt_lp else blocks.match_prefix(seq, self.weight_epoch, looked_up)
            n = min(seq.num_tokens - seq.num_computed, budget, per_seq)
            if long:
                n = fit(max(long_left, long_first), seq.num_computed, n, self.prefill_keys_per_token)
            if ckpts is not None:
                n = self._to_checkpoint(seq, seq.num_computed, n, None)
            if not self.blocks.can_allocate(seq, seq.num_computed + n):
                # Give the matched blocks back: a waiting sequence must hold nothing, or two of them
                # could each hold part of what the other needs.
                self.blocks.free_seq(seq)
                seq.num_computed = 0
                break
            if seq.num_preemptions == 0:  # vLLM counts a readmission after a preemption apart, never exported
                seq.num_cached_tokens = seq.num_computed
                if not want_prompt_lp:  # as vLLM: a request that skips the cache is not a lookup
                    self.blocks.count_lookup(seq, seq.num_computed)
            self.blocks.allocate(seq, seq.num_computed + n)
            del waiting[w]
            if self.state_slots:
                seq.state_slot = self.free_slots.pop()
            if ckpts is not None:
                if seq.num_computed:  # a prefix hit: its state comes from the checkpoint of the hit's last block
                    loads.append((seq, ckpts.load(seq.block_hashes[-1])))
                self._to_checkpoint(seq, seq.num_computed, n, saves)
            seq.status = SeqStatus.RUNNING
            if self.policy == "priority":
                self._insort(self.running, seq)  # the step's plan order is `seqs`', not this list's
            else:
                self.running.append(seq)
            if not seq.sent_to_workers:
                seq.sent_to_workers = True
                new_seqs.append(seq)
            seqs.append(seq)
            num_new.append(n)
            num_computed.append(seq.num_computed)
            seq.inflight_tokens += n
            if seq.num_computed + n == seq.num_tokens:
                seq.inflight_samples += 1
            budget -= n
            if long:
                long_left -= cost(seq.num_computed, n, self.prefill_keys_per_token)
                long_first = 0
            if computing is not None:
                self._add_computing(seq, computing)
        if num_new.count(1) != len(num_new):  # decodes first (stable: arrival order kept)
            order = sorted(range(len(seqs)), key=lambda k: num_new[k] != 1)
            seqs, num_new, num_computed = ([xs[k] for k in order] for xs in (seqs, num_new, num_computed))
        finished, self._finished_ids = self._finished_ids, []
        return ScheduledStep(seqs, num_new, num_computed, new_seqs, finished, self.weight_epoch, saves, loads)

    def _computing(self) -> set[int]:
        """In-batch sharing: the hashes of the prompt blocks running sequences compute in this plan or in the step
        in flight, not yet committed (findable once the step's results are in)."""
        out: set[int] = set()
        for seq in self.running:
            self._add_computing(seq, out)
        return out

    def _add_computing(self, seq: Sequence, out: set[int]) -> None:
        bs = self.blocks.block_size
        start = len(seq.block_hashes)
        end = min(seq.num_prompt_tokens, seq.num_computed + seq.inflight_tokens) // bs
        if end > start:
            out.update(self.blocks.hashes_to(seq, end, self.weight_epoch)[start:])

    def _to_checkpoint(self, seq: Sequence, computed: int, n: int, saves: list | None) -> int:
        """A hybrid's prefill chunk from `computed`, cut to end on its prompt's checkpoint boundary when it would
        cross it; with `saves`, a chunk ending there takes a checkpoint to save into (if the pool has one)."""
        b = next_checkpoint(seq.num_prompt_tokens, self.blocks.block_size, computed, self.checkpoint_every)
        if not computed < b <= computed + n:
            return n
        if saves is not None:
            i = b // self.blocks.block_size - 1
            h = self.blocks.hash_through(seq, i + 1, self.weight_epoch)
            slot = self.blocks.checkpoints.take(h)  # type: ignore[union-attr]
            if slot is not None:
                saves.append((seq, slot, i))
        return b - computed

    def discard_saves(self, step: ScheduledStep) -> None:
        """The step failed or was interrupted: the checkpoints it was to save are given back."""
        for _, slot, _ in step.saves:
            self.blocks.checkpoints.release(slot)  # type: ignore[union-attr]
        step.saves = []

    def update(self, step: ScheduledStep, sampled: dict[str, tuple[int, float, list[list[float]] | None]]
               ) -> list[SeqUpdate]:
        """Apply a step's result: advance computed counts, append sampled tokens, apply stop rules.

        Runs once per step for every running sequence, between the workers' results and the next plan
        (the workers wait): attributes are read once into locals and blocks are hashed only when one filled."""
        updates: list[SeqUpdate] = []
        append = updates.append
        get = sampled.get
        epoch = step.weight_epoch
        blocks = self.blocks
        commit = blocks.commit_full_blocks if blocks.caching else None
        bs = blocks.block_size
        max_len = self.max_model_len
        running, finished = SeqStatus.RUNNING, SeqStatus.FINISHED
        saves = {seq.seq_id: (slot, i) for seq, slot, i in step.saves} if step.saves else None
        for seq, n, before in zip(step.seqs, step.num_new, step.num_computed):
            status = seq.status
            if status is finished:
                continue  # aborted while the step ran, or stopped in the step before (async scheduling)
            seq.inflight_tokens -= n
            out = seq.output_token_ids
            if before + n == len(seq.prompt_token_ids) + len(out):
                seq.inflight_samples -= 1  # the step was to sample it (got or not: a failed sequence has none)
            if status is running:
                if seq.kv_epoch is None or before == 0:
                    seq.kv_epoch = epoch
                computed = seq.num_computed = seq.num_computed + n
                if commit is not None and computed // bs > len(seq.block_hashes):
                    commit(seq, epoch)
                if saves and seq.seq_id in saves:  # its state at the boundary is saved: findable by the block's hash
                    slot, i = saves.pop(seq.seq_id)
                    if i < len(seq.block_hashes):
                        blocks.checkpoints.commit(slot, seq.block_hashes[i])  # type: ignore[union-attr]
                    else:
                        blocks.checkpoints.release(slot)  # type: ignore[union-attr]
            # A sequence preempted while the step ran still takes its token: the worker has appended
            # it to its own copy, and the two must agree for the recompute to sample at the right place.
            got = get(seq.seq_id)
            if got is None:
                continue
            token, logprob, top = got
            out.append(token)
            # the stop rules (_stop_reason), inlined for the common case of a sequence that goes on
            sp = seq.sampling
            n_out = len(out)
            if (n_out >= sp.min_tokens and ((not sp.ignore_eos and token in seq.eos_token_ids)
                                            or token in sp.stop_token_ids)) \
                    or (sp.max_tokens is not None and n_out >= sp.max_tokens) \
                    or len(seq.prompt_token_ids) + n_out >= max_len:
                reason = self._stop_reason(seq, token)
                if reason:
                    self._finish(seq, reason)
                append(SeqUpdate(seq, token, logprob, top, reason is not None, seq.kv_epoch))
            else:
                append(SeqUpdate(seq, token, logprob, top, False, seq.kv_epoch))
        for slot, _ in (saves or {}).values():  # sequences aborted or preempted while the step ran
            blocks.checkpoints.release(slot)  # type: ignore[union-attr]
        return updates

    def _finishes_for_sure(self, seq: Sequence) -> bool:
        """Async scheduling: the samples in flight reach max_tokens or max_model_len, whatever they are."""
        n_out = len(seq.output_token_ids) + seq.inflight_samples
        max_tokens = seq.sampling.max_tokens
        return (max_tokens is not None and n_out >= max_tokens) or \
            len(seq.prompt_token_ids) + n_out >= self.max_model_len

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        sp = seq.sampling
        n_out = len(seq.output_token_ids)
        if n_out >= sp.min_tokens:
            if not sp.ignore_eos and token in seq.eos_token_ids:
                return "stop"
            if token in sp.stop_token_ids:
                seq.stop_reason = token
                return "stop"
        if sp.max_tokens is not None and n_out >= sp.max_tokens:
            return "length"
        if seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def _free_slot(self, seq: Sequence) -> None:
        if seq.state_slot >= 0:
            self.free_slots.append(seq.state_slot)
            seq.state_slot = -1

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.free_seq(seq)
        self._free_slot(seq)
        seq.num_computed = 0
        seq.kv_epoch = None
        seq.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        if self.policy == "priority":
            self._insort(self.waiting, seq)
        else:
            self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _finish(self, seq: Sequence, reason: str) -> None:
        if seq.status is SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SeqStatus.WAITING:
            self.waiting.remove(seq)
        else:
            return
        self.blocks.free_seq(seq)
        self._free_slot(seq)
        seq.status = SeqStatus.FINISHED
        seq.finish_reason = reason
        self.seqs.pop(seq.seq_id, None)
        if seq.sent_to_workers:
            self._finished_ids.append(seq.seq_id)


def _priority_key(seq: Sequence) -> tuple[int, float, int]:
    return seq.sampling.priority, seq.arrival_time, seq.order
