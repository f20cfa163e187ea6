"""Attempts to break the invariants the slot pool owns (kvsidecar/coordinator/pool.py), against the fake
backend, which records any backend call that overlaps another on a slot (`violations`):

- Invariant 2: at most one owner controls a physical slot at a time (and one session, one slot);
- Invariant 3: a dirty slot is checkpointed before reassignment unless policy explicitly disables it;
- Invariant 8: all backend mutation operations are serialized per physical slot.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvsidecar.coordinator.server import ServerRuntime
from kvsidecar.coordinator.state import AcquireResult, Lease, Outcome, SessionRuntime
from kvsidecar.errors import InvariantViolation
from kvsidecar.store.naming import SnapshotIdentity
from kvsidecar.testing.poll import until
from tests.unit.coordinator_helpers import Harness, start_harness

MANAGED = {"local": {"mode": "managed-slots"}}


def key(session: str) -> str:
    return SnapshotIdentity(server="local", provider="local", model="m", session_id=session).key


def rt_of(h: Harness, session: str) -> SessionRuntime:
    rt = h.coordinator.sessions.get(key(session))
    assert rt is not None
    return rt


def server(h: Harness) -> ServerRuntime:
    return h.coordinator.servers["local"]


async def until_queued(h: Harness, n: int) -> None:
    await until(lambda: h.coordinator.pool.queued(server(h)) >= n, interval_s=0, what=f"{n} acquires queued")


# Invariant 2 -------------------------------------------------------------------------------------------
async def test_two_sessions_racing_for_one_slot_take_it_one_after_the_other(h: Harness) -> None:
    c, srv = h.coordinator, server(h)
    a = asyncio.ensure_future(c.acquire("A", provider="local", model="m"))
    b = asyncio.ensure_future(c.acquire("B", provider="local", model="m"))
    done, pending = await asyncio.wait({a, b}, return_when=asyncio.FIRST_COMPLETED)
    assert len(done) == 1 and len(pending) == 1  # one holds the slot, the other waits for it
    first, second = done.pop(), pending.pop()
    won = first.result()
    slot = srv.slots[0]
    assert isinstance(slot.holder, Lease) and slot.holder.id == won.lease_id
    assert c.pool.queued(srv) == 1 and not second.done()
    assert won.lease_id is not None
    await c.release(won.lease_id, status="ok")
    then = await second
    assert isinstance(slot.holder, Lease) and slot.holder.id == then.lease_id
    assert slot.owner == (key("B") if first is a else key("A"))  # the slot changed hands, once
    assert then.evicted is not None and h.fake.violations == []
    assert then.lease_id is not None
    await c.release(then.lease_id, status="ok")


async def test_a_session_waits_for_its_own_slot_rather_than_take_a_second(tmp_path: Path) -> None:
    h = await start_harness(tmp_path, total_slots=2, servers=MANAGED)
    try:
        c, srv = h.coordinator, server(h)
        first = await c.acquire("A", provider="local", model="m")
        again = asyncio.ensure_future(c.acquire("A", provider="local", model="m"))
        await until_queued(h, 1)  # another slot is free, but A's KV is in the slot its first request holds
        assert not again.done() and any(s.free for s in srv.slots.values() if s.id != first.slot_id)
        assert first.lease_id is not None
        await c.release(first.lease_id, status="ok")
        second = await again
        assert second.slot_id == first.slot_id and second.outcome is Outcome.RESIDENT
        assert [s.owner for s in srv.slots.values()].count(key("A")) == 1
        assert second.lease_id is not None
        await c.release(second.lease_id, status="ok")
    finally:
        await h.coordinator.aclose()


async def test_a_slot_is_not_assigned_over_its_owner_nor_to_a_session_that_owns_another(
    tmp_path: Path,
) -> None:
    h = await start_harness(tmp_path, total_slots=2, servers=MANAGED)
    try:
        c, srv = h.coordinator, server(h)
        await h.turn("A")
        await h.turn("B")
        slot_a = next(s for s in srv.slots.values() if s.owner == key("A"))
        slot_b = next(s for s in srv.slots.values() if s.owner == key("B"))
        with pytest.raises(InvariantViolation):  # nobody holds it
            c.pool.assign(srv, slot_a, key("C"), "hook")
        slot_a.holder = "test"
        with pytest.raises(InvariantViolation, match="before its owner was evicted"):
            c.pool.assign(srv, slot_a, key("C"), "hook")
        with pytest.raises(InvariantViolation, match="before its owner was evicted"):
            c.pool.lend_to_aux(srv, slot_a, "hook")
        c.pool.vacate(slot_a)
        with pytest.raises(InvariantViolation, match="own two slots"):
            c.pool.assign(srv, slot_a, key("B"), "hook")
        assert slot_a.owner is None and slot_b.owner == key("B")
        c.pool.give_back(srv, slot_a)
    finally:
        await h.coordinator.aclose()


# Invariant 3 -------------------------------------------------------------------------------------------
async def test_a_dirty_slot_is_saved_before_it_changes_hands(h: Harness) -> None:
    c, slot = h.coordinator, server(h).slots[0]
    await h.turn("A")
    hold = h.fake.hold("save")
    switch = asyncio.ensure_future(c.acquire("B", provider="local", model="m"))
    await hold.entered.wait()  # the eviction's save of A is under way
    assert slot.owner != key("B") and rt_of(h, "A").dirty  # not B's while A's turn is unsaved
    hold.release()
    result = await switch
    assert slot.owner == key("B") and f"save {rt_of(h, 'A').identity.short}" in result.actions
    rt = rt_of(h, "A")
    assert not rt.dirty and h.coordinator.store.get(rt.key) is not None
    assert result.lease_id is not None
    await c.release(result.lease_id, status="ok")


async def test_with_saves_at_switches_off_the_unsaved_turns_are_given_up(tmp_path: Path) -> None:
    h = await start_harness(tmp_path, checkpoint={"on_switch": False})
    try:
        await h.turn("A")
        h.calls()
        await h.turn("B")
        assert "save" not in h.calls()
        rt = rt_of(h, "A")
        assert not rt.dirty and rt.unsaved_turns == 0  # what the slot held of A is gone, and known gone
        assert h.coordinator.store.get(rt.key) is None
    finally:
        await h.coordinator.aclose()


async def test_an_eviction_while_a_save_is_in_flight_waits_for_it(h: Harness) -> None:
    """A background save holds the slot; a switch that arrives meanwhile neither runs beside it on the
    slot (Invariant 8) nor saves the session a second time: it finds the slot clean."""
    c = h.coordinator
    await h.turn("A")
    h.calls()
    hold = h.fake.hold("save")
    saving = asyncio.ensure_future(c.checkpoints.checkpoint(rt_of(h, "A"), "manual"))
    await hold.entered.wait()
    switch = asyncio.ensure_future(c.acquire("B", provider="local", model="m"))
    await until_queued(h, 1)
    assert not switch.done()
    hold.release()
    assert await saving is True
    result = await switch
    assert result.evicted is not None and not any(a.startswith("save ") for a in result.actions)
    assert h.calls().count("save") == 1  # A was saved once: the switch found its slot clean
    assert server(h).slots[0].owner == key("B") and h.fake.violations == []
    assert result.lease_id is not None
    await c.release(result.lease_id, status="ok")


# Invariant 8 -------------------------------------------------------------------------------------------
async def test_a_restore_or_a_save_on_a_slot_nobody_holds_is_refused(h: Harness) -> None:
    c, srv = h.coordinator, server(h)
    await h.turn("A")
    rt, slot = rt_of(h, "A"), srv.slots[0]
    assert slot.free and rt.dirty
    h.calls()
    with pytest.raises(InvariantViolation, match="nobody holds"):
        await c.restorer.load(srv, slot, rt, AcquireResult(outcome=Outcome.COLD))
    with pytest.raises(InvariantViolation, match="nobody holds"):
        await c.saver.save(srv, slot, rt, trigger="manual")
    assert not {"restore", "erase", "save"} & set(h.calls())  # nothing reached the server
    assert rt.dirty and slot.owner == rt.key


# the control bounce: a save's runtime check does not schedule another save ---------------------------
async def test_the_canary_inside_a_save_is_no_idle_moment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A save whose bracket finds the server restarted re-measures the canary on the reference slot,
    taking and giving it back: that give-back must not reach the checkpoint policy (it would start a
    background save while this one runs). Only the save's own give-back does."""
    h = await start_harness(tmp_path, total_slots=2, servers=MANAGED)
    try:
        c, srv = h.coordinator, server(h)
        await h.turn("A")
        await h.turn("X")
        # the session to save is the one not on the canary's reference slot
        saved = next(s for s in ("A", "X") if srv.slots[srv.canary_slot_id].owner != key(s))
        told: list[str] = []
        given_back = c.checkpoints.given_back

        def telling(s: ServerRuntime) -> None:
            told.append(s.name)
            given_back(s)

        monkeypatch.setattr(c.checkpoints, "given_back", telling)
        h.fake.restart()  # the save's bracket finds another instance, and a canary to measure
        h.calls()
        await c.checkpoints.checkpoint(rt_of(h, saved), "manual")
        assert "prefill" in h.calls() and srv.canary is not None  # the canary ran, inside the save
        assert told == ["local"]  # the save's own give-back, not the canary's
    finally:
        await h.coordinator.aclose()
