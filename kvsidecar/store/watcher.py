"""Keeps the store current while running: a watchdog observer on each snapshot directory.

The observer's thread never touches the store: it hands each event to the event loop with
`call_soon_threadsafe`, where events for one file are debounced (`debounce_ms`) into one recheck.
A recheck may mark the generation invalid, which writes its manifest durably (fsync): it runs in a worker
thread, never on the event loop, and one at a time (a burst of events, `rm -r` say, takes one worker
thread, not all of them, from the saves and restores that share the pool).
An operator's `rm` of a snapshot file marks that generation missing within about a second.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from pathlib import Path

from watchdog.events import FileSystemEvent, FileSystemEventHandler
from watchdog.observers import Observer
from watchdog.observers.api import BaseObserver

from kvsidecar.store.naming import SNAPSHOT_FILE
from kvsidecar.store.snapshots import SnapshotStore

log = logging.getLogger("kvsidecar.watcher")

OnInvalid = Callable[[str, str, str], None]  # (server, filename, reason)


class _Handler(FileSystemEventHandler):
    def __init__(self, watcher: SnapshotWatcher, server: str) -> None:
        self.watcher = watcher
        self.server = server

    def on_any_event(self, event: FileSystemEvent) -> None:
        for raw in (event.src_path, getattr(event, "dest_path", "")):
            name = Path(str(raw)).name if raw else ""
            if SNAPSHOT_FILE.match(name):
                self.watcher.loop.call_soon_threadsafe(self.watcher.schedule, self.server, name)


class SnapshotWatcher:
    def __init__(
        self,
        store: SnapshotStore,
        loop: asyncio.AbstractEventLoop,
        *,
        debounce_ms: float = 200.0,
        on_invalid: OnInvalid | None = None,
    ) -> None:
        self.store = store
        self.loop = loop
        self.debounce_ms = debounce_ms
        self.on_invalid = on_invalid
        self._pending: dict[tuple[str, str], asyncio.TimerHandle] = {}  # loop thread only
        self._rechecks: set[asyncio.Task[None]] = set()  # loop thread only
        self._one_at_a_time = asyncio.Lock()  # one recheck in a worker thread at a time
        self._observer: BaseObserver | None = None

    def start(self) -> None:
        observer = Observer()
        for server, directory in self.store.snapshot_dirs.items():
            observer.schedule(_Handler(self, server), str(directory), recursive=False)
        observer.daemon = True
        observer.start()
        self._observer = observer

    def schedule(self, server: str, filename: str) -> None:
        key = (server, filename)
        if (handle := self._pending.pop(key, None)) is not None:
            handle.cancel()
        self._pending[key] = self.loop.call_later(self.debounce_ms / 1000, self._fire, server, filename)

    def _fire(self, server: str, filename: str) -> None:
        self._pending.pop((server, filename), None)
        task = self.loop.create_task(self._recheck(server, filename))
        self._rechecks.add(task)
        task.add_done_callback(self._recheck_done)

    def _recheck_done(self, task: asyncio.Task[None]) -> None:
        self._rechecks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            log.warning("kv.watcher.recheck_failed error=%s", str(exc)[:200])

    async def _recheck(self, server: str, filename: str) -> None:
        async with self._one_at_a_time:
            reason = await asyncio.to_thread(self.store.recheck_file, server, filename)
        if reason is not None:
            log.warning("kv.snapshot.invalidated file=%s reason=%s (changed on disk)", filename[:8], reason)
            if self.on_invalid is not None:
                self.on_invalid(server, filename, reason)

    @property
    def pending(self) -> int:
        return len(self._pending)

    def stop(self) -> None:
        for handle in self._pending.values():
            handle.cancel()
        self._pending.clear()
        for task in self._rechecks:  # a recheck already in its thread finishes there; its result is dropped
            task.cancel()
        self._rechecks.clear()
        if self._observer is not None:
            self._observer.stop()
            self._observer.join(timeout=5)
            self._observer = None
