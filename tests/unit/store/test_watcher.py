"""The watchdog observer marks a snapshot missing soon after an operator deletes its file."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvsidecar.store.snapshots import FILE_MISSING, SIZE_MISMATCH
from kvsidecar.store.watcher import SnapshotWatcher
from tests.unit.store.test_snapshots import ID, make_store, save


async def test_rm_marks_the_generation_missing(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    save(store, 10)
    seen: asyncio.Queue[tuple[str, str, str]] = asyncio.Queue()
    watcher = SnapshotWatcher(
        store, asyncio.get_running_loop(), debounce_ms=50, on_invalid=lambda *a: seen.put_nowait(a)
    )
    watcher.start()
    try:
        (store.snapshot_dirs["local"] / ID.filename("a")).unlink()
        server, filename, reason = await asyncio.wait_for(seen.get(), 5)
    finally:
        watcher.stop()
    assert (server, filename, reason) == ("local", ID.filename("a"), FILE_MISSING)
    m = store.get(ID.key)
    assert m is not None and m.generations["a"].invalid_reason == FILE_MISSING
    assert watcher.pending == 0


async def test_events_are_debounced_and_foreign_files_ignored(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    save(store, 10)
    seen: asyncio.Queue[tuple[str, str, str]] = asyncio.Queue()
    watcher = SnapshotWatcher(
        store, asyncio.get_running_loop(), debounce_ms=100, on_invalid=lambda *a: seen.put_nowait(a)
    )
    watcher.start()
    try:
        path = store.snapshot_dirs["local"] / ID.filename("a")
        (store.snapshot_dirs["local"] / "notes.txt").write_text("not a snapshot")
        for i in range(5):
            path.write_bytes(b"x" * (i + 1))
        _, _, reason = await asyncio.wait_for(seen.get(), 5)
    finally:
        watcher.stop()
    assert reason == SIZE_MISMATCH
    assert seen.empty()  # five writes, one recheck
