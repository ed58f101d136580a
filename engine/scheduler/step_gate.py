"""When the scheduler may step: one pure state machine over the control commands (no sockets, no
sequences). The scheduler actor asks it what a command means and whether to start the next step; the
scheduler (engine.scheduler.policy) does what it decides to the sequences (abort them all, drop their KV).

A *quiet* starts when the first of these holds the engine and ends when none holds it any more:
a user pause (/pause), a sleep (/sleep), a weight-update window (start_weight_update until its commit
or abort). Its mode is the mode of the command that started it; later holders do not change it:

    abort: every request ends now (finish_reason abort); new ones are refused (paused) or queue (sleep)
    wait:  running requests finish; new ones are refused; the quiesce completes when nothing is left
    keep:  nothing is stepped; requests (and new ones) wait for the end of the quiet

Starting a quiet is a *quiesce*: its ack is deferred until no step is in flight (and, for wait, no
work is left), because whoever paused may then change the weights or free the memory under them. With
clear_cache (a pause's flag; sleep levels 1 and 2 always) the kept requests lose their KV when the
quiesce completes, so nothing computed under the old weights is reused. While the engine sleeps no
step runs whatever the mode.

A sleep from level 1 inside a quiet (a keep pause first, then /sleep or SkyRL's sleep_for_weight_sync)
acts on the kept requests as well: the workers are about to release the KV cache, so either the kept
requests drop their KV (recomputed from their tokens after the quiet) or, with offload_kv, they keep it
(keep_kv: the workers copy their blocks to the host and put them back on wake) and only the prefix cache
of blocks nobody holds is forgotten.
"""

from __future__ import annotations

from dataclasses import dataclass

from bus.messages import (
    AbortWeightUpdate,
    AlreadyQuiet,
    CommandBody,
    CommitWeightUpdate,
    ControlState,
    Pause,
    Resume,
    Resumed,
    Sleep,
    SleepingTags,
    StartWeightUpdate,
    WakeUp,
    WeightEpoch,
)


@dataclass(slots=True)
class Quiesce:
    """A quiet that started: the actor aborts every request when mode is abort, then acks once
    `StepGate.quiesced` says so (clearing the KV first when clear_cache)."""

    mode: str
    clear_cache: bool
    aborted: int = 0
    keep_kv: bool = False  # the workers offload the kept requests' KV: the ack names the blocks they hold


@dataclass(slots=True)
class StepGate:
    quiet: str | None = None  # abort | wait | keep while something holds the engine
    pending: Quiesce | None = None  # the quiesce whose ack is still owed

    @classmethod
    def from_state(cls, state: ControlState) -> "StepGate":
        """A scheduler that joins a paused, sleeping or updating engine starts quiet."""
        if state.paused is not None:
            return cls(state.paused.mode)
        if state.sleeping_tags or state.weight_update_active:
            return cls("keep")
        return cls()

    def on_command(self, cmd: CommandBody, before: ControlState, after: ControlState
                   ) -> AlreadyQuiet | Resumed | SleepingTags | WeightEpoch | Quiesce | None:
        """What a command means for stepping, given the control state before and after it: the ack's
        result now, a Quiesce to carry out, or None when the command does not concern stepping."""
        if isinstance(cmd, Pause):
            if before.paused is not None or self.quiet is not None:
                return AlreadyQuiet()  # pausing twice is a no-op; a quiet in force already holds it
            return self._quiesce(cmd.mode, cmd.clear_cache)
        if isinstance(cmd, Resume):
            self._end_if_free(after)
            return Resumed()
        if isinstance(cmd, Sleep):
            if before.sleeping_tags or (self.quiet is not None and cmd.level == 0):
                return AlreadyQuiet()  # asleep already, or held by a pause: nothing to quiesce
            # from level 1 the workers release the KV cache: the kept requests drop their KV, or keep it
            # offloaded (offload_kv); held by a pause already, that is all there is to do (nothing steps)
            keep = cmd.level >= 1 and cmd.offload_kv
            if self.quiet is not None:
                self.pending = Quiesce(self.quiet, clear_cache=cmd.level >= 1 and not keep, keep_kv=keep)
                return self.pending
            return self._quiesce(cmd.mode, cmd.level >= 1 and not keep, keep_kv=keep)
        if isinstance(cmd, WakeUp):
            self._end_if_free(after)
            return SleepingTags(list(after.sleeping_tags))
        if isinstance(cmd, StartWeightUpdate):
            # no token is computed on half-written weights: requests queue, running ones keep their KV
            if self.quiet is not None:
                return AlreadyQuiet()
            return self._quiesce("keep", False)
        if isinstance(cmd, (CommitWeightUpdate, AbortWeightUpdate)):
            self._end_if_free(after)
            return WeightEpoch(after.weight_epoch)
        return None

    def may_step(self, state: ControlState, *, in_flight: bool, has_work: bool) -> bool:
        return not in_flight and has_work and self.quiet != "keep" and not state.sleeping_tags

    def quiesced(self, *, in_flight: bool, has_work: bool) -> Quiesce | None:
        """The pending quiesce once it is complete (then it is no longer pending), else None."""
        p = self.pending
        if p is None or in_flight or (p.mode == "wait" and has_work):
            return None
        self.pending = None
        return p

    def _quiesce(self, mode: str, clear_cache: bool, keep_kv: bool = False) -> Quiesce:
        self.quiet = mode
        self.pending = Quiesce(mode, clear_cache, keep_kv=keep_kv)
        return self.pending

    def _end_if_free(self, state: ControlState) -> None:
        """The quiet ends once no pause, sleep or weight update holds the engine any more."""
        if state.paused is None and not state.sleeping_tags and not state.weight_update_active:
            self.quiet = None
