"""Issue 15, "overlap the rest": a switch's save returns once llama-server has written the file; its commit
(checksum, manifest) runs while the incoming session restores. The acquire still answers only after the
commit; the evicted session's own next acquire waits for it; a failed commit costs only that generation."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvsidecar.coordinator.state import SessionState
from kvsidecar.errors import SnapshotCorrupt
from kvsidecar.store.naming import SnapshotIdentity
from kvsidecar.store.snapshots import SavePlan
from kvsidecar.testing.poll import until
from tests.unit.coordinator_helpers import Harness, start_harness


def key(session: str) -> str:
    return SnapshotIdentity(server="local", provider="local", model="m", session_id=session).key


class GatedCommit:
    """Wraps the store's commit_save (it runs in a worker thread): a commit of `session` waits for `gate`."""

    def __init__(self, h: Harness, session: str, gate: threading.Event) -> None:
        self.store = h.coordinator.store
        self.original: Callable[..., Any] = self.store.commit_save
        self.session, self.gate = session, gate
        self.entered = threading.Event()
        self.fail = False

    def __call__(self, plan: SavePlan, *args: Any, **kwargs: Any) -> Any:
        if plan.identity.session_id == self.session:
            self.entered.set()
            assert self.gate.wait(timeout=10), "the gate never opened"
            if self.fail:
                self.store.abort_save(plan, discard=True)
                raise SnapshotCorrupt("injected: the written file does not verify")
        return self.original(plan, *args, **kwargs)


async def test_the_incoming_restore_runs_while_the_outgoing_commit_is_under_way(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    for s in ("A", "B", "A"):  # both saved once; A resident and dirty
        await h.turn(s)
    restore_called = threading.Event()
    original_restore = h.fake.restore_slot

    async def restore_slot(slot_id: int, filename: str) -> Any:
        restore_called.set()
        return await original_restore(slot_id, filename)

    monkeypatch.setattr(h.fake, "restore_slot", restore_slot)
    gated = GatedCommit(h, "A", restore_called)  # A's commit proceeds only once B's restore was sent
    monkeypatch.setattr(h.coordinator.store, "commit_save", gated)
    result, _, _, cache_n = await h.turn("B")
    assert gated.entered.is_set() and result.outcome == "restored" and cache_n == 50
    manifest = h.coordinator.store.get(key("A"))
    assert manifest is not None and manifest.current is not None
    assert manifest.generations[manifest.current].tokens == 100  # answered after A's commit, not before
    assert h.coordinator.sessions.get(key("A")).state is SessionState.SAVED  # type: ignore[union-attr]
    assert not h.coordinator.sessions.busy
    result, _, _, cache_n = await h.turn("A")
    assert result.outcome == "restored" and result.restored_tokens == 100 and cache_n == 100


async def test_a_failed_commit_costs_only_that_generation(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    for s in ("A", "B", "A"):
        await h.turn(s)
    gate = threading.Event()
    gate.set()
    gated = GatedCommit(h, "A", gate)
    gated.fail = True
    monkeypatch.setattr(h.coordinator.store, "commit_save", gated)
    result, _, _, _ = await h.turn("B")
    assert result.outcome == "restored"  # the switch itself is unharmed
    rt = h.coordinator.sessions.get(key("A"))
    assert rt is not None and rt.state is SessionState.SAVED and rt.pending_commit is None
    assert not h.coordinator.sessions.busy
    monkeypatch.setattr(h.coordinator.store, "commit_save", gated.original)
    result, _, _, cache_n = await h.turn("A")  # its first generation (50 tokens) comes back
    assert result.outcome == "restored" and result.restored_tokens == 50 and cache_n == 50


async def test_the_evicted_sessions_own_acquire_waits_for_its_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    h = await start_harness(
        tmp_path, total_slots=2, servers={"local": {"mode": "managed-slots", "slot_wait_s": 10}}
    )
    try:
        await h.turn("A")  # slot 0, dirty, never saved
        await h.turn("B")  # slot 1
        gate = threading.Event()
        gated = GatedCommit(h, "A", gate)
        monkeypatch.setattr(h.coordinator.store, "commit_save", gated)
        c = asyncio.ensure_future(h.coordinator.acquire("C", provider="local", model="m"))  # evicts A
        await asyncio.to_thread(gated.entered.wait, 10)
        a = asyncio.ensure_future(h.coordinator.acquire("A", provider="local", model="m"))  # evicts B
        rt_b = h.coordinator.sessions.get(key("B"))
        assert rt_b is not None
        # B's save (not gated) is done: A's acquire is next
        await until(lambda: rt_b.state is SessionState.SAVED, interval_s=0.001, what="B saved")
        for _ in range(20):
            await asyncio.sleep(0)
        assert not a.done()  # A waits for its own commit (without the wait it would start cold now)
        gate.set()
        got_a, got_c = await a, await c
        assert got_c.outcome == "cold"
        assert got_a.outcome == "restored" and got_a.restored_tokens == 50
    finally:
        gate.set()
        await h.coordinator.aclose()


async def test_the_evicted_sessions_own_acquire_waits_for_its_save_still_being_written(
    tmp_path: Path,
) -> None:
    """An evicted session's next turn taking another slot while llama-server still writes its file: it waits
    for the write (and the commit) and restores; it never starts cold (`NO_SNAPSHOT`) on a save in flight."""
    h = await start_harness(
        tmp_path, total_slots=2, servers={"local": {"mode": "managed-slots", "slot_wait_s": 10}}
    )
    try:
        await h.turn("A")  # slot 0, dirty, never saved
        await h.turn("B")  # slot 1
        writing = h.fake.hold("save")  # the next save: A's, evicted by C
        c = asyncio.ensure_future(h.coordinator.acquire("C", provider="local", model="m"))
        await asyncio.wait_for(writing.entered.wait(), 10)
        a = asyncio.ensure_future(h.coordinator.acquire("A", provider="local", model="m"))  # evicts B
        rt_b = h.coordinator.sessions.get(key("B"))
        assert rt_b is not None
        await until(lambda: rt_b.state is SessionState.SAVED, interval_s=0.001, what="B saved")
        for _ in range(20):
            await asyncio.sleep(0)
        assert not a.done()  # A waits for its own save in flight (without the wait it would start cold now)
        writing.release()
        got_a, got_c = await a, await c
        assert got_c.outcome == "cold"
        assert got_a.outcome == "restored" and got_a.restored_tokens == 50
    finally:
        writing.release()
        await h.coordinator.aclose()


@pytest.mark.parametrize("commit_then", ["succeeds", "fails"])
async def test_a_cancel_during_the_commit_never_deletes_the_file_it_records(
    h: Harness, monkeypatch: pytest.MonkeyPatch, commit_then: str
) -> None:
    """Cancelling a save while its commit thread runs (shutdown's bound on checkpoints) used to discard
    the file at once, while the thread could be recording it in the manifest: a snapshot whose file was
    gone. Now the file is discarded only if that commit then fails."""
    for s in ("A", "B", "A"):  # A resident and dirty, saved once before
        await h.turn(s)
    gate = threading.Event()
    gated = GatedCommit(h, "A", gate)
    gated.fail = commit_then == "fails"
    monkeypatch.setattr(h.coordinator.store, "commit_save", gated)
    rt = h.coordinator.sessions.get(key("A"))
    assert rt is not None
    task = asyncio.ensure_future(h.coordinator.checkpoints.checkpoint(rt, "flush"))
    assert await asyncio.to_thread(gated.entered.wait, 10)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    gate.set()
    store = h.coordinator.store
    snaps = store.snapshot_dirs["local"]
    with contextlib.suppress(
        AssertionError
    ):  # up to 2 s: the commit thread, then its follow-up, finish on their own
        await until(lambda: store.inflight() == set(), timeout_s=2.0, interval_s=0.01, what="no claim left")
    await asyncio.sleep(0.05)
    m = store.get(key("A"))
    assert m is not None and m.current is not None
    current = m.generations[m.current]
    assert (snaps / current.filename).exists(), "the manifest vouches for a file that was deleted"
    if commit_then == "succeeds":
        assert current.tokens == 100  # the new generation, recorded and on disk
    else:
        assert current.tokens == 50  # the previous generation; the failed one's file is gone
        assert {p.name for p in snaps.iterdir() if p.name.startswith(key("A"))} == {current.filename}
    assert rt.state is not SessionState.SAVING
    monkeypatch.setattr(h.coordinator.store, "commit_save", gated.original)
    await h.turn("B")
    result, _, _, cache_n = await h.turn("A")
    assert result.outcome == "restored" and cache_n == result.restored_tokens
