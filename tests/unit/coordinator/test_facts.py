"""The decisions' inputs read from live records (kvsidecar/coordinator/facts.py): every field where the
decisions expect it (facts.py builds the named tuples positionally, for the hot path's sake)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvsidecar.coordinator import facts
from kvsidecar.coordinator.decisions import SavedGeneration, SessionFacts, SlotFacts
from kvsidecar.coordinator.pool import CLEANING
from tests.unit.coordinator_helpers import start_harness


async def test_a_moment_reads_each_slot_and_dirty_session_into_its_named_fields(tmp_path: Path) -> None:
    h = await start_harness(tmp_path, total_slots=2, servers={"local": {"mode": "managed-slots"}})
    try:
        await h.turn("A")
        c = h.coordinator
        srv = c.servers["local"]
        slot = next(s for s in srv.slots.values() if s.owner is not None)
        rt = c.sessions.get(slot.owner)
        assert rt is not None and rt.dirty
        rt.think_s.extend([1.5, 2.5])
        rt.clean_due_at, rt.released_at = 77.0, 70.0
        loop = asyncio.get_running_loop()
        rt.clean_timer = loop.call_later(3600, lambda: None)
        try:
            moment = facts.moment(
                srv, c.sessions, 80.0, cleaning={rt.key}, waiting=True, wait_s=9.0, coming=2
            )
        finally:
            rt.clean_timer.cancel()
            rt.clean_timer = None
        assert moment.now == 80.0
        assert moment.server.coming == 2 and moment.server.waiting and moment.server.wait_s == 9.0
        expected_slot = SlotFacts(
            id=slot.id,
            owner=rt.key,
            dirty=True,
            free=slot.free,
            claimed=slot.claimed_by is not None,
            cleaning=slot.holder == CLEANING,
            aux=False,
            last_used_at=slot.last_used_at,
        )
        assert expected_slot in moment.server.slots
        assert moment.sessions == {
            rt.key: SessionFacts(
                key=rt.key,
                context_tokens=rt.context_tokens,
                think_s=(1.5, 2.5),
                append_only=rt.append_only,
                base_tokens=rt.base_tokens,
                base_generation=rt.base_generation,
                unsaved_age_s=rt.unsaved_age_s(80.0),
                unsaved_turns=rt.unsaved_turns,
                unsaved_tokens=rt.unsaved_tokens,
                released_at=70.0,
                protect_tried=rt.protect_tried == rt.dirty_revision,
                committing=False,
                clean_timer_pending=True,
                clean_due_at=77.0,
                cleaning=True,
                newest=None,
            )
        }
        newest = SavedGeneration("a", 10, "fp", frozenset())
        assert facts.session_facts(rt.key, rt, 80.0, cleaning=False, newest=newest).newest == newest
    finally:
        await h.coordinator.aclose()
