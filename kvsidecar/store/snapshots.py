"""The snapshot store: which file is a session's snapshot, and whether it is safe to restore (spec §39-42).

It owns the manifests in `<state_dir>/manifests/` and reads (never writes) the `.bin` files llama-server
saves into each server's snapshot directory. A save never goes to the newest generation that still
verifies: it targets the other one, and the manifest flips to the new file only once it is verified on
disk, so the last good generation and its record survive any failed save. Before a restore a generation
must match the server's runtime fingerprint and pass the integrity checks. Nothing here deletes a file
except `purge()`, `delete_generation()`, `delete_loose()` (retention, operators) and, before a save, an
entry planted at the name the server is about to write.

Every file is reached through `ConfinedDir`: names must be ours (manifest file names are bound to the
manifest's own key by its schema; listings are filtered by pattern), and nothing is followed through a
link. One bad manifest is one bad session: it is reported and left alone, and its key's files are held
(never collected as orphans) until a save for that identity replaces it or it is purged.

Thread-safety: the index (`_manifests`) is guarded by `_lock`; methods may be called from worker threads
(the coordinator runs checksums and fsyncs off the event loop). Per-identity ordering is the coordinator's
job: it never runs two operations on one identity at once.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Literal

from kvsidecar.backend.base import SaveResult
from kvsidecar.errors import (
    KvError,
    ManifestInvalid,
    MetadataIO,
    SaveFailed,
    SnapshotCorrupt,
    SnapshotError,
    SnapshotNotFound,
)
from kvsidecar.logs import event
from kvsidecar.store.atomic import (
    TEMP_FILE,
    atomic_write_bytes,
    ensure_private_dir,
    secure_directory,
    sweep_temp_files,
)
from kvsidecar.store.confined import UNSAFE, ConfinedDir, Entry, UnsafeFile, describe, problem, read_capped
from kvsidecar.store.fingerprint import RuntimeFingerprint
from kvsidecar.store.integrity import checksum_from_fd, header_from_fd, verify_fd
from kvsidecar.store.jsonlimits import JsonLimitError, loads_capped
from kvsidecar.store.manifest import (
    BAD_NAME,
    BadManifest,
    GenerationRecord,
    Manifest,
    read_manifest,
    write_manifest,
)
from kvsidecar.store.naming import (
    FINGERPRINT_FILE,
    GENERATIONS,
    KEY,
    MANIFEST_FILE,
    SNAPSHOT_FILE,
    Generation,
    SnapshotIdentity,
    other_generation,
    parse_snapshot_name,
    snapshot_filename,
)

log = logging.getLogger("kvsidecar.store")

# Reason codes recorded on a generation that may not be restored.
FILE_MISSING = "SNAPSHOT_FILE_MISSING"
SIZE_MISMATCH = "SNAPSHOT_SIZE_MISMATCH"
CORRUPT = "SNAPSHOT_CORRUPT"
RESTORE_FAILED = "RESTORE_FAILED"
STATE_FORMAT_CHANGED = "STATE_FORMAT_CHANGED"
TOO_LARGE = "SNAPSHOT_EXCEEDS_SLOT_CONTEXT"
FILE_UNSAFE = UNSAFE  # a link, FIFO, device, directory, hard link or foreign file at a generation's name

_FINGERPRINT_MAX_BYTES = 1 << 20
_FINGERPRINT_MAX_DEPTH = 2
_FINGERPRINT_MAX_ENTRIES = 4096


@dataclass(frozen=True, kw_only=True)
class SavePlan:
    identity: SnapshotIdentity
    generation: Generation
    filename: str
    path: Path
    kept: Generation | None = None  # the newest generation that verified: never the target


@dataclass(frozen=True, kw_only=True)
class Candidate:
    identity: SnapshotIdentity
    generation: Generation
    record: GenerationRecord
    path: Path
    fallback: bool  # True when the current generation was unusable and this is the previous one
    file_id: tuple[int, int, int, int] | None = None  # (dev, inode, size, mtime_ns) as verified


@dataclass(frozen=True, kw_only=True)
class Rejection:
    generation: Generation
    reason: str
    detail: str
    persistent: bool  # recorded on the generation (False: only not restorable on this runtime)


@dataclass(frozen=True, kw_only=True)
class LooseFile:
    """A file of ours (by name) that no manifest references: an orphan snapshot or a stale temp file."""

    area: str  # a server name (snapshot directory) or "state", "manifests", "fingerprints"
    name: str
    bytes: int
    mtime: float
    kind: Literal["orphan", "temp"]


@dataclass(kw_only=True)
class ReconcileReport:
    manifests: int = 0
    invalidated: list[tuple[str, str, str]] = field(default_factory=list)  # (key, gen, reason)
    bad_manifests: dict[str, str] = field(default_factory=dict)  # file name -> "REASON: detail"
    orphans: list[Path] = field(default_factory=list)
    held: list[Path] = field(default_factory=list)  # files of a bad manifest's key: kept, not orphans
    temp_files_removed: int = 0
    dirs_tightened: list[str] = field(default_factory=list)  # "path 0755 -> 0700"
    dir_problems: list[str] = field(default_factory=list)  # too open and not ours to fix
    elapsed_ms: float = 0.0


def _file_id(st: os.stat_result) -> tuple[int, int, int, int]:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)


def _realpath(path: Path) -> Path:
    return Path(os.path.realpath(path))


class SnapshotStore:
    def __init__(
        self,
        *,
        state_dir: Path,
        snapshot_dirs: dict[str, Path],
        verify_checksum: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        # Directories are resolved once, here: a configured symlink is followed now (and logged at open),
        # and from then on every access opens the resolved path without following a link.
        self.configured_dirs = {name: Path(p) for name, p in snapshot_dirs.items()}
        self.state_dir = _realpath(Path(state_dir))
        self.manifests_dir = self.state_dir / "manifests"
        self.fingerprints_dir = self.state_dir / "fingerprints"
        self.snapshot_dirs = {name: _realpath(p) for name, p in self.configured_dirs.items()}
        self.verify_checksum = verify_checksum
        self.clock = clock
        self._snap = {name: ConfinedDir(p, SNAPSHOT_FILE) for name, p in self.snapshot_dirs.items()}
        self._temp = {
            "state": ConfinedDir(self.state_dir, TEMP_FILE),
            "manifests": ConfinedDir(self.manifests_dir, TEMP_FILE),
            "fingerprints": ConfinedDir(self.fingerprints_dir, TEMP_FILE),
        }
        self._manifest_dir = ConfinedDir(self.manifests_dir, MANIFEST_FILE)
        self._fingerprint_dir = ConfinedDir(self.fingerprints_dir, FINGERPRINT_FILE)
        self._lock = threading.Lock()  # guards _manifests, _bad, _inflight, _formats, _runtime
        self._manifests: dict[str, Manifest] = {}
        self._bad: dict[str, str] = {}
        self._inflight: set[tuple[str, str]] = set()  # (server, filename) llama-server may be writing
        self._formats: dict[str, int] = {}  # server -> state-file version its last save wrote
        self._runtime: dict[str, str] = {}  # server -> fingerprint digest last seen for it
        self.dir_problems: list[str] = []

    # lifecycle ---------------------------------------------------------------------------------------
    def open(self) -> ReconcileReport:
        started = time.perf_counter()
        report = ReconcileReport()
        self._prepare_dirs(report)
        report.temp_files_removed = sum(
            len(sweep_temp_files(d)) for d in (self.manifests_dir, self.fingerprints_dir, self.state_dir)
        )
        self._load(report)
        self.reconcile(report)
        report.elapsed_ms = (time.perf_counter() - started) * 1000
        return report

    def _prepare_dirs(self, report: ReconcileReport) -> None:
        """Create the directories 0700, then tighten the ones that exist and are ours (spec: KV snapshots
        are plaintext transcripts). A snapshot directory shared with llama-server's group (setgid,
        group-writable: what install-systemd sets up) keeps exactly 2770."""
        try:
            for d in (self.manifests_dir, self.fingerprints_dir, *self.snapshot_dirs.values()):
                ensure_private_dir(d)
        except OSError as exc:
            raise MetadataIO(
                f"cannot create state directories under {self.state_dir}: {exc.strerror}"
            ) from None
        for name, configured in self.configured_dirs.items():
            if _realpath(configured) != configured.absolute():
                event(log, logging.INFO, "kv.store.dir_resolved", server=name, path=self.snapshot_dirs[name])
        dirs = [(d, False) for d in (self.state_dir, self.manifests_dir, self.fingerprints_dir)]
        dirs += [(d, True) for d in self.snapshot_dirs.values()]
        for directory, shared in dirs:
            try:
                mode = secure_directory(directory, allow_shared_group=shared)
            except OSError as exc:
                report.dir_problems.append(f"{directory}: cannot check its mode ({exc.strerror})")
                continue
            if mode.changed:
                report.dirs_tightened.append(f"{directory} {mode.before:04o} -> {mode.after:04o}")
                event(
                    log,
                    logging.INFO,
                    "kv.store.dir_tightened",
                    path=directory,
                    before=f"{mode.before:04o}",
                    after=f"{mode.after:04o}",
                )
            if mode.problem is not None:
                report.dir_problems.append(f"{directory}: {mode.problem}")
                event(log, logging.WARNING, "kv.store.dir_too_open", path=directory, problem=mode.problem)
        self.dir_problems = list(report.dir_problems)

    def load_readonly(self) -> None:
        """Load the manifests for a read-only look (CLI offline): no sweep, no reconcile, no writes."""
        self._load(ReconcileReport())

    def _load(self, report: ReconcileReport) -> None:
        loaded: dict[str, Manifest] = {}
        bad: dict[str, str] = {}
        try:
            names = os.listdir(self.manifests_dir)
        except OSError:
            names = []
        for name in names:
            if name.startswith(".") or not name.endswith(".json"):
                continue
            try:
                if not MANIFEST_FILE.match(name):
                    raise BadManifest(BAD_NAME, "not a manifest file name of ours; not read")
                m = read_manifest(self.manifests_dir / name)
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
        report.manifests, report.bad_manifests = len(loaded), dict(bad)

    def reconcile(self, report: ReconcileReport | None = None) -> ReconcileReport:
        """Compare manifests with files: missing, resized or not a plain file of ours -> invalid;
        unreferenced files of ours -> orphans (files of a bad manifest's key are held, not orphans)."""
        report = report or ReconcileReport()
        listing: dict[str, dict[str, os.stat_result]] = {}
        for server, d in self._snap.items():
            entries = _scan(d)
            if entries is not None:  # a directory that cannot be opened safely: leave its records alone
                listing[server] = {e.name: e.st for e in entries}
        uids = {server: d.expected_uids() for server, d in self._snap.items()}
        for m in self.all():
            present = listing.get(m.server)
            if present is None:
                continue  # server no longer configured: leave it alone
            for gen, rec in m.ordered_generations():
                if not rec.valid:
                    continue
                reason = _entry_reason(present.get(rec.filename), rec, uids[m.server])
                if reason is not None:
                    self.mark_invalid(m.key, gen, reason)
                    report.invalidated.append((m.key, gen, reason))
        for loose in self.loose_files(temp=False):
            report.orphans.append(self.snapshot_dirs[loose.area] / loose.name)
        held = self.held_keys()
        for server, names in listing.items():
            for name in names:
                parsed = parse_snapshot_name(name)
                if parsed is not None and parsed[0] in held:
                    report.held.append(self.snapshot_dirs[server] / name)
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

    def held_keys(self) -> set[str]:
        """Keys whose manifest is present but refused: their files are nobody's orphans."""
        with self._lock:
            return {m.group("key") for name in self._bad if (m := MANIFEST_FILE.match(name))}

    def inflight(self) -> set[tuple[str, str]]:
        with self._lock:
            return set(self._inflight)

    def path_for(self, server: str, filename: str) -> Path:
        """The path of one of our snapshot names in a server's directory (UnsafeFile if not ours)."""
        return self._snap[server].join(filename)

    def observed_format_version(self, server: str) -> int | None:
        with self._lock:
            return self._formats.get(server)

    def loose_files(self, *, temp: bool = True) -> list[LooseFile]:
        """Files of ours that no manifest references (the one orphan rule, used by reconcile and
        retention): snapshot-named entries in a snapshot directory that are not referenced, not being
        written and not held by a bad manifest; and (temp=True) our temp files in the state directories."""
        with self._lock:
            referenced = {
                (m.server, r.filename) for m in self._manifests.values() for r in m.generations.values()
            }
            inflight = set(self._inflight)
        held = self.held_keys()
        out: list[LooseFile] = []
        for server, d in self._snap.items():
            for e in _scan(d) or []:
                parsed = parse_snapshot_name(e.name)
                if (server, e.name) in referenced or (server, e.name) in inflight:
                    continue
                if parsed is None or parsed[0] in held or stat.S_ISDIR(e.st.st_mode):
                    continue
                size = e.st.st_size if stat.S_ISREG(e.st.st_mode) else 0
                out.append(
                    LooseFile(area=server, name=e.name, bytes=size, mtime=e.st.st_mtime, kind="orphan")
                )
        for area, d in self._temp.items() if temp else ():
            for e in _scan(d) or []:
                if stat.S_ISREG(e.st.st_mode):
                    out.append(
                        LooseFile(
                            area=area, name=e.name, bytes=e.st.st_size, mtime=e.st.st_mtime, kind="temp"
                        )
                    )
        return out

    # fingerprints ------------------------------------------------------------------------------------
    def register_fingerprint(self, fingerprint: RuntimeFingerprint) -> None:
        """Remember a fingerprint's components, so a later mismatch can say what changed. Best effort."""
        name = f"{fingerprint.digest}.json"
        with contextlib.suppress(KvError, OSError):
            st = self._fingerprint_dir.lstat(name)
            if st is not None and stat.S_ISREG(st.st_mode) and st.st_nlink == 1:
                return
            payload = _json_bytes(fingerprint.components)
            atomic_write_bytes(self._fingerprint_dir.join(name), payload)

    def fingerprint_components(self, digest: str) -> dict[str, str] | None:
        """The components a fingerprint was registered with; None if unknown or the file is not sane."""
        try:
            with self._fingerprint_dir.open_file(f"{digest}.json", uids=frozenset({os.geteuid()})) as (fd, _):
                raw = read_capped(fd, _FINGERPRINT_MAX_BYTES)
            data = loads_capped(raw, max_bytes=_FINGERPRINT_MAX_BYTES, max_depth=_FINGERPRINT_MAX_DEPTH)
        except (KvError, OSError, JsonLimitError):
            return None
        if not isinstance(data, dict) or len(data) > _FINGERPRINT_MAX_ENTRIES:
            return None
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in data.items()):
            return None
        return dict(data)

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
            replaced = self._bad.pop(f"{manifest.key}.json", None)
        if replaced is not None:
            event(log, logging.WARNING, "kv.manifest.replaced_invalid", snapshot=manifest.key[:8])
        return manifest

    def begin_save(
        self, identity: SnapshotIdentity, *, fingerprint: RuntimeFingerprint | None = None
    ) -> SavePlan:
        """Pick the generation to write: never the newest one that still verifies (preferring one saved
        under `fingerprint`, by default the server's runtime as last seen here). Stop trusting what the
        target held, and clear its name of anything planted there, before the server writes it."""
        manifest = self.get(identity.key)
        with self._lock:
            runtime = fingerprint.digest if fingerprint is not None else self._runtime.get(identity.server)
        kept = self._newest_verifying(manifest, runtime) if manifest is not None else None
        manifest = self.get(identity.key)  # _newest_verifying may have marked generations invalid
        if kept is not None:
            gen = other_generation(kept)
        else:
            gen = other_generation(manifest.current if manifest else None)
        filename = identity.filename(gen)
        if manifest is not None and gen in manifest.generations:
            # The server is about to overwrite this file: the manifest must not vouch for it meanwhile.
            # The kept generation's record stays until the new one is committed.
            current = manifest.current if manifest.current != gen else kept
            self._put(manifest.with_generation(gen, None, current=current, updated_at=self.clock()))
        with self._lock:
            self._inflight.add((identity.server, filename))
        try:
            self._clear_target(identity.server, filename)
        except BaseException:
            with self._lock:
                self._inflight.discard((identity.server, filename))
            raise
        return SavePlan(
            identity=identity,
            generation=gen,
            filename=filename,
            path=self.path_for(identity.server, filename),
            kept=kept,
        )

    def _newest_verifying(self, manifest: Manifest, runtime: str | None) -> Generation | None:
        """The generation a save must not touch: the newest valid one whose file still passes the cheap
        checks (type, owner, size, header), preferring those saved under `runtime`."""
        ordered = [(g, r) for g, r in manifest.ordered_generations() if r.valid]
        ordered.sort(key=lambda gr: gr[1].fingerprint != runtime)  # stable: current first within each
        for gen, rec in ordered:
            rejection, _ = self._verify(manifest, gen, rec, deep=False)
            if rejection is None:
                return gen
            with contextlib.suppress(KvError):
                self.mark_invalid(manifest.key, gen, rejection.reason)
        return None

    def _clear_target(self, server: str, filename: str) -> None:
        """Before the server writes `filename`: nothing may stand there that a write would go through
        (a symlink, a hard link to someone else's file, a FIFO, a device). Such an entry is removed itself,
        never what it points to; a directory makes the save refused. Our own old file is removed too, so
        the server creates a fresh file (if that removal fails, the server overwrites it in place)."""
        d = self._snap[server]
        try:
            st = d.lstat(filename)
            if st is None:
                return
            why = problem(st, d.expected_uids())
            try:
                d.unlink(filename)
            except OSError as exc:
                if why is None:
                    return
                raise SaveFailed(
                    f"a {describe(st)} is at the snapshot file name and cannot be removed ({exc.strerror}); "
                    "refusing to save through it"
                ) from None
        except UnsafeFile as exc:
            raise SaveFailed(
                f"refusing to save: {exc.message}", hint="Remove what occupies the name."
            ) from None
        except SnapshotError as exc:
            raise SaveFailed(f"cannot prepare the save: {exc.message}") from None
        if why is not None:
            event(
                log,
                logging.WARNING,
                "kv.snapshot.planted_removed",
                file=filename[:12],
                found=why,
                reason=UNSAFE,
            )

    def abort_save(self, plan: SavePlan, *, discard: bool = False) -> None:
        """The save is over. `discard`: it failed, so whatever the server left in the file is garbage
        (a partial write after ENOSPC, say): delete it now rather than let it hold the disk. It is never
        the kept generation (begin_save did not pick it)."""
        if discard:
            with contextlib.suppress(KvError, OSError):
                self._snap[plan.identity.server].unlink(plan.filename)
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
        """Verify the file the backend says it wrote; only then flip the manifest to it (Invariant: A/B).
        The file is checked, hashed and chmod-ed through one descriptor opened without following links:
        a link, FIFO, hard link or foreign file at the name is refused (and the entry removed)."""
        d = self._snap[plan.identity.server]
        try:
            with d.open_file(plan.filename) as (fd, st):
                header = header_from_fd(fd, plan.filename)
                if st.st_uid == os.geteuid():  # ours: 0600 (transcripts); the server's own umask otherwise
                    with contextlib.suppress(OSError):
                        os.fchmod(fd, 0o600)
                # n_written undercounts on some builds: the file itself is the truth for bytes.
                checksum = checksum_from_fd(fd) if self.verify_checksum else None
                after = os.fstat(fd)
                if (after.st_size, after.st_mtime_ns) != (st.st_size, st.st_mtime_ns):
                    raise SnapshotCorrupt(f"{plan.filename}: changed while being checked")
            now = self.clock()
            record = GenerationRecord(
                filename=plan.filename,
                tokens=result.tokens,
                header_tokens=header.tokens,
                bytes=st.st_size,
                checksum=checksum,
                format_version=header.version,
                fingerprint=fingerprint.digest,
                saved_at=now,
                revision=revision,
            )
            manifest = self._committed(plan, record, now, session_seq)
            self.register_fingerprint(fingerprint)
            self._put(manifest)
            with self._lock:
                self._formats[plan.identity.server] = header.version
                self._runtime[plan.identity.server] = fingerprint.digest
            return manifest
        except UnsafeFile as exc:
            event(
                log,
                logging.WARNING,
                "kv.snapshot.unsafe",
                file=plan.filename[:12],
                reason=UNSAFE,
                detail=exc.message,
            )
            with contextlib.suppress(KvError, OSError):
                d.unlink(plan.filename)
            raise
        finally:
            self.abort_save(plan)

    def _committed(
        self, plan: SavePlan, record: GenerationRecord, now: float, session_seq: int | None
    ) -> Manifest:
        base = self.get(plan.identity.key) or Manifest.new(plan.identity, now)
        return base.with_generation(
            plan.generation,
            record,
            current=plan.generation,
            updated_at=now,
            last_used_at=now,
            session_seq=session_seq if session_seq is not None else base.session_seq,
        )

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
        The file must be a plain regular file of ours (one link, expected owner, not a link) and match
        its record; `Candidate.file_id` is what was verified (see `confirm_unchanged`).
        """
        with self._lock:
            self._runtime[identity.server] = fingerprint.digest
        manifest = self.get(identity.key)
        rejections: list[Rejection] = []
        if manifest is None:
            return None, rejections
        deep = self.verify_checksum if deep is None else deep
        known_format = self.observed_format_version(identity.server)
        for gen, rec in manifest.ordered_generations():
            rejection = self._check(rec, gen, fingerprint, known_format, max_tokens)
            file_id = None
            if rejection is None:
                rejection, file_id = self._verify(manifest, gen, rec, deep=deep)
            if rejection is None:
                return Candidate(
                    identity=identity,
                    generation=gen,
                    record=rec,
                    path=self.path_for(identity.server, rec.filename),
                    fallback=bool(rejections) or gen != manifest.current,
                    file_id=file_id,
                ), rejections
            rejections.append(rejection)
            if rejection.persistent:
                self.mark_invalid(manifest.key, gen, rejection.reason)
        return None, rejections

    def confirm_unchanged(self, candidate: Candidate) -> bool:
        """After llama-server read a candidate: is the name still the very file that was verified?
        (Narrows the window in which the file could be swapped between our check and the server's open.)"""
        try:
            st = self._snap[candidate.identity.server].lstat(candidate.record.filename)
        except KvError:
            return False
        if st is None or not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            return False
        return candidate.file_id is None or _file_id(st) == candidate.file_id

    def _check(
        self,
        rec: GenerationRecord,
        gen: Generation,
        fingerprint: RuntimeFingerprint,
        known_format: int | None,
        max_tokens: int | None,
    ) -> Rejection | None:
        """The record-only checks (no I/O but a fingerprint lookup)."""
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
        return None

    def _verify(
        self, manifest: Manifest, gen: Generation, rec: GenerationRecord, *, deep: bool
    ) -> tuple[Rejection | None, tuple[int, int, int, int] | None]:
        """The file checks, all through one descriptor opened without following links."""
        try:
            with self._snap[manifest.server].open_file(rec.filename) as (fd, st):
                verify_fd(
                    fd,
                    st,
                    rec.filename,
                    size=rec.bytes,
                    format_version=rec.format_version,
                    tokens=rec.header_tokens,
                    checksum=rec.checksum,
                    deep=deep,
                )
                return None, _file_id(st)
        except KeyError:
            detail = f"server {manifest.server!r} is not configured"
            return Rejection(generation=gen, reason=FILE_MISSING, detail=detail, persistent=False), None
        except SnapshotNotFound as exc:
            return Rejection(generation=gen, reason=FILE_MISSING, detail=exc.message, persistent=True), None
        except UnsafeFile as exc:
            return Rejection(generation=gen, reason=FILE_UNSAFE, detail=exc.message, persistent=True), None
        except SnapshotCorrupt as exc:
            return Rejection(generation=gen, reason=CORRUPT, detail=exc.message, persistent=True), None
        except OSError as exc:
            detail = f"{rec.filename[:12]}: {exc.strerror}"
            return Rejection(generation=gen, reason=CORRUPT, detail=detail, persistent=True), None

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
        return self._unlink(manifest.server, rec.filename)

    def purge(self, key: str) -> int:
        """Drop a snapshot identity's manifest (or the refused file in its place), then delete its files
        (same crash rule as above). The names deleted are derived from the key, never read from disk."""
        if not isinstance(key, str) or not KEY.match(key):
            return 0
        manifest = self.get(key)
        with self._lock:
            was_bad = f"{key}.json" in self._bad
        if manifest is None and not was_bad:
            return 0
        self._drop_manifest(key)
        servers = [manifest.server] if manifest is not None else list(self._snap)
        inflight = self.inflight()
        freed = 0
        for server in servers:
            for gen in GENERATIONS:
                name = snapshot_filename(key, gen)
                if server in self._snap and (server, name) not in inflight:
                    freed += self._unlink(server, name)
        return freed

    def delete_loose(self, loose: LooseFile) -> bool:
        """Delete an orphan or temp file found by `loose_files`, re-checking under the lock that it is
        still loose (a save may have adopted the name since the listing)."""
        d = self._temp.get(loose.area) if loose.kind == "temp" else self._snap.get(loose.area)
        parsed = parse_snapshot_name(loose.name)
        if d is None or (loose.kind == "orphan" and parsed is None):
            return False
        with self._lock:
            if loose.kind == "orphan" and parsed is not None:
                m = self._manifests.get(parsed[0])
                if m is not None and any(r.filename == loose.name for r in m.generations.values()):
                    return False
                if (loose.area, loose.name) in self._inflight or f"{parsed[0]}.json" in self._bad:
                    return False
            try:
                return d.unlink(loose.name) is not None
            except (KvError, OSError) as exc:
                raise MetadataIO(f"cannot delete {loose.name[:40]}: {exc}") from None

    def _drop_manifest(self, key: str) -> None:
        try:
            self._manifest_dir.unlink(f"{key}.json")
        except (KvError, OSError) as exc:
            raise MetadataIO(f"cannot delete manifest {key[:8]}: {exc}") from None
        with self._lock:
            self._manifests.pop(key, None)
            self._bad.pop(f"{key}.json", None)

    def _unlink(self, server: str, name: str) -> int:
        try:
            return self._snap[server].unlink(name) or 0
        except (KvError, OSError) as exc:
            raise MetadataIO(f"cannot delete {name[:40]}: {exc}") from None

    # watcher -----------------------------------------------------------------------------------------
    def recheck_file(self, server: str, filename: str) -> str | None:
        """An event on a snapshot file: if it no longer matches its record, mark it. Returns the reason."""
        parsed = parse_snapshot_name(filename)
        if parsed is None or server not in self._snap or (server, filename) in self.inflight():
            return None
        key, gen = parsed
        manifest = self.get(key)
        rec = manifest.generation(gen) if manifest else None
        if manifest is None or rec is None or not rec.valid or manifest.server != server:
            return None
        d = self._snap[server]
        try:
            reason = _entry_reason(d.lstat(filename), rec, d.expected_uids())
        except KvError:
            reason = FILE_MISSING
        if reason is not None:
            try:
                self.mark_invalid(manifest.key, gen, reason)
            except KvError:
                return None
        return reason


def _scan(d: ConfinedDir) -> list[Entry] | None:
    try:
        return d.scan()
    except (KvError, OSError) as exc:
        event(log, logging.WARNING, "kv.store.dir_unsafe", path=d.path, error=str(exc)[:200])
        return None


def _entry_reason(st: os.stat_result | None, rec: GenerationRecord, uids: frozenset[int]) -> str | None:
    """Why a directory entry no longer matches its record (cheap: lstat only); None if it still does."""
    if st is None:
        return FILE_MISSING
    if problem(st, uids) is not None:
        return FILE_UNSAFE
    return SIZE_MISMATCH if st.st_size != rec.bytes else None


def _json_bytes(data: dict[str, str]) -> bytes:
    return json.dumps(data, sort_keys=True).encode()
