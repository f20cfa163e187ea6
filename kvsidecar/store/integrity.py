"""Checks a snapshot file must pass before llama-server may see it (restoring a truncated file crashes it).

Header layout written by llama.cpp's slot save: u32 magic 0x67677371 ("ggsq"), u32 format version, then
a u32 that grows with the tokens saved (seen here: n_saved + 4, and 4 for an empty slot). We record that
third word as it is and compare it, without assuming what it counts.
"""

from __future__ import annotations

import os
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


def read_header(path: Path) -> Header:
    try:
        with path.open("rb") as f:
            raw = f.read(HEADER.size)
    except FileNotFoundError:
        raise SnapshotNotFound(f"{path.name}: no such file") from None
    except OSError as exc:
        raise SnapshotCorrupt(f"{path.name}: cannot read ({exc.strerror})") from None
    if len(raw) < HEADER.size:
        raise SnapshotCorrupt(f"{path.name}: shorter than its header ({len(raw)} bytes)")
    magic, version, tokens = HEADER.unpack(raw)
    if magic != MAGIC:
        raise SnapshotCorrupt(f"{path.name}: bad magic 0x{magic:08x}")
    return Header(magic=magic, version=version, tokens=tokens)


def file_checksum(path: Path) -> str:
    """xxh3-128 of the whole file, read in 8 MiB chunks into one reused buffer."""
    h = xxhash.xxh3_128()
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        raise SnapshotNotFound(f"{path.name}: no such file") from None
    try:
        while n := os.readv(fd, [buf]):
            h.update(view[:n])
    finally:
        os.close(fd)
    return f"xxh3-128:{h.hexdigest()}"


def file_size(path: Path) -> int:
    try:
        return path.stat().st_size
    except FileNotFoundError:
        raise SnapshotNotFound(f"{path.name}: no such file") from None


def verify_file(
    path: Path, *, size: int, format_version: int, tokens: int, checksum: str | None, deep: bool
) -> None:
    """Raise SnapshotNotFound / SnapshotCorrupt unless the file is exactly what the manifest recorded."""
    actual = file_size(path)
    if actual != size:
        raise SnapshotCorrupt(f"{path.name}: size {actual} differs from the recorded {size}")
    header = read_header(path)
    if header.version != format_version or header.tokens != tokens:
        raise SnapshotCorrupt(
            f"{path.name}: header (v{header.version}, {header.tokens} tokens) differs from the recorded "
            f"(v{format_version}, {tokens} tokens)"
        )
    if deep and checksum is not None and file_checksum(path) != checksum:
        raise SnapshotCorrupt(f"{path.name}: checksum differs from the one taken after the save")
