"""Checks a snapshot file must pass before llama-server may see it (restoring a truncated file crashes it).

Header layout written by llama.cpp's slot save: u32 magic 0x67677371 ("ggsq"), u32 format version, then
a u32 that grows with the tokens saved (seen here: n_saved + 4, and 4 for an empty slot). We record that
third word as it is and compare it, without assuming what it counts.
"""

from __future__ import annotations

import os
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

import xxhash

from kvsidecar.errors import SnapshotCorrupt, SnapshotNotFound

MAGIC = 0x67677371
HEADER = struct.Struct("<III")
_CHUNK = 8 << 20


@dataclass(frozen=True, kw_only=True)
class Header:
    magic: int
    version: int
    tokens: int


def header_from_fd(fd: int, name: str) -> Header:
    try:
        os.lseek(fd, 0, os.SEEK_SET)
        raw = os.read(fd, HEADER.size)
    except OSError as exc:
        raise SnapshotCorrupt(f"{name}: cannot read ({exc.strerror})") from None
    if len(raw) < HEADER.size:
        raise SnapshotCorrupt(f"{name}: shorter than its header ({len(raw)} bytes)")
    magic, version, tokens = HEADER.unpack(raw)
    if magic != MAGIC:
        raise SnapshotCorrupt(f"{name}: bad magic 0x{magic:08x}")
    return Header(magic=magic, version=version, tokens=tokens)


def checksum_from_fd(fd: int) -> str:
    """xxh3-128 of the whole file from offset 0, read in 8 MiB chunks into one reused buffer."""
    h = xxhash.xxh3_128()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with os.fdopen(fd, "rb", buffering=0, closefd=False) as f:
        f.seek(0)
        while n := f.readinto(buf):
            h.update(view[:n])
    return f"xxh3-128:{h.hexdigest()}"


def verify_fd(
    fd: int,
    st: os.stat_result,
    name: str,
    *,
    size: int,
    format_version: int,
    tokens: int,
    checksum: str | None,
    deep: bool,
) -> None:
    """Raise SnapshotCorrupt unless the open file is exactly what the manifest recorded."""
    if st.st_size != size:
        raise SnapshotCorrupt(f"{name}: size {st.st_size} differs from the recorded {size}")
    header = header_from_fd(fd, name)
    if header.version != format_version or header.tokens != tokens:
        raise SnapshotCorrupt(
            f"{name}: header (v{header.version}, {header.tokens} tokens) differs from the recorded "
            f"(v{format_version}, {tokens} tokens)"
        )
    if deep and checksum is not None and checksum_from_fd(fd) != checksum:
        raise SnapshotCorrupt(f"{name}: checksum differs from the one taken after the save")


# Path-based forms (tools, benchmarks, tests): same checks, never through a link or into a FIFO.


def _open_plain(path: Path) -> tuple[int, os.stat_result]:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise SnapshotNotFound(f"{path.name}: no such file") from None
    except OSError as exc:
        raise SnapshotCorrupt(f"{path.name}: cannot open ({exc.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise SnapshotCorrupt(f"{path.name}: not a regular file")
    return fd, st


def read_header(path: Path) -> Header:
    fd, _ = _open_plain(path)
    try:
        return header_from_fd(fd, path.name)
    finally:
        os.close(fd)


def file_checksum(path: Path) -> str:
    fd, _ = _open_plain(path)
    try:
        return checksum_from_fd(fd)
    finally:
        os.close(fd)


def file_size(path: Path) -> int:
    fd, st = _open_plain(path)
    os.close(fd)
    return st.st_size


def verify_file(
    path: Path, *, size: int, format_version: int, tokens: int, checksum: str | None, deep: bool
) -> None:
    """Raise SnapshotNotFound / SnapshotCorrupt unless the file is exactly what the manifest recorded."""
    fd, st = _open_plain(path)
    try:
        verify_fd(
            fd,
            st,
            path.name,
            size=size,
            format_version=format_version,
            tokens=tokens,
            checksum=checksum,
            deep=deep,
        )
    finally:
        os.close(fd)
