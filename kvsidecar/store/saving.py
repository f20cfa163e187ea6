"""Saving: the A/B plan for one save, and its commit once the file is verified on disk (Invariant: A/B).

A save never goes to the newest generation that still verifies: it targets the other one (`begin_save`),
stops trusting what that target held, clears its name of anything planted there (a link, FIFO, device:
the entry itself is removed, never what it points to) and marks the name in flight so it is nobody's
orphan while llama-server writes it. `commit_save` checks, hashes and chmods the written file through one
descriptor opened without following links, and only then flips the manifest to it; so the last good
generation and its record survive any failed save. `abort_save` ends the save either way.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import threading
from dataclasses import dataclass
from functools import partial
from pathlib import Path

from kvsidecar.backend.base import SaveResult
from kvsidecar.errors import DirMoved, KvError, SaveFailed, SnapshotCorrupt, SnapshotError
from kvsidecar.files.confined import UNSAFE, UnsafeFile, describe, problem
from kvsidecar.fingerprint.records import FingerprintRecords
from kvsidecar.fingerprint.runtime import RuntimeFingerprint
from kvsidecar.logs import event
from kvsidecar.store.candidates import VerifiedFiles, file_id, verify_generation
from kvsidecar.store.integrity import Header, checksum_from_fd, header_from_fd
from kvsidecar.store.layout import StoreLayout
from kvsidecar.store.manifest import GenerationRecord, Manifest
from kvsidecar.store.naming import Generation, SnapshotIdentity, other_generation, staging_filename
from kvsidecar.store.table import ManifestTable

log = logging.getLogger("kvsidecar.store")


@dataclass(frozen=True, kw_only=True)
class SavePlan:
    identity: SnapshotIdentity
    generation: Generation
    filename: str  # what llama-server writes
    path: Path
    kept: Generation | None = None  # the newest generation that verified: never the target
    # the generation's own name; in fleet mode `filename` is a staging name renamed to it at the commit
    final: str = ""
    # where the target's old file was moved, to be deleted off the save's path (`drop_retired`)
    retired: str | None = None

    @property
    def staged(self) -> bool:
        return bool(self.final) and self.final != self.filename


def _room_for(path: Path, nbytes: int) -> bool:
    """Whether the disk holding `path` has `nbytes` free (False when that cannot be told)."""
    try:
        return shutil.disk_usage(path).free >= nbytes
    except OSError:
        return False


class SavePlanner:
    def __init__(
        self,
        layout: StoreLayout,
        table: ManifestTable,
        records: FingerprintRecords,
        verified: VerifiedFiles | None = None,
    ) -> None:
        self.verified = verified
        self.layout, self.table, self.records = layout, table, records
        # old files moved aside and not deleted yet, by (server, name): (device, bytes)
        self._retiring: dict[tuple[str, str], tuple[int, int]] = {}
        self._retiring_lock = threading.Lock()

    def begin_save(self, identity: SnapshotIdentity, *, fingerprint: RuntimeFingerprint | None) -> SavePlan:
        """Pick the generation to write: never the newest one that still verifies (preferring one saved
        under `fingerprint`, by default the server's runtime as last seen here). Stop trusting what the
        target held, and clear its name of anything planted there, before the server writes it."""
        # Not while the directory's path leads elsewhere: nothing changes (no record dropped, no file
        # moved), the save is refused as SNAPSHOT_DIR_MOVED.
        self.layout.check_snapshot_dir(identity.server)
        manifest = self.table.get(identity.key)
        runtime = fingerprint.digest if fingerprint is not None else self.table.last_runtime(identity.server)
        kept = self._newest_verifying(manifest, runtime) if manifest is not None else None
        with self.table.updating():
            manifest = self.table.get(identity.key)  # _newest_verifying may have marked generations invalid
            gen = other_generation(kept if kept is not None else manifest.current if manifest else None)
            final = identity.filename(gen)
            if manifest is not None and gen in manifest.generations:
                # The server is about to overwrite this file: the manifest must not vouch for it meanwhile.
                # The kept generation's record stays until the new one is committed.
                current = manifest.current if manifest.current != gen else kept
                now = self.table.clock()
                self.table.put(manifest.with_generation(gen, None, current=current, updated_at=now))
        if self.layout.shared:  # fleet: written under a fresh name, renamed at the commit under the fence
            filename = self._fresh_name(identity, gen)
        else:
            filename = final
            self.table.writing_started(identity.server, filename)
        try:
            with self.table.fenced(identity.key, "save"):  # fleet: only the key's owner may clear its file
                retired = self._clear_target(identity, gen, filename)
        except BaseException:
            self.table.writing_ended(identity.server, filename)
            raise
        return SavePlan(
            retired=retired,
            identity=identity,
            generation=gen,
            filename=filename,
            path=self.layout.path_for(identity.server, filename),
            kept=kept,
            final=final,
        )

    def _fresh_name(self, identity: SnapshotIdentity, gen: Generation) -> str:
        """A staging name of the generation that nobody claims (retention and other saves draw from the
        same names), claimed for this save."""
        for _ in range(3):  # 32 random bits each: a second draw is already a curiosity
            name = staging_filename(identity.key, gen)
            if self.table.claim_fresh(identity.server, name):
                return name
        raise SaveFailed("no unclaimed staging name for the save; try again")

    def _newest_verifying(self, manifest: Manifest, runtime: str | None) -> Generation | None:
        """The generation a save must not touch: the newest valid one whose file still passes the cheap
        checks (type, owner, size, header), preferring those saved under `runtime`."""
        ordered = [(g, r) for g, r in manifest.ordered_generations() if r.valid]
        ordered.sort(key=lambda gr: gr[1].fingerprint != runtime)  # stable: current first within each
        for gen, rec in ordered:
            rejection, _ = verify_generation(self.layout, manifest, gen, rec, deep=False)
            if rejection is None:
                return gen
            with contextlib.suppress(KvError):
                self.table.mark_invalid(manifest.key, gen, rejection.reason)
        return None

    def _clear_target(self, identity: SnapshotIdentity, gen: Generation, filename: str) -> str | None:
        """Before the server writes `filename`: nothing may stand there that a write would go through
        (a symlink, a hard link to someone else's file, a FIFO, a device). Such an entry is removed itself,
        never what it points to; a directory makes the save refused. Our own old file is cleared too, so
        the server creates a fresh file (if that fails, the server overwrites it in place): renamed aside
        when the disk has room (returns that name, for `drop_retired`), else removed here.

        Why aside: freeing a large file's blocks takes time in proportion to its size (ext4: ~70 ms for
        380 MB, seconds at 5-30 GB; an in-place overwrite pays the same in its truncation), and on a
        switch that time would stand between the user and the incoming session's restore. A rename takes
        microseconds; the deletion then runs beside the server's write."""
        server = identity.server
        d = self.layout.snap[server]
        try:
            st = d.lstat(filename)
            if st is None:
                return None
            why = problem(st, d.expected_uids())
            if why is None and not self.layout.shared and self._room_to_retire(d.path, st):
                retired = self._retire(identity, gen, filename, st)
                if retired is not None:
                    return retired
                st = d.lstat(filename)  # what stands there now (an entry swapped in was put back)
                if st is None:
                    return None
                why = problem(st, d.expected_uids())
            try:
                d.unlink(filename)
            except OSError as exc:
                if why is None:
                    return None
                raise SaveFailed(
                    f"a {describe(st)} is at the snapshot file name and cannot be removed ({exc.strerror}); "
                    "refusing to save through it"
                ) from None
        except UnsafeFile as exc:
            raise SaveFailed(
                f"refusing to save: {exc.message}", hint="Remove what occupies the name."
            ) from None
        except DirMoved:
            raise
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
        return None

    def check_target(self, plan: SavePlan, theirs: str | None = None) -> None:
        """Right before llama-server is asked to write `plan.filename`: the directory's configured path
        (and `theirs`, llama-server's --slot-save-path as this host sees it) still leads to the directory
        held since start (DirMoved otherwise), and the name holds nothing, or our own plain regular file
        (SaveFailed otherwise: something was planted there since `begin_save` cleared it). Through the
        held directory: what is checked is the entry llama-server's open will meet, as long as the path
        leads there (checked again right after the call, `check_written_dir`)."""
        d = self.layout.snap[plan.identity.server]
        d.anchor.ensure(theirs)
        st = d.lstat(plan.filename)
        if st is not None and (why := problem(st, d.expected_uids())) is not None:
            raise SaveFailed(
                f"refusing to save: the snapshot file name {why} (planted after it was cleared)",
                hint="Remove what occupies the name.",
            )

    def _room_to_retire(self, path: Path, st: os.stat_result) -> bool:
        """Whether the new file may be written while the old one still holds its space: room on the disk
        for twice the old file's size (the session grows), on top of twice what the files moved aside and
        not yet deleted on that disk hold (their saves are writing too)."""
        with self._retiring_lock:
            pending = sum(n for dev, n in self._retiring.values() if dev == st.st_dev)
        return _room_for(path, 2 * (st.st_size + pending))

    def _retire(
        self, identity: SnapshotIdentity, gen: Generation, filename: str, st: os.stat_result
    ) -> str | None:
        """Move our old file `st` at `filename` to a fresh name of the same generation, claimed (nobody's
        orphan) until `drop_retired` deletes it. None if it was not moved: the rename failed, or what it
        moved is not `st` (an entry swapped in after the check: put back, for the caller to clear as the
        planted entry it is). A crash after the rename leaves a name of ours in no manifest: an orphan,
        which retention deletes."""
        server = identity.server
        d = self.layout.snap[server]
        try:
            retired = d.move_aside(
                filename,
                st,
                draw=partial(staging_filename, identity.key, gen),
                claim=partial(self.table.claim_fresh, server),
                release=partial(self.table.writing_ended, server),
                keep=lambda moved: problem(moved, d.expected_uids()) is None,
            )
        except (KvError, OSError):
            return None
        if retired is None:
            return None
        with self._retiring_lock:
            self._retiring[(server, retired)] = (st.st_dev, st.st_size)
        return retired

    def drop_retired(self, plan: SavePlan) -> None:
        """Delete the old file `begin_save` moved aside (the entry itself, whatever it is by now). Errors are
        left to retention: the name is an orphan once unclaimed. Idempotent; thread-safe."""
        if plan.retired is None:
            return
        try:
            with contextlib.suppress(KvError, OSError):
                self.layout.snap[plan.identity.server].unlink(plan.retired)
        finally:
            with self._retiring_lock:
                self._retiring.pop((plan.identity.server, plan.retired), None)
            self.table.writing_ended(plan.identity.server, plan.retired)

    def abort_save(self, plan: SavePlan, *, discard: bool = False) -> None:
        """The save is over; the target's old file is gone by now. `discard`: it failed, so whatever the
        server left in the file is garbage (a partial write after ENOSPC, say): delete it now rather than let
        it hold the disk. It is never the kept generation (begin_save did not pick it)."""
        if discard:
            self._discard(plan)
        self.table.writing_ended(plan.identity.server, plan.filename)
        self.drop_retired(plan)  # if nobody did yet (the coordinator starts it beside the server's write)

    def _discard(self, plan: SavePlan) -> None:
        """Delete what the failed save left: its own staging name needs no fence (nobody else writes it);
        a generation's name does (a new owner may have committed that name since)."""
        fence = contextlib.nullcontext() if plan.staged else self.table.fenced(plan.identity.key, "discard")
        with contextlib.suppress(KvError, OSError), fence:
            self.layout.snap[plan.identity.server].unlink(plan.filename)

    def commit_save(
        self,
        plan: SavePlan,
        result: SaveResult,
        *,
        fingerprint: RuntimeFingerprint,
        revision: int,
        session_seq: int | None,
        checksum: bool,
    ) -> Manifest:
        """Verify the file the backend says it wrote; only then flip the manifest to it (Invariant: A/B).
        The file is checked, hashed and chmod-ed through one descriptor opened without following links:
        a link, FIFO, hard link or foreign file at the name is refused (and the entry removed). Not
        while the directory's path leads elsewhere (DirMoved: the server may have written elsewhere)."""
        try:
            self.layout.check_snapshot_dir(plan.identity.server)
            header, size, digest, checked = self._check_written(plan, checksum=checksum)
            now = self.table.clock()
            record = GenerationRecord(
                filename=plan.final or plan.filename,
                tokens=result.tokens,
                header_tokens=header.tokens,
                bytes=size,
                checksum=digest,
                format_version=header.version,
                fingerprint=fingerprint.digest,
                saved_at=now,
                revision=revision,
            )
            self.records.register(fingerprint)
            with self.table.updating(), self.table.fenced(plan.identity.key, "commit"):
                if plan.staged:  # the name the manifest will reference appears only under the fence
                    self._publish(plan, checked)
                manifest = self.table.put(self._committed(plan, record, now, session_seq))
            self.table.saw_runtime(plan.identity.server, fingerprint.digest, format_version=header.version)
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
            self._discard(plan)
            raise
        finally:
            self.abort_save(plan)

    def _check_written(
        self, plan: SavePlan, *, checksum: bool
    ) -> tuple[Header, int, str | None, tuple[int, int]]:
        """The written file's header, size and (if `checksum`) digest, read through one descriptor;
        ours is made 0600 (transcripts), a file of llama-server's user keeps its umask."""
        d = self.layout.snap[plan.identity.server]
        with d.open_file(plan.filename) as (fd, st):
            # The file is in our directory (fstatat through the held descriptor); and the configured path
            # of the name leads to this very file (the server wrote it by that path).
            if not d.leads_to(plan.filename, st):
                raise SnapshotCorrupt(f"{plan.filename[:40]}: its path leads to another file; not trusted")
            header = header_from_fd(fd, plan.filename)
            if st.st_uid == os.geteuid():
                with contextlib.suppress(OSError):
                    os.fchmod(fd, 0o600)
            # n_written undercounts on some builds: the file itself is the truth for bytes.
            before = os.fstat(fd)  # after the chmod (which moves ctime), before the hash
            digest = checksum_from_fd(fd) if checksum else None
            after = os.fstat(fd)
            if file_id(after) != file_id(before):
                raise SnapshotCorrupt(f"{plan.filename}: changed while being checked")
            if digest is not None and self.verified is not None:  # the next restore need not hash it
                self.verified.remember(plan.identity.server, plan.final or plan.filename, after, digest)
        return header, st.st_size, digest, (after.st_dev, after.st_ino)

    def _publish(self, plan: SavePlan, checked: tuple[int, int]) -> None:
        """Rename the checked staging file to the generation's name (atomic in one directory), and make sure
        the name now holds that very file (nothing swapped in between the check and the rename)."""
        d = self.layout.snap[plan.identity.server]
        d.check(plan.filename)
        d.check(plan.final)
        with d.fd() as dfd:
            before = os.stat(plan.filename, dir_fd=dfd, follow_symlinks=False)
            if (before.st_dev, before.st_ino) != checked:
                raise SnapshotCorrupt(f"{plan.filename}: replaced after it was checked; not committed")
            os.rename(plan.filename, plan.final, src_dir_fd=dfd, dst_dir_fd=dfd)
            after = os.stat(plan.final, dir_fd=dfd, follow_symlinks=False)
        if (after.st_dev, after.st_ino) != checked or not stat.S_ISREG(after.st_mode):
            raise SnapshotCorrupt(f"{plan.final}: not the file that was checked")

    def _committed(
        self, plan: SavePlan, record: GenerationRecord, now: float, session_seq: int | None
    ) -> Manifest:
        base = self.table.get(plan.identity.key) or Manifest.new(plan.identity, now)
        return base.with_generation(
            plan.generation,
            record,
            current=plan.generation,
            updated_at=now,
            last_used_at=now,
            session_seq=session_seq if session_seq is not None else base.session_seq,
            scope=plan.identity.scope,  # recorded durably: a donor's scope is checked here after a restart
        )
