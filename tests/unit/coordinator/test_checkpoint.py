"""Issue 15 on the fake engine: the cost model and the cost-aware checkpoint policy.

The policy must take the evicted session's save off the switch where the model says so, and fall back to
save-before-evict where it does not know (never worse than before).

The tests whose outcome hangs on a timer (a clean-ahead check, a cleaning budget) run `@on_fake_clock`: the
coordinator's clock is the loop's, and it moves only when the test advances it (tests/unit/clock.py), so
no real time is slept and no timer races a slow machine. The decisions themselves, without a coordinator,
are pinned by tests/unit/coordinator/test_decisions.py."""

from __future__ import annotations

import asyncio
import gc
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kvsidecar.backend.fake import Hold
from kvsidecar.coordinator.costs import CostModel, ServerCosts
from kvsidecar.coordinator.state import AcquireResult, Outcome, SessionRuntime
from kvsidecar.testing.poll import until
from tests.unit.clock import fake_clock, on_fake_clock
from tests.unit.coordinator_helpers import Harness, conversation, start_harness

COST_AWARE = {"policy": "cost-aware", "idle_s": 3600}
# The clock time one turn takes on the fake clock: it orders the slots' last use, as real time did.
TURN_S = 0.001


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    harness = await start_harness(tmp_path, checkpoint=COST_AWARE)
    yield harness
    await harness.coordinator.aclose()


def rt_of(h: Harness, session: str) -> SessionRuntime:
    return next(rt for rt in h.coordinator.sessions.by_key.values() if rt.identity.session_id == session)


async def on_clock(tmp_path: Path, *, total_slots: int = 1, **overrides: Any) -> Harness:
    """A coordinator whose monotonic clock is the fake loop's (the test runs `@on_fake_clock`)."""
    return await start_harness(tmp_path, total_slots=total_slots, monotonic=fake_clock().time, **overrides)


async def turn(
    h: Harness, session: str, *, purpose: str | None = None
) -> tuple[AcquireResult, dict[str, Any], int, int]:
    """A turn on the fake clock: `Harness.turn`, then the clock moves TURN_S on."""
    out = await h.turn(session, purpose=purpose)
    await fake_clock().advance(TURN_S)
    return out


async def turns(h: Harness, *sessions: str) -> None:
    for s in sessions:
        await turn(h, s)


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
    assert h.calls() == ["save"]  # B starts from A's KV (issue 28: no erase)


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


async def two_slots_a_and_b_dirty(
    tmp_path: Path, *, failure: dict[str, object] | None = None, **checkpoint: object
) -> Harness:
    """Two slots, saves measured; B (newest) and A (least recently used: the next victim) resident, dirty."""
    extra: dict[str, Any] = {"failure": failure} if failure else {}
    h = await on_clock(
        tmp_path,
        total_slots=2,
        servers={"local": {"mode": "managed-slots"}},
        checkpoint={**COST_AWARE, **checkpoint},
        **extra,
    )
    await turns(h, "A", "B", "C", "A", "B")
    return h


async def hold(h: Harness, session: str) -> str:
    """A call of `session` holds its slot: the lease id."""
    lease = await h.coordinator.acquire(session, provider="local", model="m")
    assert lease.lease_id is not None
    return lease.lease_id


async def b_works_until_a_is_due(h: Harness) -> str:
    """B's next call holds its slot until A's clean-ahead check has come due (and found the server busy)."""
    a = rt_of(h, "A")
    lease_id = await hold(h, "B")
    assert a.clean_timer is not None
    await fake_clock().advance_to(a.clean_timer.when())
    assert a.clean_timer is None, "A's check (B works)"
    return lease_id


async def give_back_b(h: Harness, times: int) -> None:
    """B's calls that fail at once: give-backs that bring no new revision."""
    for _ in range(times):
        await h.coordinator.release(await hold(h, "B"), status="aborted")


@on_fake_clock
async def test_a_clean_ahead_found_busy_runs_once_the_server_is_idle(tmp_path: Path) -> None:
    """A check that came due while another slot worked is retried when that slot is given back, not lost
    until the next switch pays for the save (what left most two-slot switches paying it)."""
    h = await two_slots_a_and_b_dirty(tmp_path)
    try:
        a = rt_of(h, "A")
        assert a.clean_timer is not None and a.dirty
        busy = h.coordinator.metrics.clean_ahead.labels("local", "busy")
        before = busy._value.get()
        h.calls()
        lease_id = await b_works_until_a_is_due(h)
        assert busy._value.get() > before and a.dirty and h.calls() == []  # declined: B works
        await h.coordinator.release(lease_id, status="aborted")  # the server is idle again
        await fake_clock().settle()  # A's save runs at once: no clock time passes
        assert not a.dirty, "A cleaned ahead"
        assert h.calls() == ["save"]
        assert h.coordinator.metrics.clean_ahead.labels("local", "saved")._value.get() == 1
        r, *_ = await h.turn("C")  # the next new session takes A's clean slot
        assert h.calls() == ["restore"] and r.outcome is Outcome.RESTORED
        assert r.evicted == a.identity.short
    finally:
        await h.coordinator.aclose()


@on_fake_clock
async def test_an_idle_server_cleans_only_its_next_victim_once_per_revision(tmp_path: Path) -> None:
    clock = fake_clock()
    h = await two_slots_a_and_b_dirty(tmp_path)
    try:
        a, b = rt_of(h, "A"), rt_of(h, "B")
        assert a.clean_timer is not None
        await clock.advance_to(a.clean_timer.when())  # its timer: the server was idle
        assert not a.dirty, "A cleaned ahead"
        await clock.advance(0.5)  # B's check comes due too; A's clean slot is the next victim now
        assert b.dirty
        h.calls()
        await give_back_b(h, 3)  # give-backs that change nothing save nothing
        await clock.settle()
        assert "save" not in h.calls() and b.dirty
    finally:
        await h.coordinator.aclose()


@on_fake_clock
async def test_as_many_slots_are_cleaned_as_switches_are_coming(tmp_path: Path) -> None:
    """Four sessions lately on two slots: two switches are coming, so both idle slots are saved ahead, one
    after the other (three sessions keep one clean: the test above)."""
    h = await on_clock(
        tmp_path, total_slots=2, servers={"local": {"mode": "managed-slots"}}, checkpoint=COST_AWARE
    )
    try:
        await turns(h, "A", "B", "C", "D", "A", "B")
        a, b = rt_of(h, "A"), rt_of(h, "B")
        await fake_clock().run_until(lambda: not a.dirty and not b.dirty, within_s=1.0, what="both cleaned")
        h.calls()
        r1, *_ = await turn(h, "C")
        r2, *_ = await turn(h, "D")
        assert h.calls() == ["restore", "restore"]  # neither switch paid a save
        assert {r1.evicted, r2.evicted} == {a.identity.short, b.identity.short}
    finally:
        await h.coordinator.aclose()


@on_fake_clock
async def test_clean_ahead_while_busy_saves_with_another_slot_working(tmp_path: Path) -> None:
    """The opt-in: a background save may stall the other slot's stream (llama-server runs slot actions in
    its one main loop), in exchange for switches that find the slot clean."""
    h = await two_slots_a_and_b_dirty(tmp_path, clean_ahead_while_busy=True)
    try:
        a = rt_of(h, "A")
        lease = await h.coordinator.acquire("B", provider="local", model="m")
        assert lease.lease_id is not None
        await fake_clock().run_until(lambda: not a.dirty, within_s=1.0, what="A cleaned ahead while B works")
        assert h.coordinator.servers["local"].slots[lease.slot_id or 0].holder is not None  # B still works
        await h.coordinator.release(lease.lease_id, status="aborted")
    finally:
        await h.coordinator.aclose()


@on_fake_clock
async def test_sessions_that_fit_in_the_slots_are_not_saved_ahead(tmp_path: Path) -> None:
    """Two agents on two slots never switch: a background save would only stall the other one's stream."""
    clock = fake_clock()
    h = await on_clock(
        tmp_path, total_slots=2, servers={"local": {"mode": "managed-slots"}}, checkpoint=COST_AWARE
    )
    try:
        await turns(h, "A", "B")
        await h.coordinator.save("A")  # a save measured: the policy has what it needs
        h.calls()
        for _ in range(3):
            for me in ("A", "B"):
                r = await h.coordinator.acquire(me, provider="local", model="m")
                assert r.lease_id is not None and r.slot_id is not None
                h.turns[me] = n = h.turns[me] + 1
                prompt_n, cache_n = h.fake.infer(r.slot_id, conversation(me, n))
                await clock.advance(0.25)  # the other one's check comes due while this one works
                await h.coordinator.release(
                    r.lease_id, status="ok", prompt_tokens=prompt_n, cached_tokens=cache_n
                )
        await clock.advance(0.3)
        assert "save" not in h.calls()
        assert h.coordinator.metrics.clean_ahead.labels("local", "no_switch")._value.get() > 0
        r, *_ = await turn(h, "C")  # a third session: now a slot changes hands, and the save is paid
        assert h.calls()[:1] == ["save"] and r.evicted is not None
    finally:
        await h.coordinator.aclose()


@on_fake_clock
async def test_a_failing_background_save_is_tried_once_per_revision(tmp_path: Path) -> None:
    clock = fake_clock()
    h = await two_slots_a_and_b_dirty(tmp_path)
    try:
        a, b = rt_of(h, "A"), rt_of(h, "B")
        a_slot = next(s.id for s in h.coordinator.servers["local"].slots.values() if s.owner == a.key)
        h.fake.calls.clear()
        h.fake.fail_next_save(50)
        assert a.clean_timer is not None
        await clock.advance_to(a.clean_timer.when())
        assert a.clean_timer is None, "A's clean-ahead check"
        await give_back_b(h, 5)  # none of them tries A's save again
        await clock.advance(0.1)
        saves = [c[1] for c in h.fake.calls if c[0] == "save"]
        assert saves.count(a_slot) == 1 and len(saves) <= 2  # at most one attempt per dirty session
        assert a.dirty and b.dirty
    finally:
        await h.coordinator.aclose()


@on_fake_clock
async def test_a_failed_request_does_not_start_its_save_at_the_release(tmp_path: Path) -> None:
    """A check that came due while the session's own request ran is void: a failed request brings no new
    revision and no re-arm, and the retry an agent sends at once must not queue behind a save."""
    clock = fake_clock()
    h = await on_clock(tmp_path, checkpoint=COST_AWARE)
    try:
        await turns(h, "A", "B", "A")
        a = rt_of(h, "A")
        r = await h.coordinator.acquire("A", provider="local", model="m")
        assert r.lease_id is not None and a.clean_timer is not None
        await clock.advance_to(a.clean_timer.when())
        assert a.clean_timer is None, "A's check (while A works)"
        h.calls()
        await h.coordinator.release(r.lease_id, status="error")
        await clock.advance(0.05)
        assert "save" not in h.calls() and a.dirty
    finally:
        await h.coordinator.aclose()


@on_fake_clock
async def test_a_new_session_waits_for_the_slot_being_cleaned(tmp_path: Path) -> None:
    """It takes the slot saved ahead for it rather than evict the session just released (a second save)."""
    clock = fake_clock()
    h = await two_slots_a_and_b_dirty(tmp_path)
    try:
        a = rt_of(h, "A")
        lease_id = await b_works_until_a_is_due(h)
        held = h.fake.hold("save")
        await h.coordinator.release(lease_id, status="aborted")  # idle: A's save starts, held
        await clock.settle()
        assert held.entered.is_set()
        h.calls()
        arriving = asyncio.ensure_future(h.turn("C"))
        await clock.advance(0.05)
        assert not arriving.done()  # waiting for A's slot, not evicting B's
        held.release()
        r, *_ = await arriving
        assert r.evicted == a.identity.short and "save" not in r.actions[0]
        assert h.calls() == ["restore"]  # after A's background save C only restores: one save in all
    finally:
        await h.coordinator.aclose()


async def a_cleaning_held(h: Harness) -> Hold:
    """B's call ends while A's check is due: A's background save starts and is held there."""
    lease_id = await b_works_until_a_is_due(h)
    held = h.fake.hold("save")
    await h.coordinator.release(lease_id, status="aborted")
    await fake_clock().settle()
    assert held.entered.is_set()
    return held


@on_fake_clock
async def test_a_sessions_own_request_is_not_starved_by_a_new_session_waiting_for_its_slot(
    tmp_path: Path,
) -> None:
    """C (new) waits for A's slot being cleaned, then A's own request comes: C stops waiting for a slot
    its session wants back and takes B's; A gets its own slot when the save ends. Neither waits for the
    other's whole call."""
    h = await two_slots_a_and_b_dirty(tmp_path)
    try:
        clock = fake_clock()
        held = await a_cleaning_held(h)
        c = asyncio.ensure_future(h.coordinator.acquire("C", provider="local", model="m"))
        await clock.advance(0.02)
        own = asyncio.ensure_future(h.coordinator.acquire("A", provider="local", model="m"))
        await clock.advance(0.02)
        held.release()
        await clock.settle()
        assert c.done() and own.done()  # C still holds its slot: A did not wait for it
        rc, ra = c.result(), own.result()
        assert rc.lease_id is not None and ra.lease_id is not None and ra.slot_id != rc.slot_id
        assert ra.outcome is Outcome.RESIDENT and rc.evicted == rt_of(h, "B").identity.short
        for lease_id in (rc.lease_id, ra.lease_id):
            await h.coordinator.release(lease_id, status="aborted")
    finally:
        await h.coordinator.aclose()


@on_fake_clock
async def test_a_new_session_does_not_wait_for_a_slot_its_own_session_asked_for(tmp_path: Path) -> None:
    """A's own request is first in line for its slot: C would wait for nothing, so it takes B's at once."""
    h = await two_slots_a_and_b_dirty(tmp_path)
    try:
        clock = fake_clock()
        held = await a_cleaning_held(h)
        own = asyncio.ensure_future(h.coordinator.acquire("A", provider="local", model="m"))
        await clock.advance(0.02)
        c = asyncio.ensure_future(h.coordinator.acquire("C", provider="local", model="m"))
        await clock.settle()  # at once: no clock time passes
        assert c.done()
        rc = c.result()
        assert not own.done() and rc.evicted == rt_of(h, "B").identity.short
        held.release()
        await clock.settle()
        assert own.done()
        ra = own.result()
        assert ra.outcome is Outcome.RESIDENT
        for lease_id in (rc.lease_id, ra.lease_id):
            assert lease_id is not None
            await h.coordinator.release(lease_id, status="aborted")
    finally:
        await h.coordinator.aclose()


@on_fake_clock
async def test_a_new_session_stops_waiting_when_the_cleaning_overruns_its_prediction(tmp_path: Path) -> None:
    """The background save outlasts 1.5x its predicted time (a stuck disk, a slow commit): the waiting
    session takes the other dirty slot and pays its save rather than time out."""
    clock = fake_clock()
    h = await two_slots_a_and_b_dirty(tmp_path)
    try:
        held = await a_cleaning_held(h)
        a_slot = next(
            s for s in h.coordinator.servers["local"].slots.values() if s.owner == rt_of(h, "A").key
        )
        cleaning_until, tokens = a_slot.cleaning_until, rt_of(h, "A").context_tokens
        save_s = h.coordinator.costs.server("local").save_s(tokens or 0)
        assert cleaning_until is not None and save_s is not None
        assert cleaning_until - clock.time() == pytest.approx(1.5 * save_s + 0.2)  # its predicted time, 1.5x
        try:
            c = asyncio.ensure_future(h.coordinator.acquire("C", provider="local", model="m"))
            await clock.advance_to(cleaning_until - 0.001)
            assert not c.done()  # within the budget: it waits for A's slot
            await clock.advance_to(cleaning_until)  # the budget is spent: it stops waiting
            assert c.done()
            rc = c.result()
        finally:
            held.release()
        assert rc.evicted == rt_of(h, "B").identity.short and rc.actions[0].startswith("save ")
        assert rc.lease_id is not None
        await h.coordinator.release(rc.lease_id, status="aborted")
    finally:
        await h.coordinator.aclose()


async def test_demand_is_bounded_and_forgets_sessions_gone_quiet(h: Harness) -> None:
    """Session ids come from clients: what the policy remembers of them is bounded and expires."""
    srv = h.coordinator.servers["local"]
    policy = h.coordinator.checkpoints
    for i in range(5000):
        policy.note_request(srv, f"flood-{i}")
    assert len(policy.requested_at(srv)) == 4096
    now = policy.monotonic
    policy.monotonic = lambda: now() + 3600  # an hour later: all of them are past the window
    await h.turn("A")
    assert list(policy.requested_at(srv)) == [rt_of(h, "A").key]


@on_fake_clock
async def test_auxiliary_requests_count_as_demand_when_they_take_session_slots(tmp_path: Path) -> None:
    """No slot reserved for auxiliary requests: two agents on two slots plus title requests is a switch
    coming, so an idle slot is kept clean and the title request pays no save."""
    h = await on_clock(
        tmp_path, total_slots=2, servers={"local": {"mode": "managed-slots"}}, checkpoint=COST_AWARE
    )
    try:
        await turns(h, "A", "B")
        await h.coordinator.save("A")  # a save measured
        await turn(h, "title", purpose="title")  # an auxiliary request earlier on: demand
        await turns(h, "A", "B")
        await fake_clock().run_until(lambda: not rt_of(h, "A").dirty, within_s=1.0, what="A cleaned ahead")
        h.calls()
        await turn(h, "title", purpose="title")
        assert "save" not in h.calls()
    finally:
        await h.coordinator.aclose()


@on_fake_clock
async def test_strict_mode_background_save_failure_is_not_left_unretrieved(tmp_path: Path) -> None:
    clock = fake_clock()
    h = await two_slots_a_and_b_dirty(tmp_path, failure={"strict": True})
    errors: list[dict[str, object]] = []
    loop = asyncio.get_running_loop()
    loop.set_exception_handler(lambda _loop, ctx: errors.append(ctx))
    try:
        a = rt_of(h, "A")
        lease_id = await b_works_until_a_is_due(h)
        h.fake.fail_next_save(1)
        await h.coordinator.release(lease_id, status="aborted")
        await clock.settle()
        assert "save" in h.calls(), "A's background save"
        await clock.advance(0.05)
        gc.collect()
        await asyncio.sleep(0)
        assert errors == [] and a.dirty
    finally:
        loop.set_exception_handler(None)
        await h.coordinator.aclose()


@on_fake_clock
async def test_a_due_check_survives_an_acquire_that_lands_first(tmp_path: Path) -> None:
    clock = fake_clock()
    h = await two_slots_a_and_b_dirty(tmp_path)
    try:
        a = rt_of(h, "A")
        await h.coordinator.release(await b_works_until_a_is_due(h), status="aborted")
        lease_id = await hold(h, "B")  # B's next call, in the same loop turn as the release
        await clock.advance(0.05)
        assert a.dirty  # B works again: not now
        await h.coordinator.release(lease_id, status="aborted")
        await clock.settle()
        assert not a.dirty, "A cleaned at the next idle moment"
    finally:
        await h.coordinator.aclose()


@on_fake_clock
async def test_own_request_during_its_background_save_waits_then_is_resident(tmp_path: Path) -> None:
    clock = fake_clock()
    h = await on_clock(tmp_path, checkpoint=COST_AWARE)
    try:
        await turns(h, "A", "B", "A")
        h.fake.delay_save(100)
        cleaning = asyncio.ensure_future(h.coordinator.checkpoints.clean_ahead(rt_of(h, "A")))
        await clock.settle()
        assert any(c[0] == "save" for c in h.fake.calls)  # the save is under way, for 0.1 s of the clock
        own = asyncio.ensure_future(h.turn("A"))  # waits for the save, then its own slot
        await clock.settle()
        assert not own.done()
        await clock.advance(0.1)
        assert own.done() and cleaning.done()
        r, _, prompt_n, cache_n = own.result()
        assert await cleaning
        assert r.outcome is Outcome.RESIDENT and cache_n == 100 and prompt_n == 50
    finally:
        h.fake.delay_save(0)  # the shutdown save: a delay would wait for a clock nobody moves
        await h.coordinator.aclose()


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
    await until(lambda: not rt_of(h, "A").dirty, interval_s=0, what="A's background save")
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
