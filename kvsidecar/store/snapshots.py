"""The snapshot store: which file is a session's snapshot, and whether it is safe to restore (spec §39-42).

It owns the manifests in `<state_dir>/manifests/` and reads (never writes) the `.bin` files llama-server
saves into each server's snapshot directory. A save goes to the generation the manifest does not point at,
and the manifest flips to it only once the file on disk is verified; the previous generation stays as the
fallback. Before a restore a generation must match the server's runtime fingerprint and pass the integrity
checks. Nothing here deletes a file except `purge()` and `delete_generation()` (retention, operators).

Thread-safety: the index (`_manifests`) is guarded by `_lock`; methods may be called from worker threads
(the coordinator runs checksums and fsyncs off the event loop). Per-identity ordering is the coordinator's
job: it never runs two operations on one identity at once.
"""

from __future__ import annotations

import contextlib
import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path

from kvsidecar.backend.base import SaveResult
from kvsidecar.errors import KvError, ManifestInvalid, MetadataIO, SnapshotCorrupt, SnapshotNotFound
from kvsidecar.store.atomic import atomic_write_bytes, ensure_private_dir, sweep_temp_files
from kvsidecar.store.fingerprint import RuntimeFingerprint
from kvsidecar.store.integrity import file_checksum, file_size, read_header, verify_file
from kvsidecar.store.manifest import GenerationRecord, Manifest, manifest_path, read_manifest, write_manifest
from kvsidecar.store.naming import SNAPSHOT_FILE, Generation, SnapshotIdentity, other_generation

# Reason codes recorded on a generation that may not be restored.
FILE_MISSING = "SNAPSHOT_FILE_MISSING"
SIZE_MISMATCH = "SNAPSHOT_SIZE_MISMATCH"
CORRUPT = "SNAPSHOT_CORRUPT"
RESTORE_FAILED = "RESTORE_FAILED"
STATE_FORMAT_CHANGED = "STATE_FORMAT_CHANGED"
TOO_LARGE = "SNAPSHOT_EXCEEDS_SLOT_CONTEXT"


@dataclass(frozen=True, kw_only=True)
class SavePlan:
    identity: SnapshotIdentity
    generation: Generation
    filename: str
    path: Path


@dataclass(frozen=True, kw_only=True)
class Candidate:
    identity: SnapshotIdentity
    generation: Generation
    record: GenerationRecord
    path: Path
    fallback: bool  # True when the current generation was unusable and this is the previous one


@dataclass(frozen=True, kw_only=True)
class Rejection:
    generation: Generation
    reason: str
    detail: str
    persistent: bool  # recorded on the generation (False: only not restorable on this runtime)


@dataclass(kw_only=True)
class ReconcileReport:
    manifests: int = 0
    invalidated: list[tuple[str, str, str]] = field(default_factory=list)  # (key, gen, reason)
    bad_manifests: dict[str, str] = field(default_factory=dict)  # file name -> reason
    orphans: list[Path] = field(default_factory=list)
    temp_files_removed: int = 0
    elapsed_ms: float = 0.0


def _make_private(path: Path) -> None:
    """KV snapshots are plaintext transcripts: 0600 when we own the file. (When llama-server runs as
    another user sharing a group, its own umask decides; see systemd/llama-server.service.)"""
    with contextlib.suppress(OSError):
        if path.stat().st_uid == os.geteuid():
            path.chmod(0o600)


class SnapshotStore:
    def __init__(
        self,
        *,
        state_dir: Path,
        snapshot_dirs: dict[str, Path],
        verify_checksum: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.state_dir = Path(state_dir)
        self.manifests_dir = self.state_dir / "manifests"
        self.fingerprints_dir = self.state_dir / "fingerprints"
        self.snapshot_dirs = {name: Path(p) for name, p in snapshot_dirs.items()}
        self.verify_checksum = verify_checksum
        self.clock = clock
        self._lock = threading.Lock()  # guards _manifests, _bad, _inflight, _formats
        self._manifests: dict[str, Manifest] = {}
        self._bad: dict[str, str] = {}
        self._inflight: set[tuple[str, str]] = set()  # (server, filename) llama-server may be writing
        self._formats: dict[str, int] = {}  # server -> state-file version its last save wrote

    # lifecycle ---------------------------------------------------------------------------------------
    def open(self) -> ReconcileReport:
        started = time.perf_counter()
        try:
            ensure_private_dir(self.manifests_dir)
            ensure_private_dir(self.fingerprints_dir)
            for d in self.snapshot_dirs.values():
                ensure_private_dir(d)
        except OSError as exc:
            raise MetadataIO(
                f"cannot create state directories under {self.state_dir}: {exc.strerror}"
            ) from None
        report = ReconcileReport()
        report.temp_files_removed = len(sweep_temp_files(self.manifests_dir)) + len(
            sweep_temp_files(self.state_dir)
        )
        self._load(report)
        self.reconcile(report)
        report.elapsed_ms = (time.perf_counter() - started) * 1000
        return report

    def load_readonly(self) -> None:
        """Load the manifests for a read-only look (CLI offline): no sweep, no reconcile, no writes."""
        self._load(ReconcileReport())

    def _load(self, report: ReconcileReport) -> None:
        loaded: dict[str, Manifest] = {}
        bad: dict[str, str] = {}
        if not self.manifests_dir.is_dir():
            return
        for entry in os.scandir(self.manifests_dir):
            if not entry.name.endswith(".json") or entry.name.startswith("."):
                continue
            try:
                m = read_manifest(Path(entry.path))
                loaded[m.key] = m
            except ManifestInvalid as exc:
                bad[entry.name] = exc.message
        with self._lock:
            self._manifests, self._bad = loaded, bad
        report.manifests, report.bad_manifests = len(loaded), dict(bad)

    def reconcile(self, report: ReconcileReport | None = None) -> ReconcileReport:
        """Compare manifests with files: missing or resized -> invalid; unreferenced files -> orphans."""
        report = report or ReconcileReport()
        listing: dict[str, dict[str, int]] = {}
        for server, directory in self.snapshot_dirs.items():
            files: dict[str, int] = {}
            with contextlib.suppress(FileNotFoundError):
                for entry in os.scandir(directory):
                    if SNAPSHOT_FILE.match(entry.name):
                        with contextlib.suppress(FileNotFoundError):
                            files[entry.name] = entry.stat().st_size
            listing[server] = files
        referenced: set[tuple[str, str]] = set()
        for m in self.all():
            present = listing.get(m.server)
            if present is None:
                continue  # server no longer configured: leave it alone
            for gen, rec in m.ordered_generations():
                referenced.add((m.server, rec.filename))
                if not rec.valid:
                    continue
                size = present.get(rec.filename)
                reason = FILE_MISSING if size is None else SIZE_MISMATCH if size != rec.bytes else None
                if reason is not None:
                    self.mark_invalid(m.key, gen, reason)
                    report.invalidated.append((m.key, gen, reason))
        with self._lock:
            inflight = set(self._inflight)
        for server, files in listing.items():
            for name in files:
                if (server, name) not in referenced and (server, name) not in inflight:
                    report.orphans.append(self.snapshot_dirs[server] / name)
        return report

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

    def inflight(self) -> set[tuple[str, str]]:
        with self._lock:
            return set(self._inflight)

    def path_for(self, server: str, filename: str) -> Path:
        return self.snapshot_dirs[server] / filename

    def observed_format_version(self, server: str) -> int | None:
        with self._lock:
            return self._formats.get(server)

    # fingerprints ------------------------------------------------------------------------------------
    def register_fingerprint(self, fingerprint: RuntimeFingerprint) -> None:
        """Remember a fingerprint's components, so a later mismatch can say what changed."""
        path = self.fingerprints_dir / f"{fingerprint.digest}.json"
        if not path.exists():
            self._write(lambda: atomic_write_bytes(path, json.dumps(fingerprint.components).encode()))

    def fingerprint_components(self, digest: str) -> dict[str, str] | None:
        try:
            data = json.loads((self.fingerprints_dir / f"{digest}.json").read_bytes())
        except (OSError, ValueError):
            return None
        return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else None

    # writes ------------------------------------------------------------------------------------------
    def _write(self, op: Callable[[], None]) -> None:
        try:
            op()
        except OSError as exc:
            raise MetadataIO(f"cannot write metadata in {self.state_dir}: {exc.strerror}") from None

    def _put(self, manifest: Manifest) -> Manifest:
        self._write(lambda: write_manifest(self.manifests_dir, manifest))
        with self._lock:
            self._manifests[manifest.key] = manifest
        return manifest

    def begin_save(self, identity: SnapshotIdentity) -> SavePlan:
        """Pick the generation the manifest does not point at, and stop trusting what it held."""
        manifest = self.get(identity.key)
        gen = other_generation(manifest.current if manifest else None)
        filename = identity.filename(gen)
        if manifest is not None and gen in manifest.generations:
            # The server is about to overwrite this file: the manifest must not vouch for it meanwhile.
            self._put(manifest.with_generation(gen, None, updated_at=self.clock()))
        with self._lock:
            self._inflight.add((identity.server, filename))
        return SavePlan(
            identity=identity,
            generation=gen,
            filename=filename,
            path=self.path_for(identity.server, filename),
        )

    def abort_save(self, plan: SavePlan, *, discard: bool = False) -> None:
        """The save is over. `discard`: it failed, so whatever the server left in the file is garbage
        (a partial write after ENOSPC, say): delete it now rather than let it hold the disk."""
        if discard:
            with contextlib.suppress(OSError):
                plan.path.unlink()
        with self._lock:
            self._inflight.discard((plan.identity.server, plan.filename))

    def commit_save(
        self,
        plan: SavePlan,
        result: SaveResult,
        *,
        fingerprint: RuntimeFingerprint,
        revision: int,
        session_seq: int | None = None,
    ) -> Manifest:
        """Verify the file the backend says it wrote; only then flip the manifest to it (Invariant: A/B)."""
        try:
            size = file_size(plan.path)
            header = read_header(plan.path)
            _make_private(plan.path)
            # n_written undercounts on some builds: the file itself is the truth for bytes.
            checksum = file_checksum(plan.path) if self.verify_checksum else None
            if file_size(plan.path) != size:
                raise SnapshotCorrupt(f"{plan.filename}: changed size while being checked")
            now = self.clock()
            record = GenerationRecord(
                filename=plan.filename,
                tokens=result.tokens,
                header_tokens=header.tokens,
                bytes=size,
                checksum=checksum,
                format_version=header.version,
                fingerprint=fingerprint.digest,
                saved_at=now,
                revision=revision,
            )
            base = self.get(plan.identity.key) or Manifest.new(plan.identity, now)
            manifest = base.with_generation(
                plan.generation,
                record,
                current=plan.generation,
                updated_at=now,
                last_used_at=now,
                session_seq=session_seq if session_seq is not None else base.session_seq,
            )
            self.register_fingerprint(fingerprint)
            self._put(manifest)
            with self._lock:
                self._formats[plan.identity.server] = header.version
            return manifest
        finally:
            self.abort_save(plan)

    def mark_invalid(self, key: str, gen: Generation, reason: str) -> None:
        """Record that a generation may not be restored. Never deletes anything (spec §31)."""
        manifest = self.get(key)
        rec = manifest.generation(gen) if manifest else None
        if manifest is None or rec is None or rec.invalid_reason == reason:
            return
        self._put(manifest.with_generation(gen, replace(rec, invalid_reason=reason), updated_at=self.clock()))

    def touch(self, key: str, *, persist: bool = True) -> None:
        manifest = self.get(key)
        if manifest is None:
            return
        updated = replace(manifest, last_used_at=self.clock())
        if persist:
            self._put(updated)
        else:
            with self._lock:
                self._manifests[key] = updated

    # restore -----------------------------------------------------------------------------------------
    def find_restorable(
        self,
        identity: SnapshotIdentity,
        fingerprint: RuntimeFingerprint,
        *,
        max_tokens: int | None = None,
        deep: bool | None = None,
    ) -> tuple[Candidate | None, list[Rejection]]:
        """The newest generation that is safe to hand to llama-server, and why others were passed over.

        Invariant 4: a generation is a candidate only when its runtime fingerprint equals the server's.
        """
        manifest = self.get(identity.key)
        rejections: list[Rejection] = []
        if manifest is None:
            return None, rejections
        deep = self.verify_checksum if deep is None else deep
        known_format = self.observed_format_version(identity.server)
        for gen, rec in manifest.ordered_generations():
            rejection = self._check(manifest, gen, rec, fingerprint, known_format, max_tokens, deep)
            if rejection is None:
                return Candidate(
                    identity=identity,
                    generation=gen,
                    record=rec,
                    path=self.path_for(identity.server, rec.filename),
                    fallback=bool(rejections) or gen != manifest.current,
                ), rejections
            rejections.append(rejection)
            if rejection.persistent:
                self.mark_invalid(manifest.key, gen, rejection.reason)
        return None, rejections

    def _check(
        self,
        manifest: Manifest,
        gen: Generation,
        rec: GenerationRecord,
        fingerprint: RuntimeFingerprint,
        known_format: int | None,
        max_tokens: int | None,
        deep: bool,
    ) -> Rejection | None:
        if rec.invalid_reason is not None:
            return Rejection(
                generation=gen, reason=rec.invalid_reason, detail="marked invalid", persistent=False
            )
        if rec.fingerprint != fingerprint.digest:
            reason = fingerprint.mismatch_reason(self.fingerprint_components(rec.fingerprint))
            return Rejection(
                generation=gen, reason=reason, detail="saved under another runtime", persistent=False
            )
        if known_format is not None and rec.format_version != known_format:
            return Rejection(
                generation=gen,
                reason=STATE_FORMAT_CHANGED,
                detail=f"file format v{rec.format_version}, server writes v{known_format}",
                persistent=False,
            )
        if max_tokens is not None and rec.tokens > max_tokens:
            return Rejection(
                generation=gen,
                reason=TOO_LARGE,
                detail=f"{rec.tokens} tokens > slot n_ctx {max_tokens}",
                persistent=False,
            )
        try:
            verify_file(
                self.path_for(manifest.server, rec.filename),
                size=rec.bytes,
                format_version=rec.format_version,
                tokens=rec.header_tokens,
                checksum=rec.checksum,
                deep=deep,
            )
        except SnapshotNotFound as exc:
            return Rejection(generation=gen, reason=FILE_MISSING, detail=exc.message, persistent=True)
        except SnapshotCorrupt as exc:
            return Rejection(generation=gen, reason=CORRUPT, detail=exc.message, persistent=True)
        return None

    # deletion ----------------------------------------------------------------------------------------
    def delete_generation(self, key: str, gen: Generation) -> int:
        """Forget a generation, then delete its file: a crash in between leaves an orphan file (which
        retention collects), never a record that vouches for a file that is gone."""
        manifest = self.get(key)
        rec = manifest.generation(gen) if manifest else None
        if manifest is None or rec is None:
            return 0
        remaining = manifest.with_generation(
            gen, None, current=manifest.current if manifest.current != gen else None, updated_at=self.clock()
        )
        if remaining.generations:
            self._put(remaining)
        else:
            self._drop_manifest(key)
        return self._unlink(self.path_for(manifest.server, rec.filename))

    def purge(self, key: str) -> int:
        """Drop a snapshot identity's manifest, then delete its files (same crash rule as above)."""
        manifest = self.get(key)
        if manifest is None:
            return 0
        self._drop_manifest(key)
        return sum(
            self._unlink(self.path_for(manifest.server, r.filename)) for r in manifest.generations.values()
        )

    def _drop_manifest(self, key: str) -> None:
        try:
            manifest_path(self.manifests_dir, key).unlink(missing_ok=True)
        except OSError as exc:
            raise MetadataIO(f"cannot delete manifest {key[:8]}: {exc.strerror}") from None
        with self._lock:
            self._manifests.pop(key, None)

    @staticmethod
    def _unlink(path: Path) -> int:
        try:
            size = path.stat().st_size
            path.unlink()
            return size
        except FileNotFoundError:
            return 0
        except OSError as exc:
            raise MetadataIO(f"cannot delete {path.name}: {exc.strerror}") from None

    # watcher -----------------------------------------------------------------------------------------
    def recheck_file(self, server: str, filename: str) -> str | None:
        """An event on a snapshot file: if it no longer matches its record, mark it. Returns the reason."""
        m = SNAPSHOT_FILE.match(filename)
        if m is None or (server, filename) in self.inflight():
            return None
        manifest = self.get(m.group("key"))
        gen: Generation = "a" if m.group("gen") == "a" else "b"
        rec = manifest.generation(gen) if manifest else None
        if manifest is None or rec is None or not rec.valid or manifest.server != server:
            return None
        try:
            size: int | None = (self.snapshot_dirs[server] / filename).stat().st_size
        except FileNotFoundError:
            size = None
        reason = FILE_MISSING if size is None else SIZE_MISMATCH if size != rec.bytes else None
        if reason is not None:
            try:
                self.mark_invalid(manifest.key, gen, reason)
            except KvError:
                return None
        return reason
