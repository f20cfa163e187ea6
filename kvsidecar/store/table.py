"""The manifest table: the store's index of every manifest in `<state_dir>/manifests/`, and its writes.

It owns the in-memory view of the manifests (loaded at start, written through on every change with the
atomic-write helper), the manifest files that were refused (one bad manifest is one bad session: it is
reported and left alone, and its key's files are held until a save for that identity replaces it or it
is purged), the snapshot names llama-server may be writing right now, and what each server was last
seen to run (its fingerprint digest and state-file format version).

It also owns the one orphan rule (`claimed`): a file with one of our snapshot names belongs to someone
when its key's manifest references it, a save is writing it, or a refused manifest holds its key.
Reconcile, retention and the deletion of a loose file all ask this one question.

Thread-safety: `_lock` guards every dict and set below; methods may be called from worker threads (the
coordinator and the watcher run fsyncs off the event loop). Each read-modify-write of a manifest holds
`_update` (`updating()`), so two threads changing one manifest (the watcher marking a file while a save
commits) never lose either change. Ordering of the operations on one identity is the coordinator's job.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

from kvsidecar.errors import DirMoved, Fenced, KvError, ManifestInvalid, MetadataIO, SnapshotNotFound
from kvsidecar.files.atomic import atomic_write_at
from kvsidecar.files.confined import UNSAFE, lstat_at
from kvsidecar.logs import event
from kvsidecar.store.fence import FenceFiles
from kvsidecar.store.layout import StoreLayout
from kvsidecar.store.manifest import (
    BAD_NAME,
    BadManifest,
    GenerationRecord,
    Manifest,
    read_manifest,
)
from kvsidecar.store.naming import MANIFEST_FILE, Generation, parse_snapshot_name

log = logging.getLogger("kvsidecar.store")

# Reason codes recorded on a generation that may not be restored.
FILE_MISSING = "SNAPSHOT_FILE_MISSING"
SIZE_MISMATCH = "SNAPSHOT_SIZE_MISMATCH"
CORRUPT = "SNAPSHOT_CORRUPT"
RESTORE_FAILED = "RESTORE_FAILED"
STATE_FORMAT_CHANGED = "STATE_FORMAT_CHANGED"
TOO_LARGE = "SNAPSHOT_EXCEEDS_SLOT_CONTEXT"
FILE_UNSAFE = UNSAFE  # a link, FIFO, device, directory, hard link or foreign file at a generation's name


class ManifestTable:
    def __init__(self, layout: StoreLayout, *, clock: Callable[[], float]) -> None:
        self.layout = layout
        self.clock = clock  # stamps updated_at / last_used_at on every change
        # Held across each read-modify-write of a manifest (read, change, durable write): two threads that
        # change one manifest (the watcher marking a file, a save committing) never lose either change.
        self._update = threading.RLock()
        # guards the five fields below; any thread; held across I/O only by `holding_claims` (a rename, or
        # the unlink of a small or unrenamable loose file)
        self._lock = threading.Lock()
        self._manifests: dict[str, Manifest] = {}  # key -> manifest
        self._bad: dict[str, str] = {}  # refused manifest file name -> "REASON: detail"
        self._inflight: set[tuple[str, str]] = set()  # (server, filename) llama-server may be writing
        self._formats: dict[str, int] = {}  # server -> state-file version its last save wrote
        self._runtime: dict[str, str] = {}  # server -> fingerprint digest last seen for it
        # Fleet mode: the shared store's fence files (kvsidecar.store.fence); None on a single host.
        self.fence: FenceFiles | None = None

    def load(self) -> tuple[int, dict[str, str]]:
        """(Re)read every manifest file: how many loaded, and the refused ones (file name -> why)."""
        loaded: dict[str, Manifest] = {}
        bad: dict[str, str] = {}
        # Through the held manifests directory (a link put in its place later is never read through)
        with contextlib.ExitStack() as stack:
            try:
                dfd = stack.enter_context(self.layout.manifest_dir.fd())
                names = os.listdir(dfd)
            except (KvError, OSError):
                dfd, names = -1, []
            for name in names:
                if name.startswith(".") or not name.endswith(".json"):
                    continue
                try:
                    if not MANIFEST_FILE.match(name):
                        raise BadManifest(BAD_NAME, "not a manifest file name of ours; not read")
                    m = read_manifest(Path(name), dir_fd=dfd)
                    loaded[m.key] = m
                except ManifestInvalid as exc:
                    bad[name] = exc.message
                    event(
                        log,
                        logging.WARNING,
                        "kv.manifest.invalid",
                        file=repr(name[:40]),
                        reason=getattr(exc, "reason", "MANIFEST_INVALID"),
                        detail=exc.message[:200],
                    )
        with self._lock:
            self._manifests, self._bad = loaded, bad
        return len(loaded), dict(bad)

    def reload(self, key: str) -> Manifest | None:
        """Fleet mode: re-read one key's manifest from the shared directory (another host may have
        committed since); a missing file forgets the key, a refused one is recorded as bad."""
        name = f"{key}.json"
        manifest: Manifest | None = None
        problem: str | None = None
        try:
            with self.layout.manifest_dir.fd() as dfd:  # the held directory, never a link in its place
                if lstat_at(self.layout.manifest_dir.check(name), dfd) is not None:
                    manifest = read_manifest(Path(name), dir_fd=dfd)
        except SnapshotNotFound:  # no manifests directory (yet): no manifest
            pass
        except ManifestInvalid as exc:
            problem = exc.message
        with self._lock:
            self._bad.pop(name, None)
            if manifest is None:
                self._manifests.pop(key, None)
                if problem is not None:
                    self._bad[name] = problem
            else:
                self._manifests[key] = manifest
        return manifest

    @contextlib.contextmanager
    def fenced(self, key: str, what: str) -> Iterator[None]:
        """Hold around a write or delete of one key's files: in fleet mode refused (Fenced) unless this
        host holds the key's newest fencing token; a no-op on a single host."""
        if self.fence is None:
            yield
        else:
            with self.fence.guard(key, what):
                yield

    # queries -----------------------------------------------------------------------------------------
    def get(self, key: str) -> Manifest | None:
        with self._lock:
            return self._manifests.get(key)

    def all(self) -> list[Manifest]:
        with self._lock:
            return list(self._manifests.values())

    def bad_manifests(self) -> dict[str, str]:
        with self._lock:
            return dict(self._bad)

    def is_bad(self, key: str) -> bool:
        with self._lock:
            return f"{key}.json" in self._bad

    def held_keys(self) -> set[str]:
        """Keys whose manifest is present but refused: their files are nobody's orphans."""
        with self._lock:
            return {m.group("key") for name in self._bad if (m := MANIFEST_FILE.match(name))}

    def inflight(self) -> set[tuple[str, str]]:
        with self._lock:
            return set(self._inflight)

    def observed_format_version(self, server: str) -> int | None:
        with self._lock:
            return self._formats.get(server)

    def last_runtime(self, server: str) -> str | None:
        with self._lock:
            return self._runtime.get(server)

    # what the servers are doing ----------------------------------------------------------------------
    def writing_started(self, server: str, filename: str) -> None:
        """llama-server may be writing `filename` from now on: it is nobody's orphan meanwhile."""
        with self._lock:
            self._inflight.add((server, filename))

    def writing_ended(self, server: str, filename: str) -> None:
        with self._lock:
            self._inflight.discard((server, filename))

    def saw_runtime(self, server: str, digest: str, *, format_version: int | None = None) -> None:
        with self._lock:
            self._runtime[server] = digest
            if format_version is not None:
                self._formats[server] = format_version

    # the one orphan rule -----------------------------------------------------------------------------
    def _claimed(self, name: str) -> bool:
        """Caller holds _lock. A snapshot name belongs to someone: not one of ours at all, referenced by its
        key's manifest (file names are bound to their manifest's key), being written (by any server: a
        shared directory lists it under each), or its key's manifest is present but refused."""
        parsed = parse_snapshot_name(name)
        if parsed is None:
            return True
        manifest = self._manifests.get(parsed[0])
        if manifest is not None and any(r.filename == name for r in manifest.generations.values()):
            return True
        return any(n == name for _, n in self._inflight) or f"{parsed[0]}.json" in self._bad

    def unclaimed(self, names: list[str]) -> set[str]:
        """The names in `names` that nobody claims: the orphans among them."""
        with self._lock:
            return {n for n in names if not self._claimed(n)}

    @contextlib.contextmanager
    def holding_claims(self, name: str) -> Iterator[bool]:
        """Whether `name` is unclaimed, with the index held still meanwhile: no save can adopt the name
        (nor a manifest start referencing it) while the caller acts on the answer, e.g. renames the file."""
        with self._lock:
            yield not self._claimed(name)

    def claim_held(self, server: str, filename: str) -> bool:
        """For a caller inside `holding_claims` (which holds the lock already): claim `filename`, a fresh
        name, as `writing_started` does; False (nothing claimed) if anyone claims it already."""
        if self._claimed(filename):
            return False
        self._inflight.add((server, filename))
        return True

    def claim_fresh(self, server: str, filename: str) -> bool:
        """`claim_held` for a caller that does not hold the lock."""
        with self._lock:
            return self.claim_held(server, filename)

    def unclaim_held(self, server: str, filename: str) -> None:
        self._inflight.discard((server, filename))

    # writes ------------------------------------------------------------------------------------------
    @contextlib.contextmanager
    def updating(self) -> Iterator[None]:
        """Hold around reading a manifest, changing it and `put`ting it back (reentrant)."""
        with self._update:
            yield

    def put(self, manifest: Manifest) -> Manifest:
        """Write a manifest durably, into the held manifests directory only, and only while its path
        still leads there (DirMoved otherwise: nothing is written; session ids never land elsewhere)."""
        try:
            with self.fenced(manifest.key, "manifest write"):
                d = self.layout.manifest_dir
                name = d.check(f"{manifest.key}.json")
                self.layout.check_metadata("manifests")
                with d.fd() as dfd:
                    atomic_write_at(dfd, name, manifest.to_json())
        except OSError as exc:
            raise MetadataIO(f"cannot write metadata in {self.layout.state_dir}: {exc.strerror}") from None
        with self._lock:
            self._manifests[manifest.key] = manifest
            replaced = self._bad.pop(f"{manifest.key}.json", None)
        if replaced is not None:
            event(log, logging.WARNING, "kv.manifest.replaced_invalid", snapshot=manifest.key[:8])
        return manifest

    def drop(self, key: str) -> None:
        """Delete a key's manifest file (or the refused file in its place) and forget it."""
        try:
            with self.fenced(key, "manifest delete"):
                self.layout.manifest_dir.unlink(f"{key}.json")
        except (Fenced, DirMoved):
            raise
        except (KvError, OSError) as exc:
            raise MetadataIO(f"cannot delete manifest {key[:8]}: {exc}") from None
        with self._lock:
            self._manifests.pop(key, None)
            self._bad.pop(f"{key}.json", None)

    def mark_invalid(self, key: str, gen: Generation, reason: str) -> None:
        """Record that a generation may not be restored. Never deletes anything (spec §31)."""
        with self.updating():
            manifest = self.get(key)
            rec = manifest.generation(gen) if manifest else None
            if manifest is None or rec is None or rec.invalid_reason == reason:
                return
            changed = manifest.with_generation(
                gen, replace(rec, invalid_reason=reason), updated_at=self.clock()
            )
            try:
                self.put(changed)
            except Fenced:  # fleet: another host owns the key; it re-checks the file before any restore
                with self._lock:
                    self._manifests[key] = changed

    def touch(self, key: str, *, persist: bool = True) -> None:
        """Note a use of the snapshot (retention's LRU order); persist=False: in memory only, no write."""
        with self.updating():
            manifest = self.get(key)
            if manifest is None:
                return
            updated = replace(manifest, last_used_at=self.clock())
            if persist and self.fence is None:
                self.put(updated)
            else:  # fleet: a use is not worth a fenced write to a shared file (retention reads residency)
                with self._lock:
                    self._manifests[key] = updated

    def forget_generation(self, key: str, gen: Generation) -> tuple[str, GenerationRecord] | None:
        """Drop a generation's record (the whole manifest with its last one): (server, the record) it was,
        for the caller to delete the file after. None if there was no such record."""
        with self.updating():
            manifest = self.get(key)
            rec = manifest.generation(gen) if manifest else None
            if manifest is None or rec is None:
                return None
            current = manifest.current if manifest.current != gen else None
            remaining = manifest.with_generation(gen, None, current=current, updated_at=self.clock())
            if remaining.generations:
                self.put(remaining)
            else:
                self.drop(key)
        return manifest.server, rec
