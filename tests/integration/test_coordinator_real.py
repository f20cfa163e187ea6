"""Spec §75 scenarios and the §84 call sequence against a real llama-server (--cache-ram 0, so every
warm start below is proven to come from a disk snapshot, not llama-server's RAM prompt cache)."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
from pathlib import Path

import httpx

from kvsidecar.coordinator.state import Outcome, SessionState
from kvsidecar.store.naming import SnapshotIdentity
from tests.conftest import StartServer
from tests.integration.real_helpers import prompt, real_harness


def ident(session: str) -> SnapshotIdentity:
    return SnapshotIdentity(server="local", provider="local", model="tiny", session_id=session)


async def test_switch_and_restore_sequence_with_real_reuse(start_llama: StartServer, tmp_path: Path) -> None:
    h = await real_harness(start_llama(), tmp_path)
    try:
        r, _, pn, _ = await h.turn("A")
        assert (r.outcome, h.calls()) == (Outcome.COLD, ["erase"]) and pn > 500
        r, _, pn, cn = await h.turn("A")
        assert (r.outcome, h.calls()) == (Outcome.RESIDENT, []) and cn > 500  # resident: the slot's own cache
        r, *_ = await h.turn("B")
        assert (r.outcome, h.calls()) == (Outcome.COLD, ["save"])  # A's KV kept: same scope (issue 28)
        r, out, pn, cn = await h.turn("A")
        assert (r.outcome, h.calls()) == (Outcome.RESTORED, ["save", "restore"])
        assert r.restored_tokens is not None and cn >= r.restored_tokens - 8  # the engine's own numbers
        assert pn < (pn + cn) / 2  # only the new turn was computed, not the whole prompt
        assert out["restore_verification"] == "effective"
        fp = h.coordinator.servers["local"].fingerprint
        assert fp is not None and fp.info.get("pid") == str(h.server.pid)
    finally:
        await h.coordinator.aclose()


async def test_restore_after_sidecar_and_server_restart(start_llama: StartServer, tmp_path: Path) -> None:
    server = start_llama()
    h = await real_harness(server, tmp_path)
    await h.turn("A")
    await h.coordinator.aclose()  # shutdown checkpoint saves A
    server.restart()  # the KV cache in llama-server's memory is gone
    h2 = await real_harness(server, tmp_path)
    h2.turns = dict(h.turns)
    try:
        r, _, pn, cn = await h2.turn("A")
        assert r.outcome is Outcome.RESTORED and h2.calls() == ["restore"]
        assert r.restored_tokens is not None and cn >= r.restored_tokens - 8  # the prefix came from disk
        assert pn <= (pn + cn) - r.restored_tokens + 8  # only the new turn was computed
    finally:
        await h2.coordinator.aclose()


async def test_deleted_or_corrupt_snapshot_costs_a_cold_prefill_only(
    start_llama: StartServer, tmp_path: Path
) -> None:
    server = start_llama()
    h = await real_harness(server, tmp_path)
    try:
        await h.turn("A")
        await h.turn("B")
        snap = server.save_dir / ident("A").filename("a")
        snap.write_bytes(snap.read_bytes()[: snap.stat().st_size // 2])  # what a crash mid-save leaves
        r, _, pn, cn = await h.turn("A")
        assert r.outcome is Outcome.COLD_FALLBACK and r.reason == "SNAPSHOT_CORRUPT"
        assert "restore" not in h.calls() and server.alive  # restoring it would have aborted llama-server
        assert cn <= 8 and pn > 1000  # cold: only the prefix it shares with B's KV (kept, issue 28) reused
        await h.turn("B")
        (server.save_dir / ident("A").filename("b")).unlink()
        r, *_ = await h.turn("A")
        assert r.outcome is Outcome.COLD_FALLBACK and server.alive
    finally:
        await h.coordinator.aclose()


async def test_backend_down_then_back(start_llama: StartServer, tmp_path: Path) -> None:
    server = start_llama()
    h = await real_harness(server, tmp_path)
    try:
        await h.turn("A")
        server.stop()
        r = await h.coordinator.acquire("B", provider="local", model="tiny")
        assert r.outcome is Outcome.COLD_FALLBACK and r.lease_id is not None
        await h.coordinator.release(r.lease_id, status="error")
        server.start()
        await h.coordinator.guard.refresh(h.coordinator.servers["local"])
        assert h.coordinator.servers["local"].available
        r, *_ = await h.turn("C")
        assert r.outcome is Outcome.COLD
    finally:
        await h.coordinator.aclose()


async def test_save_failure_does_not_block_the_next_session(start_llama: StartServer, tmp_path: Path) -> None:
    server = start_llama()
    h = await real_harness(server, tmp_path)
    try:
        await h.turn("A")
        assert server.slot_save_path is not None
        shutil.rmtree(server.slot_save_path)  # the server cannot write its file
        r, *_ = await h.turn("B")
        assert r.outcome is Outcome.COLD
        assert h.coordinator.telemetry.stats()["save_failures"] == 1 and server.alive
        server.slot_save_path.mkdir()
    finally:
        await h.coordinator.aclose()


async def test_auxiliary_request_then_session_restores(start_llama: StartServer, tmp_path: Path) -> None:
    h = await real_harness(start_llama(), tmp_path)
    try:
        await h.turn("A")
        h.calls()
        r, *_ = await h.turn("title", purpose="session-title")
        assert r.reason == "auxiliary" and h.calls() == ["save"]
        r, _, _, cn = await h.turn("A")
        assert r.outcome is Outcome.RESTORED and cn > 500
        assert h.coordinator.store.get(ident("title").key) is None
    finally:
        await h.coordinator.aclose()


async def test_client_cancellation_releases_the_slot(start_llama: StartServer, tmp_path: Path) -> None:
    server = start_llama()
    h = await real_harness(server, tmp_path)
    try:
        r = await h.coordinator.acquire("A", provider="local", model="tiny")
        assert r.lease_id is not None
        async with httpx.AsyncClient(timeout=0.05) as client:
            with contextlib.suppress(httpx.TimeoutException):  # the user pressed stop mid-request
                await client.post(
                    f"{server.base_url}/completion",
                    json={"prompt": prompt("A", 5), "n_predict": 64, "id_slot": 0},
                )
        await h.coordinator.release(r.lease_id, status="aborted")
        r2, *_ = await asyncio.wait_for(h.turn("B"), 120)
        assert r2.outcome is Outcome.COLD and server.alive
    finally:
        await h.coordinator.aclose()


async def test_disposal_saves_and_leaves_nothing_running(start_llama: StartServer, tmp_path: Path) -> None:
    h = await real_harness(start_llama(), tmp_path)
    await h.turn("A")
    out = await h.coordinator.session_event("A", "disposed")
    assert out["saved"] == 1
    await h.coordinator.aclose()
    assert not h.coordinator._tasks
    m = h.coordinator.store.get(ident("A").key)
    assert m is not None and m.has_valid
    assert h.coordinator.sessions.by_key.get(ident("A").key) is None or (
        h.coordinator.sessions.by_key[ident("A").key].state is SessionState.SAVED
    )


async def test_previous_generation_restores_when_the_current_is_gone(
    start_llama: StartServer, tmp_path: Path
) -> None:
    """A/B generations on the real server: save -> verify -> flip, and fallback to the older prefix."""
    server = start_llama()
    h = await real_harness(server, tmp_path)
    try:
        await h.turn("A")
        await h.turn("B")  # A turn 1 saved to generation a
        await h.turn("A")
        await h.turn("B")  # A turn 2 saved to generation b (current)
        m = h.coordinator.store.get(ident("A").key)
        assert m is not None and m.current == "b" and set(m.generations) == {"a", "b"}
        older = m.generations["a"].tokens
        (server.save_dir / ident("A").filename("b")).unlink()
        r, _, pn, cn = await h.turn("A")
        assert r.outcome is Outcome.RESTORED and r.restored_tokens == older
        assert r.reason is not None and "SNAPSHOT_FILE_MISSING" in r.reason
        assert cn >= older - 8 and pn <= (pn + cn) - older + 8  # the older prefix was reused for real
    finally:
        await h.coordinator.aclose()
