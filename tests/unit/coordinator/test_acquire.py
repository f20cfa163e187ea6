"""The acquire path's release of a turn its client aborted (`Acquirer.release` with `held_tokens`): what the
slot holds once llama-server stopped is the session's unsaved KV, saved by the next eviction."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvsidecar.coordinator.state import Outcome
from tests.unit.coordinator_helpers import Harness, conversation, start_harness


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    harness = await start_harness(tmp_path)
    yield harness
    await harness.coordinator.aclose()


async def test_an_aborted_turn_with_what_its_slot_holds_is_the_sessions_unsaved_kv(h: Harness) -> None:
    await h.turn("A")
    assert (await h.coordinator.session_event("A", "flush"))["saved"] == 1
    lease = await h.coordinator.acquire("A", provider="local", model="m")
    assert lease.outcome is Outcome.RESIDENT and lease.lease_id is not None
    partial = [*conversation("A", 2), 7, 7, 7]  # the next prompt and three generated tokens, then cut
    h.fake.infer(0, partial)
    out = await h.coordinator.release(lease.lease_id, status="aborted", held_tokens=len(partial))
    assert out["dirty"] is True and out["revision"] == 2
    rt = h.coordinator.sessions.by_key[lease_key(h, "A")]
    assert rt.dirty and rt.context_tokens == len(partial) and rt.unsaved_tokens == len(partial)
    h.calls()
    r, *_ = await h.turn("B")  # B takes the only slot: A's aborted turn is saved first
    assert r.outcome is Outcome.COLD and h.calls()[0] == "save"
    back = await h.coordinator.acquire("A", provider="local", model="m")
    assert back.outcome is Outcome.RESTORED and back.restored_tokens == len(partial)
    assert h.fake.slot_tokens(0) == partial


async def test_an_aborted_turn_that_says_nothing_of_its_slot_changes_nothing(h: Harness) -> None:
    await h.turn("A")
    assert (await h.coordinator.session_event("A", "flush"))["saved"] == 1
    for held in (None, 0):
        lease = await h.coordinator.acquire("A", provider="local", model="m")
        assert lease.lease_id is not None
        out = await h.coordinator.release(lease.lease_id, status="aborted", held_tokens=held)
        assert out["dirty"] is False and not h.coordinator.sessions.by_key[lease_key(h, "A")].dirty


async def test_an_aborted_auxiliary_request_is_nobodys(h: Harness) -> None:
    await h.turn("A")
    aux = await h.coordinator.acquire(None, provider="local", model="m", purpose="title")
    assert aux.lease_id is not None
    out = await h.coordinator.release(aux.lease_id, status="aborted", held_tokens=40)
    assert out["dirty"] is False and h.coordinator.servers["local"].slots[0].owner is None


def lease_key(h: Harness, session: str) -> str:
    [key] = h.coordinator.sessions.by_session_id[session]
    return key
