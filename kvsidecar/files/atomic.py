"""The one atomic-write helper every metadata write goes through (spec §40), and the startup temp sweep.

temp file in the same directory -> write -> fsync -> rename over the target -> fsync the directory.
A crash at any step leaves either the old file or the new one, never half of one; what it may leave is a
temp file, which `sweep_temp_files()` removes at the next start.
"""

from __future__ import annotations

import contextlib
import os
import re
import secrets
import stat
import time
from dataclasses import dataclass
from pathlib import Path

TEMP_MARK = ".tmp-"
# The only names sweep_temp_files() may delete: `.<target name>.tmp-<hex>`, as atomic_write_bytes makes.
TEMP_FILE = re.compile(r"\A\.[A-Za-z0-9._-]{1,200}\.tmp-[0-9a-f]{1,32}\Z", re.ASCII)


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_and_close(fd: int, data: bytes, durable: bool) -> None:
    """Write all of `data` (fsynced when `durable`), then close `fd` whatever happened."""
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if durable:
            os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes, *, mode: int = 0o600, durable: bool = True) -> None:
    tmp = path.with_name(f".{path.name}{TEMP_MARK}{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        _write_and_close(fd, data, durable)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if durable:
        _fsync_dir(path.parent)


def atomic_write_at(dfd: int, name: str, data: bytes, *, mode: int = 0o600, durable: bool = True) -> None:
    """`atomic_write_bytes` relative to a directory descriptor: the temp file is created there (O_EXCL,
    O_NOFOLLOW) and renamed over `name` there, so nothing on the directory's path (a link retargeted, an
    ancestor replaced) can send the write anywhere else. `name` is one plain file name."""
    if not name or "/" in name or name in {".", ".."}:
        raise ValueError(f"not a plain file name: {name!r:.80}")
    tmp = f".{name}{TEMP_MARK}{secrets.token_hex(4)}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=dfd)
    try:
        _write_and_close(fd, data, durable)
        os.replace(tmp, name, src_dir_fd=dfd, dst_dir_fd=dfd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dfd)
        raise
    if durable:
        os.fsync(dfd)


SHARED_TEMP_AGE_S = 600.0  # fleet: another host's write in progress is never this old


def sweep_temp_files(directory: Path, *, min_age_s: float = 0.0) -> list[Path]:
    """Remove temp files a crashed write left behind. Only ours: regular files named like TEMP_FILE,
    unlinked relative to the directory (a planted link is removed itself, never followed). In a directory
    shared by several hosts, only those older than `min_age_s` (another host may be writing one now)."""
    cutoff = time.time() - min_age_s
    removed: list[Path] = []
    try:
        dfd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return removed
    try:
        for name in os.listdir(dfd):
            if not TEMP_FILE.match(name):
                continue
            with contextlib.suppress(FileNotFoundError):
                st = os.stat(name, dir_fd=dfd, follow_symlinks=False)
                if stat.S_ISREG(st.st_mode) and (min_age_s <= 0 or st.st_mtime < cutoff):
                    os.unlink(name, dir_fd=dfd)
                    removed.append(directory / name)
    finally:
        os.close(dfd)
    return removed


def ensure_private_dir(directory: Path) -> None:
    """Create a directory 0700 (KV snapshots are plaintext transcripts)."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)


PRIVATE = 0o700
SHARED = 0o2770  # setgid, group rwx: llama-server as another user of a shared group (install-systemd)


@dataclass(frozen=True, kw_only=True)
class DirMode:
    path: Path
    before: int
    after: int
    changed: bool
    problem: str | None  # too open and we could not fix it


def secure_directory(directory: Path, *, allow_shared_group: bool = False, fix: bool = True) -> DirMode:
    """Tighten a directory we own to 0700 (or keep a deliberate shared-group setup, setgid + group
    writable, at exactly 2770 when allowed). Never through a symlink. If we do not own it (or `fix` is
    False: the doctor's read-only look), nothing is changed, and `problem` says what to do when others
    (or, for a private one, the group) have access."""
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        before = stat.S_IMODE(st.st_mode)
        shared = allow_shared_group and before & stat.S_ISGID and before & stat.S_IWGRP
        want = SHARED if shared else PRIVATE
        if before == want:
            return DirMode(path=directory, before=before, after=before, changed=False, problem=None)
        ours = st.st_uid == os.geteuid()
        if ours and fix:
            os.fchmod(fd, want)
            return DirMode(path=directory, before=before, after=want, changed=True, problem=None)
    finally:
        os.close(fd)
    # Not ours: for a snapshot directory, the group is how we get in; others must have nothing.
    mask, who = (0o007, "o") if allow_shared_group else (0o077, "go")
    if ours:
        problem = (
            f"mode {before:04o}; kvsidecar sets {want:04o} at start (or run: chmod {want:04o} {directory})"
        )
    elif before & mask:
        problem = (
            f"mode {before:04o}, owned by uid {st.st_uid}, not by us (uid {os.geteuid()}): cannot tighten "
            f"it; its owner should run: chmod {who}-rwx {directory}"
        )
    else:
        problem = None
    return DirMode(path=directory, before=before, after=before, changed=False, problem=problem)
