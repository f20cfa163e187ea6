"""Issue 15 on a real llama-server (--cache-ram 0): the cost-aware policy's three cases.

- clean ahead: once the idle session has been cleaned in the background, a switch does no save;
- a skipped save: the next restore brings the older generation back, the engine reuses it and computes
  only the rest, and the answer equals a cold run's;
- the session's own request arrives during its background save: it waits, then runs on its own slot.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvsidecar.coordinator import decisions
from kvsidecar.coordinator.costs import ServerCosts
from kvsidecar.coordinator.state import Outcome, SessionRuntime
from kvsidecar.testing.poll import until
from tests.conftest import StartServer
from tests.integration.real_helpers import RealHarness, erase, generate, prompt, real_harness

COST_AWARE = {"checkpoint": {"policy": "cost-aware", "idle_s": 3600}}


def rt_of(h: RealHarness, session: str) -> SessionRuntime:
    return next(rt for rt in h.coordinator.sessions.by_key.values() if rt.identity.session_id == session)


async def test_clean_ahead_then_the_switch_does_no_save(start_llama: StartServer, tmp_path: Path) -> None:
    h = await real_harness(start_llama(), tmp_path, **COST_AWARE)
    try:
        await h.turn("A")
        await h.turn("B")  # A saved: the save bandwidth is learned
        await h.turn("A")
        rt = rt_of(h, "A")
        assert rt.clean_timer is not None  # armed for when A has idled as long as its save takes
        # the timer fires by itself: the server is idle
        await until(lambda: not rt.dirty, timeout_s=30, interval_s=0.05, what="A's clean ahead")
        h.calls()
        r, *_ = await h.turn("B")
        assert r.outcome is Outcome.RESTORED and h.calls() == ["restore"]  # no save on the switch
    finally:
        await h.coordinator.aclose()


async def test_skipped_save_restores_the_older_generation_and_recomputes_the_rest(
    start_llama: StartServer, tmp_path: Path
) -> None:
    server = start_llama()
    h = await real_harness(server, tmp_path, **COST_AWARE)
    try:
        await h.turn("A")
        await h.turn("B")  # A's first generation: 600 tokens
        await h.turn("A")  # restored, then 600 more
        costs = h.coordinator.costs
        costs.servers["local"] = ServerCosts()  # a slow disk and a fast prefill, as on a big model
        costs.observe_transfer(
            "local", kind="save", nbytes=1 << 30, tokens=1000, server_ms=60_000.0, measured_ms=60_000.0
        )
        costs.observe_prefill("local", tokens=100_000, ms=1_000.0)
        h.calls()
        await h.turn("B")
        assert h.calls() == ["restore"]  # A evicted without a save
        n = h.turns["A"] + 1
        h.turns["A"] = n
        r = await h.coordinator.acquire("A", provider="local", model="tiny")
        assert r.outcome is Outcome.RESTORED and r.restored_tokens is not None and r.slot_id is not None
        warm = await asyncio.to_thread(generate, server.base_url, prompt("A", n), r.slot_id)
        assert r.lease_id is not None
        await h.coordinator.release(r.lease_id, status="aborted")
        await asyncio.to_thread(erase, server.base_url, r.slot_id)
        cold = await asyncio.to_thread(generate, server.base_url, prompt("A", n), r.slot_id)
        assert warm == cold
        assert r.restored_tokens < 2 * 600  # the older generation
    finally:
        await h.coordinator.aclose()


async def test_own_request_during_its_background_save(start_llama: StartServer, tmp_path: Path) -> None:
    h = await real_harness(start_llama(), tmp_path, **COST_AWARE)
    try:
        await h.turn("A")
        await h.turn("B")
        await h.turn("A")
        h.calls()
        cleaning = asyncio.ensure_future(h.coordinator.checkpoints.clean_ahead(rt_of(h, "A")))
        await until(
            lambda: "save" in h.backend.calls, timeout_s=30, interval_s=0.001, what="the save to start"
        )
        r, _, pn, cn = await h.turn("A")  # arrives while its slot is being saved: waits, then resident
        assert await cleaning
        assert r.outcome is Outcome.RESIDENT and cn > pn > 0  # its own slot, the history reused
    finally:
        await h.coordinator.aclose()


async def test_a_clean_ahead_found_busy_runs_when_the_other_slot_is_given_back(
    start_llama: StartServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--parallel 2`: A's background save comes due while B's slot works, so it waits (a save would stall
    B's stream); when B's slot is given back the server is idle, A is cleaned, and the next new session's
    switch does no save."""
    server = start_llama(parallel=2, ctx_size=8192)
    assert server.slot_save_path is not None
    local = {
        "base_url": server.base_url,
        "snapshot_dir": str(server.slot_save_path),
        "probe_interval_s": 3600,
        "mode": "managed-slots",
    }
    h = await real_harness(server, tmp_path, servers={"local": local}, **COST_AWARE)
    try:
        # A's check comes due only once B's call below holds its slot: the tiny model's saves take
        # milliseconds, so the ski-rental wait would otherwise be its 0.2 s floor and race the next turn
        monkeypatch.setattr(decisions, "MIN_CLEAN_AHEAD_S", 5.0)
        for s in ("A", "B", "C", "A", "B"):  # saves measured; A (least recently used) and B resident, dirty
            await h.turn(s)
        a = rt_of(h, "A")
        assert a.clean_timer is not None and a.dirty
        lease = await h.coordinator.acquire("B", provider="local", model="tiny")
        assert lease.lease_id is not None
        h.calls()
        await until(
            lambda: a.clean_timer is None, timeout_s=30, interval_s=0.02, what="A's clean-ahead timer"
        )
        await asyncio.sleep(0.2)  # and nothing more happens while B's slot works
        assert a.clean_timer is None and a.dirty and h.calls() == []  # due, but B's slot is working
        await h.coordinator.release(lease.lease_id, status="aborted")
        await until(lambda: not a.dirty, timeout_s=30, interval_s=0.02, what="A's save at the idle moment")
        assert not a.dirty and h.calls() == ["save"]
        r, _, pn, cn = await h.turn("C")
        assert r.outcome is Outcome.RESTORED and h.calls() == ["restore"]  # the switch paid no save
        assert r.evicted == a.identity.short and cn > 0 and pn > cn
    finally:
        await h.coordinator.aclose()
