"""The snapshot store: which file is a session's snapshot, and whether it is safe to restore (spec §39-42).

`SnapshotStore` is the one object the rest of kvsidecar holds; it composes the parts and owns deletion.
The parts, each in its own module:

- `layout.StoreLayout`          the directories, resolved once, and the confined views of them
- `table.ManifestTable`         the manifests (index + writes), refused manifests, names in flight, and the
                                one orphan rule
- `reconcile.Reconciler`        manifests against files at start and per watcher event; loose files
- `saving.SavePlanner`          the A/B plan of a save and its commit after verifying the file
- `candidates.CandidateFinder`  which generation may be restored, and why the others may not
- `FingerprintRecords`          the components of each fingerprint saved under, for mismatch reasons
                                (kvsidecar.fingerprint.records)

It reads (never writes) the `.bin` files llama-server saves into each server's snapshot directory.
Nothing deletes a file except `purge()`, `delete_generation()`, `delete_loose()` (retention, operators)
and, before a save, an entry planted at the name the server is about to write. A record is always
dropped before its file, so a crash in between leaves an orphan file (which retention collects), never a
record that vouches for a file that is gone.

Thread-safety: see `table`; every method may be called from a worker thread, and the ones that write
(durably: fsync) should be.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import psutil

from kvsidecar.backend.base import SaveResult
from kvsidecar.errors import DirMoved, Fenced, KvError, MetadataIO
from kvsidecar.files.confined import DirAnchor
from kvsidecar.fingerprint.records import FingerprintRecords
from kvsidecar.fingerprint.runtime import RuntimeFingerprint
from kvsidecar.store.candidates import Candidate, CandidateFinder, Rejection, VerifiedFiles, file_id
from kvsidecar.store.fence import FenceFiles
from kvsidecar.store.layout import StoreLayout
from kvsidecar.store.manifest import Manifest
from kvsidecar.store.naming import (
    GENERATIONS,
    KEY,
    Generation,
    SnapshotIdentity,
    parse_snapshot_name,
    snapshot_filename,
)
from kvsidecar.store.readahead import read_ahead, step_bytes
from kvsidecar.store.reconcile import LooseFile, Reconciler, ReconcileReport
from kvsidecar.store.saving import SavePlan, SavePlanner
from kvsidecar.store.state_header import tokens_of
from kvsidecar.store.state_sections import StateFormatError
from kvsidecar.store.table import (
    CORRUPT,
    FILE_MISSING,
    FILE_UNSAFE,
    RESTORE_FAILED,
    SIZE_MISMATCH,
    STATE_FORMAT_CHANGED,
    TOO_LARGE,
    ManifestTable,
)

if TYPE_CHECKING:
    from kvsidecar.config import Config

__all__ = [
    "CORRUPT",
    "FILE_MISSING",
    "FILE_UNSAFE",
    "RESTORE_FAILED",
    "SIZE_MISMATCH",
    "STATE_FORMAT_CHANGED",
    "TOO_LARGE",
    "Candidate",
    "LooseFile",
    "ReconcileReport",
    "Rejection",
    "SavePlan",
    "SnapshotStore",
]


class SnapshotStore:
    def __init__(
        self,
        *,
        state_dir: Path,
        snapshot_dirs: dict[str, Path],
        verify_checksum: bool = True,
        clock: Callable[[], float] = time.time,
        shared_dir: Path | None = None,
    ) -> None:
        # fleet mode: manifests, fingerprints and fences live in the shared directory (docs/FLEET.md)
        self.layout = StoreLayout(state_dir=state_dir, snapshot_dirs=snapshot_dirs, meta_dir=shared_dir)
        self.state_dir = self.layout.state_dir
        self.manifests_dir = self.layout.manifests_dir
        self.fingerprints_dir = self.layout.fingerprints_dir
        self.verify_checksum = verify_checksum  # live: SIGHUP may change it
        self.clock = clock
        self.table = ManifestTable(self.layout, clock=clock)
        self.records = FingerprintRecords(self.layout.fingerprint_dir)
        self.reconciler = Reconciler(self.layout, self.table)
        self.verified = VerifiedFiles()  # checksummed by this daemon and unchanged since: not re-hashed
        self.saves = SavePlanner(self.layout, self.table, self.records, self.verified)
        self.candidates = CandidateFinder(self.layout, self.table, self.records, self.verified)
        self.dir_problems: list[str] = []

    @property
    def configured_dirs(self) -> dict[str, Path]:
        return self.layout.configured_dirs

    @property
    def snapshot_dirs(self) -> dict[str, Path]:
        """Each server's snapshot directory (a discovered model's: its router entry's, `share_dir`)."""
        return self.layout.snapshot_dirs

    def share_dir(self, server: str, like: str) -> None:
        self.layout.share_dir(server, like)

    @classmethod
    def from_config(cls, config: Config) -> SnapshotStore:
        """The store a config describes (the daemon's, and the CLI's offline reads): its state directory,
        each server's snapshot directory and, in fleet mode, the shared metadata directory."""
        return cls(
            state_dir=config.state_dir,
            snapshot_dirs={name: s.snapshot_dir for name, s in config.servers.items()},
            verify_checksum=config.restore.verify_checksum,
            shared_dir=config.fleet.metadata_dir(),
        )

    def reconfigure(self, *, verify_checksum: bool) -> None:
        """SIGHUP: `restore.verify_checksum`, the store's one live setting."""
        self.verify_checksum = verify_checksum

    # lifecycle ---------------------------------------------------------------------------------------
    def open(self) -> ReconcileReport:
        """Start: directories created and tightened, temp files swept, manifests loaded, reconciled."""
        started = time.perf_counter()
        report = ReconcileReport()
        modes = self.layout.prepare()
        report.dirs_tightened, report.dir_problems = modes.tightened, modes.problems
        self.dir_problems = list(modes.problems)
        report.temp_files_removed = self.layout.sweep_temp_files()
        report.manifests, report.bad_manifests = self.table.load()
        self.reconciler.reconcile(report)
        report.elapsed_ms = (time.perf_counter() - started) * 1000
        return report

    def fence_with(self, token_for: Callable[[str], int | None]) -> FenceFiles:
        """Fleet mode: from now on every write and delete of a key's files is fenced by `token_for`."""
        fence = FenceFiles(self.layout.fences_dir, token_for, anchor=self.layout.anchors.get("fences"))
        self.table.fence = fence
        return fence

    def reload_all(self) -> None:
        """Fleet mode: re-read every manifest of the shared directory (the leader, before retention)."""
        with self.table.updating():
            self.table.load()

    def reload(self, key: str) -> Manifest | None:
        """Fleet mode: re-read one key's manifest (another host may have committed it since)."""
        return self.table.reload(key)

    def load_readonly(self) -> None:
        """Load the manifests for a read-only look (CLI offline): no sweep, no reconcile, no writes."""
        self.table.load()

    def reconcile(self, report: ReconcileReport | None = None) -> ReconcileReport:
        return self.reconciler.reconcile(report)

    # queries -----------------------------------------------------------------------------------------
    def get(self, key: str) -> Manifest | None:
        return self.table.get(key)

    def all(self) -> list[Manifest]:
        return self.table.all()

    def bad_manifests(self) -> dict[str, str]:
        return self.table.bad_manifests()

    def held_keys(self) -> set[str]:
        return self.table.held_keys()

    def inflight(self) -> set[tuple[str, str]]:
        return self.table.inflight()

    def path_for(self, server: str, filename: str) -> Path:
        return self.layout.path_for(server, filename)

    def observed_format_version(self, server: str) -> int | None:
        return self.table.observed_format_version(server)

    def loose_files(self, *, temp: bool = True) -> list[LooseFile]:
        return self.reconciler.loose_files(temp=temp)

    def register_fingerprint(self, fingerprint: RuntimeFingerprint) -> None:
        self.records.register(fingerprint)

    def fingerprint_components(self, digest: str) -> dict[str, str] | None:
        return self.records.components(digest)

    # saves, restores, records (writes go to disk durably: call off the event loop) ----------------------
    def begin_save(
        self, identity: SnapshotIdentity, *, fingerprint: RuntimeFingerprint | None = None
    ) -> SavePlan:
        return self.saves.begin_save(identity, fingerprint=fingerprint)

    def abort_save(self, plan: SavePlan, *, discard: bool = False) -> None:
        self.saves.abort_save(plan, discard=discard)

    def drop_retired(self, plan: SavePlan) -> None:
        self.saves.drop_retired(plan)

    def commit_save(
        self,
        plan: SavePlan,
        result: SaveResult,
        *,
        fingerprint: RuntimeFingerprint,
        revision: int,
        session_seq: int | None = None,
    ) -> Manifest:
        return self.saves.commit_save(
            plan,
            result,
            fingerprint=fingerprint,
            revision=revision,
            session_seq=session_seq,
            checksum=self.verify_checksum,
        )

    def preread(
        self, identity: SnapshotIdentity, fingerprint: str | None, *, stop: Callable[[], bool] = lambda: False
    ) -> int:
        """Have the kernel read ahead the generation a restore of `identity` would try first (the newest
        valid one saved under `fingerprint`), so that the read overlaps whatever comes before the restore (a
        switch's save). Advisory: it proves nothing (the restore checks everything again), and never
        raises. The name is derived from the key, opened as a plain regular file of ours only; a file
        larger than half the memory available is left alone (reading it would only evict other data).
        Runs until done or `stop()`; blocks for as long as the kernel takes to queue the reads. Returns
        the bytes advised."""
        try:
            manifest = self.table.get(identity.key)
            d = self.layout.snap.get(identity.server)
            if manifest is None or d is None or manifest.server != identity.server:
                return 0
            for gen, rec in manifest.ordered_generations():
                if rec.valid and (fingerprint is None or rec.fingerprint == fingerprint):
                    with d.open_file(identity.filename(gen)) as (fd, st):
                        if st.st_size > psutil.virtual_memory().available // 2:
                            return 0
                        return read_ahead(fd, st.st_size, step_bytes(st.st_dev), stop=stop)
        except Exception:  # advice only: whatever went wrong, the restore finds it (or not) on its own
            return 0
        return 0

    def find_restorable(
        self,
        identity: SnapshotIdentity,
        fingerprint: RuntimeFingerprint,
        *,
        max_tokens: int | None = None,
        deep: bool | None = None,
    ) -> tuple[Candidate | None, list[Rejection]]:
        deep = self.verify_checksum if deep is None else deep
        return self.candidates.find(identity, fingerprint, max_tokens=max_tokens, deep=deep)

    def find_points(
        self,
        identity: SnapshotIdentity,
        fingerprint: RuntimeFingerprint,
        *,
        max_tokens: int | None = None,
        deep: bool | None = None,
    ) -> tuple[list[Candidate], list[Rejection]]:
        """Every restorable generation of `identity`, newest first (the checks of `find_restorable`)."""
        deep = self.verify_checksum if deep is None else deep
        return self.candidates.find_all(identity, fingerprint, max_tokens=max_tokens, deep=deep)

    def point_tokens(self, candidate: Candidate) -> tuple[int, ...] | None:
        """The tokens `candidate`'s file holds, from its header (state_header.py); None when they cannot be
        read (the planner then knows nothing of them). Opened as a plain regular file of ours only, and
        only the very file the candidate's checks verified (its device, inode, size and times): a file
        replaced since proves nothing of what will be restored."""
        d = self.layout.snap.get(candidate.identity.server)
        if d is None or candidate.file_id is None:
            return None
        try:
            with d.open_file(candidate.record.filename) as (fd, st):
                if file_id(st) != candidate.file_id:
                    return None
                return tokens_of(fd, st.st_size)
        except (KvError, OSError, StateFormatError):
            return None

    def confirm_unchanged(self, candidate: Candidate) -> bool:
        return self.candidates.confirm_unchanged(candidate)

    # the directories llama-server writes and reads by path (SNAPSHOT_DIR_MOVED; layout, confined) ------
    def check_snapshot_dir(self, server: str, theirs: str | None = None) -> None:
        """DirMoved unless `server`'s configured snapshot_dir (and `theirs`, llama-server's
        --slot-save-path as this host sees it) still resolves to the directory held since start."""
        self.layout.check_snapshot_dir(server, theirs)

    def snapshot_anchor(self, server: str) -> DirAnchor | None:
        """The held snapshot directory of `server` (None: not one of the store's servers)."""
        return self.layout.anchors.get(f"snapshots:{server}")

    def snapshot_dir_fault(self, server: str, theirs: str | None = None) -> str | None:
        return self.layout.snapshot_dir_fault(server, theirs)

    def dir_faults(self, theirs: dict[str, str | None] | None = None) -> dict[str, str]:
        """Every held directory whose path leads elsewhere now (area -> why)."""
        return self.layout.faults(theirs)

    def check_save_target(self, plan: SavePlan, theirs: str | None = None) -> None:
        """Right before the server writes `plan`: see `SavePlanner.check_target`."""
        self.saves.check_target(plan, theirs)

    def check_before_restore(self, candidate: Candidate, theirs: str | None = None) -> None:
        """Right before the server reads `candidate`: see `CandidateFinder.check_before_restore`."""
        self.candidates.check_before_restore(candidate, theirs)

    def mark_invalid(self, key: str, gen: Generation, reason: str) -> None:
        self.table.mark_invalid(key, gen, reason)

    def touch(self, key: str, *, persist: bool = True) -> None:
        self.table.touch(key, persist=persist)

    def recheck_file(self, server: str, filename: str) -> str | None:
        return self.reconciler.recheck_file(server, filename)

    # deletion ----------------------------------------------------------------------------------------
    def delete_generation(self, key: str, gen: Generation) -> int:
        """Forget a generation, then delete its file: a crash in between leaves an orphan file (which
        retention collects), never a record that vouches for a file that is gone."""
        forgotten = self.table.forget_generation(key, gen)
        if forgotten is None:
            return 0
        server, rec = forgotten
        return self._unlink(server, rec.filename)

    def purge(self, key: str) -> int:
        """Drop a snapshot identity's manifest (or the refused file in its place), then delete its files
        (same crash rule as above). The names deleted are derived from the key, never read from disk."""
        if not isinstance(key, str) or not KEY.match(key):
            return 0
        manifest = self.get(key)
        if manifest is None and not self.table.is_bad(key):
            return 0
        self.table.drop(key)
        servers = [manifest.server] if manifest is not None else list(self.layout.snap)
        inflight = self.inflight()
        freed = 0
        for server in servers:
            for gen in GENERATIONS:
                name = snapshot_filename(key, gen)
                if server in self.layout.snap and (server, name) not in inflight:
                    freed += self._unlink(server, name)
        return freed

    def delete_loose(self, loose: LooseFile) -> bool:
        return self.reconciler.delete_loose(loose)

    def _unlink(self, server: str, name: str) -> int:
        parsed = parse_snapshot_name(name)
        try:
            with self.table.fenced(parsed[0] if parsed else "-", "snapshot delete"):
                return self.layout.snap[server].unlink(name) or 0
        except (Fenced, DirMoved):
            raise
        except (KvError, OSError) as exc:
            raise MetadataIO(f"cannot delete {name[:40]}: {exc}") from None
