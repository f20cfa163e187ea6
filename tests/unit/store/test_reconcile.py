"""Store rules that exist once: writes off the event loop, one orphan rule, one free-disk floor."""

from __future__ import annotations

import asyncio
import errno
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kvsidecar.config import RetentionConfig
from kvsidecar.errors import MetadataIO
from kvsidecar.metrics import Metrics
from kvsidecar.retention.job import RetentionJob
from kvsidecar.retention.plan import Disk, Policy, free_floor_bytes
from kvsidecar.store import reconcile as reconcile_module
from kvsidecar.store.reconcile import LooseFile
from kvsidecar.store.snapshots import FILE_MISSING, SIZE_MISMATCH, SnapshotStore
from kvsidecar.store.watcher import SnapshotWatcher
from tests.unit.store.test_snapshots import FP, ID, Clock, save, server_writes


@pytest.fixture
def fsync_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """The thread of every fsync from now on."""
    seen: list[int] = []
    real = os.fsync

    def spy(fd: int) -> None:
        seen.append(threading.get_ident())
        real(fd)

    monkeypatch.setattr(os, "fsync", spy)
    yield seen


def shared_dir_store(tmp_path: Path) -> SnapshotStore:
    """Two servers whose snapshot_dir is the same directory (nothing in the config forbids it)."""
    store = SnapshotStore(
        state_dir=tmp_path / "state",
        snapshot_dirs={"local": tmp_path / "snaps", "other": tmp_path / "snaps"},
        clock=Clock(),
    )
    store.open()
    return store


async def test_watcher_marks_files_without_fsync_on_the_event_loop(
    tmp_path: Path, fsync_threads: list[int]
) -> None:
    store = _one_store(tmp_path)
    save(store, 10)
    fsync_threads.clear()
    seen: asyncio.Queue[tuple[str, str, str]] = asyncio.Queue()
    watcher = SnapshotWatcher(
        store, asyncio.get_running_loop(), debounce_ms=10, on_invalid=lambda *a: seen.put_nowait(a)
    )
    watcher.start()
    try:
        (store.snapshot_dirs["local"] / ID.filename("a")).unlink()
        _, _, reason = await asyncio.wait_for(seen.get(), 5)
    finally:
        watcher.stop()
    assert reason == FILE_MISSING
    m = store.get(ID.key)
    assert m is not None and m.generations["a"].invalid_reason == FILE_MISSING  # written, durably
    assert fsync_threads, "marking the generation wrote its manifest with fsync"
    assert threading.get_ident() not in fsync_threads  # ... and never on the event loop's thread


async def test_watcher_rechecks_of_two_generations_both_land(tmp_path: Path) -> None:
    store = _one_store(tmp_path)
    save(store, 10)
    save(store, 20, revision=2)
    seen: asyncio.Queue[tuple[str, str, str]] = asyncio.Queue()
    watcher = SnapshotWatcher(
        store, asyncio.get_running_loop(), debounce_ms=10, on_invalid=lambda *a: seen.put_nowait(a)
    )
    watcher.start()
    try:
        (store.snapshot_dirs["local"] / ID.filename("a")).unlink()
        (store.snapshot_dirs["local"] / ID.filename("b")).write_bytes(b"resized")
        reasons = {(await asyncio.wait_for(seen.get(), 5))[1:] for _ in range(2)}
    finally:
        watcher.stop()
    assert reasons == {(ID.filename("a"), FILE_MISSING), (ID.filename("b"), SIZE_MISMATCH)}
    again = SnapshotStore(state_dir=tmp_path / "state", snapshot_dirs={"local": tmp_path / "snaps"})
    again.load_readonly()  # what is on disk, not only in memory
    m = again.get(ID.key)
    assert m is not None
    assert {g: r.invalid_reason for g, r in m.generations.items()} == {"a": FILE_MISSING, "b": SIZE_MISMATCH}


def test_a_snapshot_in_a_shared_directory_is_nobodys_orphan(tmp_path: Path) -> None:
    store = shared_dir_store(tmp_path)
    save(store, 10)  # server "local"; the directory lists it under "other" too
    assert store.loose_files() == []
    again = SnapshotStore(
        state_dir=tmp_path / "state",
        snapshot_dirs={"local": tmp_path / "snaps", "other": tmp_path / "snaps"},
    )
    assert again.open().orphans == []


async def test_a_file_being_written_in_a_shared_directory_is_not_collected(tmp_path: Path) -> None:
    store = shared_dir_store(tmp_path)
    plan = store.begin_save(ID)  # llama-server of "local" is writing it
    plan.path.write_bytes(b"half written")
    old = time.time() - 3600
    os.utime(plan.path, (old, old))
    assert store.loose_files() == []
    job = RetentionJob(
        store=store,
        config=RetentionConfig(),
        metrics=Metrics(),
        protected_keys=set,
        disk_usage=lambda _: Disk(total_bytes=10**12, free_bytes=10**12),
    )
    report = await job.run()
    assert report["deletions"] == [] and plan.path.exists()
    store.commit_save(plan, server_writes(plan, 10), fingerprint=FP, revision=1)
    assert store.find_restorable(ID, FP)[0] is not None


def test_a_real_orphan_in_a_shared_directory_is_still_found_once_per_listing(tmp_path: Path) -> None:
    store = shared_dir_store(tmp_path)
    name = "f" * 32 + ".a.bin"
    (tmp_path / "snaps" / name).write_bytes(b"left behind")
    loose = store.loose_files(temp=False)
    assert {(f.area, f.name) for f in loose} == {("local", name), ("other", name)}
    assert store.delete_loose(loose[0]) is True
    assert not (tmp_path / "snaps" / name).exists()


@pytest.mark.parametrize(
    ("total", "min_bytes", "percent", "floor"),
    [
        (1001, None, 10.0, 101),  # 100.1 rounds up: the floor is never below the percentage asked for
        (1000, None, 10.0, 100),
        (1000, 500, 10.0, 500),  # the larger of the two
        (10**12, 1, 0.5, 5 * 10**9),
        (1000, None, None, None),
        (1000, 0, None, 0),
    ],
)
def test_one_free_disk_floor(
    total: int, min_bytes: int | None, percent: float | None, floor: int | None
) -> None:
    got = free_floor_bytes(total_bytes=total, min_free_bytes=min_bytes, min_free_percent=percent)
    assert got == floor
    policy = Policy(min_free_bytes=min_bytes, min_free_percent=percent)
    assert policy.floor(Disk(total_bytes=total, free_bytes=0)) == floor


ORPHAN_KEY = "e" * 32


def _table_held(store: SnapshotStore) -> bool:
    lock = store.table._lock
    free = lock.acquire(blocking=False)
    if free:
        lock.release()
    return not free


def _one_store(tmp_path: Path) -> SnapshotStore:
    store = SnapshotStore(state_dir=tmp_path / "state", snapshot_dirs={"local": tmp_path / "snaps"})
    store.open()
    return store


def _with_orphan(tmp_path: Path, gen: str = "a") -> tuple[SnapshotStore, str]:
    """A store, and a file of ours by name in its snapshot directory that no manifest references."""
    store = _one_store(tmp_path)
    name = f"{ORPHAN_KEY}.{gen}.bin"
    (tmp_path / "snaps" / name).write_bytes(b"orphan")
    return store, name


class _UnlinkSpy:
    """Records, for each unlink in the snapshot directory, whether the manifest table was free meanwhile."""

    def __init__(
        self, store: SnapshotStore, monkeypatch: pytest.MonkeyPatch, fail: str | None = None
    ) -> None:
        self.store, self.fail = store, fail
        self.real = os.unlink
        self.seen: list[tuple[str, bool]] = []
        monkeypatch.setattr(os, "unlink", self)

    def __call__(self, name: Any, *args: Any, **kwargs: Any) -> None:
        self.seen.append((str(name), not _table_held(self.store)))
        if self.fail is not None and str(name).endswith(".bin") and str(name) != self.fail:
            raise OSError(5, "EIO")
        self.real(name, *args, **kwargs)


def test_an_orphan_is_freed_without_holding_the_manifest_table(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Freeing a 30 GB orphan takes seconds, and every manifest lookup (on the event loop) waits for the
    table: the orphan is renamed to a fresh claimed name under the table and deleted after."""
    store, name = _with_orphan(tmp_path, "b")
    spy = _UnlinkSpy(store, monkeypatch)
    [loose] = store.loose_files(temp=False)
    assert store.delete_loose(loose) is True
    deleted = [(n, free) for n, free in spy.seen if n.endswith(".bin")]
    assert len(deleted) == 1 and deleted[0][1], f"unlinked with the table held: {deleted}"
    assert deleted[0][0] != name and deleted[0][0].startswith(ORPHAN_KEY + ".b.")  # its fresh name
    assert list((tmp_path / "snaps").iterdir()) == [] and store.inflight() == set()


def test_an_orphan_that_fails_to_delete_is_left_to_the_next_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, name = _with_orphan(tmp_path, "a")
    _UnlinkSpy(store, monkeypatch, fail=name)
    [loose] = store.loose_files(temp=False)
    with pytest.raises(MetadataIO):
        store.delete_loose(loose)
    monkeypatch.undo()
    assert store.inflight() == set()  # its fresh name is nobody's claim: the next run finds it
    [again] = store.loose_files(temp=False)
    assert again.name != name and again.kind == "orphan"
    assert store.delete_loose(again) is True
    assert list((tmp_path / "snaps").iterdir()) == []


def test_an_orphan_adopted_before_the_deletion_is_kept(tmp_path: Path) -> None:
    store = _one_store(tmp_path)
    plan = store.begin_save(ID)  # the name is claimed from here on
    plan.path.write_bytes(b"being written")
    stale = LooseFile(area="local", name=plan.filename, bytes=13, mtime=0.0, kind="orphan")
    assert store.delete_loose(stale) is False  # listed before the save claimed it: not deleted
    assert plan.path.read_bytes() == b"being written"
    assert sorted(p.name for p in (tmp_path / "snaps").iterdir()) == [plan.filename]


def test_an_orphan_is_renamed_with_the_table_held_and_its_fresh_name_claimed_until_unlinked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The re-check and the rename are one step; the fresh name is nobody's orphan while it is freed."""
    store, name = _with_orphan(tmp_path, "b")
    renames: list[tuple[str, str, bool]] = []
    unlinks: list[tuple[str, bool, set[tuple[str, str]], list[str]]] = []
    real_rename, real_unlink = os.rename, os.unlink

    def rename(src: Any, dst: Any, *a: Any, **k: Any) -> None:
        renames.append((str(src), str(dst), _table_held(store)))
        real_rename(src, dst, *a, **k)

    def unlink(p: Any, *a: Any, **k: Any) -> None:
        held = _table_held(store)
        listed = [] if held else [f.name for f in store.loose_files(temp=False)]
        unlinks.append((str(p), held, set() if held else store.inflight(), listed))
        real_unlink(p, *a, **k)

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "unlink", unlink)
    [loose] = store.loose_files(temp=False)
    assert store.delete_loose(loose) is True
    [(src, aside, held)] = renames
    assert src == name and held, "renamed with the table free: a save could adopt the name in between"
    [(gone, held_then, claims, listed)] = [u for u in unlinks if u[0].endswith(".bin")]
    assert gone == aside and not held_then
    assert ("local", aside) in claims and listed == []  # claimed: no listing offers it meanwhile
    assert store.inflight() == set()


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_a_link_at_an_orphan_name_is_removed_itself(tmp_path: Path, kind: str) -> None:
    store = _one_store(tmp_path)
    save(store, 10)
    good = tmp_path / "snaps" / ID.filename("a")
    before = good.read_bytes()
    at = tmp_path / "snaps" / (ORPHAN_KEY + ".a.bin")
    if kind == "symlink":
        at.symlink_to(good)
    else:
        os.link(good, at)
    [loose] = store.loose_files(temp=False)
    assert store.delete_loose(loose) is True
    assert not os.path.lexists(at) and good.read_bytes() == before and os.stat(good).st_nlink == 1
    assert sorted(p.name for p in (tmp_path / "snaps").iterdir()) == [good.name]
    assert store.find_restorable(ID, FP)[0] is not None


@pytest.mark.parametrize("when", ["after the listing", "between the check and the rename"])
def test_a_directory_swapped_in_at_an_orphan_name_is_refused_and_left_where_it_was(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, when: str
) -> None:
    store, name = _with_orphan(tmp_path)
    snaps = tmp_path / "snaps"

    def swap() -> None:
        (snaps / name).unlink()
        (snaps / name).mkdir()
        (snaps / name / "precious").write_bytes(b"x")

    [loose] = store.loose_files(temp=False)
    if when == "after the listing":
        swap()
    else:
        real_rename = os.rename

        def rename(src: Any, dst: Any, *a: Any, **k: Any) -> None:
            if str(src) == name:
                swap()
            real_rename(src, dst, *a, **k)

        monkeypatch.setattr(os, "rename", rename)
    with pytest.raises(MetadataIO):
        store.delete_loose(loose)
    monkeypatch.undo()
    assert [p.name for p in snaps.iterdir()] == [name]  # put back under its own name, nothing inside lost
    assert (snaps / name / "precious").read_bytes() == b"x"
    assert store.inflight() == set()


def test_a_crash_between_the_rename_and_the_unlink_leaves_an_orphan_the_next_daemon_collects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, name = _with_orphan(tmp_path)
    snaps = tmp_path / "snaps"
    old = time.time() - 3600
    os.utime(snaps / name, (old, old))

    class Crash(BaseException):
        pass

    def unlink(*_a: Any, **_k: Any) -> None:
        raise Crash

    monkeypatch.setattr(os, "unlink", unlink)
    [loose] = store.loose_files(temp=False)
    with pytest.raises(Crash):
        store.delete_loose(loose)
    monkeypatch.undo()
    [left] = list(snaps.iterdir())
    assert left.name != name and abs(left.stat().st_mtime - old) < 1  # a rename keeps the mtime
    again = _one_store(tmp_path)  # the next daemon
    [found] = again.loose_files(temp=False)
    assert found.name == left.name and again.delete_loose(found) is True
    assert list(snaps.iterdir()) == []


@pytest.mark.parametrize("taken_how", ["on disk", "claimed by a save"])
def test_a_fresh_name_that_is_taken_is_never_used(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, taken_how: str
) -> None:
    """A save claims its staging (fleet) or moved-aside name before the file exists: retention must not
    move an orphan onto it, delete what the save then writes there, or end the save's claim."""
    store, name = _with_orphan(tmp_path)
    snaps = tmp_path / "snaps"
    taken = ORPHAN_KEY + ".a.0badf00d.bin"
    if taken_how == "on disk":
        (snaps / taken).write_bytes(b"someone's file")
    else:
        store.table.writing_started("local", taken)
    names = iter([taken, ORPHAN_KEY + ".a.0000beef.bin"])
    monkeypatch.setattr(reconcile_module, "staging_filename", lambda _k, _g: next(names))
    [loose] = [f for f in store.loose_files(temp=False) if f.name == name]
    assert store.delete_loose(loose) is True
    assert not (snaps / name).exists() and not (snaps / (ORPHAN_KEY + ".a.0000beef.bin")).exists()
    if taken_how == "on disk":
        assert (snaps / taken).read_bytes() == b"someone's file"
    else:
        assert store.inflight() == {("local", taken)}  # the save's claim stands


def test_a_failed_rename_ends_its_claim_and_deletes_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, _ = _with_orphan(tmp_path)

    def rename(*_a: Any, **_k: Any) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "rename", rename)
    [loose] = store.loose_files(temp=False)
    assert store.delete_loose(loose) is True  # freeing space is what retention is for, slow or not
    assert store.inflight() == set() and list((tmp_path / "snaps").iterdir()) == []


def test_fleet_the_fresh_name_is_unlinked_outside_the_keys_fence(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Other hosts wait at most a few seconds for a key's fence: the seconds-long unlink of a large orphan
    must not hold it (the re-check and the rename do)."""
    store = SnapshotStore(
        state_dir=tmp_path / "state",
        snapshot_dirs={"local": tmp_path / "snaps"},
        shared_dir=tmp_path / "meta",
    )
    store.open()
    fence = store.fence_with(lambda _key: 1)
    snaps = tmp_path / "snaps"
    name = ORPHAN_KEY + ".a.bin"
    (snaps / name).write_bytes(b"orphan")
    old = time.time() - 3600
    os.utime(snaps / name, (old, old))
    renamed: list[bool] = []
    unlinked: list[tuple[str, bool]] = []
    real_rename, real_unlink = os.rename, os.unlink

    def fenced() -> bool:
        lock = fence._locks.get(ORPHAN_KEY)
        return lock is not None and lock.locked()

    def rename(src: Any, dst: Any, *a: Any, **k: Any) -> None:
        renamed.append(fenced())
        real_rename(src, dst, *a, **k)

    def unlink(p: Any, *a: Any, **k: Any) -> None:
        unlinked.append((str(p), fenced()))
        real_unlink(p, *a, **k)

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr(os, "unlink", unlink)
    [loose] = store.loose_files(temp=False)
    assert store.delete_loose(loose) is True
    monkeypatch.undo()
    [(gone, fenced_then)] = [u for u in unlinked if u[0].endswith(".bin")]
    assert renamed == [True] and gone != name and not fenced_then
    assert list(snaps.iterdir()) == []
