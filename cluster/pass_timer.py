"""How long forward passes take where they run, for the speeds that size prefill chunks and that
the router's cost model is fitted on.

On the CPU a pass has ended when its call returns: its seconds are known at once. On a GPU the
call returns as soon as the pass is queued, so the host's clock would time the launch only (tens
of microseconds for a CUDA-graph replay). There the timer records a CUDA event before and after
the pass and reads them once the device has reached the second, which ``collect`` checks at the
next pass: timing never waits for the device.

A pass given a floor (an emulated device's time for it: ``EngineConfig.pace``) lasts at least that
long, sleeping the rest; its time is the floor's then, as the device it emulates would report.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

__all__ = ["PassTimer"]

MAX_PENDING = 256  # passes whose events are not read yet (the oldest are dropped past this)


class PassTimer:
    def __init__(self, device: torch.device | str = "cpu", clock: Callable[[], float] = time.perf_counter,
                 event: Callable[[], object] | None = None, sleep: Callable[[float], None] = time.sleep) -> None:
        """``clock``: the host's seconds (CPU passes); ``event()``: a new device event with
        ``record()``, ``query()`` and ``elapsed_time(end)`` in ms (default: a timing CUDA event);
        ``sleep``: waits out a floor (CPU passes)."""
        self.on_device = torch.device(device).type == "cuda"
        self._clock = clock
        self._sleep = sleep
        self._event = event or (lambda: torch.cuda.Event(enable_timing=True))
        self._pending: deque[tuple[object, object, Callable[[float], None]]] = deque(maxlen=MAX_PENDING)

    @contextmanager
    def timed(self, done: Callable[[float], None], floor_s: float = 0.0) -> Iterator[None]:
        """Time the block's pass: ``done(seconds)`` is called once it is known (on a GPU, at a
        later pass). ``floor_s``: the least the pass lasts (CPU passes only)."""
        self.collect()
        if not self.on_device:
            t0 = self._clock()
            yield
            left = floor_s - (self._clock() - t0)
            if left > 0:
                self._sleep(left)
            done(self._clock() - t0)
            return
        if floor_s:
            raise ValueError("a pass's floor emulates a device on the CPU; a GPU pass takes its own time")
        start = self._event()
        start.record()
        yield
        end = self._event()
        end.record()
        self._pending.append((start, end, done))

    def collect(self) -> None:
        """Report every pass whose end the device has reached, in order."""
        while self._pending and self._pending[0][1].query():
            start, end, done = self._pending.popleft()
            done(start.elapsed_time(end) / 1e3)
