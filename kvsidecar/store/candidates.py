"""Restore candidates: which generation of a snapshot is safe to hand to llama-server (spec §39-42).

It owns the checks a generation passes before a restore, cheapest first: its record (not marked invalid,
saved under the server's runtime fingerprint (Invariant 4, the trust rule of `store/trust.py`), in the
state-file format the server writes, within the slot's context), then its file, all through one descriptor
opened without following links: a plain regular file of ours (one link, expected owner) whose size, header
and (deep) checksum match the record. A generation that fails on evidence about the file is marked invalid;
one that only does not fit this runtime is passed over and kept. After llama-server read a candidate,
`confirm_unchanged` checks that the name is still the very file that was verified.
"""

from __future__ import annotations

import os
import stat
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from kvsidecar.errors import KvError, SnapshotCorrupt, SnapshotNotFound
from kvsidecar.files.confined import UnsafeFile
from kvsidecar.fingerprint.records import FingerprintRecords
from kvsidecar.fingerprint.runtime import RuntimeFingerprint
from kvsidecar.store.integrity import verify_fd
from kvsidecar.store.layout import StoreLayout
from kvsidecar.store.manifest import GenerationRecord, Manifest
from kvsidecar.store.naming import Generation, SnapshotIdentity
from kvsidecar.store.table import (
    CORRUPT,
    FILE_MISSING,
    FILE_UNSAFE,
    STATE_FORMAT_CHANGED,
    TOO_LARGE,
    ManifestTable,
)
from kvsidecar.store.trust import Decision, Saved, proven, trust

FileId = tuple[int, int, int, int, int]  # (dev, inode, size, mtime_ns, ctime_ns: utime cannot put it back)


@dataclass(frozen=True, kw_only=True)
class Candidate:
    identity: SnapshotIdentity
    generation: Generation
    record: GenerationRecord
    path: Path
    fallback: bool  # True when the current generation was unusable and this is the previous one
    file_id: FileId | None = None  # (dev, inode, size, mtime_ns) as verified


@dataclass(frozen=True, kw_only=True)
class Rejection:
    generation: Generation
    reason: str
    detail: str
    persistent: bool  # recorded on the generation (False: only not restorable on this runtime)


def file_id(st: os.stat_result) -> FileId:
    return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)


class VerifiedFiles:
    """Files this daemon has checksummed (after a save, or before a restore), by what would change if
    anyone wrote them: device, inode, size, mtime_ns and ctime_ns (a writer can put mtime back with
    utime, never ctime). A file whose identity is unchanged is not hashed again before its next restore:
    at real KV sizes the hash is most of a switch's own cost (issue 15). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._known: dict[tuple[str, str], tuple[tuple[int, ...], str]] = {}

    @staticmethod
    def _key(st: os.stat_result) -> tuple[int, ...]:
        return (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)

    def remember(self, server: str, filename: str, st: os.stat_result, checksum: str) -> None:
        with self._lock:
            self._known[(server, filename)] = (self._key(st), checksum)

    def known(self, server: str, filename: str, st: os.stat_result, checksum: str | None) -> bool:
        with self._lock:
            entry = self._known.get((server, filename))
        return checksum is not None and entry == (self._key(st), checksum)


class CandidateFinder:
    def __init__(
        self,
        layout: StoreLayout,
        table: ManifestTable,
        records: FingerprintRecords,
        verified: VerifiedFiles | None = None,
    ) -> None:
        self.layout, self.table, self.records = layout, table, records
        self.verified = verified or VerifiedFiles()

    def find(
        self,
        identity: SnapshotIdentity,
        fingerprint: RuntimeFingerprint,
        *,
        max_tokens: int | None,
        deep: bool,
    ) -> tuple[Candidate | None, list[Rejection]]:
        """The newest generation that is safe to hand to llama-server, and why others were passed over.

        Invariant 4: a generation is a candidate only when its runtime fingerprint equals the server's.
        The file must be a plain regular file of ours (one link, expected owner, not a link) and match
        its record; `Candidate.file_id` is what was verified (see `confirm_unchanged`).
        """
        found, rejections = self._walk(identity, fingerprint, max_tokens=max_tokens, deep=deep, first=True)
        return (found[0] if found else None), rejections

    def find_all(
        self,
        identity: SnapshotIdentity,
        fingerprint: RuntimeFingerprint,
        *,
        max_tokens: int | None,
        deep: bool,
    ) -> tuple[list[Candidate], list[Rejection]]:
        """Every generation that is safe to hand to llama-server, newest first (each passed the checks of
        `find`), and why the others were passed over: the points a start plan chooses among."""
        return self._walk(identity, fingerprint, max_tokens=max_tokens, deep=deep, first=False)

    def _walk(
        self,
        identity: SnapshotIdentity,
        fingerprint: RuntimeFingerprint,
        *,
        max_tokens: int | None,
        deep: bool,
        first: bool,
    ) -> tuple[list[Candidate], list[Rejection]]:
        """The generations newest first through the checks; stops at the first that passes when `first`."""
        self.table.saw_runtime(identity.server, fingerprint.digest)
        manifest = self.table.get(identity.key)
        found: list[Candidate] = []
        rejections: list[Rejection] = []
        if manifest is None:
            return found, rejections
        known_format = self.table.observed_format_version(identity.server)
        for gen, rec in manifest.ordered_generations():
            rejection = self._check(rec, gen, fingerprint, known_format, max_tokens)
            verified = None
            if rejection is None:
                rejection, verified = verify_generation(
                    self.layout, manifest, gen, rec, deep=deep, verified=self.verified
                )
            if rejection is None:
                found.append(
                    Candidate(
                        identity=identity,
                        generation=gen,
                        record=rec,
                        path=self.layout.path_for(identity.server, rec.filename),
                        fallback=bool(rejections) or gen != manifest.current,
                        file_id=verified,
                    )
                )
                if first:
                    break
                continue
            rejections.append(rejection)
            if rejection.persistent:
                self.table.mark_invalid(manifest.key, gen, rejection.reason)
        return found, rejections

    def check_before_restore(self, candidate: Candidate, theirs: str | None = None) -> None:
        """Right before llama-server is asked to read a candidate: the directory's configured path (and
        `theirs`, llama-server's --slot-save-path as this host sees it) still leads to the directory held
        since start (DirMoved otherwise), and the name, opened by those paths as the server opens it, is
        still the very file that was verified (UnsafeFile otherwise: swapped, or a link planted)."""
        d = self.layout.snap[candidate.identity.server]
        d.anchor.ensure(theirs)
        name = candidate.record.filename
        st = d.lstat(name)
        if st is None:  # deleted since it was verified: llama-server would wipe the slot, never asked
            raise SnapshotNotFound(f"{name[:40]}: deleted since it was verified; not restored")
        same = stat.S_ISREG(st.st_mode) and st.st_nlink == 1
        if same and st is not None and candidate.file_id is not None:
            same = file_id(st) == candidate.file_id
        if not same or not d.leads_to(name, st, theirs):
            raise UnsafeFile(f"{name[:40]}: no longer the file that was verified; not restored")

    def confirm_unchanged(self, candidate: Candidate) -> bool:
        """After llama-server read a candidate: is the name still the very file that was verified?
        (Narrows the window in which the file could be swapped between our check and the server's open.)"""
        try:
            st = self.layout.snap[candidate.identity.server].lstat(candidate.record.filename)
        except KvError:
            return False
        if st is None or not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            return False
        return candidate.file_id is None or file_id(st) == candidate.file_id

    def _check(
        self,
        rec: GenerationRecord,
        gen: Generation,
        fingerprint: RuntimeFingerprint,
        known_format: int | None,
        max_tokens: int | None,
    ) -> Rejection | None:
        """The record-only checks (no I/O but a fingerprint lookup)."""
        now = proven(fingerprint)  # the caller proved the runtime under this fingerprint just now
        if rec.invalid_reason is not None:
            return Rejection(
                generation=gen, reason=rec.invalid_reason, detail="marked invalid", persistent=False
            )
        saved = Saved(fingerprint=rec.fingerprint, components=self._components(rec, fingerprint))
        verdict = trust(saved, now)
        if verdict.decision is not Decision.RESTORE:  # the one trust rule (store/trust.py)
            return Rejection(
                generation=gen,
                reason=verdict.reason or verdict.decision.value,
                detail="saved under another runtime",
                persistent=False,
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

    def _components(self, rec: GenerationRecord, fingerprint: RuntimeFingerprint) -> Mapping[str, str] | None:
        """The components `rec` was saved under, read from their record only when they can differ (the
        same digest: the same components)."""
        if rec.fingerprint == fingerprint.digest:
            return fingerprint.components
        return self.records.components(rec.fingerprint)


def verify_generation(
    layout: StoreLayout,
    manifest: Manifest,
    gen: Generation,
    rec: GenerationRecord,
    *,
    deep: bool,
    verified: VerifiedFiles | None = None,
) -> tuple[Rejection | None, FileId | None]:
    """The file checks, all through one descriptor opened without following links. With `verified`, a
    file this daemon already checksummed and nobody wrote since gets the cheap checks only."""
    try:
        with layout.snap[manifest.server].open_file(rec.filename) as (fd, st):
            hashed = deep and not (
                verified is not None and verified.known(manifest.server, rec.filename, st, rec.checksum)
            )
            verify_fd(
                fd,
                st,
                rec.filename,
                size=rec.bytes,
                format_version=rec.format_version,
                tokens=rec.header_tokens,
                checksum=rec.checksum,
                deep=hashed,
            )
            if file_id(os.fstat(fd)) != file_id(st):  # written while we checked it: not what we verified
                detail = "changed while being checked"
                return Rejection(generation=gen, reason=CORRUPT, detail=detail, persistent=False), None
            if hashed and verified is not None and rec.checksum is not None:
                verified.remember(manifest.server, rec.filename, st, rec.checksum)
            return None, file_id(st)
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
