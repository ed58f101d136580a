"""engine.scheduler.step_gate: when the scheduler may step, as a pure state machine over typed commands."""

from __future__ import annotations

from bus.control_state import reduce
from bus.messages import (
    AbortWeightUpdate,
    AlreadyQuiet,
    CommitWeightUpdate,
    ControlState,
    Health,
    Pause,
    Resume,
    Resumed,
    Sleep,
    SleepingTags,
    StartWeightUpdate,
    WakeUp,
    WeightEpoch,
)
from engine.scheduler.step_gate import Quiesce, StepGate


class Engine:
    """The gate plus the control state, advanced as the follower does: reduce, then ask the gate."""

    def __init__(self, state: ControlState | None = None):
        self.state = state or ControlState()
        self.gate = StepGate.from_state(self.state)

    def send(self, cmd):
        before, self.state = self.state, reduce(self.state, cmd)
        return self.gate.on_command(cmd, before, self.state)

    def may_step(self, in_flight=False, has_work=True) -> bool:
        return self.gate.may_step(self.state, in_flight=in_flight, has_work=has_work)


def test_steps_freely_when_nothing_holds():
    e = Engine()
    assert e.may_step() and not e.may_step(in_flight=True) and not e.may_step(has_work=False)
    assert e.send(Health()) is None and e.may_step()


def test_keep_pause_quiesces_and_holds_until_resume():
    e = Engine()
    q = e.send(Pause("keep", True))
    assert isinstance(q, Quiesce) and q.clear_cache and not e.may_step()
    assert e.gate.quiesced(in_flight=True, has_work=True) is None  # a step still runs: the ack waits
    assert e.gate.quiesced(in_flight=False, has_work=True) is q and e.gate.pending is None
    assert e.send(Pause("abort")) == AlreadyQuiet()  # pausing twice: a no-op, the first mode stays
    assert e.gate.quiet == "keep"
    assert e.send(Resume()) == Resumed() and e.may_step()


def test_wait_pause_steps_until_the_work_is_done():
    e = Engine()
    assert isinstance(e.send(Pause("wait", False)), Quiesce)
    assert e.may_step()  # running requests finish
    assert e.gate.quiesced(in_flight=False, has_work=True) is None
    assert e.gate.quiesced(in_flight=False, has_work=False) is not None


def test_abort_pause_quiesces_in_abort_mode():
    e = Engine()
    q = e.send(Pause("abort", True))
    assert q.mode == "abort" and e.may_step()  # nothing is left to step; new requests are refused elsewhere


def test_sleep_holds_every_mode_and_wake_up_ends_it():
    e = Engine()
    q = e.send(Sleep(1, "abort"))
    assert isinstance(q, Quiesce) and q.clear_cache  # levels 1 and 2 drop the KV
    assert not e.may_step()  # asleep: no step whatever the mode
    assert e.send(Sleep(2)) == AlreadyQuiet()
    assert e.send(WakeUp(["kv_cache"])) == SleepingTags(["weights"]) and not e.may_step()
    assert e.send(WakeUp(None)) == SleepingTags([]) and e.may_step()
    assert not Engine().send(Sleep(0, "keep")).clear_cache  # level 0 keeps the KV


def test_a_pause_taken_during_a_sleep_outlives_the_wake_up():
    e = Engine()
    e.send(Sleep(1, "keep"))
    assert e.send(Pause("keep")) == AlreadyQuiet()  # already quiet
    e.send(WakeUp(None))
    assert not e.may_step()
    e.send(Resume())
    assert e.may_step()


def test_resume_during_a_sleep_then_wake_up_steps_again():
    """pause, sleep, resume, wake: nothing holds the engine any more, so it steps (the actor's old flags
    kept it paused here for good)."""
    e = Engine()
    e.send(Pause("keep"))
    e.send(Sleep(1))
    e.send(Resume())
    assert not e.may_step()  # still asleep
    e.send(WakeUp(None))
    assert e.may_step()


def test_weight_update_window_holds_steps_until_commit_or_abort():
    for end in (CommitWeightUpdate("v2"), AbortWeightUpdate()):
        e = Engine()
        q = e.send(StartWeightUpdate())
        assert q == Quiesce("keep", False) and not e.may_step()
        assert e.send(end) == WeightEpoch(1 if isinstance(end, CommitWeightUpdate) else 0)
        assert e.may_step()


def test_a_weight_update_inside_a_pause_keeps_the_pause():
    e = Engine()
    e.send(Pause("keep"))
    assert e.send(StartWeightUpdate()) == AlreadyQuiet()
    e.send(CommitWeightUpdate(""))
    assert not e.may_step()  # the user's pause still holds
    e.send(Resume())
    assert e.may_step()
    e = Engine()
    e.send(StartWeightUpdate())
    e.send(Pause("keep"))
    e.send(Resume())
    assert not e.may_step()  # the update's window still holds


def test_a_late_scheduler_starts_quiet_from_the_snapshot():
    assert Engine(reduce(ControlState(), Pause("wait"))).gate.quiet == "wait"
    assert Engine(reduce(ControlState(), Sleep(1))).gate.quiet == "keep"
    assert Engine(reduce(ControlState(), StartWeightUpdate())).gate.quiet == "keep"
    assert Engine().gate.quiet is None


def test_a_sleep_inside_a_keep_pause_drops_or_keeps_the_frozen_requests_kv():
    """pause(keep) then sleep: the workers are about to release the KV cache, so the frozen requests either
    drop their KV (recomputed after the quiet) or, with offload_kv (SkyRL's sleep_for_weight_sync), keep it
    and the ack names their blocks (keep_kv). Before, a sleep inside a pause left their KV tables pointing
    at a cache the workers had released."""
    for offload, level in ((False, 1), (False, 2), (True, 2), (True, 1)):
        e = Engine()
        e.send(Pause("keep", False))
        e.gate.quiesced(in_flight=False, has_work=True)  # the pause's quiesce completed
        q = e.send(Sleep(level, "keep", offload))
        assert q == Quiesce("keep", not offload, keep_kv=offload) and e.gate.quiet == "keep"
        assert e.gate.quiesced(in_flight=False, has_work=True) is q and not e.may_step()
        e.send(WakeUp(["weights"]))
        e.send(WakeUp(["kv_cache"]))
        assert not e.may_step()  # the pause holds until /resume
        e.send(Resume())
        assert e.may_step()
    e = Engine()
    e.send(Pause("keep", False))
    assert e.send(Sleep(0, "keep", True)) == AlreadyQuiet()  # level 0 releases nothing
    q = Engine().send(Sleep(2, "keep", True))  # not paused: the sleep's own keep quiesce keeps the KV
    assert q == Quiesce("keep", False, keep_kv=True)
