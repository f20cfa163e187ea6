"""File digests: xxh3-128 of every byte of a file, and the cache that keeps them across restarts.

The fingerprint digests the model, the server binary, the llama.cpp libraries and the files its settings
name. Hashing reads 16 MiB at a time (xxhash releases the GIL). The digests are cached in the state
directory by (device, inode, size, mtime_ns, ctime_ns): a rewrite in place changes ctime, which `utime`
cannot put back, and a replacement changes the inode. A file modified during hashing is not cached, and
neither is one changed within the last 2 s (timestamps are coarse: a second write in the same tick would
keep the key). The cache file is read with a size cap and a strict schema; anything wrong with it starts
an empty cache. It is written without fsync: losing it costs only a re-hash.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import re
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import xxhash

from kvsidecar.errors import KvError
from kvsidecar.files.atomic import atomic_write_at, atomic_write_bytes
from kvsidecar.files.confined import DirAnchor
from kvsidecar.files.documents import DIGEST_CACHE
from kvsidecar.logs import event

log = logging.getLogger("kvsidecar.fingerprint")


_BLOCK = 16 << 20
_CACHE_VERSION = 2
_CACHE_MAX_BYTES = DIGEST_CACHE.max_bytes
_CACHE_MAX_ENTRIES = 512
_CACHE_KEY = re.compile(r"[0-9]{1,20}(:[0-9]{1,20}){4}")
_HEX128 = re.compile(r"[0-9a-f]{32}")


class FileChanging(OSError):
    """The file changed while it was being read."""


def file_identity(st: os.stat_result) -> str:
    """The cache key: changes when the file is rewritten or replaced."""
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def file_digest(path: Path | str) -> tuple[str, os.stat_result]:
    """xxh3-128 of every byte of a regular file, and its stat; FileChanging if it changed meanwhile."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        before = os.fstat(fd)
        if not stat.S_ISREG(before.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        with contextlib.suppress(OSError, AttributeError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        h = xxhash.xxh3_128()
        buf = bytearray(_BLOCK)
        view = memoryview(buf)
        while n := os.readv(fd, [buf]):
            h.update(view[:n])
        after = os.fstat(fd)
    finally:
        os.close(fd)
    if file_identity(before) != file_identity(after) or file_identity(os.stat(path)) != file_identity(after):
        raise FileChanging(errno.EAGAIN, "changed while read", str(path))
    return h.hexdigest(), after


def _validate_cache(data: Any) -> dict[str, str]:
    if not isinstance(data, dict) or set(data) != {"version", "entries"}:
        raise ValueError("not an object with exactly version and entries")
    if type(data["version"]) is not int or data["version"] != _CACHE_VERSION:
        raise ValueError(f"version is not {_CACHE_VERSION}")
    entries = data["entries"]
    if not isinstance(entries, dict) or len(entries) > _CACHE_MAX_ENTRIES:
        raise ValueError(f"entries is not an object of at most {_CACHE_MAX_ENTRIES} items")
    for key, value in entries.items():
        if not _CACHE_KEY.fullmatch(key) or not isinstance(value, str) or not _HEX128.fullmatch(value):
            raise ValueError("an entry is not file identity -> 32 hex digits")
    return dict(entries)


def _read_capped(path: Path, cap: int) -> bytes | None:
    """The file's bytes if it is a regular file (not a link) of at most `cap` bytes; None if absent."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > cap:
            raise ValueError(f"not a regular file of at most {cap} bytes")
        data = bytearray()
        while len(data) <= cap and (chunk := os.read(fd, cap + 1 - len(data))):
            data += chunk
    finally:
        os.close(fd)
    if len(data) > cap:
        raise ValueError(f"grew beyond {cap} bytes")
    return bytes(data)


def load_digest_cache(path: Path) -> dict[str, str]:
    """The persisted digests; empty (with a warning) when the file is unreadable or not exactly our format."""
    try:
        raw = _read_capped(path, _CACHE_MAX_BYTES)
        if raw is None:
            return {}
        return _validate_cache(DIGEST_CACHE.read(raw))  # {"version": 2, "entries": {identity: digest}}
    except (OSError, ValueError) as exc:  # DocumentError is a ValueError
        event(log, logging.WARNING, "kv.digest_cache.ignored", path=str(path), error=str(exc)[:200])
        return {}


class FileDigestCache:
    """Whole-file digests keyed by (device, inode, size, mtime_ns, ctime_ns), persisted in the state dir.

    Thread-safe: `digest()` is called from worker threads. A second call for an unchanged file is a stat
    and a dict lookup; two concurrent calls for the same new file hash it once.
    """

    def __init__(self, path: Path, *, racy_window_s: float = 2.0, anchor: DirAnchor | None = None) -> None:
        self.path = path
        # the state directory held open (the store's): the cache is written in it, never through its path,
        # and not at all while the path leads elsewhere (issue 26 B)
        self.anchor = anchor
        self._racy_ns = int(racy_window_s * 1e9)
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._busy: dict[str, threading.Lock] = {}
        self._entries = load_digest_cache(path)
        self.computed = 0

    def digest(
        self, path: Path | str, *, expect: Callable[[os.stat_result], bool] | None = None
    ) -> str | None:
        """None when the file cannot be read as a regular file, or kept changing while being read.

        `expect`: the file must be this one (checked on the stat the digest is keyed by and on the file
        that was read): a path that meanwhile names another file gives None, never that file's digest."""
        try:
            st = os.stat(path)
        except (OSError, ValueError):  # ValueError: a NUL in a path a hostile /props or setting names
            return None
        if expect is not None and not expect(st):
            return None
        key = file_identity(st)
        with self._lock:
            if (hit := self._lookup(key)) is not None:
                return hit
            busy = self._busy.setdefault(key, threading.Lock())
        with busy:
            with self._lock:
                hit = self._lookup(key)
            result = hit if hit is not None else self._compute(path, expect)
        with self._lock:
            self._busy.pop(key, None)
        return result

    def _lookup(self, key: str) -> str | None:
        hit = self._entries.pop(key, None)
        if hit is not None:
            self._entries[key] = hit  # most recently used last
        return hit

    def _compute(
        self, path: Path | str, expect: Callable[[os.stat_result], bool] | None = None
    ) -> str | None:
        for _ in range(3):
            try:
                digest, st = file_digest(path)
                if expect is not None and not expect(st):
                    return None
                break
            except FileChanging:
                continue
            except (OSError, ValueError):
                return None
        else:
            return None
        with self._lock:
            self.computed += 1
            if time.time_ns() - st.st_ctime_ns < self._racy_ns:
                return digest  # changed moments ago: another write in the same timestamp tick could follow
            self._entries[file_identity(st)] = digest
            while len(self._entries) > _CACHE_MAX_ENTRIES:
                del self._entries[next(iter(self._entries))]
        self._save()
        return digest

    def _save(self) -> None:
        with self._write_lock:
            with self._lock:
                data = {"version": _CACHE_VERSION, "entries": dict(self._entries)}
            raw = json.dumps(data).encode()
            with contextlib.suppress(OSError, KvError):
                if self.anchor is None:
                    atomic_write_bytes(self.path, raw, durable=False)
                elif self.anchor.moved() is None:
                    with self.anchor.fd() as dfd:
                        atomic_write_at(dfd, self.path.name, raw, durable=False)
