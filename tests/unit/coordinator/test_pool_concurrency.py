"""The slot pool (managed-slots, spec §63-65) under concurrency, against the fake backend.

The randomized test drives 100 sessions over 4 slots with 24 concurrent clients, injected delays and
failures, and checks the invariants after every step: one owner per slot and one slot per session
(Invariant 2), no backend mutation or inference overlapping another on a slot (Invariant 8, checked by the
fake itself), leases and slot holders agreeing, and no session ever handed a slot that holds another
session's tokens as resident or restored state. It ends with nothing leaked.
"""

from __future__ import annotations

import asyncio
import random
from pathlib import Path
from typing import Literal

import pytest

from kvsidecar.coordinator.core import Coordinator
from kvsidecar.coordinator.state import Lease, Outcome
from kvsidecar.errors import KvError
from kvsidecar.store.naming import SnapshotIdentity
from kvsidecar.testing.poll import until
from tests.unit.coordinator_helpers import Harness, conversation, start_harness

MANAGED = {"local": {"mode": "managed-slots"}}


def key(session: str) -> str:
    return SnapshotIdentity(server="local", provider="local", model="m", session_id=session).key


def check_invariants(c: Coordinator, h: Harness) -> None:
    slots = c.servers["local"].slots.values()
    owners = [s.owner for s in slots if s.owner is not None]
    assert len(owners) == len(set(owners)), "a session owns two slots"
    for s in slots:
        if isinstance(s.holder, Lease):
            preparing = s.holder.id in c.pool.preparing  # held while its restore/erase runs
            assert (c.leases.get(s.holder.id) is s.holder or preparing) and s.holder.slot_id == s.id
    for lease in c.leases:
        assert c.servers["local"].slots[lease.slot_id].holder is lease
    assert h.fake.violations == []


async def test_sessions_run_in_parallel_on_different_slots(tmp_path: Path) -> None:
    h = await start_harness(tmp_path, total_slots=4, servers=MANAGED)
    try:
        h.fake.delay_restore(20)
        leases = await asyncio.gather(
            *(h.coordinator.acquire(f"s{i}", provider="local", model="m") for i in range(4))
        )
        assert sorted(r.slot_id for r in leases if r.slot_id is not None) == [0, 1, 2, 3]
        for r in leases:
            assert r.lease_id is not None
            await h.coordinator.release(r.lease_id, status="ok")
    finally:
        await h.coordinator.aclose()


async def test_reserved_aux_slot(tmp_path: Path) -> None:
    h = await start_harness(
        tmp_path, total_slots=3, servers={"local": {"mode": "managed-slots", "reserve_aux_slot": True}}
    )
    try:
        for s in ("a", "b", "c"):
            await h.turn(s)
        used = {sl.id for sl in h.coordinator.servers["local"].slots.values() if sl.owner}
        assert used == {0, 1}  # sessions never take slot 2
        r, *_ = await h.turn("title", purpose="session-title")
        assert r.slot_id == 2 and r.evicted is None  # no session was evicted for the title
        assert {sl.owner for sl in h.coordinator.servers["local"].slots.values() if sl.owner} == {
            key("b"),
            key("c"),
        }
    finally:
        await h.coordinator.aclose()


async def test_waiters_get_slot_busy_after_the_bound(tmp_path: Path) -> None:
    h = await start_harness(
        tmp_path, total_slots=2, servers={"local": {"mode": "managed-slots", "slot_wait_s": 0.05}}
    )
    try:
        held = [await h.coordinator.acquire(f"s{i}", provider="local", model="m") for i in range(2)]
        with pytest.raises(KvError) as info:
            await h.coordinator.acquire("s9", provider="local", model="m")
        assert info.value.code == "KV_SLOT_BUSY"
        for r in held:
            assert r.lease_id is not None
            await h.coordinator.release(r.lease_id, status="ok")
    finally:
        await h.coordinator.aclose()


@pytest.mark.parametrize(
    ("seed", "policy"), [(1, "save-before-evict"), (2, "save-before-evict"), (3, "cost-aware")]
)
async def test_randomized_concurrency_keeps_every_invariant(tmp_path: Path, seed: int, policy: str) -> None:
    """cost-aware (with clean_ahead_while_busy, so that they run mid-load) adds background saves started
    by timers and give-backs, and new sessions waiting for a slot being cleaned."""
    rng = random.Random(seed)
    checkpoint: dict[str, object] = {"idle_s": 30, "policy": policy}
    if policy == "cost-aware":
        checkpoint["clean_ahead_while_busy"] = True
    h = await start_harness(tmp_path, total_slots=4, servers=MANAGED, checkpoint=checkpoint)
    c = h.coordinator
    turns: dict[str, int] = {}
    outcomes: dict[str, int] = {}
    h.fake.knobs.save_delay_s = 0.0005
    h.fake.knobs.restore_delay_s = 0.0005

    async def client(n_ops: int) -> None:
        for _ in range(n_ops):
            session = f"s{rng.randrange(100)}"
            roll = rng.random()
            if roll < 0.03:
                h.fake.fail_next_save()
            elif roll < 0.06:
                h.fake.fail_next_restore()
            r = await c.acquire(session, provider="local", model="m")
            outcomes[r.outcome.value] = outcomes.get(r.outcome.value, 0) + 1
            check_invariants(c, h)
            assert r.slot_id is not None and r.lease_id is not None
            held = h.fake.slot_tokens(r.slot_id)
            turn = turns.get(session, 0) + 1
            if r.outcome in (Outcome.RESIDENT, Outcome.RESTORED):
                assert held == conversation(session, turn)[: len(held)], "handed another session's cache"
            await asyncio.sleep(rng.random() * 0.001)
            fate = rng.random()
            if fate < 0.1:
                await c.release(r.lease_id, status="aborted")
            else:
                prompt_n, cache_n = h.fake.infer(r.slot_id, conversation(session, turn))
                status: Literal["ok", "error"] = "error" if fate < 0.15 else "ok"
                await c.release(r.lease_id, status=status, prompt_tokens=prompt_n, cached_tokens=cache_n)
                if status == "ok":
                    turns[session] = turn
            check_invariants(c, h)
            if rng.random() < 0.02:
                await c.session_event(session, "flush")
            if policy == "cost-aware" and rng.random() < 0.05:
                await asyncio.sleep(0.3)  # think time: clean-ahead checks come due

    await asyncio.gather(*(client(100) for _ in range(24)))  # 2,400 acquire/release pairs
    slots = c.servers["local"].slots.values()
    await until(lambda: all(s.holder is None for s in slots), what="background saves done")
    assert len(c.leases) == 0
    if policy == "cost-aware":
        assert c.metrics.clean_ahead.labels("local", "saved")._value.get() > 0  # they did run
    assert (
        outcomes.get("restored", 0) > 100 and outcomes.get("resident", 0) > 0 and outcomes.get("cold", 0) > 0
    )
    await c.aclose()
    assert not c._tasks and h.fake.violations == []
