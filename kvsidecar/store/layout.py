"""Where the snapshot store's files live, and the only views through which the store reaches them.

It owns the directories: `<state_dir>/manifests/`, `<state_dir>/fingerprints/` and each server's snapshot
directory. They are resolved once, at construction (a configured symlink is followed then, and logged at
open), created 0700 and tightened at start (`prepare`). From then on every access goes through a
`ConfinedDir`: a name must match the directory's own pattern, and nothing is followed through a link.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from kvsidecar.errors import MetadataIO
from kvsidecar.logs import event
from kvsidecar.store.atomic import (
    SHARED_TEMP_AGE_S,
    TEMP_FILE,
    ensure_private_dir,
    secure_directory,
    sweep_temp_files,
)
from kvsidecar.store.confined import ConfinedDir
from kvsidecar.store.naming import FINGERPRINT_FILE, MANIFEST_FILE, SNAPSHOT_FILE

log = logging.getLogger("kvsidecar.store")


@dataclass(kw_only=True)
class DirModes:
    """What `prepare` did to the directories' modes, and what it could not fix."""

    tightened: list[str] = field(default_factory=list)  # "path 0755 -> 0700"
    problems: list[str] = field(default_factory=list)  # too open and not ours to fix


def _realpath(path: Path) -> Path:
    return Path(os.path.realpath(path))


class StoreLayout:
    def __init__(
        self, *, state_dir: Path, snapshot_dirs: dict[str, Path], meta_dir: Path | None = None
    ) -> None:
        # Directories are resolved once, here: a configured symlink is followed now (and logged at open),
        # and from then on every access opens the resolved path without following a link.
        self.configured_dirs = {name: Path(p) for name, p in snapshot_dirs.items()}
        self.state_dir = _realpath(Path(state_dir))
        # Fleet mode: the metadata lives in the shared directory (fleet.shared_dir), one copy for every host.
        self.shared = meta_dir is not None
        self.meta_dir = _realpath(Path(meta_dir)) if meta_dir is not None else self.state_dir
        self.manifests_dir = self.meta_dir / "manifests"
        self.fingerprints_dir = self.meta_dir / "fingerprints"
        self.fences_dir = self.meta_dir / "fences"
        self.snapshot_dirs = {name: _realpath(p) for name, p in self.configured_dirs.items()}
        self.snap = {name: ConfinedDir(p, SNAPSHOT_FILE) for name, p in self.snapshot_dirs.items()}
        self.temp = {
            "state": ConfinedDir(self.state_dir, TEMP_FILE),
            "manifests": ConfinedDir(self.manifests_dir, TEMP_FILE),
            "fingerprints": ConfinedDir(self.fingerprints_dir, TEMP_FILE),
        }
        self.manifest_dir = ConfinedDir(self.manifests_dir, MANIFEST_FILE)
        self.fingerprint_dir = ConfinedDir(self.fingerprints_dir, FINGERPRINT_FILE)

    def path_for(self, server: str, filename: str) -> Path:
        """The path of one of our snapshot names in a server's directory (UnsafeFile if not ours)."""
        return self.snap[server].join(filename)

    def prepare(self) -> DirModes:
        """Create the directories 0700, then tighten the ones that exist and are ours (spec: KV snapshots
        are plaintext transcripts). A snapshot directory shared with llama-server's group (setgid,
        group-writable: what install-systemd sets up) keeps exactly 2770."""
        if self.shared and self.meta_dir in {*self.snapshot_dirs.values(), self.state_dir}:
            raise MetadataIO(  # it would be tightened 0700: llama-server could no longer write there
                f"fleet.shared_dir resolves to {self.meta_dir}, a snapshot directory or state_dir"
            )
        try:
            fences = [self.fences_dir] if self.shared else []
            for d in (self.manifests_dir, self.fingerprints_dir, *fences, *self.snapshot_dirs.values()):
                ensure_private_dir(d)
        except OSError as exc:
            raise MetadataIO(
                f"cannot create state directories under {self.state_dir}: {exc.strerror}"
            ) from None
        for name, configured in self.configured_dirs.items():
            if _realpath(configured) != configured.absolute():
                event(log, logging.INFO, "kv.store.dir_resolved", server=name, path=self.snapshot_dirs[name])
        modes = DirModes()
        metadata = (self.state_dir, self.manifests_dir, self.fingerprints_dir)
        dirs = [(d, False) for d in (*metadata, *([self.meta_dir, self.fences_dir] if self.shared else []))]
        dirs += [(d, True) for d in self.snapshot_dirs.values()]
        for directory, shared in dirs:
            _tighten(directory, shared, modes)
        return modes

    def sweep_temp_files(self) -> int:
        """Remove the temp files a crashed metadata write left behind; how many there were."""
        age = SHARED_TEMP_AGE_S if self.shared else 0.0  # another host may be writing one right now
        shared = sum(
            len(sweep_temp_files(d, min_age_s=age)) for d in (self.manifests_dir, self.fingerprints_dir)
        )
        return shared + len(sweep_temp_files(self.state_dir))


def _tighten(directory: Path, shared: bool, modes: DirModes) -> None:
    try:
        mode = secure_directory(directory, allow_shared_group=shared)
    except OSError as exc:
        modes.problems.append(f"{directory}: cannot check its mode ({exc.strerror})")
        return
    if mode.changed:
        modes.tightened.append(f"{directory} {mode.before:04o} -> {mode.after:04o}")
        event(
            log,
            logging.INFO,
            "kv.store.dir_tightened",
            path=directory,
            before=f"{mode.before:04o}",
            after=f"{mode.after:04o}",
        )
    if mode.problem is not None:
        modes.problems.append(f"{directory}: {mode.problem}")
        event(log, logging.WARNING, "kv.store.dir_too_open", path=directory, problem=mode.problem)
