"""An event loop on a clock the test moves (issue 27): a timer armed with `loop.call_later` fires when the
test advances the clock past it, never by itself, so a timer test sleeps for nothing and cannot race a slow
machine.

- `FakeClockLoop.time()` starts at 1000.0 and moves only in `advance()`; give the coordinator `loop.time` as
  its monotonic clock and both see the same time.
- `settle()` runs everything that can run without the clock moving: ready callbacks, and work in worker
  threads (`run_in_executor`, `asyncio.to_thread`: a save's commit), waited for in real time.
- `advance(s)` moves the clock `s` seconds on, stopping at each timer due by then, in order, and settling
  after each, so what one timer starts runs before the next one fires.
- `on_fake_clock` runs an `async def` test on a fresh FakeClockLoop (pytest-asyncio's loop keeps real time).

On this loop `asyncio.sleep(x)` with x > 0 returns only once the test advances the clock by x: a test waits
with `settle()` / `advance()`, never a sleep. A test that waits for a clock nobody moves fails after
`REAL_LIMIT_S` real seconds, showing where it waited, rather than hang.
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import Executor
from typing import Any, ParamSpec, TypeVar, TypeVarTuple

P = ParamSpec("P")
T = TypeVar("T")
Ts = TypeVarTuple("Ts")
REAL_LIMIT_S = 20.0
_SETTLE_ROUNDS_MAX = 100_000  # a callback chain that never ends is a bug in the test, not a wait


class FakeClockLoop(asyncio.SelectorEventLoop):
    def __init__(self) -> None:
        super().__init__()
        self._now = 1000.0
        self._in_threads: set[asyncio.Future[Any]] = set()

    def time(self) -> float:
        return self._now

    def run_in_executor(
        self, executor: Executor | None, func: Callable[[*Ts], T], *args: *Ts
    ) -> asyncio.Future[T]:
        future = super().run_in_executor(executor, func, *args)
        self._in_threads.add(future)
        future.add_done_callback(self._in_threads.discard)
        return future

    def _next_timer(self) -> float | None:
        # The loop's own heap of timers (CPython's BaseEventLoop._scheduled); cancelled ones may linger.
        pending = [h.when() for h in self._scheduled if not h.cancelled()]  # type: ignore[attr-defined]
        return min(pending) if pending else None

    def _idle(self) -> bool:
        """Nothing is ready to run besides the caller (CPython's BaseEventLoop._ready) or in a thread."""
        return not self._ready and not self._in_threads  # type: ignore[attr-defined]

    async def settle(self) -> None:
        """Run until nothing can happen without the clock moving."""
        for _ in range(_SETTLE_ROUNDS_MAX):
            if self._in_threads:
                await asyncio.wait(set(self._in_threads))  # real time: the thread wakes the loop
                continue
            await asyncio.sleep(0)
            if self._idle():
                return
        raise AssertionError("the loop never settled: a callback chain that does not end")

    async def advance(self, seconds: float) -> None:
        """Move the clock `seconds` on, firing each timer due by then at its own time, in order."""
        assert seconds >= 0
        target = self._now + seconds
        await self.settle()
        while (when := self._next_timer()) is not None and when <= target:
            self._now = max(self._now, when)
            await self.settle()
        self._now = target
        await self.settle()

    async def advance_to(self, when: float) -> None:
        await self.advance(max(0.0, when - self._now))

    async def run_until(self, check: Callable[[], object], *, within_s: float, what: str) -> None:
        """Advance timer by timer until `check()` holds; fail once `within_s` clock seconds have passed."""
        deadline = self._now + within_s
        await self.settle()
        while not check():
            when = self._next_timer()
            if when is None or when > deadline:
                raise AssertionError(f"not within {within_s}s of the test's clock: {what}")
            await self.advance_to(when)


def fake_clock() -> FakeClockLoop:
    """The running loop, which must be a FakeClockLoop (the test is decorated with `on_fake_clock`)."""
    loop = asyncio.get_running_loop()
    assert isinstance(loop, FakeClockLoop), "decorate the test with @on_fake_clock"
    return loop


def on_fake_clock(test: Callable[P, Coroutine[Any, Any, None]]) -> Callable[P, None]:
    """Run an async test on its own FakeClockLoop. Its fixtures must be synchronous (tmp_path, monkeypatch):
    an async fixture would run on pytest-asyncio's real-time loop."""

    @functools.wraps(test)
    def run(*args: P.args, **kwargs: P.kwargs) -> None:
        with asyncio.Runner(loop_factory=FakeClockLoop) as runner:
            runner.run(_watched(test(*args, **kwargs)))

    return run


async def _watched(body: Coroutine[Any, Any, None]) -> None:
    """Run `body`, cancelled (a failure showing where it waited) after REAL_LIMIT_S real seconds."""
    loop, task = asyncio.get_running_loop(), asyncio.current_task()
    assert task is not None
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        loop.call_soon_threadsafe(task.cancel)

    watchdog = threading.Timer(REAL_LIMIT_S, expire)
    watchdog.daemon = True
    watchdog.start()
    try:
        await body
    except asyncio.CancelledError as e:
        if expired.is_set():
            raise AssertionError(f"waited {REAL_LIMIT_S}s of real time for a clock nobody moved") from e
        raise
    finally:
        watchdog.cancel()
