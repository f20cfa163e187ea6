"""Issue 26 class B: kvsidecar and llama-server must use the same directory, always.

llama-server opens `<--slot-save-path>/<name>` by path at every save and restore; kvsidecar holds the
directory it opened at start. When the path (a link on it, or any ancestor) is retargeted, nothing may be
saved, restored or written through it: SNAPSHOT_DIR_MOVED in the save/restore outcome, status, doctor,
logs and `kvsidecar_snapshot_dir_moved`; nothing is deleted or invalidated, and once the path leads back
everything works again. Real symlinks in tmp_path; the fake backend opens files by path, as llama-server.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kvsidecar.backend.base import SaveResult
from kvsidecar.coordinator.canary import CANARY_FILE, sweep_canary_files
from kvsidecar.coordinator.state import Outcome
from kvsidecar.doctor.checks import Doctor
from kvsidecar.errors import DirMoved
from kvsidecar.files.confined import UnsafeFile
from kvsidecar.fingerprint.file_digests import FileDigestCache
from kvsidecar.fingerprint.llama_crashes import CrashRecord
from kvsidecar.fingerprint.llama_process import ProcessInfo
from kvsidecar.store.naming import SnapshotIdentity
from kvsidecar.store.snapshots import SnapshotStore
from tests.unit.coordinator_helpers import Harness, start_harness
from tests.unit.store.test_snapshots import FP, FP2, ID, make_store, save, server_writes

MOVED = "KV_SNAPSHOT_DIR_MOVED"
VICTIM_TEXT = "an operator's notes, nothing to do with kvsidecar\n" * 8  # a few hundred bytes of text


def ident(session: str) -> SnapshotIdentity:
    return SnapshotIdentity(server="local", provider="local", model="m", session_id=session)


def retarget(link: Path, target: Path) -> None:
    """Point `link` at `target` in one step (a rename over it), as `ln -sfn` would."""
    new = link.with_name(link.name + ".new")
    new.symlink_to(target, target_is_directory=True)
    os.replace(new, link)


def outside_with_planted_links(tmp_path: Path, session: str) -> tuple[Path, Path]:
    """A directory the link gets pointed at: at both of the session's file names, a link to a victim
    file outside both trees."""
    victim = tmp_path / "victim.txt"
    victim.write_text(VICTIM_TEXT)
    outside = tmp_path / "outside"
    outside.mkdir()
    for gen in ("a", "b"):
        (outside / ident(session).filename(gen)).symlink_to(victim)
    return outside, victim


def moved_gauge(h: Harness) -> float | None:
    return h.coordinator.metrics.registry.get_sample_value(
        "kvsidecar_snapshot_dir_moved", {"server": "local"}
    )


def saves(h: Harness) -> list[tuple[Any, ...]]:
    return [c for c in h.fake.calls if c[0] == "save"]


@pytest.fixture
async def linked(tmp_path: Path) -> AsyncIterator[Harness]:
    """A harness whose snapshot_dir (and llama-server's --slot-save-path: the fake's directory) is a
    symlink `snaps` -> `real`."""
    (tmp_path / "real").mkdir()
    (tmp_path / "snaps").symlink_to(tmp_path / "real", target_is_directory=True)
    harness = await start_harness(tmp_path)
    yield harness
    await harness.coordinator.aclose()


async def test_a_save_never_writes_through_a_retargeted_snapshot_dir_link(
    linked: Harness, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Item 4: the link is pointed at a directory with links planted at the session's names; the
    eviction save of A is refused before llama-server is asked, and the victim file is unchanged."""
    h = linked
    await h.turn("A")
    outside, victim = outside_with_planted_links(tmp_path, "A")
    retarget(tmp_path / "snaps", outside)
    h.fake.calls.clear()
    with caplog.at_level(logging.INFO, logger="kvsidecar"):
        await h.turn("B")  # one slot: A is saved first (refused), B starts cold
    assert victim.read_text() == VICTIM_TEXT
    assert saves(h) == []  # llama-server was never asked to write
    assert sorted(p.name for p in outside.iterdir()) == sorted(ident("A").filename(g) for g in ("a", "b"))
    assert h.coordinator.store.get(ident("A").key) is None  # nothing recorded
    assert h.coordinator.sessions.get(ident("A").key).last_error == MOVED  # type: ignore[union-attr]
    assert h.coordinator.metrics.registry.get_sample_value(
        "kvsidecar_save_failure_total", {"server": "local", "code": MOVED}
    )
    [view] = h.coordinator.status()["servers"]
    assert [w["code"] for w in view["warnings"]] == [MOVED]
    assert view["persistence_now"] == {"state": "unavailable", "reason": "SNAPSHOT_DIR_MOVED"}
    assert moved_gauge(h) == 1.0
    assert "kv.store.dir_moved" in caplog.text and "SNAPSHOT_DIR_MOVED" in caplog.text


async def test_a_restore_never_reads_through_a_retargeted_link_and_resumes_when_it_leads_back(
    linked: Harness, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Item 4: a truncated file kvsidecar never checked sits at the name in the directory the link now
    leads to (restoring it aborts llama-server); it is not restored, nothing of A is invalidated or
    deleted, and once the link leads back A restores."""
    h = linked
    await h.turn("A")
    await h.turn("B")  # A saved on the switch
    a = ident("A")
    manifest = h.coordinator.store.get(a.key)
    assert manifest is not None and manifest.has_valid
    good = tmp_path / "real" / a.filename(manifest.current or "a")
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / good.name).write_bytes(good.read_bytes()[:20])  # truncated
    retarget(tmp_path / "snaps", outside)
    h.fake.calls.clear()
    with caplog.at_level(logging.INFO, logger="kvsidecar"):
        result, *_ = await h.turn("A")
        assert result.outcome is Outcome.COLD_FALLBACK and result.reason == MOVED
        assert not h.fake.crashed and [c for c in h.fake.calls if c[0] == "restore"] == []
        again = h.coordinator.store.get(a.key)
        assert again is not None and all(r.valid for _, r in again.ordered_generations())
        assert good.is_file()
        retarget(tmp_path / "snaps", tmp_path / "real")
        assert moved_gauge(h) == 0.0 and h.coordinator.status()["servers"][0]["warnings"] == []
        await h.turn("B")
        result, *_ = await h.turn("A")
    assert result.outcome is Outcome.RESTORED
    assert "kv.store.dir_moved" in caplog.text and "kv.store.dir_back" in caplog.text


async def test_a_retargeted_ancestor_of_the_snapshot_dir_is_the_same_fault(tmp_path: Path) -> None:
    """Item 4, an ancestor: `top` -> p1 holds snaps/ and state/; pointed at p2 (planted links at A's
    names, its own state/manifests), nothing is written under p2 and the victim is unchanged."""
    (tmp_path / "p1").mkdir()
    top = tmp_path / "top"
    top.symlink_to(tmp_path / "p1", target_is_directory=True)
    h = await start_harness(top)
    try:
        await h.turn("A")
        planted, victim = outside_with_planted_links(tmp_path, "A")
        p2 = tmp_path / "p2"
        (p2 / "state" / "manifests").mkdir(parents=True)
        planted.rename(p2 / "snaps")
        retarget(top, p2)
        h.fake.calls.clear()
        await h.turn("B")
        assert victim.read_text() == VICTIM_TEXT and saves(h) == []
        assert list((p2 / "state" / "manifests").iterdir()) == []
        faults = h.coordinator.store.dir_faults()
        assert {"snapshots:local", "manifests"} <= set(faults)
    finally:
        retarget(top, tmp_path / "p1")
        await h.coordinator.aclose()


async def test_a_retarget_during_the_save_is_never_trusted(linked: Harness, tmp_path: Path) -> None:
    """The race: the link is retargeted after the check, while llama-server writes, and put back before
    the save answers. The written file is not in the held directory: the save is not recorded."""
    h = linked
    await h.turn("A")
    outside = tmp_path / "outside"
    outside.mkdir()
    real_save = h.fake.save_slot

    async def save_while_retargeted(slot_id: int, filename: str) -> SaveResult:
        retarget(tmp_path / "snaps", outside)
        try:
            return await real_save(slot_id, filename)
        finally:
            retarget(tmp_path / "snaps", tmp_path / "real")

    h.fake.save_slot = save_while_retargeted  # type: ignore[method-assign]
    await h.turn("B")
    assert h.coordinator.store.get(ident("A").key) is None  # not recorded
    assert [p.name for p in (tmp_path / "real").iterdir() if p.name.startswith(ident("A").key)] == []


async def test_a_retarget_that_stays_during_the_save_is_caught_after_it(
    linked: Harness, tmp_path: Path
) -> None:
    h = linked
    await h.turn("A")
    outside = tmp_path / "outside"
    outside.mkdir()
    hold = h.fake.hold("save")

    async def retarget_in_flight() -> None:
        await hold.entered.wait()
        retarget(tmp_path / "snaps", outside)
        hold.release()

    await asyncio.gather(h.turn("B"), retarget_in_flight())
    assert h.coordinator.store.get(ident("A").key) is None
    assert h.coordinator.sessions.get(ident("A").key).last_error == MOVED  # type: ignore[union-attr]


async def test_llama_servers_own_save_path_retargeted_refuses_saves(tmp_path: Path) -> None:
    """llama-server may name the directory by another path (a link of its own): that path, as this host
    sees it, must lead to the held directory too."""
    h = await start_harness(tmp_path)
    try:
        theirs = tmp_path / "llama-link"
        theirs.symlink_to(tmp_path / "snaps", target_is_directory=True)
        h.process[0] = ProcessInfo(
            pid=os.getpid(),
            create_time=1.0,
            exe=None,
            cmdline=("llama-server",),
            flags={"slot_save_path": str(theirs)},
            cwd="/",
        )
        srv = h.coordinator.servers["local"]
        await h.coordinator.guard.refresh(srv)
        assert h.coordinator.status()["servers"][0]["warnings"] == []  # the same directory
        await h.turn("A")
        outside = tmp_path / "outside"
        outside.mkdir()
        retarget(theirs, outside)
        h.fake.calls.clear()
        await h.turn("B")
        assert saves(h) == [] and h.coordinator.store.get(ident("A").key) is None
        assert h.coordinator.sessions.get(ident("A").key).last_error == MOVED  # type: ignore[union-attr]
        assert moved_gauge(h) == 1.0
    finally:
        await h.coordinator.aclose()


async def test_the_canary_is_never_created_read_or_deleted_through_a_replaced_dir(
    linked: Harness, tmp_path: Path
) -> None:
    """Item 4, the canary: re-measured after a restart while the snapshot dir is replaced by a link to
    another directory; llama-server is not asked to save it, nothing is measured (nothing is restored
    or saved until it is), and a canary-named file in that directory is left alone by the sweep."""
    h = linked
    srv = h.coordinator.servers["local"]
    outside = tmp_path / "outside"
    outside.mkdir()
    planted = outside / "kvsidecar-canary.0123456789abcdef.bin"
    planted.write_bytes(b"someone else's")
    assert CANARY_FILE.match(planted.name)
    retarget(tmp_path / "snaps", outside)
    failures = srv.canary_failures
    h.fake.restart()
    h.fake.calls.clear()
    await h.coordinator.guard.refresh(srv)
    assert saves(h) == [] and srv.canary is None and srv.canary_failures == failures + 1
    anchor = h.coordinator.store.snapshot_anchor("local")
    assert anchor is not None
    assert sweep_canary_files(anchor) == 0 and planted.read_bytes() == b"someone else's"
    assert sorted(p.name for p in outside.iterdir()) == [planted.name]


def test_manifests_and_fingerprints_are_never_written_through_a_link_in_place_of_their_dir(
    tmp_path: Path,
) -> None:
    """Item 4 (related): `state/manifests` replaced by a link to another directory: the next manifest
    write is refused (DirMoved) and nothing lands there, no session id in clear; the same for
    fingerprints/; reads still come from the directory held."""
    store = make_store(tmp_path)
    save(store, 10)
    state = tmp_path / "state"
    outside = tmp_path / "outside"
    outside.mkdir()
    for sub in ("manifests", "fingerprints"):
        (state / sub).rename(state / f"{sub}.old")
        (state / sub).symlink_to(outside, target_is_directory=True)
    plan = store.begin_save(SnapshotIdentity(server="local", provider="p", model="m", session_id="secret-id"))
    with pytest.raises(DirMoved):
        store.commit_save(plan, server_writes(plan, 10), fingerprint=FP2, revision=1)
    with pytest.raises(DirMoved):
        store.touch(ID.key)
    store.register_fingerprint(FP2)
    assert list(outside.iterdir()) == []
    assert store.get(ID.key) is not None  # nothing lost
    assert set(store.dir_faults()) == {"manifests", "fingerprints"}


def test_the_digest_cache_is_never_written_through_a_retargeted_state_dir(tmp_path: Path) -> None:
    """state_dir is a link, retargeted after start: file-digests.json is written in the directory held,
    never through the link, and not at all while the link leads elsewhere."""
    (tmp_path / "state.real").mkdir()
    state = tmp_path / "state"
    state.symlink_to(tmp_path / "state.real", target_is_directory=True)
    store = SnapshotStore(state_dir=state, snapshot_dirs={"local": tmp_path / "snaps"})
    store.open()
    outside = tmp_path / "outside"
    outside.mkdir()
    digests = FileDigestCache(
        state / "file-digests.json", racy_window_s=0, anchor=store.layout.anchors["state"]
    )
    retarget(state, outside)
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"x" * 100)
    assert digests.digest(model) is not None
    assert list(outside.iterdir()) == [] and not (tmp_path / "state.real" / "file-digests.json").exists()
    assert "state" in store.dir_faults()
    retarget(state, tmp_path / "state.real")  # leads back: written again, in the held directory
    other = tmp_path / "n.gguf"
    other.write_bytes(b"GGUF" + b"y" * 100)
    assert digests.digest(other) is not None
    assert (tmp_path / "state.real" / "file-digests.json").is_file() and list(outside.iterdir()) == []


def test_fleet_fences_are_never_opened_through_a_link_in_place_of_their_dir(tmp_path: Path) -> None:
    """Fleet: `<shared>/fences` replaced by a link to another directory: a fence is not created, read or
    advanced there (a stale host would find no fence and pass); the write is refused (DirMoved)."""
    shared = tmp_path / "shared"
    store = SnapshotStore(
        state_dir=tmp_path / "state", snapshot_dirs={"local": tmp_path / "snaps"}, shared_dir=shared
    )
    store.open()
    fence = store.fence_with({ID.key: 10}.get)
    fence.advance(ID.key, 10)
    outside = tmp_path / "outside"
    outside.mkdir()
    (shared / "fences").rename(shared / "fences.old")
    (shared / "fences").symlink_to(outside, target_is_directory=True)
    with pytest.raises(DirMoved):
        fence.advance(ID.key, 11)
    with pytest.raises(DirMoved), fence.guard(ID.key, "manifest write"):
        pass
    assert list(outside.iterdir()) == []
    assert "fences" in store.dir_faults()


def test_a_moved_snapshot_dir_refuses_the_save_and_changes_nothing(tmp_path: Path) -> None:
    """Store level: begin_save refuses before any record changes; check_before_restore refuses; the
    generation stays valid; delete and purge delete nothing."""
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "snaps"
    link.symlink_to(real, target_is_directory=True)
    store = SnapshotStore(state_dir=tmp_path / "state", snapshot_dirs={"local": link})
    store.open()
    plan = store.begin_save(ID)
    store.commit_save(plan, server_writes(plan, 10), fingerprint=FP, revision=1)
    candidate, _ = store.find_restorable(ID, FP)
    assert candidate is not None
    outside = tmp_path / "outside"
    outside.mkdir()
    retarget(link, outside)
    before = store.get(ID.key)
    with pytest.raises(DirMoved):
        store.begin_save(ID)
    with pytest.raises(DirMoved):
        store.check_before_restore(candidate)
    assert store.get(ID.key) == before
    with pytest.raises(DirMoved):
        store.layout.snap["local"].unlink(ID.filename("a"))
    assert (real / ID.filename("a")).is_file()
    retarget(link, real)
    store.check_before_restore(candidate)  # leads back: allowed again


def test_a_link_planted_at_the_name_after_the_check_is_not_restored(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    save(store, 10)
    candidate, _ = store.find_restorable(ID, FP)
    assert candidate is not None
    path = store.snapshot_dirs["local"] / candidate.record.filename
    copy = tmp_path / "copy.bin"
    copy.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(copy)
    with pytest.raises(UnsafeFile):  # not the file verified
        store.check_before_restore(candidate)


async def test_doctor_reports_a_moved_snapshot_dir_and_probes_nothing_through_it(
    linked: Harness, tmp_path: Path
) -> None:
    h = linked
    outside = tmp_path / "outside"
    outside.mkdir()
    retarget(tmp_path / "snaps", outside)
    doctor = Doctor(
        config=h.coordinator.config,
        server="local",
        backend=h.fake,
        process_finder=lambda _url: None,
        crash_reader=lambda _scope: CrashRecord(),
        snapshot_anchor=h.coordinator.store.snapshot_anchor("local"),
    )
    h.fake.calls.clear()
    report = await doctor.run()
    [check] = [c for c in report.checks if c.name == "snapshot directory"]
    assert check.status == "FAIL" and "SNAPSHOT_DIR_MOVED" in check.detail
    assert report.result == "NOT READY" and saves(h) == [] and list(outside.iterdir()) == []
