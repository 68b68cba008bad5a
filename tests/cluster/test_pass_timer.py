"""Passes are timed where they run (``cluster.pass_timer``): on the CPU by the clock around the
call; on a GPU by device events read a pass later, never by the launch's time."""

from __future__ import annotations

import pytest

from cluster.pass_timer import PassTimer


class FakeDevice:
    """A device whose queue the test advances: events record the device's time when it gets
    there (``run``), and ``query`` says whether it has."""

    def __init__(self) -> None:
        self.now_ms, self.queue, self.done = 0.0, [], set()

    def event(self):
        device = self

        class Event:
            def record(self):
                device.queue.append(self)

            def query(self):
                return self in device.done

            def elapsed_time(self, end):
                return end.at - self.at

        return Event()

    def run(self, ms: float) -> None:
        """The device works through its queue: each pass takes ``ms``."""
        for i, ev in enumerate(self.queue):
            if i % 2:  # an end event: the pass ran
                self.now_ms += ms
            ev.at = self.now_ms
            self.done.add(ev)
        self.queue.clear()


def test_a_gpu_pass_is_timed_by_its_events_a_pass_later_not_by_its_launch():
    device, host, seen = FakeDevice(), [0.0], []
    timer = PassTimer("cuda", clock=lambda: host[0], event=device.event)
    with timer.timed(seen.append):
        host[0] += 0.00003  # the launch returns at once
    assert seen == []  # not read yet: reading it now would wait for the device
    device.run(ms=80.0)
    with timer.timed(seen.append):  # the next pass reads the last one's events
        pass
    assert seen == [0.08]
    timer.collect()
    assert seen == [0.08]  # the second pass's events are not reached yet
    device.run(ms=5.0)
    timer.collect()
    assert seen == [0.08, 0.005]


def test_a_cpu_pass_is_timed_by_the_clock_around_it():
    now, seen = [1.0], []
    timer = PassTimer("cpu", clock=lambda: now[0], event=lambda: (_ for _ in ()).throw(AssertionError("no events")))
    with timer.timed(seen.append):
        now[0] += 0.25
    assert seen == [0.25]


def test_a_cpu_pass_with_a_floor_sleeps_the_rest_and_reports_the_floor():
    now, seen, slept = [1.0], [], []

    def sleep(s: float) -> None:
        slept.append(s)
        now[0] += s

    timer = PassTimer("cpu", clock=lambda: now[0], sleep=sleep)
    with timer.timed(seen.append, floor_s=0.25):
        now[0] += 0.1
    assert slept == [pytest.approx(0.15)] and seen == [pytest.approx(0.25)]
    with timer.timed(seen.append, floor_s=0.25):  # a pass longer than its floor takes its own time
        now[0] += 0.4
    assert len(slept) == 1 and seen[-1] == pytest.approx(0.4)


def test_a_gpu_pass_refuses_a_floor():
    timer = PassTimer("cuda", clock=lambda: 0.0, event=FakeDevice().event)
    with pytest.raises(ValueError, match="emulates a device on the CPU"), timer.timed(lambda s: None, floor_s=0.1):
        pass
