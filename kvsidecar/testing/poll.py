"""Waiting until something holds, for tests, the benchmarks and the local fleet: the one polling helper.

`eventually` (blocking) and `until` (async) call `check` until it returns a truthy value, which they return,
and fail with an AssertionError naming `what` once `timeout_s` has passed. A check that raises ends the
wait with its exception: it can say "this will never hold" (a process that exited) instead of waiting out
the deadline.

The deadline is wall-clock time (`time.monotonic`), never the event loop's clock: a test on the fake loop
clock (tests/unit/clock.py) moves only when it says so, and a wait bounded by that clock would never end.
There, poll with `interval_s=0`: each round then yields one loop step, never a timer the test must advance.
The defaults only bound a broken run; a passing one returns as soon as the check holds: 20 s for other
processes (a daemon, llama-server, Redis), 10 s for what runs on this event loop.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar, overload

T = TypeVar("T")


def eventually(
    check: Callable[[], T | None],
    *,
    timeout_s: float = 20.0,
    interval_s: float = 0.05,
    what: str = "the condition",
) -> T:
    """Call `check` every `interval_s` until it returns a truthy value (returned); fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last: {value!r})")
        time.sleep(interval_s)


@overload
async def until(
    check: Callable[[], Awaitable[T | None]],
    *,
    timeout_s: float = ...,
    interval_s: float = ...,
    what: str = "the condition",
) -> T: ...


@overload
async def until(
    check: Callable[[], T | None],
    *,
    timeout_s: float = ...,
    interval_s: float = ...,
    what: str = "the condition",
) -> T: ...


async def until(
    check: Callable[[], object],
    *,
    timeout_s: float = 10.0,
    interval_s: float = 0.01,
    what: str = "the condition",
) -> object:
    """`eventually` on the event loop: `check` may be a coroutine function; between calls the loop runs."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = check()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s}s waiting for {what} (last: {value!r})")
        await asyncio.sleep(interval_s)
