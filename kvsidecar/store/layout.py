"""Where the snapshot store's files live, and the only views through which the store reaches them.

It owns the directories: `<state_dir>/manifests/`, `<state_dir>/fingerprints/` and each server's snapshot
directory. They are resolved once, at construction (a configured symlink is followed then, and logged at
open), created 0700, tightened and held open at start (`prepare`). From then on every access goes through
a `ConfinedDir`: a name must match the directory's own pattern, nothing is followed through a link, and
the directory is the one held (`confined.DirAnchor`). Its configured path (and, for a snapshot directory,
llama-server's --slot-save-path as this host sees it) must keep leading to that very directory: when it
does not, that is a fault, `SNAPSHOT_DIR_MOVED` (`check_snapshot_dir`, `check_metadata`, `faults`), and
nothing is saved, restored or written there until it leads back. Nothing is deleted because of it.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path

from kvsidecar.errors import MetadataIO
from kvsidecar.files.atomic import (
    SHARED_TEMP_AGE_S,
    TEMP_FILE,
    ensure_private_dir,
    secure_directory,
    sweep_temp_files,
)
from kvsidecar.files.confined import ConfinedDir, DirAnchor
from kvsidecar.logs import event
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
        configured_meta = Path(meta_dir) if meta_dir is not None else Path(state_dir)
        self.meta_dir = _realpath(Path(meta_dir)) if meta_dir is not None else self.state_dir
        self.manifests_dir = self.meta_dir / "manifests"
        self.fingerprints_dir = self.meta_dir / "fingerprints"
        self.fences_dir = self.meta_dir / "fences"
        self.snapshot_dirs = {name: _realpath(p) for name, p in self.configured_dirs.items()}
        # One held directory each; the paths that must keep leading to it are the resolved and the
        # configured one (a link on the path retargeted, or an ancestor replaced, leads elsewhere).
        self.anchors: dict[str, DirAnchor] = {
            f"snapshots:{name}": DirAnchor(
                p, area=f"snapshots:{name}", views=(str(self.configured_dirs[name]),)
            )
            for name, p in self.snapshot_dirs.items()
        }
        for area, path, configured in (
            ("state", self.state_dir, Path(state_dir)),
            ("manifests", self.manifests_dir, configured_meta / "manifests"),
            ("fingerprints", self.fingerprints_dir, configured_meta / "fingerprints"),
        ):
            self.anchors[area] = DirAnchor(path, area=area, views=(str(configured),))
        if self.shared:  # fleet: the fence files, which every host's writes are checked against
            self.anchors["fences"] = DirAnchor(
                self.fences_dir, area="fences", views=(str(configured_meta / "fences"),)
            )
        self.snap = {
            name: ConfinedDir(p, SNAPSHOT_FILE, anchor=self.anchors[f"snapshots:{name}"])
            for name, p in self.snapshot_dirs.items()
        }
        self.temp = {
            area: ConfinedDir(self.anchors[area].path, TEMP_FILE, anchor=self.anchors[area])
            for area in ("state", "manifests", "fingerprints")
        }
        self.manifest_dir = ConfinedDir(self.manifests_dir, MANIFEST_FILE, anchor=self.anchors["manifests"])
        self.fingerprint_dir = ConfinedDir(
            self.fingerprints_dir, FINGERPRINT_FILE, anchor=self.anchors["fingerprints"]
        )

    def share_dir(self, server: str, like: str) -> None:
        """`server` (a model discovered on a router, coordinator/router_models.py) keeps its snapshots in
        `like`'s directory, through the very same held directory. Each map is replaced, never changed in
        place: a worker thread iterating one keeps its own copy."""
        if server in self.snap:
            return
        self.configured_dirs = {**self.configured_dirs, server: self.configured_dirs[like]}
        self.snapshot_dirs = {**self.snapshot_dirs, server: self.snapshot_dirs[like]}
        self.anchors = {**self.anchors, f"snapshots:{server}": self.anchors[f"snapshots:{like}"]}
        self.snap = {**self.snap, server: self.snap[like]}

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
            metadata_dirs = (self.state_dir, self.manifests_dir, self.fingerprints_dir, *fences)
            for d in (*metadata_dirs, *self.snapshot_dirs.values()):
                ensure_private_dir(d)
        except OSError as exc:
            raise MetadataIO(
                f"cannot create state directories under {self.state_dir}: {exc.strerror}"
            ) from None
        for name, configured in self.configured_dirs.items():
            if _realpath(configured) != configured.absolute():
                event(log, logging.INFO, "kv.store.dir_resolved", server=name, path=self.snapshot_dirs[name])
        for anchor in self.anchors.values():
            try:
                anchor.hold()
            except OSError as exc:  # a link or non-directory now stands where the directory was resolved
                raise MetadataIO(
                    f"cannot open {anchor.path} as a directory of ours ({exc.strerror}): kvsidecar keeps "
                    "its files only in a real directory, never behind a symlink at it"
                ) from None
            anchor.moved()  # a path that leads elsewhere already (changed since it was resolved): logged
        modes = DirModes()
        metadata = (self.state_dir, self.manifests_dir, self.fingerprints_dir)
        dirs = [(d, False) for d in (*metadata, *([self.meta_dir, self.fences_dir] if self.shared else []))]
        dirs += [(d, True) for d in self.snapshot_dirs.values()]
        for directory, shared in dirs:
            _tighten(directory, shared, modes)
        return modes

    def check_snapshot_dir(self, server: str, theirs: str | None = None) -> None:
        """Right before (and after) llama-server is asked to save or restore in `server`'s directory: the
        configured snapshot_dir, and `theirs` (llama-server's --slot-save-path as this host sees it, when
        known), must still resolve to the directory held since start. DirMoved otherwise."""
        self.anchors[f"snapshots:{server}"].ensure(theirs)

    def snapshot_dir_fault(self, server: str, theirs: str | None = None) -> str | None:
        """Why `server`'s snapshot directory may not be used now (checked now); None if it may."""
        anchor = self.anchors.get(f"snapshots:{server}")
        return anchor.moved(theirs) if anchor is not None else None

    def check_metadata(self, area: str) -> None:
        """Before a metadata write in `area` ("manifests", "fingerprints"): DirMoved unless its path
        still leads to the directory held since start."""
        self.anchors[area].ensure()

    def faults(self, theirs: dict[str, str | None] | None = None) -> dict[str, str]:
        """Every held directory whose path leads elsewhere now: area -> why (status, doctor, metrics).
        `theirs`: llama-server's --slot-save-path per server, as this host sees it, where known."""
        theirs = theirs or {}
        out: dict[str, str] = {}
        for area, anchor in self.anchors.items():
            server = area.removeprefix("snapshots:") if area.startswith("snapshots:") else None
            why = anchor.moved(theirs.get(server) if server is not None else None)
            if why is not None:
                out[area] = why
        return out

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
