"""Waiting for a condition instead of sleeping a fixed time: poll it until it holds or a deadline
passes (then the test fails naming what it waited for)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def until(condition: Callable[[], T], within_s: float, what: str, every_s: float = 0.1) -> T:
    """Call ``condition`` every ``every_s`` seconds until it returns something true, and return
    that; fail the test after ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"waited {within_s} s for {what}; the last check gave {value!r}")
        time.sleep(every_s)
