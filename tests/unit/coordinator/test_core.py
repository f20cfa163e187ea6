"""The coordinator on the fake backend: spec §75 scenarios, §76 units, §84 calls, §85 invariants."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import NoReturn

import pytest

from kvsidecar.backend.fake import FakeKvBackend
from kvsidecar.coordinator.breaker import BreakerState
from kvsidecar.coordinator.core import Coordinator
from kvsidecar.coordinator.state import Lease, Outcome, SessionState
from kvsidecar.errors import InvalidSessionId, LeaseNotFound, MetadataIO, SaveFailed, ShuttingDown, SlotBusy
from kvsidecar.fingerprint.llama_process import ProcessInfo
from kvsidecar.store.naming import SnapshotIdentity
from kvsidecar.store.snapshots import SnapshotStore
from kvsidecar.testing.poll import until
from tests.unit.coordinator_helpers import Harness, make_config, start_harness


def key(session: str, model: str = "m") -> str:
    return SnapshotIdentity(server="local", provider="local", model=model, session_id=session).key


def owner(h: Harness) -> str | None:
    return h.coordinator.servers["local"].slots[0].owner


async def test_first_milestone_call_sequence(h: Harness) -> None:
    """Spec §84: A: erase; A: none; B: save A (B has no snapshot; issue 28: A's KV is kept, the engine
    reuses only its exact common prefix with B's prompt); A: save B + restore A."""
    r, *_ = await h.turn("A")
    assert (r.outcome, h.calls()) == (Outcome.COLD, ["erase"])  # what the slot held before: unknown scope
    r, *_ = await h.turn("A")
    assert (r.outcome, h.calls()) == (Outcome.RESIDENT, [])
    r, *_ = await h.turn("B")
    assert (r.outcome, h.calls()) == (Outcome.COLD, ["save"])
    assert r.evicted is not None
    r, _, prompt_n, cache_n = await h.turn("A")
    assert (r.outcome, h.calls()) == (Outcome.RESTORED, ["save", "restore"])
    assert r.restored_tokens == 100 and cache_n == 100 and prompt_n == 50  # only the new turn is computed
    assert r.actions == [
        f"save {r.evicted}",
        f"restore {h.coordinator.sessions.by_key[key('A')].identity.short}",
    ]


async def test_resident_requests_cost_nothing(h: Harness, tmp_path: Path) -> None:
    """Invariant 6: no disk I/O, no management call while the session stays resident."""
    await h.turn("A")
    h.calls()
    before = sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "state").rglob("*") if p.is_file())
    for _ in range(5):
        r, *_ = await h.turn("A")
        assert r.outcome is Outcome.RESIDENT
    after = sorted((p.name, p.stat().st_mtime_ns) for p in (tmp_path / "state").rglob("*") if p.is_file())
    assert h.calls() == [] and before == after
    assert list((tmp_path / "snaps").iterdir()) == []


async def test_dirty_revisions_and_state_machine(h: Harness) -> None:
    await h.turn("A")
    rt = h.coordinator.sessions.by_key[key("A")]
    assert (rt.state, rt.dirty_revision, rt.saved_revision) == (SessionState.ACTIVE_DIRTY, 1, 0)
    await h.turn("A")
    assert rt.dirty_revision == 2
    await h.turn("B")
    assert (rt.state, rt.saved_revision) == (SessionState.SAVED, 2)
    await h.turn("A")
    assert rt.state is SessionState.ACTIVE_DIRTY and rt.dirty_revision == 3


async def test_corrupt_snapshot_is_invalidated_and_the_request_goes_cold(h: Harness, tmp_path: Path) -> None:
    await h.turn("A")
    await h.turn("B")
    h.fake.truncate_snapshot(
        SnapshotIdentity(server="local", provider="local", model="m", session_id="A").filename("a")
    )
    r, _, prompt_n, cache_n = await h.turn("A")
    assert r.outcome is Outcome.COLD_FALLBACK and r.reason == "SNAPSHOT_CORRUPT"
    assert "restore" not in h.calls()  # the truncated file never reached the server (it would crash)
    assert not h.fake.crashed and cache_n == 0 and prompt_n == 100
    m = h.coordinator.store.get(key("A"))
    assert m is not None and m.generations["a"].invalid_reason == "SNAPSHOT_CORRUPT"


async def test_restore_refused_by_the_server_falls_back_cold_and_keeps_the_file(h: Harness) -> None:
    """Only evidence about the file invalidates it: a refusal keeps the file and is not repeated against
    the same runtime."""
    await h.turn("A")
    await h.turn("B")
    h.fake.fail_next_restore()
    r, *_ = await h.turn("A")
    assert r.outcome is Outcome.COLD_FALLBACK and r.reason == "KV_RESTORE_FAILED"
    assert h.calls()[-2:] == ["restore", "erase"]
    assert owner(h) == key("A")
    m = h.coordinator.store.get(key("A"))
    assert m is not None and all(rec.invalid_reason is None for _, rec in m.ordered_generations())
    rt = h.coordinator.sessions.by_key[key("A")]
    assert len(rt.refused) == 1


async def test_restore_refused_is_not_offered_again_to_the_same_runtime(h: Harness) -> None:
    await h.turn("A")
    await h.turn("B")
    h.fake.fail_next_restore()
    await h.turn("A")  # refused: cold, A is now resident and dirty again (a new generation is saved next)
    await h.turn("B")  # A saved into its other generation
    h.calls()
    r, *_ = await h.turn("A")
    assert r.outcome is Outcome.RESTORED  # the newly saved generation, not the refused one


async def test_server_unreachable_at_restore_never_invalidates(h: Harness) -> None:
    await h.turn("A")
    await h.turn("B")
    h.fake.set_unavailable()
    r = await h.coordinator.acquire("A", provider="local", model="m")
    assert r.outcome is Outcome.COLD_FALLBACK
    assert r.lease_id is not None
    await h.coordinator.release(r.lease_id, status="aborted")
    m = h.coordinator.store.get(key("A"))
    assert m is not None and m.has_valid
    h.fake.set_unavailable(False)
    h.fake.restart()
    await h.coordinator.guard.refresh(h.coordinator.servers["local"])  # the probe sees the new instance
    r, *_ = await h.turn("A")
    assert r.outcome is Outcome.RESTORED


async def test_previous_generation_is_the_fallback(h: Harness) -> None:
    await h.turn("A")
    await h.turn("B")  # A saved to a
    await h.turn("A")
    await h.turn("C")  # A saved to b (current)
    ident = SnapshotIdentity(server="local", provider="local", model="m", session_id="A")
    h.fake.remove_snapshot(ident.filename("b"))
    r, _, prompt_n, cache_n = await h.turn("A")
    assert r.outcome is Outcome.RESTORED and r.reason is not None and "SNAPSHOT_FILE_MISSING" in r.reason
    assert r.restored_tokens == 50 and cache_n == 50 and prompt_n == 100  # an older prefix, still reused


async def test_backend_unavailable_keeps_inference_going(h: Harness) -> None:
    await h.turn("A")
    h.fake.set_unavailable()
    r = await h.coordinator.acquire("B", provider="local", model="m")
    assert r.outcome is Outcome.COLD_FALLBACK and r.lease_id is not None
    await h.coordinator.release(r.lease_id, status="error")
    assert owner(h) == key("B")


async def test_save_failure_lets_the_next_session_run(h: Harness) -> None:
    await h.turn("A")
    h.fake.fail_next_save()
    r, *_ = await h.turn("B")
    assert r.outcome is Outcome.COLD and owner(h) == key("B")
    assert h.coordinator.telemetry.stats()["save_failures"] == 1
    r, *_ = await h.turn("A")
    assert r.outcome is Outcome.COLD  # nothing was saved for A: a clean cold start, never a wrong one


async def test_strict_mode_turns_failures_into_errors(tmp_path: Path) -> None:
    h = await start_harness(tmp_path, failure={"strict": True})
    try:
        await h.turn("A")
        h.fake.fail_next_save()
        with pytest.raises(SaveFailed):
            await h.coordinator.acquire("B", provider="local", model="m")
        r, *_ = await h.turn("C")  # the slot was given back: nothing is stuck
        assert r.outcome in {Outcome.COLD, Outcome.RESTORED}
    finally:
        await h.coordinator.aclose()


async def test_auxiliary_request_never_becomes_session_state(h: Harness) -> None:
    """Invariant 7 and spec §72: save A, run the title request unowned, restore A next time."""
    await h.turn("A")
    h.calls()
    r, *_ = await h.turn("title", purpose="session-title")
    assert r.outcome is Outcome.COLD and r.reason == "auxiliary"
    assert h.calls() == ["save"] and owner(h) is None
    assert h.coordinator.store.get(key("title")) is None
    r, _, _, cache_n = await h.turn("A")
    assert r.outcome is Outcome.RESTORED and cache_n == 50
    assert h.calls() == ["restore"]


async def test_session_with_purpose_is_auxiliary(h: Harness) -> None:
    r = await h.coordinator.acquire("A", provider="local", model="m", purpose="compaction")
    assert r.reason == "auxiliary" and r.lease_id is not None
    await h.coordinator.release(r.lease_id, status="ok")
    assert key("A") not in h.coordinator.sessions.by_key


async def test_unmanaged_provider_is_bypassed(h: Harness) -> None:
    r = await h.coordinator.acquire("A", provider="openai", model="gpt")
    assert r.outcome is Outcome.BYPASS and r.lease_id is None
    assert h.calls() == [] and h.coordinator.sessions.by_key == {}


async def test_cancelled_request_releases_the_slot(h: Harness) -> None:
    r = await h.coordinator.acquire("A", provider="local", model="m")
    waiting = asyncio.ensure_future(h.coordinator.acquire("B", provider="local", model="m"))
    await asyncio.sleep(0)
    assert not waiting.done()
    assert r.lease_id is not None
    out = await h.coordinator.release(r.lease_id, status="aborted")
    assert out["dirty"] is False
    rb = await asyncio.wait_for(waiting, 5)
    assert rb.outcome is Outcome.COLD and rb.lease_id is not None
    await h.coordinator.release(rb.lease_id, status="ok")


async def test_a_waiter_cancelled_in_the_queue_leaks_nothing(h: Harness) -> None:
    r = await h.coordinator.acquire("A", provider="local", model="m")
    waiting = asyncio.ensure_future(h.coordinator.acquire("B", provider="local", model="m"))
    await asyncio.sleep(0)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert r.lease_id is not None
    await h.coordinator.release(r.lease_id, status="ok")
    r2, *_ = await h.turn("C")
    assert r2.outcome is Outcome.COLD and len(h.coordinator.leases) == 0


async def test_busy_slot_times_out_with_slot_busy(h: Harness) -> None:
    h.coordinator.acquirer.acquire_timeout_s = 0.05
    r = await h.coordinator.acquire("A", provider="local", model="m")
    with pytest.raises(SlotBusy):
        await h.coordinator.acquire("B", provider="local", model="m")
    assert r.lease_id is not None
    await h.coordinator.release(r.lease_id, status="ok")


async def test_release_twice_and_unknown_lease(h: Harness) -> None:
    r = await h.coordinator.acquire("A", provider="local", model="m")
    assert r.lease_id is not None
    await h.coordinator.release(r.lease_id, status="ok")
    with pytest.raises(LeaseNotFound):
        await h.coordinator.release(r.lease_id, status="ok")
    with pytest.raises(LeaseNotFound):
        await h.coordinator.release("nope", status="ok")
    assert h.coordinator.sessions.by_key[key("A")].dirty_revision == 1  # the double release changed nothing


async def test_lease_expiry_frees_the_slot(h: Harness) -> None:
    r = await h.coordinator.acquire("A", provider="local", model="m")
    assert r.lease_id is not None
    lease = h.coordinator.leases.get(r.lease_id)
    assert lease is not None
    loop = asyncio.get_running_loop()
    assert lease.expiry is not None
    # a lease not yet seen in use ends at its claim TTL (issue 26 C; tests/unit/coordinator/test_caller.py)
    assert abs(lease.expiry.when() - (loop.time() + h.coordinator.config.api.lease_claim_ttl_s)) < 5
    await h.coordinator.lease_ends.expire(r.lease_id)  # what the timer does when the TTL runs out
    assert h.coordinator.telemetry.stats()["leases_expired"] == 1 and r.lease_id not in h.coordinator.leases
    assert h.coordinator.sessions.by_key[key("A")].dirty_revision == 0  # an expired lease is aborted, not ok
    r2, *_ = await h.turn("B")
    assert r2.outcome is Outcome.COLD


async def test_flush_coalesces_saves(h: Harness) -> None:
    await h.turn("A")
    h.calls()
    assert (await h.coordinator.session_event("A", "flush"))["saved"] == 1
    assert (await h.coordinator.session_event("A", "flush"))["saved"] == 0
    await h.coordinator.save("A")
    assert h.calls() == ["save"]
    rt = h.coordinator.sessions.by_key[key("A")]
    assert rt.state is SessionState.ACTIVE_CLEAN and not rt.dirty
    r, *_ = await h.turn("B")
    assert h.calls() == []  # A was clean: switching away needs no save (and its KV is kept, issue 28)
    assert r.outcome is Outcome.COLD


async def test_created_and_switch_events_do_nothing(h: Harness) -> None:
    """Spec §51: snapshot management follows inference, not navigation."""
    await h.turn("A")
    await h.turn("B")
    h.calls()
    for t in ("created", "switch"):
        await h.coordinator.session_event("A", t)
    assert h.calls() == [] and owner(h) == key("B")


async def test_turn_end_saves_only_when_configured(tmp_path: Path) -> None:
    h = await start_harness(tmp_path, checkpoint={"on_turn_end": True})
    try:
        await h.turn("A")
        h.calls()
        assert (await h.coordinator.session_event("A", "turn_end"))["saved"] == 1
        assert (await h.coordinator.session_event("A", "step_end"))["saved"] == 0
        assert h.calls() == ["save"]
    finally:
        await h.coordinator.aclose()


async def test_idle_timer_follows_the_last_request_and_rechecks_ownership(h: Harness) -> None:
    clock = [1000.0]
    h.coordinator.checkpoints.monotonic = lambda: clock[0]
    await h.turn("A")
    rt = h.coordinator.sessions.by_key[key("A")]
    timer = rt.idle_timer
    assert timer is not None
    clock[0] += 20
    await h.turn("A")  # pushes the deadline to t+50 without touching the timer
    assert rt.idle_timer is timer
    h.calls()
    clock[0] += 10  # the timer fires at t+30: the session was used 10 s ago, not idle yet
    await h.coordinator.checkpoints.on_idle(key("A"))
    assert h.calls() == [] and rt.idle_timer is not None and rt.idle_timer is not timer  # re-armed for t+50
    clock[0] += 20
    await h.coordinator.checkpoints.on_idle(key("A"))
    assert h.calls() == ["save"] and not rt.dirty
    await h.coordinator.checkpoints.on_idle(key("A"))  # a second firing saves nothing (coalesced)
    assert h.calls() == []
    await h.turn("A")
    await h.turn("B")
    h.calls()
    clock[0] += 60
    await h.coordinator.checkpoints.on_idle(key("A"))  # A is no longer resident: nothing to do
    assert h.calls() == []


async def test_disposed_checkpoints_then_drops_ownership(h: Harness) -> None:
    await h.turn("A")
    h.calls()
    out = await h.coordinator.session_event("A", "disposed")
    assert out["saved"] == 1 and owner(h) is None and key("A") not in h.coordinator.sessions.by_key
    r, *_ = await h.turn("A")
    assert r.outcome is Outcome.RESTORED


async def test_circuit_opens_after_repeated_failures(h: Harness) -> None:
    await h.turn("A")
    h.fake.fail_next_save(10)
    h.fake.fail_next_erase(10)
    for s in ("B", "C", "D"):  # each switch's save fails (a cold start keeps the KV: no erase to fail)
        await h.turn(s)
    srv = h.coordinator.servers["local"]
    assert srv.breaker.state is BreakerState.OPEN
    h.calls()
    r, *_ = await h.turn("E")
    assert r.outcome is Outcome.COLD_FALLBACK and r.reason == "circuit open"
    assert h.calls() == []  # no time wasted on a broken persistence path


async def test_ineffective_restore_is_detected(h: Harness) -> None:
    """Invariant 10: an HTTP 200 restore that the engine does not reuse (SWA without --swa-full)."""
    await h.turn("A")
    await h.turn("B")
    h.fake.knobs.restore_reuses_nothing = True
    r, out, _, cache_n = await h.turn("A")
    assert r.outcome is Outcome.RESTORED and cache_n == 0
    assert out["restore_verification"] == "ineffective"
    assert h.coordinator.telemetry.stats()["restore_ineffective"] == 1
    h.fake.knobs.restore_reuses_nothing = False
    await h.turn("B")
    r, out, *_ = await h.turn("A")
    assert out["restore_verification"] == "effective"


async def test_server_restart_drops_residency(h: Harness) -> None:
    h.process[0] = ProcessInfo(pid=1, create_time=1.0, exe=None, cmdline=("llama-server",), flags={})
    srv = h.coordinator.servers["local"]
    await h.coordinator.guard.refresh(srv)
    await h.turn("A")
    await h.coordinator.save("A")
    h.fake.restart()
    h.process[0] = ProcessInfo(pid=2, create_time=2.0, exe=None, cmdline=("llama-server",), flags={})
    await h.coordinator.guard.refresh(srv)
    assert owner(h) is None and h.coordinator.telemetry.stats()["server_restarts"] == 1
    h.calls()
    r, _, _, cache_n = await h.turn("A")
    assert r.outcome is Outcome.RESTORED and h.calls() == ["restore"] and cache_n == 50


async def test_unreachable_then_back_counts_as_restart(h: Harness) -> None:
    await h.turn("A")
    srv = h.coordinator.servers["local"]
    h.fake.set_unavailable()
    await h.coordinator.guard.refresh(srv)
    h.fake.set_unavailable(False)
    await h.coordinator.guard.refresh(srv)
    assert owner(h) is None


async def test_models_of_one_session_are_separate_snapshots(h: Harness) -> None:
    """Spec §56: identity is (session, provider, model)."""
    await h.turn("A", model="m1")
    await h.turn("A", model="m2")
    assert h.coordinator.store.get(key("A", "m1")) is not None
    assert owner(h) == key("A", "m2")


async def test_hostile_session_id_is_refused_before_anything(h: Harness) -> None:
    with pytest.raises(InvalidSessionId):
        await h.coordinator.acquire("../../etc/passwd", provider="local", model="m")
    assert h.calls() == [] and h.coordinator.sessions.by_key == {}


async def test_purge_and_invalidate(h: Harness, tmp_path: Path) -> None:
    await h.turn("A")
    await h.turn("B")
    assert (await h.coordinator.invalidate("A"))["invalidated"] == 1
    r, *_ = await h.turn("A")
    assert r.outcome is Outcome.COLD_FALLBACK
    await h.turn("B")
    out = await h.coordinator.purge("A")
    assert out["purged"] == 1 and h.coordinator.store.get(key("A")) is None
    assert not any(p.name.startswith(key("A")) for p in (tmp_path / "snaps").iterdir())


async def test_shutdown_checkpoints_and_leaves_nothing_running(tmp_path: Path) -> None:
    """Spec §58 / acceptance 20: close saves the dirty slot and stops every timer and task."""
    h = await start_harness(tmp_path)
    await h.turn("A")
    h.calls()
    c = h.coordinator
    assert c.sessions.by_key[key("A")].idle_timer is not None and c._tasks
    await c.aclose()
    assert h.calls() == ["save"]
    assert not c._tasks
    manifest = c.store.get(key("A"))
    assert manifest is not None and manifest.has_valid
    after = await c.acquire("A", provider="local", model="m")
    assert after.outcome is Outcome.BYPASS  # closed: no new persistence work


async def test_status_view(h: Harness) -> None:
    await h.turn("A")
    status = h.coordinator.status()
    assert status["servers"][0]["slots"][0]["state"] == "dirty"
    assert status["servers"][0]["slots"][0]["owner"] == h.coordinator.sessions.by_key[key("A")].identity.short
    assert status["stats"]["cold_starts"] == 1
    views = h.coordinator.session_views()
    assert views[0]["session"] != "A"  # abbreviated, never the full id in listings
    assert h.coordinator.session_views("A")[0]["session"] == "A"


async def test_invariant_one_owner_per_slot_under_interleaving(h: Harness) -> None:
    """Invariants 2 and 8: many sessions at once on one slot; the slot is never held by two."""
    seen_holders: list[int] = []

    async def worker(name: str) -> None:
        for _ in range(5):
            r = await h.coordinator.acquire(name, provider="local", model="m")
            slot = h.coordinator.servers["local"].slots[0]
            holders = sum(1 for lease in h.coordinator.leases if lease.slot_id == 0)
            seen_holders.append(holders)
            assert isinstance(slot.holder, Lease) and slot.holder.id == r.lease_id
            assert slot.owner == key(name)
            await asyncio.sleep(0)
            assert r.lease_id is not None
            await h.coordinator.release(r.lease_id, status="ok")

    await asyncio.gather(*(worker(f"s{i}") for i in range(6)))
    assert max(seen_holders) == 1 and len(seen_holders) == 30


@pytest.mark.parametrize(
    ("owners", "dirty", "want"),
    [
        ({0: "s", 1: None}, set(), 0),  # 1. the slot the session already owns
        ({0: "x", 1: None}, set(), 1),  # 2. an empty slot
        ({0: "x", 1: "y"}, {"x"}, 1),  # 3. the least recently used clean slot
        ({0: "x", 1: "y"}, {"x", "y"}, 0),  # 4. the least recently used dirty slot (saved before reuse)
    ],
)
async def test_slot_selection_order(
    tmp_path: Path, owners: dict[int, str | None], dirty: set[str], want: int
) -> None:
    """Spec §64, on a two-slot pool (slot 0 used longest ago)."""
    h = await start_harness(tmp_path, total_slots=2, servers={"local": {"mode": "managed-slots"}})
    try:
        srv = h.coordinator.servers["local"]
        assert sorted(srv.slots) == [0, 1]
        for i, o in owners.items():
            srv.slots[i].owner = o
            srv.slots[i].last_used_at = float(i)
        h.coordinator.pool.is_dirty = lambda k: k in dirty
        chosen = h.coordinator.pool.select(srv, "s")
        assert chosen is not None and chosen.id == want
        srv.slots[want].holder = "busy"
        if owners.get(want) == "s":
            assert h.coordinator.pool.select(srv, "s") is None  # wait for its own slot
    finally:
        await h.coordinator.aclose()


async def test_half_open_trial_ending_without_a_verdict_does_not_wedge_the_breaker(h: Harness) -> None:
    """Issue 14: a trial that ended in a non-backend error (the manifest commit failing) kept
    trial_in_flight set, and persistence for the server stayed off until a restart."""
    await h.turn("A")
    srv = h.coordinator.servers["local"]
    now = [1000.0]
    srv.breaker.clock = lambda: now[0]
    for _ in range(srv.breaker.max_consecutive_failures):
        srv.breaker.failure("KV_SAVE_FAILED")
    now[0] += srv.breaker.cooldown_s + 1  # half-open: one trial

    def broken_commit(*args: object, **kwargs: object) -> NoReturn:
        raise MetadataIO("disk went away under the manifest")

    real_commit = h.coordinator.store.commit_save
    h.coordinator.store.commit_save = broken_commit  # type: ignore[method-assign]
    await h.turn("B")  # evicts A: the save is the trial, and its commit fails
    h.coordinator.store.commit_save = real_commit  # type: ignore[method-assign]
    assert not srv.breaker.trial_in_flight
    await h.turn("A")
    await h.turn("B")  # the breaker lets persistence through again
    assert "save" in h.calls()


async def test_unreadable_manifest_while_finding_falls_back_cold(h: Harness) -> None:
    """Issue 14: a MetadataIO error while finding a snapshot failed the acquire instead of going cold."""
    await h.turn("A")
    await h.turn("B")

    def unreadable(*args: object, **kwargs: object) -> NoReturn:
        raise MetadataIO("manifest unreadable: I/O error")

    h.coordinator.store.find_restorable = unreadable  # type: ignore[method-assign]
    h.coordinator.store.find_points = unreadable  # type: ignore[method-assign]
    r, _, prompt_n, cache_n = await h.turn("A")
    assert r.outcome is Outcome.COLD and cache_n == 0 and prompt_n > 0


async def test_sigterm_while_waiting_for_a_slot_is_shutting_down(tmp_path: Path) -> None:
    """Issue 14: a request waiting for a slot when the daemon stops gets KV_SHUTTING_DOWN, not a 500."""
    h = await start_harness(tmp_path)
    first = await h.coordinator.acquire("A", provider="local", model="m")
    waiting = asyncio.ensure_future(h.coordinator.acquire("B", provider="local", model="m"))
    srv = h.coordinator.servers["local"]
    await until(lambda: h.coordinator.pool.queued(srv), interval_s=0, what="B's acquire to queue")
    closing = asyncio.ensure_future(h.coordinator.aclose())
    with pytest.raises(ShuttingDown) as info:
        await waiting
    assert info.value.code == "KV_SHUTTING_DOWN"
    assert first.lease_id is not None
    await closing


async def test_a_reload_reaches_every_part_that_reads_the_live_config(tmp_path: Path) -> None:
    """SIGHUP applies `restore` and `checkpoint` live: the restorer, the carry-over it built, the saver
    and the checkpoint policy all read the new values (each is told through its own `reconfigure`)."""
    h = await start_harness(tmp_path)
    c = h.coordinator
    new = make_config(tmp_path, restore={"carry_over_builds": False}, checkpoint={"idle_s": 123})
    try:
        assert c.reconfigure(new) == []
        assert c.restorer.config.restore.carry_over_builds is False
        assert c.restorer.carry.config.restore.carry_over_builds is False
        assert c.saver.config.checkpoint.idle_s == c.checkpoints.config.checkpoint.idle_s == 123
    finally:
        await c.aclose()


async def test_a_router_s_model_is_chosen_by_the_model_the_call_runs_on(tmp_path: Path) -> None:
    """Each model of a router is its own server; the hook API's model, or the proxy's body `model`
    (`runs_on`), picks it, and a model no entry manages passes through."""
    url = "http://127.0.0.1:8080"
    config = make_config(
        tmp_path,
        servers={"local": {"base_url": url, "model": "coder"}, "chat": {"base_url": url, "model": "chat"}},
    )
    snaps = {name: tmp_path / "snaps" for name in ("local", "chat")}
    store = SnapshotStore(state_dir=config.state_dir, snapshot_dirs=snaps, verify_checksum=True)
    store.open()
    fakes = {name: FakeKvBackend(tmp_path / "snaps") for name in ("local", "chat")}
    coordinator = Coordinator(config=config, store=store, backends=dict(fakes), process_finder=None)
    await coordinator.start()
    try:
        hook = await coordinator.acquire("s1", provider="local", model="chat")
        proxied = await coordinator.acquire("s2", provider="local", model="default", runs_on="coder")
        other = await coordinator.acquire("s3", provider="local", model="default", runs_on="another")
        assert (hook.server, proxied.server) == ("chat", "local")
        assert other.outcome is Outcome.BYPASS and other.reason == "unmanaged provider"
        assert coordinator.session_key("s1", "local", "chat", None)[1] == "chat"
    finally:
        await coordinator.aclose()
