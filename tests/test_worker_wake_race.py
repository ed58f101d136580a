"""A step plan can overtake the wake_up command sent before it: plans and commands travel on different
sockets. A real worker process between a fake coordinator and a fake scheduler (tests/test_bus_bad_input.py)
gets a plan while its memory is released; it must wait for the wake, then compute the plan on the restored
memory, never crash or compute on released memory (the regression: _await_wake was deleted while its call
stayed, and such a plan killed the worker with AttributeError)."""

from __future__ import annotations

import time

from bus.codec import decode
from bus.endpoints import COMMAND_TOPIC, PLAN_TOPIC
from bus.messages import Ack, Command, ReleaseMemory, StepResult, WakeUp
from bus.sockets import send
from tests.test_bus_bad_input import _next, lone_worker, plan_of


def test_a_plan_that_overtakes_its_wake_up_waits_for_it_then_computes(tmp_path):
    with lone_worker(tmp_path) as (coord, sched, proc, log_path):
        assert sched.run(plan_of(1, "s1")).error is None  # awake: computes
        send(coord.pub, Command(1, ReleaseMemory(1)), topic=COMMAND_TOPIC)
        ack = _next(coord, Ack)
        assert ack.seq == 1 and ack.ok, ack
        # the plan first; the wake only once the worker is waiting for it (its log says so)
        send(sched.plans, plan_of(2, "s2"), topic=PLAN_TOPIC)
        deadline = time.monotonic() + 20
        while "worker.plan_before_wake" not in log_path.read_text():
            assert time.monotonic() < deadline and proc.poll() is None, log_path.read_text()[-3000:]
            time.sleep(0.05)  # polling the log file for a condition, with a deadline
        send(coord.pub, Command(2, WakeUp()), topic=COMMAND_TOPIC)
        deadline = time.monotonic() + 30
        res = None
        while res is None:
            assert time.monotonic() < deadline, "no result for the plan that waited for its wake"
            if sched.results.poll(100):
                msg = decode(sched.results.recv_multipart())
                if isinstance(msg, StepResult) and msg.step_id == 2:
                    res = msg
        assert res.error is None and res.seq_ids == ["s2"] and res.token_ids.shape == (1,), res
        assert proc.poll() is None
        assert "Traceback" not in log_path.read_text()
