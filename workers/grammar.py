"""The grammar engine of the workers: one llguidance matcher per constrained sequence, kept next to its
sampling state, and the batch's token bitmask per step.

- The llguidance tokenizer is built once, while the worker loads the model (build_in_background).
- Compiled grammars are cached by their text (engine.structured_outputs.grammar_text): the first sequence
  with a constraint compiles it (llguidance drops the GIL while it builds), later ones start from a copy
  of the cached matcher, which is microseconds.
- Per step, for the sampled rows that carry a matcher (and only then: a batch without constraints does no
  mask work at all), one int32 bitmask [rows, ceil(V / 32)] is filled (llguidance, microseconds to tens of
  microseconds per row) and applied to those rows' logits by the sampler (workers/sampler.py) before the draw.
  The fill overlaps the forward pass, as vLLM's does: the runner starts it (`step_masks`) once the step's
  sampled rows are known, before the model runs, on the grammar thread, where one llguidance executor call
  fills every row with the GIL released; the runner waits for it (`PendingMasks.result`) just before sampling.
  The matchers were advanced by the previous step's tokens; `advance` (the only thing that moves them) first
  waits for a fill still under way, so a step that fails between the two never races the grammar thread.
- Each sampled or forced (trace-replay) token advances the matcher once: the runner samples a sequence
  only at its last known token, so a recompute after preemption or a prefix-cache hit, which re-runs
  positions whose tokens are known, never advances it again.
- End of the grammar: once the grammar can only stop, the mask allows only EOS (any of the request's EOS
  ids), so the request finishes on EOS with finish_reason "stop", as in vLLM. After EOS the matcher is
  terminated and masks nothing (vLLM's is_terminated).
- A token the grammar rejects (a trace-replay token outside the grammar) is reported for that sequence
  only (`GrammarRejected`, a 400 naming trace_decode_token_ids); the step and the other sequences go on.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from bus.messages import ErrorInfo, ErrorKind
from bus.sampling_params import SamplingParams, StructuredOutputsParams
from engine.structured_outputs import StructuredOutputsConfig, grammar_text


class Constrained(Protocol):
    """A row of the sampler (workers.sampler.RowState) as far as grammars care: its matcher, if any."""

    grammar: SeqGrammar | None

COMPILED_CACHE = 256  # compiled matchers kept (one per distinct constraint)


class GrammarError(Exception):
    """A constraint the worker cannot enforce (no tokenizer, or it does not compile here)."""


@dataclass(slots=True)
class SeqGrammar:
    """One sequence's matcher and where it stands."""

    matcher: object  # llguidance.LLMatcher
    eos_ids: frozenset[int]
    terminated: bool = False  # EOS was taken: nothing is masked any more (vLLM)
    rejected: str | None = None  # why a token was refused, once

    def accept(self, token: int, eos_token: int) -> bool:
        """Advance by one token; False (and `rejected` set) when the grammar refuses it."""
        if self.terminated:
            return True
        m = self.matcher
        if token in self.eos_ids or (not self.eos_ids and token == eos_token):
            self.terminated = True
            if m.is_stopped():  # type: ignore[attr-defined]
                return True
            token = eos_token  # any of the request's EOS ids counts as the grammar's EOS
        if m.consume_token(token):  # type: ignore[attr-defined]
            return True
        self.rejected = m.get_error() or f"token {token} is not allowed by the grammar"  # type: ignore[attr-defined]
        self.terminated = True
        return False


@dataclass(slots=True)
class StepMasks:
    """The bitmask of one step: row k of `bitmask` belongs to row `rows[k]` of the sampled batch."""

    rows: list[int]
    bitmask: torch.Tensor  # int32 [len(rows), ceil(V / 32)]

    def window(self, a: int, b: int) -> StepMasks | None:
        """The masks of batch rows a..b-1, numbered from a; None when none of them is constrained."""
        keep = [k for k, r in enumerate(self.rows) if a <= r < b]
        if not keep:
            return None
        return StepMasks([self.rows[k] - a for k in keep], self.bitmask[keep])


class PendingMasks:
    """A step's bitmask while llguidance fills it; `result()` waits for it (once) and returns the StepMasks."""

    def __init__(self, engine: GrammarEngine, live: list[tuple[int, SeqGrammar]], bitmask: torch.Tensor,
                 filling: Future | None):
        self._engine, self._live, self._bitmask, self._filling = engine, live, bitmask, filling
        self._masks: StepMasks | None = None

    def result(self) -> StepMasks:
        if self._masks is None:
            if self._filling is not None:
                self._filling.result()  # llguidance's error, if any, raises here
                self._filling = None
            self._masks = self._engine.finish_masks(self._live, self._bitmask)
        return self._masks


class GrammarEngine:
    """The worker's llguidance tokenizer (built on first use, about a second for a 150k vocabulary),
    compiled-grammar cache and executor."""

    def __init__(self, tokenizer_path: Path | None, vocab_size: int, config: StructuredOutputsConfig | None = None):
        self.config = config or StructuredOutputsConfig()  # --structured-outputs-config
        self.tokenizer_path = tokenizer_path
        self.vocab_size = vocab_size
        self.words = (vocab_size + 31) // 32
        self._tok = None
        self._tok_error: str | None = None
        self._builder: threading.Thread | None = None
        self._compiled: OrderedDict[str, object] = OrderedDict()
        self._executor = None  # llguidance.LLExecutor, one thread: fills a step's rows in one call, GIL released
        self._thread: ThreadPoolExecutor | None = None  # where that call runs while the model does (step_masks)
        self._filling: Future | None = None  # the last fill started there
        self.live: set[str] = set()  # sequences with a matcher: empty means no mask work at all
        self._errors: list[tuple[str, ErrorInfo]] = []

    # --- what the model runner calls --------------------------------------------------------------

    def on_new_seq(self, seq_id: str, params: SamplingParams, eos_ids: list[int]) -> SeqGrammar | None:
        """The matcher of a new sequence, or None (no constraint, or it cannot be enforced: then the
        sequence's error is reported with the step's result and the scheduler fails it)."""
        if params.structured_outputs is None:
            return None
        try:
            g = self.start(params.structured_outputs, eos_ids)
        except GrammarError as e:
            self._errors.append((seq_id, ErrorInfo(ErrorKind.GRAMMAR_ERROR, str(e), status=400,
                                                   param="structured_outputs")))
            return None
        self.live.add(seq_id)
        return g

    def forget(self, seq_id: str) -> None:
        self.live.discard(seq_id)

    def step_masks(self, rows: Sequence[Constrained]) -> PendingMasks | None:
        """Starts filling the bitmask of the step's sampled rows on the grammar thread, to overlap the forward
        pass (None, at no cost, when no row is constrained); the matchers must not move until its result()."""
        if not self.live:
            return None
        idx = [i for i, r in enumerate(rows) if r.grammar is not None]
        return self._start_fill(idx, [rows[i].grammar for i in idx], background=True) if idx else None

    def advance(self, seq_ids: list[str], rows: Sequence[Constrained], tokens: list[int]) -> None:
        """Each sampled (or forced) token advances its sequence's matcher once."""
        if not self.live:
            return
        if self._filling is not None:  # normally done already: the runner sampled with its result
            self._filling.exception()
            self._filling = None
        eos = self.eos_token
        for sid, r, tok in zip(seq_ids, rows, tokens):
            g = r.grammar
            if g is not None and not g.accept(tok, eos):
                self._errors.append((sid, ErrorInfo(
                    ErrorKind.GRAMMAR_REJECTED, f"token {tok} is not allowed by the request's structured output "
                    f"constraint: {g.rejected}", status=400, param="trace_decode_token_ids")))

    def take_errors(self) -> list[tuple[str, ErrorInfo]]:
        errors, self._errors = self._errors, []
        return errors

    def build_in_background(self) -> None:
        """Start building the llguidance tokenizer (1-3 s for a 150k vocabulary, holding the GIL), so the
        worker does it while it loads the model, never inside a step; `wait_ready` joins it. The worker calls
        both before it joins the bus (a thread holding the GIL for seconds would starve its heartbeats)."""
        if self.tokenizer_path is None or not self.tokenizer_path.is_file() or self._builder is not None:
            return
        self._builder = threading.Thread(target=self._build, name="grammar-tokenizer", daemon=True)
        self._builder.start()

    def wait_ready(self) -> None:
        if self._builder is not None:
            self._builder.join()

    def _build(self) -> None:
        import llguidance

        try:
            tok = llguidance.LLTokenizer(self.tokenizer_path.read_text(encoding="utf-8"), n_vocab=self.vocab_size)
            # the first mask with a tokenizer builds llguidance's token tables (seconds for a 150k vocabulary):
            # done here, once, so no step pays for it
            warm = llguidance.LLMatcher(tok, llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}),
                                        log_level=0)
            warm.consume_tokens(tok.tokenize_str('{"a": "b'))
            warm.compute_bitmask()
            self._tok = tok
        except Exception as e:  # noqa: BLE001 - an unusual tokenizer: constrained requests fail, nothing else
            self._tok_error = f"the grammar engine cannot read this model's tokenizer: {e}"

    def _tokenizer(self):
        if self._tok is None:
            self.wait_ready()
            if self._tok is None and self._tok_error is None:
                self._build()  # not started in the background (a runner built directly, as in tests)
        if self._tok is None:
            raise GrammarError(self._tok_error or "structured outputs need the model's tokenizer.json, which this "
                                                  f"worker does not have ({self.tokenizer_path})")
        return self._tok

    def start(self, so: StructuredOutputsParams, eos_ids: list[int]) -> SeqGrammar:
        """A fresh matcher for a new sequence (raises GrammarError)."""
        import llguidance

        tok = self._tokenizer()
        try:
            text = grammar_text(self.config.apply(so))
        except ValueError as e:  # ParamError: the gateway refuses these; a bus peer may not have
            raise GrammarError(str(e)) from None
        base = self._compiled.get(text)
        if base is None:
            base = llguidance.LLMatcher(tok, text, log_level=0)
            if base.is_error():
                raise GrammarError(f"the grammar does not compile: {base.get_error()}")
            self._compiled[text] = base
            if len(self._compiled) > COMPILED_CACHE:
                self._compiled.popitem(last=False)
        else:
            self._compiled.move_to_end(text)
        return SeqGrammar(base.deep_copy(), frozenset(eos_ids))

    @property
    def eos_token(self) -> int:
        return int(self._tok.eos_token) if self._tok is not None else -1

    def fill(self, rows: list[int], grammars: list[SeqGrammar]) -> StepMasks | None:
        """The bitmask of the sampled rows whose matcher still constrains (None when there are none), now."""
        pending = self._start_fill(rows, grammars, background=False)
        return pending.result() if pending is not None else None

    def _start_fill(self, rows: list[int], grammars: list[SeqGrammar], background: bool) -> PendingMasks | None:
        live = [(i, g) for i, g in zip(rows, grammars) if not g.terminated]
        if not live:
            return None
        import llguidance

        if self._executor is None:
            # one thread: a pool on a busy host costs more than it saves; the point is the released GIL.
            # (llguidance.torch is not imported: it runs torch.compile at import, seconds.)
            self._executor = llguidance.LLExecutor(num_threads=1)
        bitmask = torch.empty(len(live), self.words, dtype=torch.int32)
        # llguidance writes row k's words at data_ptr + k * row bytes
        args = ([(g.matcher, k) for k, (_, g) in enumerate(live)], bitmask.data_ptr(), self.words * 4, len(live))
        if not background:
            self._executor.unsafe_compute_mask_ptr(*args)
            return PendingMasks(self, live, bitmask, None)
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar-masks")
        self._filling = self._thread.submit(self._executor.unsafe_compute_mask_ptr, *args)
        return PendingMasks(self, live, bitmask, self._filling)

    def finish_masks(self, live: list[tuple[int, SeqGrammar]], bitmask: torch.Tensor) -> StepMasks:
        """The filled bitmask, with the grammar's EOS bit standing for the request's EOS ids."""
        eos = self.eos_token
        words = bitmask.numpy().view(np.uint32)
        for k, (_, g) in enumerate(live):
            w = words[k]
            if g.eos_ids and 0 <= eos < self.vocab_size and (int(w[eos >> 5]) >> (eos & 31)) & 1:
                w[eos >> 5] &= np.uint32(~(1 << (eos & 31)) & 0xFFFFFFFF)
                for t in g.eos_ids:
                    if 0 <= t < self.vocab_size:
                        w[t >> 5] |= np.uint32(1 << (t & 31))
        return StepMasks([i for i, _ in live], bitmask)


def apply_masks(z: torch.Tensor, masks: StepMasks) -> torch.Tensor:
    """The logits [S, V] with -inf in each masked row where its bitmask has a 0 bit, as a new tensor (`z` is
    not modified): the words are inverted (tiny), unpacked to one byte per token and viewed as bool, and one
    torch.where writes the result. One pass that writes fresh memory costs about half of a copy followed by
    an in-place masked_fill (whose conditional stores are slow on CPU); the values are the same bits."""
    n, v = z.shape
    banned = np.unpackbits((~masks.bitmask.numpy()).view(np.uint8), axis=1, bitorder="little")[:, :v]
    if len(masks.rows) == n:
        ban = torch.from_numpy(banned.view(np.bool_))
    else:  # rows without a mask ban nothing
        ban = torch.zeros(n, v, dtype=torch.bool)
        ban.numpy()[masks.rows] = banned.view(np.bool_)
    return torch.where(ban, float("-inf"), z)
