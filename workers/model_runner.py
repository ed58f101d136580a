"""Turns a StepPlan into tensors, runs the model, samples. Device code; no sockets.

The runner remembers each sequence's tokens (prompt + what it sampled), so a plan only says how many
tokens to compute from where (see bus.messages.StepPlan).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
import torch

from ascend_ops.attention import AttentionMetadata, PrefillChunk
from bus.messages import StepPlan, StepResult
from engine.sampling_params import SamplingParams
from workers.kv_cache import KVCache
from workers.sampler import RowState, sample


@dataclass(slots=True)
class SeqState:
    tokens: list[int]
    row: RowState


class ModelRunner:
    def __init__(self, model, kv: KVCache, *, rank: int, block_size: int, device: torch.device, seed: int = 0):
        self.model, self.kv = model, kv
        self.rank, self.block_size, self.device = rank, block_size, device
        self.seqs: dict[str, SeqState] = {}
        self.generator = torch.Generator().manual_seed(seed)
        self.weight_version = 0

    def execute(self, plan: StepPlan, between_layers=None) -> StepResult:
        t0 = time.perf_counter()
        for ns in plan.new_seqs:
            params = SamplingParams.from_wire(ns.sampling)
            gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
            toks = list(ns.prompt_token_ids)
            self.seqs[ns.seq_id] = SeqState(toks, RowState(params, ns.eos_token_ids, ns.prompt_token_ids, [], gen))
        for sid in plan.finished:
            self.seqs.pop(sid, None)
        if not plan.seq_ids:
            return self._result(plan, [], None, t0)
        input_ids, positions, meta, sample_rows, sample_ids = self._prepare(plan)
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, meta, self.kv.views, between_layers)
            if not sample_ids:  # only partial prefill chunks this step: nothing to sample
                return self._result(plan, [], None, t0)
            # Sampling runs on the host with per-request CPU generators, so seeded draws are identical
            # on every platform; on accelerators this costs one [S, V] copy per step.
            logits = self.model.compute_logits(hidden[sample_rows.to(hidden.device)]).float().cpu()
            out = sample(logits, [self.seqs[s].row for s in sample_ids], self.generator)
        for sid, tok in zip(sample_ids, out.token_ids.tolist()):
            st = self.seqs[sid]
            st.tokens.append(tok)
            st.row.output_token_ids.append(tok)
        return self._result(plan, sample_ids, out, t0)

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
        q = 0
        for sid, start, n, table in zip(plan.seq_ids, plan.num_computed, plan.num_new, plan.block_tables):
            st = self.seqs[sid]
            tokens += st.tokens[start:start + n]
            pos = np.arange(start, start + n, dtype=np.int64)
            tab = np.asarray(table, dtype=np.int64)
            pos_parts.append(pos)
            slot_parts.append(tab[pos // bs] * bs + pos % bs)
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
        meta = AttentionMetadata(torch.from_numpy(np.concatenate(slot_parts)), num_decodes=num_decodes)
        if num_decodes:
            width = max(len(t) for t in dec_tables)
            padded = np.zeros((num_decodes, width), dtype=np.int64)
            for i, t in enumerate(dec_tables):
                padded[i, :len(t)] = t
            meta.decode_block_tables = torch.from_numpy(padded)
            meta.decode_ctx_lens = torch.tensor(dec_lens, dtype=torch.int64)
            meta.decode_max_ctx = max(dec_lens)
        meta.prefills = prefills
        input_ids = torch.tensor(tokens, dtype=torch.int64)
        positions = torch.from_numpy(np.concatenate(pos_parts))
        if self.device.type != "cpu":
            input_ids, positions = input_ids.to(self.device), positions.to(self.device)
            meta = _to_device(meta, self.device)
        return input_ids, positions, meta, torch.tensor(sample_rows, dtype=torch.int64), sample_ids

    def _result(self, plan: StepPlan, sample_ids: list[str], out, t0: float) -> StepResult:
        if out is None:
            z = np.zeros(0, np.int64)
            return StepResult(plan.step_id, self.rank, [], z, np.zeros(0, np.float32), z.reshape(0, 0),
                              np.zeros((0, 0), np.float32), self.weight_version, "", time.perf_counter() - t0)
        return StepResult(plan.step_id, self.rank, sample_ids, out.token_ids.numpy(),
                          out.logprobs.float().numpy(), out.topk_ids.numpy(), out.topk_logprobs.float().numpy(),
                          self.weight_version, "", time.perf_counter() - t0)


def _to_device(meta: AttentionMetadata, device: torch.device) -> AttentionMetadata:
    meta.slot_mapping = meta.slot_mapping.to(device)
    if meta.decode_block_tables is not None:
        meta.decode_block_tables = meta.decode_block_tables.to(device)
        meta.decode_ctx_lens = meta.decode_ctx_lens.to(device)  # type: ignore[union-attr]
    for c in meta.prefills:
        c.block_table = c.block_table.to(device)
    return meta
