"""Reconcile: the manifests against the files on disk, and the loose files no manifest references.

At start (`reconcile`), and for one file on each watcher event (`recheck_file`), a valid generation whose
file is missing, resized or not a plain regular file of ours is marked invalid (cheap: lstat only; the
full checks run before a restore). Nothing here deletes a snapshot that a manifest references.

Loose files are files of ours by name that nobody claims (`ManifestTable.unclaimed`, the one orphan rule):
orphan snapshot files (a crash between dropping a record and deleting its file leaves one) and temp
files a crashed metadata write left. `loose_files` lists them for reconcile's report and for retention,
which alone deletes them (`delete_loose`, re-checked against the rule at the moment of deletion).
"""

from __future__ import annotations

import logging
import os
import stat
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Literal

from kvsidecar.errors import KvError, MetadataIO
from kvsidecar.files.atomic import SHARED_TEMP_AGE_S
from kvsidecar.files.confined import ConfinedDir, Entry, problem
from kvsidecar.logs import event
from kvsidecar.store.layout import StoreLayout
from kvsidecar.store.manifest import GenerationRecord
from kvsidecar.store.naming import Generation, parse_snapshot_name, staging_filename
from kvsidecar.store.table import FILE_MISSING, FILE_UNSAFE, SIZE_MISMATCH, ManifestTable

log = logging.getLogger("kvsidecar.store")


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


class Reconciler:
    def __init__(self, layout: StoreLayout, table: ManifestTable) -> None:
        self.layout, self.table = layout, table

    def reconcile(self, report: ReconcileReport | None = None) -> ReconcileReport:
        """Compare manifests with files: missing, resized or not a plain file of ours -> invalid;
        unreferenced files of ours -> orphans (files of a bad manifest's key are held, not orphans)."""
        report = report or ReconcileReport()
        listing: dict[str, dict[str, os.stat_result]] = {}
        for server, d in self.layout.snap.items():
            entries = scan(d)
            if entries is not None:  # a directory that cannot be opened safely: leave its records alone
                listing[server] = {e.name: e.st for e in entries}
        uids = {server: d.expected_uids() for server, d in self.layout.snap.items()}
        for m in self.table.all():
            present = listing.get(m.server)
            if present is None:
                continue  # server no longer configured: leave it alone
            for gen, rec in m.ordered_generations():
                if not rec.valid:
                    continue
                reason = entry_reason(present.get(rec.filename), rec, uids[m.server])
                if reason is not None and not self.layout.shared:
                    self.table.mark_invalid(m.key, gen, reason)
                    report.invalidated.append((m.key, gen, reason))
        for loose in self.loose_files(temp=False):
            report.orphans.append(self.layout.snapshot_dirs[loose.area] / loose.name)
        held = self.table.held_keys()
        for server, names in listing.items():
            for name in names:
                parsed = parse_snapshot_name(name)
                if parsed is not None and parsed[0] in held:
                    report.held.append(self.layout.snapshot_dirs[server] / name)
        return report

    def loose_files(self, *, temp: bool = True) -> list[LooseFile]:
        """Files of ours that no manifest references (the one orphan rule, used by reconcile and
        retention): snapshot-named entries in a snapshot directory that nobody claims (not referenced,
        not being written, not held by a bad manifest); and (temp=True) our temp files in the state
        directories."""
        out: list[LooseFile] = []
        for server, d in self.layout.snap.items():
            entries = [e for e in scan(d) or [] if not stat.S_ISDIR(e.st.st_mode)]
            unclaimed = self.table.unclaimed([e.name for e in entries])
            for e in entries:
                if e.name in unclaimed:
                    size = e.st.st_size if stat.S_ISREG(e.st.st_mode) else 0
                    out.append(
                        LooseFile(area=server, name=e.name, bytes=size, mtime=e.st.st_mtime, kind="orphan")
                    )
        for area, d in self.layout.temp.items() if temp else ():
            for e in scan(d) or []:
                if stat.S_ISREG(e.st.st_mode):
                    out.append(
                        LooseFile(
                            area=area, name=e.name, bytes=e.st.st_size, mtime=e.st.st_mtime, kind="temp"
                        )
                    )
        return out

    def delete_loose(self, loose: LooseFile) -> bool:
        """Delete an orphan or temp file found by `loose_files`, re-checking against the orphan rule, with
        the table held still, that it is still loose (a save may have adopted the name since the listing)."""
        d = self.layout.temp.get(loose.area) if loose.kind == "temp" else self.layout.snap.get(loose.area)
        parsed = parse_snapshot_name(loose.name)
        if d is None or (loose.kind == "orphan" and parsed is None):
            return False
        if self.layout.shared:
            # Fleet: another host may be writing it (its in-flight set is not ours): only old ones, and an
            # orphan only under the key's fence, against its manifest as it is on the shared disk now. The
            # fence covers the re-check and the rename; the slow unlink of the fresh name comes after it.
            if loose.area != "state" and time.time() - loose.mtime < SHARED_TEMP_AGE_S:
                return False
            if parsed is not None:
                with self.table.fenced(parsed[0], "orphan delete"):
                    self.table.reload(parsed[0])
                    taken = self._take_loose(d, loose)
                return self._free(d, loose, taken)
        return self._free(d, loose, self._take_loose(d, loose))

    def _take_loose(self, d: ConfinedDir, loose: LooseFile) -> bool | str:
        """The re-check and the deletion must be one step against the table (no save adopts the name in
        between), but freeing a large file takes time in proportion to its size (seconds at 5-30 GB), and
        every manifest lookup waits for the table meanwhile. So an orphan snapshot is renamed, with the
        table held, to a fresh name it claims (returned, for `_free`). Anything else is deleted here and
        the outcome returned: other loose files are small, and if the rename fails (ENOSPC, say) the file
        is deleted in place, slow as that is: freeing space is what retention is there for."""
        parsed = parse_snapshot_name(loose.name) if loose.kind == "orphan" else None
        with self.table.holding_claims(loose.name) as unclaimed:
            if loose.kind == "orphan" and not unclaimed:
                return False
            aside = self._set_aside(d, loose.area, loose.name, parsed) if parsed is not None else None
            if aside is not None:
                return aside
            try:
                return d.unlink(loose.name) is not None
            except (KvError, OSError) as exc:
                raise MetadataIO(f"cannot delete {loose.name[:40]}: {exc}") from None

    def _free(self, d: ConfinedDir, loose: LooseFile, taken: bool | str) -> bool:
        """Unlink the fresh name `_take_loose` moved an orphan to (nothing held), then end its claim; if
        that fails, the file stays under the fresh name, unclaimed: an orphan for the next run."""
        if isinstance(taken, bool):
            return taken
        try:
            return d.unlink(taken) is not None
        except (KvError, OSError) as exc:
            raise MetadataIO(f"cannot delete {loose.name[:40]}: {exc}") from None
        finally:
            self.table.writing_ended(loose.area, taken)

    def _set_aside(self, d: ConfinedDir, area: str, name: str, parsed: tuple[str, Generation]) -> str | None:
        """With the table held: move the regular file at `name` aside to a fresh name of ours that nothing
        is at and nobody claims (a save's staging or moved-aside name is claimed before its file exists),
        claimed. None when it is not moved (the caller deletes it in place)."""
        try:
            st = d.lstat(name)
            if st is None or not stat.S_ISREG(st.st_mode):
                return None
            return d.move_aside(
                name,
                st,
                draw=partial(staging_filename, *parsed),
                claim=partial(self.table.claim_held, area),
                release=partial(self.table.unclaim_held, area),
                keep=lambda _moved: True,
            )
        except (KvError, OSError):
            return None

    def recheck_file(self, server: str, filename: str) -> str | None:
        """An event on a snapshot file: if it no longer matches its record, mark it. Returns the reason.
        It may write the manifest (durably): call it off the event loop."""
        parsed = parse_snapshot_name(filename)
        if parsed is None or server not in self.layout.snap or (server, filename) in self.table.inflight():
            return None
        key, gen = parsed
        fence = self.table.fence
        if fence is not None and fence.token_for(key) is None:
            return None  # fleet: another host's file (its owner checks it before any restore)
        manifest = self.table.get(key)
        rec = manifest.generation(gen) if manifest else None
        if manifest is None or rec is None or not rec.valid:
            return None
        if manifest.server != server and self.layout.snap.get(manifest.server) is not self.layout.snap.get(
            server
        ):
            return None  # (a router's model discovered shares its entry's held directory: `share_dir`)
        if rec.filename != filename:  # a staging name of the generation (fleet): not the recorded file
            return None
        d = self.layout.snap[server]
        try:
            reason = entry_reason(d.lstat(filename), rec, d.expected_uids())
        except KvError:
            reason = FILE_MISSING
        if reason is not None:
            try:
                self.table.mark_invalid(manifest.key, gen, reason)
            except KvError:
                return None
        return reason


def scan(d: ConfinedDir) -> list[Entry] | None:
    """The directory's entries of ours; None (logged) when it cannot be opened safely."""
    try:
        return d.scan()
    except (KvError, OSError) as exc:
        event(log, logging.WARNING, "kv.store.dir_unsafe", path=d.path, error=str(exc)[:200])
        return None


def entry_reason(st: os.stat_result | None, rec: GenerationRecord, uids: frozenset[int]) -> str | None:
    """Why a directory entry no longer matches its record (cheap: lstat only); None if it still does."""
    if st is None:
        return FILE_MISSING
    if problem(st, uids) is not None:
        return FILE_UNSAFE
    return SIZE_MISMATCH if st.st_size != rec.bytes else None
