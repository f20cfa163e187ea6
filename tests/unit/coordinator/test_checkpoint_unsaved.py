"""Issue 26 E on the fake engine, with a clock the test moves: a session that keeps its slot and calls more
often than `idle_s` is saved in the background within `checkpoint.max_unsaved_s` / `max_unsaved_turns`,
only while its server is idle, and its unsaved age and tokens are in the views and in /metrics.

No real sleeps decide anything here: the coordinator's monotonic clock is the test's, and `until` only
waits for a save already started (its commit runs in a worker thread)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from kvsidecar.coordinator.checkpoint import PROTECT_FORCED, PROTECT_PREDICTED
from kvsidecar.coordinator.state import Outcome, SessionRuntime
from kvsidecar.fingerprint.llama_process import ProcessInfo
from kvsidecar.testing.poll import until
from tests.unit.coordinator_helpers import Harness, start_harness


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def rt_of(h: Harness, session: str) -> SessionRuntime:
    return next(rt for rt in h.coordinator.sessions.by_key.values() if rt.identity.session_id == session)


def saves(h: Harness, trigger: str) -> float:
    value: float = h.coordinator.metrics.save.labels("local", trigger)._value.get()
    return value


Start = Callable[..., Awaitable[Harness]]


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
async def start(tmp_path: Path, clock: Clock) -> AsyncIterator[Start]:
    """Factory: a harness on the test's clock (checkpoint keys as given, idle_s 30); each one closed."""
    made: list[Harness] = []

    async def make(*, slots: int = 1, **checkpoint: Any) -> Harness:
        mode = {"servers": {"local": {"mode": "managed-slots"}}} if slots > 1 else {}
        h = await start_harness(
            tmp_path / str(len(made)),
            total_slots=slots,
            monotonic=clock,
            checkpoint={"idle_s": 30, **checkpoint},
            **mode,
        )
        made.append(h)
        return h

    yield make
    for h in made:
        await h.coordinator.aclose()


async def turns_every(h: Harness, clock: Clock, session: str, n: int, every_s: float) -> None:
    for _ in range(n):
        await h.turn(session)
        clock.t += every_s


@pytest.fixture(params=["cost-aware", "save-before-evict"])
async def every_5s(request: pytest.FixtureRequest, start: Start) -> Harness:
    return await start(policy=request.param, max_unsaved_s=20)


async def test_a_session_calling_faster_than_idle_s_is_saved_within_the_bound(
    every_5s: Harness, clock: Clock
) -> None:
    """The case of the issue: a call every 5 s (idle_s is 30 s) used to leave the session unsaved for as
    long as it kept calling. Its first unsaved turn is at t0; at the first idle moment past t0 + 20 s it is
    saved, whatever the policy."""
    h = every_5s
    await turns_every(h, clock, "A", 4, 5.0)  # turns at t0 .. t0+15, all unsaved; it is t0+20 now
    a = rt_of(h, "A")
    assert "save" not in h.calls() and a.dirty
    view = h.coordinator.session_views("A")[0]
    assert view["unsaved_age_s"] == 20.0 and view["unsaved_turns"] == 4 and view["unsaved_tokens"] == 200
    slot = h.coordinator.status()["servers"][0]["slots"][0]
    assert slot["unsaved_age_s"] == 20.0 and slot["unsaved_tokens"] == 200
    await h.turn("A")  # t0 + 20: released past the bound, the server idle
    await until(lambda: not a.dirty, what="A saved in the background")
    assert h.calls() == ["save"] and saves(h, PROTECT_FORCED) == 1
    view = h.coordinator.session_views("A")[0]
    assert view["unsaved_age_s"] is None and view["unsaved_turns"] == 0 and view["unsaved_tokens"] == 0
    # and so on: at no release is its newest saved generation older than the bound (cost-aware may save it
    # sooner, from half the bound on, now that a save's time is known and short)
    slot_of_a = h.coordinator.servers["local"].slots[0]
    for _ in range(12):
        clock.t += 5.0
        await h.turn("A")
        await until(lambda: slot_of_a.free, what="any background save ended")
        age = a.unsaved_age_s(clock())
        assert age is None or age < 20
    assert saves(h, PROTECT_FORCED) + saves(h, PROTECT_PREDICTED) >= 3


async def test_a_crash_after_the_background_save_restores_the_session(start: Start, clock: Clock) -> None:
    """llama-server restarts (its slots come back empty): the session comes back `restored` from the
    background save, with only the turns since to recompute; before, it came back cold."""
    h = await start(max_unsaved_s=20)
    h.process[0] = ProcessInfo(pid=1, create_time=1.0, exe=None, cmdline=("llama-server",), flags={})
    srv = h.coordinator.servers["local"]
    await h.coordinator.guard.refresh(srv)
    await turns_every(h, clock, "A", 5, 5.0)
    await until(lambda: not rt_of(h, "A").dirty, what="A saved in the background")
    await h.turn("A")  # one more turn, unsaved
    h.fake.restart()  # the crash: a new process, every slot empty
    h.process[0] = ProcessInfo(pid=2, create_time=2.0, exe=None, cmdline=("llama-server",), flags={})
    await h.coordinator.guard.refresh(srv)
    h.calls()
    r, _, prompt_n, cache_n = await h.turn("A")
    assert r.outcome is Outcome.RESTORED and h.calls() == ["restore"]
    assert cache_n == 250 and prompt_n == 100  # the five saved turns reused; the lost one and this one


async def test_a_turn_bound_saves_every_n_turns(start: Start, clock: Clock) -> None:
    h = await start(policy="save-before-evict", max_unsaved_s=0, max_unsaved_turns=3)
    for expected in (0, 0, 1, 1, 1, 2):
        await h.turn("A")
        await until(lambda: h.coordinator.servers["local"].slots[0].free, what="a save ended")
        assert saves(h, PROTECT_FORCED) == expected


@pytest.mark.parametrize("policy", ["cost-aware", "save-before-evict"])
async def test_zero_disables_both_bounds(start: Start, clock: Clock, policy: str) -> None:
    """Both bounds 0: the behaviour before issue 26, even where a predicted save would be worth it."""
    h = await start(policy=policy, max_unsaved_s=0, max_unsaved_turns=0)
    await learned(h, clock, think_s=60.0)
    h.calls()
    await turns_every(h, clock, "A", 6, 60.0)
    await asyncio.sleep(0.05)
    assert "save" not in h.calls() and rt_of(h, "A").dirty


async def test_never_while_another_slot_works_and_never_in_its_way(start: Start, clock: Clock) -> None:
    """A past its bound while B's call runs: no save then (it would stop B's stream inside llama-server).
    It is saved at the idle moment B's release makes; B's next request, arriving during that save, gets
    its own slot at once (kvsidecar never makes it wait for A's save)."""
    h = await start(slots=2, policy="save-before-evict", max_unsaved_s=20)
    await h.turn("A")
    clock.t += 1.0
    await h.turn("B")
    clock.t += 25.0  # both past the bound, A the older; neither was saved at its release (too young)
    lease_b = await h.coordinator.acquire("B", provider="local", model="m")
    assert lease_b.lease_id is not None
    await h.turn("A")  # A released past its bound while B works: declined
    await asyncio.sleep(0.05)
    assert "save" not in h.calls() and rt_of(h, "A").dirty
    held = h.fake.hold("save")
    await h.coordinator.release(lease_b.lease_id, status="aborted")  # idle now: A (the oldest) first
    await asyncio.wait_for(held.entered.wait(), 5)
    b_again = await asyncio.wait_for(h.coordinator.acquire("B", provider="local", model="m"), 1)
    assert b_again.outcome is Outcome.RESIDENT and b_again.lease_id is not None
    held.release()
    await until(lambda: not rt_of(h, "A").dirty, what="A saved")
    assert rt_of(h, "B").dirty  # B's slot was working when A's save ended: not now
    await h.coordinator.release(b_again.lease_id, status="aborted")  # idle again: B's turn
    await until(lambda: not rt_of(h, "B").dirty, what="B saved")
    assert saves(h, PROTECT_FORCED) == 2


async def test_a_failing_background_save_is_tried_once_per_revision(start: Start, clock: Clock) -> None:
    h = await start(policy="save-before-evict", max_unsaved_s=20)
    await turns_every(h, clock, "A", 4, 5.0)
    h.calls()
    h.fake.fail_next_save(50)
    await h.turn("A")  # released past the bound: its save is tried, and fails
    await until(lambda: "save" in [c[0] for c in h.fake.calls], what="the background save")
    for _ in range(3):  # calls that fail at once: give-backs with no new revision
        r = await h.coordinator.acquire("A", provider="local", model="m")
        assert r.lease_id is not None
        await h.coordinator.release(r.lease_id, status="aborted")
    await asyncio.sleep(0.05)
    assert h.calls().count("save") == 1 and rt_of(h, "A").dirty  # no loop of failing saves


async def test_the_timer_saves_a_session_that_went_quiet_past_the_bound(start: Start, clock: Clock) -> None:
    """Nothing is given back while A thinks on an idle server: the timer armed at its release (for half
    the bound, then the bound) brings the idle moment."""
    h = await start(policy="save-before-evict", max_unsaved_s=20)
    await h.turn("A")
    a = rt_of(h, "A")
    loop = asyncio.get_running_loop()
    assert a.protect_timer is not None and a.protect_timer.when() - loop.time() == pytest.approx(10, 0.01)
    policy = h.coordinator.checkpoints
    clock.t += 10.0
    a.protect_timer.cancel()
    policy._protect_timer(a.key)  # what the timer does at half the bound: nothing predicted, not yet
    assert a.dirty and a.protect_timer is not None  # re-armed for the bound itself
    assert a.protect_timer.when() - loop.time() == pytest.approx(10, 0.01)
    clock.t += 10.0
    a.protect_timer.cancel()
    policy._protect_timer(a.key)  # at the bound: the server is idle, A's slot free
    await until(lambda: not a.dirty, what="A saved by its timer")


async def learned(h: Harness, clock: Clock, *, think_s: float) -> SessionRuntime:
    """A saved once (the save bandwidth learned), then turns `think_s` apart; a slow prefill learned."""
    await h.turn("A")
    await h.coordinator.save("A")
    for _ in range(2):
        clock.t += think_s
        await h.turn("A")
    h.coordinator.costs.observe_prefill("local", tokens=10, ms=1000.0)  # 10 tokens/s: recomputing is dear
    return rt_of(h, "A")


async def test_a_save_predicted_to_end_before_the_next_request_runs_at_once(
    start: Start, clock: Clock
) -> None:
    """Long before its bound (an hour): a session that thinks far longer than its save takes, and whose
    unsaved tokens cost more to recompute than the save, is saved right after its release (`background`)."""
    h = await start(policy="cost-aware", max_unsaved_s=3600)
    a = await learned(h, clock, think_s=60.0)
    clock.t += 60.0
    h.calls()
    await h.turn("A")
    await until(lambda: not a.dirty, what="A saved in the background")
    assert h.calls() == ["save"] and saves(h, PROTECT_PREDICTED) == 1


async def test_no_predicted_save_when_the_next_request_would_land_during_it(
    start: Start, clock: Clock
) -> None:
    """The same session calling again right after each answer: its next request is expected before any
    save could end, so nothing is saved in its way (only its bound, an hour here, would force one)."""
    h = await start(policy="cost-aware", max_unsaved_s=3600)
    a = await learned(h, clock, think_s=0.0)
    h.calls()
    await h.turn("A")
    await asyncio.sleep(0.05)
    assert "save" not in h.calls() and a.dirty


async def test_unsaved_gauges_aggregate_across_sessions(start: Start, clock: Clock) -> None:
    h = await start(slots=2, policy="save-before-evict", max_unsaved_s=0)
    await h.turn("A")
    clock.t += 4.0
    await h.turn("B")
    await h.turn("B")
    clock.t += 3.0
    text = h.coordinator.metrics.render().decode()
    assert 'kvsidecar_unsaved_sessions{server="local"} 2.0' in text
    assert 'kvsidecar_unsaved_max_age_seconds{server="local"} 7.0' in text
    assert 'kvsidecar_unsaved_max_tokens{server="local"} 100.0' in text
    assert 'kvsidecar_unsaved_tokens{server="local"} 150.0' in text
    unsaved = [line for line in text.splitlines() if line.startswith("kvsidecar_unsaved_")]
    assert len(unsaved) == 4 and all('{server="local"} ' in line for line in unsaved)  # no id as a label
