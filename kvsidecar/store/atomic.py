"""The one atomic-write helper every metadata write goes through (spec §40), and the startup temp sweep.

temp file in the same directory -> write -> fsync -> rename over the target -> fsync the directory.
A crash at any step leaves either the old file or the new one, never half of one; what it may leave is a
temp file, which `sweep_temp_files()` removes at the next start.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

TEMP_MARK = ".tmp-"


def _fsync_dir(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: Path, data: bytes, *, mode: int = 0o600, durable: bool = True) -> None:
    tmp = path.with_name(f".{path.name}{TEMP_MARK}{secrets.token_hex(4)}")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            tmp.unlink()
        raise
    if durable:
        _fsync_dir(path.parent)


def sweep_temp_files(directory: Path) -> list[Path]:
    """Remove temp files a crashed write left behind. Only ours: dot-names carrying the temp mark."""
    removed = []
    with contextlib.suppress(FileNotFoundError):
        for entry in os.scandir(directory):
            if (
                entry.name.startswith(".")
                and TEMP_MARK in entry.name
                and entry.is_file(follow_symlinks=False)
            ):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(entry.path)
                    removed.append(Path(entry.path))
    return removed


def ensure_private_dir(directory: Path) -> None:
    """Create a directory 0700 (KV snapshots are plaintext transcripts)."""
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
