"""Waiting in tests without racing the clock.

On a loaded 2-core machine what takes milliseconds when idle can take seconds (one
real-model forward ~1.8 s), so a test never sleeps a fixed time and then asserts that
something happened: it polls the condition until a deadline far above the worst case
(:func:`wait_until`, :func:`async_wait_until`), or injects a clock it advances itself.
"""

from __future__ import annotations

import asyncio
import time
from typing import Callable, TypeVar

T = TypeVar("T")

DEADLINE_S = 60.0  # generous: only a hang should ever reach it


def wait_until(cond: Callable[[], T], what: str, timeout_s: float = DEADLINE_S, interval_s: float = 0.02) -> T:
    """Poll ``cond()`` every ``interval_s`` seconds until it is truthy; return its value.

    Raises:
        AssertionError: ``cond()`` still falsy after ``timeout_s`` seconds (``what`` says of what).
    """
    deadline = time.monotonic() + timeout_s
    while not (value := cond()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(interval_s)
    return value


async def async_wait_until(cond: Callable[[], T], what: str, timeout_s: float = DEADLINE_S,
                           interval_s: float = 0.005) -> T:
    """:func:`wait_until` for coroutines: polls with ``asyncio.sleep`` so the loop keeps running."""
    deadline = time.monotonic() + timeout_s
    while not (value := cond()):
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        await asyncio.sleep(interval_s)
    return value
