"""Issue 15 on the fake engine: the cost model and the cost-aware checkpoint policy.

The policy must take the evicted session's save off the switch where the model says so, and fall back to
save-before-evict where it does not know (never worse than before)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvsidecar.coordinator.costs import CostModel, ServerCosts
from kvsidecar.coordinator.state import Outcome, SessionRuntime
from tests.unit.coordinator_helpers import Harness, conversation, start_harness

COST_AWARE = {"policy": "cost-aware", "idle_s": 3600}


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    harness = await start_harness(tmp_path, checkpoint=COST_AWARE)
    yield harness
    await harness.coordinator.aclose()


def rt_of(h: Harness, session: str) -> SessionRuntime:
    return next(rt for rt in h.coordinator.sessions.by_key.values() if rt.identity.session_id == session)


def test_cost_model_learns_and_predicts() -> None:
    costs = CostModel()
    assert costs.server("s").save_s(1000) is None  # nothing learned: no prediction
    costs.observe_transfer(
        "s", kind="save", nbytes=128 * 1024 * 1000, tokens=1000, server_ms=1000.0, measured_ms=1000.0
    )
    costs.observe_transfer(
        "s", kind="restore", nbytes=128 * 1024 * 1000, tokens=1000, server_ms=100.0, measured_ms=100.0
    )
    costs.observe_prefill("s", tokens=500, ms=5000.0)
    s = costs.server("s")
    assert s.save_s(2000) == pytest.approx(2.0)
    assert s.restore_s(2000) == pytest.approx(0.2)
    assert s.prefill_s(100) == pytest.approx(1.0)
    costs.observe_transfer(
        "s", kind="save", nbytes=128 * 1024 * 1000, tokens=1000, server_ms=2000.0, measured_ms=2000.0
    )
    slower = s.save_s(1000)
    assert slower is not None and 1.0 < slower < 2.0  # follows a slower disk, smoothly


async def test_nothing_learned_means_save_before_evict(h: Harness) -> None:
    await h.turn("A")
    h.calls()
    await h.turn("B")
    assert h.calls() == ["save", "erase"]


async def test_clean_ahead_takes_the_save_off_the_switch(h: Harness) -> None:
    await h.turn("A")
    await h.turn("B")  # A saved: the save bandwidth is learned
    await h.turn("A")
    h.calls()
    assert await h.coordinator.checkpoints.clean_ahead(rt_of(h, "A"))  # what the timer does once A idled
    assert h.calls() == ["save"]
    r, *_ = await h.turn("B")
    assert h.calls() == ["restore"]  # the switch pays only the restore
    assert r.outcome is Outcome.RESTORED
    stats = h.coordinator.metrics.clean_ahead.labels("local", "saved")._value.get()
    assert stats == 1


async def test_clean_ahead_timer_is_armed_after_a_release(h: Harness) -> None:
    await h.turn("A")
    await h.turn("B")
    await h.turn("A")
    assert rt_of(h, "A").clean_timer is not None
    await h.turn("A")  # a newer request re-arms it
    assert rt_of(h, "A").clean_timer is not None


async def test_zero_think_time_is_no_worse_than_save_before_evict(h: Harness) -> None:
    await h.turn("A")
    await h.turn("B")
    await h.turn("A")
    h.calls()
    await h.turn("B")  # immediately: the clean-ahead timer has not fired
    assert h.calls() == ["save", "restore"]


async def test_no_clean_ahead_while_another_slot_works(tmp_path: Path) -> None:
    h = await start_harness(
        tmp_path, total_slots=2, servers={"local": {"mode": "managed-slots"}}, checkpoint=COST_AWARE
    )
    try:
        for s in ("A", "B", "C", "A", "B"):  # saves measured; A and B resident, both dirty
            await h.turn(s)
        lease = await h.coordinator.acquire("B", provider="local", model="m")  # B's slot is working
        assert not await h.coordinator.checkpoints.clean_ahead(rt_of(h, "A"))
        assert lease.lease_id is not None
        await h.coordinator.release(lease.lease_id, status="aborted")
    finally:
        await h.coordinator.aclose()


async def test_own_request_during_its_background_save_waits_then_is_resident(h: Harness) -> None:
    await h.turn("A")
    await h.turn("B")
    await h.turn("A")
    h.fake.delay_save(100)
    cleaning = asyncio.ensure_future(h.coordinator.checkpoints.clean_ahead(rt_of(h, "A")))
    while not any(c[0] == "save" for c in h.fake.calls):
        await asyncio.sleep(0.005)
    r, _, prompt_n, cache_n = await h.turn("A")  # waits for the save, then its own slot
    assert await cleaning
    assert r.outcome is Outcome.RESIDENT and cache_n == 100 and prompt_n == 50


async def test_skip_a_save_when_recomputing_is_cheaper(h: Harness) -> None:
    costs = h.coordinator.costs
    await h.turn("A")  # cold: 50 tokens
    await h.turn("B")  # A saved (50 tokens)
    await h.turn("A")  # restored: the slot extends A's 50-token snapshot
    # a slow disk and a fast prefill: 50 more tokens are cheaper to recompute than 100 to write
    costs.servers["local"] = ServerCosts()
    costs.observe_transfer(
        "local", kind="save", nbytes=64 * 100, tokens=100, server_ms=10_000.0, measured_ms=10_000.0
    )
    costs.observe_prefill("local", tokens=1000, ms=10.0)
    h.calls()
    await h.turn("B")  # evicts A (100 tokens, append-only since its 50-token snapshot): no save
    assert h.calls() == ["restore"]
    skipped = h.coordinator.metrics.save_skipped.labels("local", "recompute_cheaper")._value.get()
    assert skipped == 1
    r, out, prompt_n, cache_n = await h.turn("A")  # the older generation, and the rest recomputed
    assert r.outcome is Outcome.RESTORED and r.restored_tokens == 50
    assert cache_n == 50 and prompt_n == 100 and out["restore_verification"] == "effective"


async def test_no_skip_when_the_history_was_rewritten(h: Harness) -> None:
    costs = h.coordinator.costs
    await h.turn("A")
    await h.turn("B")
    r = await h.coordinator.acquire("A", provider="local", model="m")
    assert r.slot_id is not None and r.lease_id is not None
    rewritten = [7, 7, 7, *conversation("A", 2)[3:]]  # a compaction: the snapshot is no longer a prefix
    prompt_n, cache_n = h.fake.infer(r.slot_id, rewritten)
    await h.coordinator.release(r.lease_id, status="ok", prompt_tokens=prompt_n, cached_tokens=cache_n)
    costs.servers["local"] = ServerCosts()
    costs.observe_transfer(
        "local", kind="save", nbytes=64 * 100, tokens=100, server_ms=10_000.0, measured_ms=10_000.0
    )
    costs.observe_prefill("local", tokens=1000, ms=10.0)
    h.calls()
    await h.turn("B")
    assert h.calls()[0] == "save"  # its snapshot is not a prefix any more: saved as before


async def test_turn_end_hint_does_not_wait_for_the_background_save(h: Harness) -> None:
    """Review: the hint used to return only after the whole clean-ahead save."""
    for s in ("A", "B", "A"):
        await h.turn(s)
    hold = h.fake.hold("save")
    out = await h.coordinator.session_event("A", "turn_end")  # returns while the save is held
    assert out["saved"] == 0
    await hold.entered.wait()
    hold.release()
    while rt_of(h, "A").dirty:
        await asyncio.sleep(0)
    assert "save" in h.calls()


async def test_clean_ahead_refused_when_the_save_could_outlast_an_acquire_wait(h: Harness) -> None:
    """Review: a session's own request must never time out waiting for its own background save."""
    for s in ("A", "B", "A"):
        await h.turn(s)
    h.coordinator.checkpoints.acquire_timeout_s = 0.0001  # shorter than any save
    h.calls()
    assert not await h.coordinator.checkpoints.clean_ahead(rt_of(h, "A"))
    assert h.calls() == []


async def test_sighup_to_save_before_evict_stops_clean_ahead(h: Harness) -> None:
    for s in ("A", "B", "A"):
        await h.turn(s)
    assert rt_of(h, "A").clean_timer is not None
    config = h.coordinator.config
    checkpoint = config.checkpoint.model_copy(update={"policy": "save-before-evict"})
    h.coordinator.reconfigure(config.model_copy(update={"checkpoint": checkpoint}))
    assert rt_of(h, "A").clean_timer is None
    assert not await h.coordinator.checkpoints.clean_ahead(rt_of(h, "A"))


async def test_auxiliary_acquires_are_not_cold_starts(h: Harness) -> None:
    await h.turn("A")
    before = h.coordinator.status()["stats"]["cold_starts"]
    await h.turn("x", purpose="title")
    assert h.coordinator.status()["stats"]["cold_starts"] == before == 1


async def test_long_think_times_start_the_clean_ahead_right_after_the_release(h: Harness) -> None:
    for s in ("A", "B", "A"):
        await h.turn(s)
    rt = rt_of(h, "A")
    loop = asyncio.get_running_loop()
    assert rt.clean_timer is not None and rt.clean_timer.when() - loop.time() > 0.1  # ski rental: wait
    rt.think_s.extend([30.0, 45.0])  # this session thinks far longer than a save takes
    h.coordinator.checkpoints.touched(rt)
    assert rt.clean_timer is not None and rt.clean_timer.when() - loop.time() < 0.05


async def test_a_new_session_borrows_its_servers_think_times(h: Harness) -> None:
    """A session with too few think times of its own uses every session's on its server: when those are far
    longer than a save, its clean ahead starts right after its first releases too."""
    for s in ("A", "B", "A"):
        await h.turn(s)
    rt = rt_of(h, "A")
    loop = asyncio.get_running_loop()
    assert len(rt.think_s) < 2 and rt.clean_timer is not None
    assert rt.clean_timer.when() - loop.time() > 0.1  # nothing known: ski rental
    for seconds in (30.0, 45.0, 60.0, 20.0):  # other sessions on this server think for long
        h.coordinator.costs.observe_think("local", seconds)
    h.coordinator.checkpoints.touched(rt)
    assert rt.clean_timer is not None and rt.clean_timer.when() - loop.time() < 0.05
    assert (
        h.coordinator.status()["cost_model"]["local"]["think_median_s"] == 30.0
    )  # A's own (short) one counts too
    rt.think_s.extend([0.0, 0.0])  # but its own, once it has them, win: it comes back at once
    h.coordinator.checkpoints.touched(rt)
    assert rt.clean_timer is not None and rt.clean_timer.when() - loop.time() > 0.1


async def test_cost_estimates_are_read_at_scrape_time(h: Harness) -> None:
    """Every learned figure is in /metrics as it is now, the prefill speed included (it has no save of its
    own to publish it)."""
    h.coordinator.costs.observe_prefill("local", tokens=1000, ms=500.0)
    text = h.coordinator.metrics.render().decode()
    assert 'kvsidecar_cost_prefill_tokens_per_second{server="local"} 2000.0' in text
