"""Turns a StepPlan into tensors, runs the model, samples. Device code; no sockets.

The runner remembers each sequence's tokens (prompt + what it sampled), so a plan only says how many
tokens to compute from where (see bus.messages.StepPlan).

Prompt logprobs: for a sequence that asked for them, every prefill row whose next token is a prompt
token also goes through the LM head (in slices, so a long prompt never holds [P, V] logits at once).
The rows of each chunk are kept until the step that samples the sequence, which sends them all in one
PromptLogprobs; a recompute after preemption skips the positions already done.

Routed experts (--enable-return-routed-experts, MoE models, rank 0): the model appends each MoE layer's
top-k ids; per step they become one array [T, layers, top_k] (one stack, one cast to uint8/uint16, one
host copy) that goes back whole in the StepResult with spans saying which rows are whose, starting at
which position (engine.routed_experts). The rows are also kept per KV slot, so a sequence whose prompt
starts with a prefix-cache hit gets the routes of the positions it never computed, from whichever
sequence computed them. With the flag off, or on a dense model, nothing of this runs.

A step that raised or was interrupted leaves its sequences' state behind what the scheduler planned next
(their tokens were not appended): `drop` forgets them here at once. The scheduler fails or aborts them, but
with async scheduling the plan after that step was sent already and still names them; such a plan runs
without them and reports each as failed (`seq_errors`), until a plan's `finished` list names it.

Hybrid models (Qwen3-Next / Qwen3.5): each plan row names the sequence's recurrent-state slot
(StepPlan.state_slots, workers.kv_cache). A row from position 0 zeroes its slot first; any other row must
resume exactly where the slot's state stopped (`state_pos`), else the step fails naming the sequence rather
than computing from another position's state. A prefix-cache hit resumes from a checkpoint
(StepPlan.state_loads: copied into the slot before the step, its position checked like any other); the
plan's state_saves are copied out of their slots after the forward (engine.state_checkpoints).

Tensor parallelism (model.tp of size N > 1): every tp worker runs the same plan; the LM head's logits
reach tp rank 0 only (the model gathers them), which samples and computes every reported number, then
broadcasts the sampled token ids so every rank's sequences stay the same. Only rank 0's StepResult carries
them; the others send an empty one (an ack), so the scheduler still gets one result per worker.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ascend_ops.attention import AttentionMetadata, PrefillChunk
from ascend_ops.tp_group import SOLO
from bus.messages import ErrorInfo, ErrorKind, NewSeq, PromptLogprobs, StepPlan, StepResult
from bus.sampling_params import SamplingParams
from engine.routed_experts import wire_dtype
from engine.structured_outputs import StructuredOutputsConfig
from workers.grammar import GrammarEngine
from workers.kv_cache import KVCache
from workers.logits_processors import RowState, topk
from workers.sampler import LOGPROBS_MODES, SampleOutput, head_rows, sample_in_spans

PROMPT_LOGITS_ROWS = 256  # prompt-logprob rows per LM-head slice: bounds the [rows, V] fp32 logits


@dataclass(slots=True)
class SeqState:
    tokens: list[int]
    row: RowState
    num_prompt: int = 0
    prompt_lp_next: int = 1  # next prompt token whose logprob is owed (token 0 has none)
    prompt_lp_parts: list | None = None  # computed rows not yet sent: (logprobs, ranks, topk_ids, topk_lps)
    routed_next: int = 0  # routed experts: positions below this were reported
    lora: tuple[int, int] | None = None  # its adapter version (workers/lora.py), None: the base model


class ModelRunner:
    def __init__(self, model, kv: KVCache, *, rank: int, block_size: int, device: torch.device, seed: int = 0,
                 logprobs_mode: str = "raw_logprobs", return_routed_experts: bool = False,
                 tokenizer_path: Path | None = None, structured_outputs: StructuredOutputsConfig | None = None,
                 lora=None, return_sampling_mask: bool = False):
        if logprobs_mode not in LOGPROBS_MODES:
            raise ValueError(f"logprobs_mode must be one of {', '.join(LOGPROBS_MODES)}, got {logprobs_mode!r}")
        self.model, self.kv = model, kv
        self.lora = lora  # workers.lora.LoraSlots with --enable-lora
        self.lora_failed: dict[str, ErrorInfo] = {}  # new sequences whose adapter failed to load, until reported
        self.tp = getattr(model, "tp", SOLO)
        self.rank, self.block_size, self.device = rank, block_size, device
        self.seqs: dict[str, SeqState] = {}
        self.state_pos: dict[int, int] = {}  # hybrid models: state slot -> the position its state has reached
        self.dropped: set[str] = set()  # forgotten after a failed step, not yet in a plan's finished list
        self.generator = torch.Generator().manual_seed(seed)
        self.weight_epoch = 0
        self.logprobs_mode = logprobs_mode
        self.return_sampling_mask = return_sampling_mask  # --return-sampling-mask: each row's support
        self.vocab_size = int(model.cfg.vocab_size)
        self.grammar = GrammarEngine(tokenizer_path, self.vocab_size, structured_outputs)  # workers/grammar.py
        self.route_dtype: torch.dtype | None = None  # routed-experts capture: None = off
        if return_routed_experts and model.num_moe_layers and rank == 0:  # the scheduler reads rank 0's result
            wire = wire_dtype(model.num_experts)
            # uint16 travels as int16 on the device (a cast torch supports everywhere), viewed back on the host
            self.route_dtype = torch.uint8 if wire == np.uint8 else torch.int16
            # the routes of the token whose KV is in each slot (np.zeros: pages are touched only when used)
            self.route_store = np.zeros((kv.num_blocks * block_size, model.num_moe_layers, model.moe_top_k), wire)

    def execute(self, plan: StepPlan, between_layers=None) -> StepResult:
        t0 = time.perf_counter()
        # Forget first: a finished id may come back at once as a new request with the same id.
        for sid in plan.finished:
            self._forget(self.seqs.pop(sid, None))
            self.lora_failed.pop(sid, None)
            self.grammar.forget(sid)
            self.dropped.discard(sid)
        for ns in plan.new_seqs:
            params = ns.sampling
            lora = self._lora_of(ns.seq_id, params)
            if lora is False:
                continue  # its adapter could not be loaded: it fails alone, below (skipped)
            gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
            toks = list(ns.prompt_token_ids)
            row = RowState(params, ns.eos_token_ids, ns.prompt_token_ids, [], gen,
                           self.grammar.on_new_seq(ns.seq_id, params, ns.eos_token_ids))
            self.seqs[ns.seq_id] = SeqState(toks, row, len(toks),
                                            prompt_lp_parts=[] if params.prompt_logprobs is not None else None,
                                            lora=lora)
        skipped: list[str] = []
        if self.dropped and not self.dropped.isdisjoint(plan.seq_ids):
            plan, skipped = self._without_dropped(plan)
        if not plan.seq_ids:
            return self._with_skipped(self._result(plan, [], None, t0), skipped)
        input_ids, positions, meta, sample_rows, sample_ids, prompt_rows, routes = self._prepare(plan)
        row_states = [self.seqs[s].row for s in sample_ids]
        # structured outputs: the sampled rows' grammar masks fill on the grammar thread while the model runs
        # (tp rank 0 only: it samples); None when no row is constrained (workers/grammar.py)
        pending = self.grammar.step_masks(row_states) if sample_ids and not self.tp.rank else None
        out = None
        if self.lora is not None:  # each token row's adapter version, for the grouped LoRA product
            self.lora.begin_step([self.seqs[sid].lora for sid, n in zip(plan.seq_ids, plan.num_new) for _ in range(n)])
        with torch.inference_mode():
            if routes is None:
                hidden = self.model(input_ids, positions, meta, self.kv.views, between_layers)
            else:
                routed: list[torch.Tensor] = []
                hidden = self.model(input_ids, positions, meta, self.kv.views, between_layers, routed_experts=routed)
                routed_ids = torch.stack(routed, dim=1).to(self.route_dtype)  # [T, layers, top_k], on the device
            for slot, checkpoint in plan.state_saves:  # states at their block boundary, for prefix hits
                self.kv.save_checkpoint(slot, checkpoint, self.state_pos[slot])
            for sid, rows, targets in prompt_rows:
                self._prompt_logprobs(self.seqs[sid], hidden, rows, targets)
            if sample_ids:  # else only partial prefill chunks this step: nothing to sample
                out = self._sample(hidden[sample_rows.to(hidden.device)], row_states, pending)
        if self.lora is not None:
            self.lora.end_step()
        toks = out.token_ids.tolist() if out is not None else []
        if self.tp.size > 1 and sample_ids:  # rank 0's draws, on every rank (one broadcast)
            shared = out.token_ids if out is not None else torch.empty(len(sample_ids), dtype=torch.int64)
            toks = self.tp.broadcast(shared).tolist()
        for sid, tok in zip(sample_ids, toks):
            st = self.seqs[sid]
            st.tokens.append(tok)
            st.row.output_token_ids.append(tok)
        if toks and self.grammar.live:  # every rank's matchers follow the tokens (rank 0's masks decided them)
            self.grammar.advance(sample_ids, row_states, toks)
        if self.tp.rank:  # a tp rank above 0: rank 0 reports; an empty result acks the step
            for sid in sample_ids:
                self.seqs[sid].prompt_lp_parts = None
            return self._result(plan, [], None, t0)
        prompt_lps = [self._take_prompt_logprobs(sid) for sid in sample_ids
                      if self.seqs[sid].prompt_lp_parts is not None]
        routed_rows = self._routed_rows(routed_ids, *routes) if routes is not None else (None, None)
        result = self._result(plan, sample_ids, out, t0)  # step_time_s counts the capture too
        result.prompt_logprobs = prompt_lps
        result.seq_errors = self.grammar.take_errors()
        result.routed_experts, result.routed_spans = routed_rows
        return self._with_skipped(result, skipped)

    def drop(self, seq_ids: list[str]) -> None:
        """Forget the sequences of a step that raised or was interrupted (see the module's docstring)."""
        for sid in seq_ids:
            st = self.seqs.pop(sid, None)
            if st is not None:
                self.dropped.add(sid)
                self._forget(st)
            self.grammar.forget(sid)

    def _lora_of(self, sid: str, params: SamplingParams):
        """The adapter version a new sequence runs with (None: the base model), or False when its folder could
        not be loaded now (gone or changed since the gateway checked it): the sequence then fails alone with
        that cause, the rest of the step runs."""
        if params.lora is None or self.lora is None:
            return None
        try:
            return self.lora.acquire(params.lora)
        except Exception as e:  # noqa: BLE001 - any unreadable folder: this sequence's error, not the step's
            self.dropped.add(sid)
            self.lora_failed[sid] = ErrorInfo(type(e).__name__, f"LoRA adapter {params.lora.name!r}: {e}",
                                              status=400, param="model")
            return False

    def _forget(self, st: SeqState | None) -> None:
        if st is not None and st.lora is not None:
            self.lora.release(st.lora)

    def _without_dropped(self, plan: StepPlan) -> tuple[StepPlan, list[str]]:
        keep = [i for i, sid in enumerate(plan.seq_ids) if sid not in self.dropped]
        skipped = [sid for sid in plan.seq_ids if sid in self.dropped]
        rows = (plan.seq_ids, plan.num_computed, plan.num_new, plan.block_tables)
        ids, computed, new, tables = ([xs[i] for i in keep] for xs in rows)
        slots = [plan.state_slots[i] for i in keep] if plan.state_slots else []
        windows = [plan.window_tables[i] for i in keep] if plan.window_tables else []
        kept = set(slots)
        return StepPlan(plan.step_id, plan.new_seqs, ids, computed, new, tables, plan.finished, plan.weight_epoch,
                        slots, windows, [p for p in plan.state_loads if p[0] in kept],
                        [p for p in plan.state_saves if p[0] in kept]), skipped

    def _with_skipped(self, result: StepResult, skipped: list[str]) -> StepResult:
        if skipped and not self.tp.rank:  # rank 0 reports for the engine
            why = ErrorInfo(ErrorKind.STEP_FAILED,
                            "an earlier step of this request failed or was interrupted on this worker")
            result.seq_errors = [*result.seq_errors, *((sid, self.lora_failed.pop(sid, why)) for sid in skipped)]
        return result

    def _sample(self, hidden: torch.Tensor, row_states: list[RowState], pending) -> SampleOutput | None:
        """The LM head and the sampler over the sampled rows' hidden states, in spans of rows
        (workers.sampler.sample_in_spans); None on a tp rank above 0, which gets rank 0's tokens instead.
        Sampling runs on the host with per-request CPU generators, so seeded draws are identical on every
        platform. On CPU the LM head multiplies the rows in a few even products (workers.sampler.head_rows: its
        [rows, V] output is the step's largest tensor, and each product streams all its weights) and each span's
        rows are widened to fp32 logits as the sampler reaches them (a span may take rows of two products); an
        accelerator computes the logits whole and copies them to the host once."""
        if hidden.device.type == "cpu":
            rows = head_rows(len(hidden), self.vocab_size, self.model.lm_head_itemsize(hidden.dtype))
            products: dict[int, torch.Tensor | None] = {}  # k -> the LM head's product of rows k*rows ..

            def product(k: int) -> torch.Tensor | None:
                if k not in products:  # in order, on every tp rank alike (a collective); the one before is kept
                    products.pop(k - 2, None)
                    products[k] = self.model.lm_head_product(hidden[k * rows:(k + 1) * rows])
                return products[k]

            def logits_of(a: int, b: int) -> torch.Tensor | None:
                parts = [(product(k), max(a, k * rows) - k * rows, min(b, (k + 1) * rows) - k * rows)
                         for k in range(a // rows, (b - 1) // rows + 1)]  # a span may straddle two products
                if parts[0][0] is None:
                    return None
                got = [self.model.logits_from(p[lo:hi]) for p, lo, hi in parts]
                return got[0] if len(got) == 1 else torch.cat(got)
        else:
            whole = self.model.compute_logits(hidden)
            host = None if whole is None else whole.float().cpu()

            def logits_of(a: int, b: int) -> torch.Tensor | None:
                return None if host is None else host[a:b]
        # the grammar masks (rank 0 only) fill while the model runs: waited for after the first span's logits
        return sample_in_spans(logits_of, row_states, self.generator, self.logprobs_mode,
                               pending.result if pending is not None else None, vocab=self.vocab_size,
                               sampling_mask=self.return_sampling_mask)

    def _routed_rows(self, routed_ids: torch.Tensor, slots: np.ndarray, spans: list[list],
                     skipped: list[np.ndarray]) -> tuple[np.ndarray, list[list]]:
        """The step's routes on the host, remembered per KV slot; the positions prefix-cache hits skipped
        (their slots in `skipped`, spans already in `spans`) are read back from there and appended."""
        rows = routed_ids.cpu().numpy()
        if self.route_dtype is torch.int16:
            rows = rows.view(np.uint16)
        self.route_store[slots] = rows
        if skipped:
            rows = np.concatenate([rows, *(self.route_store[s] for s in skipped)])
        return rows, spans

    def _prompt_logprobs(self, st: SeqState, hidden: torch.Tensor, rows: list[int], targets: list[int]) -> None:
        """Raw logprobs of `targets` (prompt tokens) from the hidden states at `rows` (their positions - 1),
        with ranks and the request's top alternatives; kept on the sequence until it is sampled."""
        k = min(st.row.params.num_prompt_logprobs(self.vocab_size), self.vocab_size)
        for a in range(0, len(rows), PROMPT_LOGITS_ROWS):
            idx = torch.tensor(rows[a:a + PROMPT_LOGITS_ROWS], dtype=torch.int64, device=hidden.device)
            tgt = torch.tensor(targets[a:a + PROMPT_LOGITS_ROWS], dtype=torch.int64, device=hidden.device)
            logits = self.model.compute_logits(hidden[idx])
            if logits is None:  # a tp rank above 0: it took part in the gather, rank 0 reports
                continue
            lp = torch.log_softmax(logits.float(), dim=-1)
            chosen = lp.gather(1, tgt.unsqueeze(1))
            ranks = (lp >= chosen).sum(dim=-1)
            top_lp, top_ids = topk(lp, k) if k else (lp[:, :0], tgt.unsqueeze(1)[:, :0])
            st.prompt_lp_parts.append((chosen.squeeze(1).cpu().numpy(), ranks.cpu().numpy(),
                                       top_ids.cpu().numpy(), top_lp.cpu().numpy()))

    def _take_prompt_logprobs(self, sid: str) -> PromptLogprobs:
        st = self.seqs[sid]
        parts, st.prompt_lp_parts = st.prompt_lp_parts or [], None  # sent once: later steps owe nothing
        st.prompt_lp_next = st.num_prompt
        k = min(st.row.params.num_prompt_logprobs(self.vocab_size), self.vocab_size)
        if not parts:
            return PromptLogprobs(sid, np.zeros(0, np.float32), np.zeros(0, np.int64), np.zeros((0, k), np.int64),
                                  np.zeros((0, k), np.float32))
        return PromptLogprobs(sid, *(np.concatenate([p[j] for p in parts]) for j in range(4)))

    def _prepare(self, plan: StepPlan):
        bs = self.block_size
        tokens: list[int] = []
        pos_parts: list[np.ndarray] = []
        slot_parts: list[np.ndarray] = []
        sample_rows: list[int] = []
        sample_ids: list[str] = []
        num_decodes = 0
        dec_tables: list[list[int]] = []
        dec_lens: list[int] = []
        prefills: list[PrefillChunk] = []
        prompt_rows: list[tuple[str, list[int], list[int]]] = []
        capture = self.route_dtype is not None
        spans: list[list] = []  # routed experts: [seq_id, first position, first row, rows]
        skipped: list[np.ndarray] = []  # slots of positions a prefix-cache hit skipped
        num_rows = sum(plan.num_new) if capture else 0  # skipped positions go after the step's rows
        q = 0
        for sid, start, n, table in zip(plan.seq_ids, plan.num_computed, plan.num_new, plan.block_tables):
            st = self.seqs[sid]
            tokens += st.tokens[start:start + n]
            if st.prompt_lp_parts is not None:
                # rows whose next token is a prompt token not yet reported: positions next-1 .. P-2
                lo, hi = max(start, st.prompt_lp_next - 1), min(start + n, st.num_prompt - 1)
                if hi > lo:
                    prompt_rows.append((sid, list(range(q + lo - start, q + hi - start)), st.tokens[lo + 1:hi + 1]))
                    st.prompt_lp_next = hi + 1
            pos = np.arange(start, start + n, dtype=np.int64)
            tab = np.asarray(table, dtype=np.int64)
            pos_parts.append(pos)
            slot_parts.append(tab[pos // bs] * bs + pos % bs)
            if capture:
                if start > st.routed_next:  # cache hit: those positions' routes were stored with their KV
                    hit = np.arange(st.routed_next, start)
                    skipped.append(tab[hit // bs] * bs + hit % bs)
                    spans.append([sid, st.routed_next, num_rows, len(hit)])
                    num_rows += len(hit)
                spans.append([sid, start, q, n])
                st.routed_next = start + n
            if n == 1 and not prefills:
                num_decodes += 1
                dec_tables.append(table)
                dec_lens.append(start + 1)
            else:
                prefills.append(PrefillChunk(q, n, start + n, torch.from_numpy(tab)))
            if start + n == len(st.tokens):
                sample_rows.append(q + n - 1)
                sample_ids.append(sid)
            q += n
        slots = np.concatenate(slot_parts)
        meta = AttentionMetadata(torch.from_numpy(slots), num_decodes=num_decodes)
        if num_decodes:
            meta.decode_block_tables = _padded(dec_tables)
            meta.decode_ctx_lens = torch.tensor(dec_lens, dtype=torch.int64)
            meta.decode_max_ctx = max(dec_lens)
        meta.prefills = prefills
        if plan.window_tables:
            meta.window_group = _group_meta(meta, plan.window_tables, pos_parts, bs)
        input_ids = torch.tensor(tokens, dtype=torch.int64)
        positions = torch.from_numpy(np.concatenate(pos_parts))
        if self.kv.state_slots:
            meta.state_slots = self._state_slots(plan)
        if self.device.type != "cpu":
            input_ids, positions = input_ids.to(self.device), positions.to(self.device)
            meta = _to_device(meta, self.device)
        routes = (slots, spans, skipped) if capture else None
        return (input_ids, positions, meta, torch.tensor(sample_rows, dtype=torch.int64), sample_ids, prompt_rows,
                routes)

    def _state_slots(self, plan: StepPlan) -> torch.Tensor:
        """The rows' state slots (plan order = decodes, then prefill chunks): fresh ones zeroed, the others
        checked to resume where their state stopped."""
        if len(plan.state_slots) != len(plan.seq_ids):
            raise RuntimeError(f"a hybrid model's plan names {len(plan.state_slots)} state slots for "
                               f"{len(plan.seq_ids)} sequences")
        fresh = []
        for slot, checkpoint in plan.state_loads:  # prefix hits: the state at the hit's end, checked below
            if not (0 <= slot < self.kv.state_slots and 0 <= checkpoint < self.kv.checkpoints):
                raise RuntimeError(f"state checkpoint {checkpoint} into slot {slot}: out of range")
            self.state_pos[slot] = self.kv.load_checkpoint(slot, checkpoint)
        for sid, slot, start, n in zip(plan.seq_ids, plan.state_slots, plan.num_computed, plan.num_new):
            if not 0 <= slot < self.kv.state_slots:
                raise RuntimeError(f"sequence {sid}: state slot {slot} is not one of the {self.kv.state_slots}")
            if start == 0:
                fresh.append(slot)
            elif self.state_pos.get(slot) != start:
                raise RuntimeError(f"sequence {sid} resumes at position {start} but its state slot {slot} holds "
                                   f"position {self.state_pos.get(slot)}: a hybrid model cannot skip positions")
            self.state_pos[slot] = start + n
        self.kv.reset_state(fresh)
        return torch.tensor(plan.state_slots, dtype=torch.int64)

    def _result(self, plan: StepPlan, sample_ids: list[str], out, t0: float) -> StepResult:
        if out is None:
            z = np.zeros(0, np.int64)
            return StepResult(plan.step_id, self.rank, [], z, np.zeros(0, np.float32), z.reshape(0, 0),
                              np.zeros((0, 0), np.float32), self.weight_epoch, None, time.perf_counter() - t0)
        return StepResult(plan.step_id, self.rank, sample_ids, out.token_ids.numpy(),
                          out.logprobs.float().numpy(), out.topk_ids.numpy(), out.topk_logprobs.float().numpy(),
                          self.weight_epoch, None, time.perf_counter() - t0,
                          None if out.ranks is None else out.ranks.numpy(),
                          None if out.sampling_mass is None else out.sampling_mass.numpy(),
                          sampling_mask_ids=None if out.mask_ids is None else out.mask_ids.numpy(),
                          sampling_mask_counts=None if out.mask_counts is None else out.mask_counts.numpy())


def _padded(tables: list[list[int]]) -> torch.Tensor:
    """Block tables as one [rows, longest] tensor, 0-padded."""
    padded = np.zeros((len(tables), max(len(t) for t in tables)), dtype=np.int64)
    for i, t in enumerate(tables):
        padded[i, :len(t)] = t
    return torch.from_numpy(padded)


def _group_meta(meta: AttentionMetadata, tables: list[list[int]], pos_parts: list[np.ndarray],
                bs: int) -> AttentionMetadata:
    """The step's metadata over another layer group's block tables (a mixed-window model's sliding-window
    layers, StepPlan.window_tables): the same rows and lengths, that group's slots and tables."""
    tabs = [np.asarray(t, dtype=np.int64) for t in tables]
    slots = np.concatenate([t[p // bs] * bs + p % bs for t, p in zip(tabs, pos_parts, strict=True)])
    n = meta.num_decodes
    return AttentionMetadata(
        torch.from_numpy(slots), num_decodes=n, decode_block_tables=_padded(tables[:n]) if n else None,
        decode_ctx_lens=meta.decode_ctx_lens, decode_max_ctx=meta.decode_max_ctx,
        prefills=[PrefillChunk(c.q_start, c.q_len, c.ctx_len, torch.from_numpy(t))
                  for c, t in zip(meta.prefills, tabs[n:], strict=True)])


def _to_device(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    meta.slot_mapping = meta.slot_mapping.to(device)
    if meta.state_slots is not None:
        meta.state_slots = meta.state_slots.to(device)
    if meta.decode_block_tables is not None:
        meta.decode_block_tables = meta.decode_block_tables.to(device)
        meta.decode_ctx_lens = meta.decode_ctx_lens.to(device)  # type: ignore[union-attr]
    for c in meta.prefills:
        c.block_table = c.block_table.to(device)
    if meta.window_group is not None:
        meta.window_group = _to_device(meta.window_group, device)
    return meta


def warm_up(model, *, rank: int, block_size: int, device: torch.device, kv_dtype: torch.dtype | None = None) -> float:
    """One short greedy prefill and one decode of a throwaway sequence through `model`, on a KV cache of one
    block made for it and dropped after, so that work done once per process (oneDNN packing every CPU
    weight, loading the attention kernel, first-touch of the step's buffers: ~0.5-1.5 s on SmolLM2-135M) is
    paid at start-up instead of by the first request, as vLLM's start-up dummy runs do, and the memory it
    takes is resident before the KV cache is sized. Greedy, on a runner of its own: no generator or state of
    the real runner is touched. Every tp rank runs it at the same point (its forward has collectives).
    Returns the seconds it took."""
    t0 = time.perf_counter()
    kv = KVCache.for_model(model, block_size, 1, kv_dtype or next(model.parameters()).dtype, device)
    runner = ModelRunner(model, kv, rank=rank, block_size=block_size, device=device)
    n = max(1, min(8, block_size - 1))
    sid = "warm-up"
    params = SamplingParams(temperature=0.0, max_tokens=2)
    slots = [0] if kv.state_slots else []  # a hybrid model's one state slot
    runner.execute(StepPlan(1, [NewSeq(sid, [0] * n, params, [])], [sid], [0], [n], [[0, 0]], [], 0, slots))
    runner.execute(StepPlan(2, [], [sid], [n], [1], [[0, 0]], [], 0, slots))
    return time.perf_counter() - t0
