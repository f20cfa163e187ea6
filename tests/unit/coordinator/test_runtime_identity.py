"""Issue 16 A: a restore or a save commit is bracketed by a check of the server's identity.

The fake engine computes a prompt's "KV" from its salt (model and KV-shaping settings), so the runtime
canary tells two runtimes apart even when nothing the server reports differs. No probe runs between the
steps of these tests (probe_interval_s is an hour): every detection here comes from the brackets.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvsidecar.coordinator.state import Outcome
from kvsidecar.fingerprint.llama_process import ProcessInfo
from tests.unit.coordinator_helpers import Harness, start_harness


def key(h: Harness, session: str) -> str:
    return next(k for k, rt in h.coordinator.sessions.by_key.items() if rt.identity.session_id == session)


def tokens_of(h: Harness, session: str) -> list[int]:
    m = h.coordinator.store.get(key(h, session))
    assert m is not None
    return [rec.tokens for _, rec in m.ordered_generations()]


@pytest.mark.parametrize(
    "change",
    [
        {"model_path": "/models/other.gguf"},  # another model at another path: /props shows it
        {"kv_salt": "same path, other weights"},  # replaced in place, or an LLAMA_ARG_* setting
    ],
)
async def test_restart_with_another_runtime_inside_the_probe_window_never_restores(
    h: Harness, change: dict[str, str]
) -> None:
    await h.turn("A")
    await h.turn("B")  # A saved under the first runtime
    h.fake.restart(**change)
    h.calls()
    r, _, prompt_n, cache_n = await h.turn("A")
    assert r.outcome is Outcome.COLD_FALLBACK
    assert "restore" not in h.calls()
    assert cache_n == 0 and prompt_n == 100


async def test_same_runtime_restart_inside_the_window_still_restores(h: Harness) -> None:
    await h.turn("A")
    await h.turn("B")
    h.fake.restart()  # same model, same settings: the canary is the same, the snapshot is good
    r, _, _, cache_n = await h.turn("A")
    assert r.outcome is Outcome.RESTORED and cache_n == 50


async def test_dirty_owner_is_not_saved_from_the_emptied_slot_after_a_restart(h: Harness) -> None:
    await h.turn("A")
    await h.turn("A")  # A is dirty and resident; nothing saved yet
    h.fake.restart()
    h.calls()
    await h.turn("B")  # evicts A: A's KV died with the old process, there is nothing to save
    assert h.coordinator.store.get(key(h, "A")) is None
    assert not any(name.startswith(key(h, "A")) for name in _files(h))


async def test_a_save_in_the_window_is_not_recorded_under_the_previous_runtime(h: Harness) -> None:
    for session in ("A", "B", "A", "B"):  # both saved under runtime 1; B resident
        await h.turn(session)
    srv = h.coordinator.servers["local"]
    assert srv.fingerprint is not None
    runtime1 = srv.fingerprint.digest
    before, runtime1_salt = tokens_of(h, "B"), h.fake.kv_salt
    h.fake.restart(kv_salt="runtime 2")
    await h.turn("B")  # believed resident (a remote server: no local process to check): runs on runtime 2
    r, *_ = await h.turn("A")  # evicts B: B's KV is runtime 2's and is never recorded as runtime 1's
    assert r.outcome is Outcome.COLD_FALLBACK  # and A's runtime-1 snapshot is not restored into it
    m = h.coordinator.store.get(key(h, "B"))
    assert m is not None and tokens_of(h, "B") == before
    assert all(rec.fingerprint == runtime1 for _, rec in m.ordered_generations())
    h.fake.restart(kv_salt=runtime1_salt)  # back to runtime 1: B's snapshot is good again
    await h.coordinator.guard.refresh(srv)
    r, _, _, cache_n = await h.turn("B")
    assert r.outcome is Outcome.RESTORED and cache_n > 0


async def test_restart_during_the_restore_voids_it(h: Harness) -> None:
    await h.turn("A")
    await h.turn("B")
    held = h.fake.hold("restore")
    task = asyncio.ensure_future(h.coordinator.acquire("A", provider="local", model="m"))
    await asyncio.wait_for(held.entered.wait(), 5)
    h.fake.restart(kv_salt="runtime 2")
    held.release()
    r = await task
    assert r.outcome is Outcome.COLD_FALLBACK and r.reason == "server restarted during restore"
    assert r.slot_id is not None and r.lease_id is not None
    assert h.fake.slot_tokens(r.slot_id) == []  # the restored KV landed in runtime 2: erased
    await h.coordinator.release(r.lease_id, status="aborted")
    m = h.coordinator.store.get(key(h, "A"))
    assert m is not None and m.has_valid  # the file is fine; it belongs to runtime 1


async def test_restart_during_the_save_discards_the_file(h: Harness) -> None:
    await h.turn("A")
    held = h.fake.hold("save")
    task = asyncio.ensure_future(h.turn("B"))
    await asyncio.wait_for(held.entered.wait(), 5)
    h.fake.restart()
    held.release()
    await task
    assert h.coordinator.store.get(key(h, "A")) is None
    assert not any(name.startswith(key(h, "A")) for name in _files(h))


async def test_local_process_restart_is_seen_on_the_resident_path(h: Harness) -> None:
    srv = h.coordinator.servers["local"]
    h.process[0] = ProcessInfo(pid=10, create_time=1.0, exe=None, cmdline=("llama-server",), flags={})
    await h.coordinator.guard.refresh(srv)
    await h.turn("A")
    await h.coordinator.save("A")
    h.fake.restart()
    h.process[0] = ProcessInfo(pid=11, create_time=2.0, exe=None, cmdline=("llama-server",), flags={})
    r, _, _, cache_n = await h.turn("A")  # not "resident": the process that held the KV is gone
    assert r.outcome is Outcome.RESTORED and cache_n == 50


async def test_server_without_any_identity_is_re_fingerprinted_before_each_restore(h: Harness) -> None:
    h.fake.nonce = None  # a remote server that exposes no per-start nonce
    h.fake.restart()
    await h.coordinator.guard.refresh(h.coordinator.servers["local"])
    await h.turn("A")
    await h.turn("B")
    h.fake.restart(kv_salt="runtime 2")
    h.calls()
    r, *_ = await h.turn("A")
    calls = h.calls()
    assert r.outcome is Outcome.COLD_FALLBACK and "restore" not in calls and "prefill" in calls


async def test_sessions_with_nothing_are_forgotten(h: Harness) -> None:
    config = h.coordinator.config
    checkpoint = config.checkpoint.model_copy(update={"on_switch": False})
    h.coordinator.reconfigure(config.model_copy(update={"checkpoint": checkpoint}))
    for i in range(20):
        await h.turn(f"s{i}")
    h.coordinator.forget_idle_sessions()
    # only the resident one is left: the others have no snapshot, no slot, no lease
    assert len(h.coordinator.sessions.by_key) == 1 and len(h.coordinator.sessions.by_session_id) == 1


def _files(h: Harness) -> list[str]:
    return sorted(p.name for p in h.fake.snapshot_dir.iterdir())


def test_a_pinned_or_constant_media_marker_is_not_a_nonce() -> None:
    from kvsidecar.backend.llamacpp import _nonce

    assert _nonce("<__media_swaS1kRM1vCvsZgUWSP5bZZmNxfTTpzg__>") is not None  # a real per-start marker
    for pinned in ("<__media__>", "", "<__media_x__>", "media", None, 7):
        assert _nonce(pinned) is None


MANAGED = {"local": {"mode": "managed-slots"}}


async def test_no_identity_managed_server_keeps_its_fingerprint(tmp_path: Path) -> None:
    """Review finding: a forced re-fingerprint on a slot other than the canary's threw the whole server's
    fingerprint away. Now that one restore goes cold and every other session still saves."""
    h = await start_harness(tmp_path, total_slots=2, servers=MANAGED)
    try:
        h.fake.nonce = None
        h.fake.restart()
        srv = h.coordinator.servers["local"]
        await h.coordinator.guard.refresh(srv)
        for s in ("A", "B", "C"):  # C evicts A (least recently used): A saved
            await h.turn(s)
        assert srv.fingerprint is not None
        for s in ("A", "B", "C", "A"):
            await h.turn(s)
        assert srv.fingerprint is not None
        assert h.coordinator.telemetry.stats()["saves"] >= 3
    finally:
        await h.coordinator.aclose()


async def test_pending_canary_takes_the_reference_slot_from_its_owner(tmp_path: Path) -> None:
    """Review finding: with the reference slot owned and the canary pending, persistence stayed off."""
    h = await start_harness(tmp_path, total_slots=2, servers=MANAGED)
    try:
        srv = h.coordinator.servers["local"]
        await h.turn("A")
        await h.turn("B")  # both slots owned
        ref = srv.slots[srv.canary_slot_id]
        assert ref.owner is not None
        await srv.refresh(force=True)  # fingerprinted again, not by the guard: the canary is pending
        assert srv.fingerprint is None
        await h.coordinator.guard.refresh(srv)  # what the probe loop does
        assert srv.fingerprint is not None and ref.owner is None
    finally:
        await h.coordinator.aclose()


def test_process_watch_sees_the_local_server_exit() -> None:
    """The resident path's check: a pidfd poll, true while the process runs, false once it exited."""
    import subprocess

    import psutil

    from kvsidecar.coordinator.process_watch import _ProcessWatch

    child = subprocess.Popen(["sleep", "30"])
    try:
        info = ProcessInfo(
            pid=child.pid, create_time=psutil.Process(child.pid).create_time(), exe=None, cmdline=(), flags={}
        )
        watch = _ProcessWatch(info)
        assert watch.fd is not None and watch.alive() is True
        child.kill()
        child.wait()
        assert watch.alive() is False
        watch.close()
        stale = ProcessInfo(pid=child.pid, create_time=info.create_time, exe=None, cmdline=(), flags={})
        assert _ProcessWatch(stale).fd is None  # a pid that is gone (or reused) gets no watch
    finally:
        child.kill()


async def test_file_swapped_while_the_server_read_it_is_voided(h: Harness) -> None:
    """A snapshot replaced between our checks and llama-server's open: the restore does not count."""
    await h.turn("A")
    await h.turn("B")
    store = h.coordinator.store
    real = store.confirm_unchanged
    store.confirm_unchanged = lambda candidate: False  # type: ignore[method-assign]
    r, _, _, cache_n = await h.turn("A")
    store.confirm_unchanged = real  # type: ignore[method-assign]
    assert r.outcome is Outcome.COLD_FALLBACK and r.reason == "SNAPSHOT_FILE_UNSAFE" and cache_n == 0


async def test_a_failing_post_restore_check_falls_back_cold_not_stuck_restoring(h: Harness) -> None:
    """Review: an OSError while confirming the file after the restore left the session RESTORING."""
    await h.turn("A")
    await h.turn("B")

    def unreadable(candidate: object) -> bool:
        raise OSError(5, "EIO")

    store = h.coordinator.store
    store.confirm_unchanged = unreadable  # type: ignore[method-assign]
    r, _, _, cache_n = await h.turn("A")
    assert r.outcome is Outcome.COLD_FALLBACK and cache_n == 0
    assert h.coordinator.sessions.by_key[key(h, "A")].state.value == "active_dirty"  # ran cold, not stuck


def runtime_view(h: Harness) -> dict[str, object]:
    (server,) = [s for s in h.coordinator.status()["servers"] if s["name"] == "local"]
    view = server["runtime"]
    assert isinstance(view, dict)
    return view


def runtime_state(h: Harness) -> object:
    return runtime_view(h)["state"]


async def test_status_shows_what_is_known_of_the_server_as_a_restart_is_found(h: Harness) -> None:
    """Status says the identity's state: proven while the bracket holds, changed once a check fails
    (nothing is trusted then), and proven again once the next probe has fingerprinted the new instance."""
    await h.turn("A")
    srv = h.coordinator.servers["local"]
    assert runtime_state(h) == "proven"
    h.fake.restart()
    assert not await srv.same_instance()  # the nonce changed: the bracket's check fails
    assert runtime_state(h) == "changed" and srv.fingerprint is None
    await h.coordinator.guard.refresh(srv)
    assert runtime_state(h) == "proven" and srv.fingerprint is not None
    assert runtime_view(h)["restarts_seen"] == 1
