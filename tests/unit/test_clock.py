"""The fake loop clock of the timer tests (tests/unit/clock.py): timers fire when the test moves the clock,
in order, never by real time; work in threads is waited for; a wait nobody can end fails."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.unit import clock as clock_module
from tests.unit.clock import fake_clock, on_fake_clock


@on_fake_clock
async def test_a_timer_fires_when_the_clock_is_moved_past_it_and_not_before() -> None:
    clock, fired = fake_clock(), list[str]()
    start = clock.time()
    clock.call_later(0.5, fired.append, "late")
    clock.call_later(0.2, fired.append, "early")
    real = time.monotonic()
    await clock.advance(0.19)
    assert fired == [] and clock.time() == start + 0.19
    await clock.advance(0.01)
    assert fired == ["early"]
    await clock.advance(3600)
    assert fired == ["early", "late"] and clock.time() == start + 3600.2
    assert time.monotonic() - real < 1.0  # an hour of the clock, no real sleep


@on_fake_clock
async def test_what_a_timer_starts_runs_before_the_next_timer_fires() -> None:
    clock, seen = fake_clock(), list[tuple[str, float]]()

    async def chain() -> None:
        seen.append(("first", clock.time()))
        await asyncio.sleep(0.1)  # a timer of the fake clock, armed by what the first one started
        seen.append(("second", clock.time()))

    clock.call_later(1.0, lambda: asyncio.ensure_future(chain()))
    clock.call_later(1.05, lambda: seen.append(("between", clock.time())))
    await clock.advance(2.0)
    assert [s for s, _ in seen] == ["first", "between", "second"]
    assert [t - seen[0][1] for _, t in seen] == pytest.approx([0.0, 0.05, 0.1])


@on_fake_clock
async def test_settle_waits_for_work_in_threads_without_moving_the_clock() -> None:
    clock = fake_clock()
    start = clock.time()
    done = asyncio.ensure_future(asyncio.to_thread(time.sleep, 0.05))
    await clock.settle()
    assert done.done() and clock.time() == start


@on_fake_clock
async def test_run_until_fails_past_its_bound_of_the_clock() -> None:
    clock = fake_clock()
    flag: list[bool] = []
    clock.call_later(2.0, flag.append, True)
    with pytest.raises(AssertionError, match=r"not within 1\.0s"):
        await clock.run_until(lambda: flag, within_s=1.0, what="the flag")
    await clock.run_until(lambda: flag, within_s=2.0, what="the flag")


def test_a_wait_for_a_clock_nobody_moves_fails_instead_of_hanging(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(clock_module, "REAL_LIMIT_S", 0.2)

    @on_fake_clock
    async def stuck() -> None:
        await asyncio.sleep(1.0)  # nobody advances the clock

    with pytest.raises(AssertionError, match="clock nobody moved"):
        stuck()


async def test_pytest_asyncio_tests_keep_their_real_time_loop() -> None:
    assert not isinstance(asyncio.get_running_loop(), clock_module.FakeClockLoop)
