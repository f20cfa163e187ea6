"""The runtime canary: the KV of a fixed prompt, as a fingerprint of everything that shapes KV.

Flags and `/props` say what an operator asked for; they do not show settings given as `LLAMA_ARG_*`
variables, a model file replaced in place, or the command line of a server on another host. The bytes of
the KV that the server computes for a fixed prompt show all of them: the same model and settings give the
same bytes on every start (seen on CPU across restarts, thread counts and batch sizes), another model or
another RoPE setting gives other bytes. So once per server start the coordinator prefills this prompt into
a slot it holds and is about to erase anyway, saves the slot, hashes the file and deletes it; the digest
becomes the fingerprint's `canary_kv` component: the digest of the KV itself (the state file parsed,
every K and V byte and the layout hashed, the format version not), so a new llama.cpp build that computes
the same KV has the same canary (issue 29). A false difference costs a cold prefill, never a wrong
conversation.

The file is created by llama-server by path, so it gets the save's own checks (`measure_canary`): the
path must lead to the snapshot directory the store holds, before and after; it is read and deleted
through that held directory, never through its path.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import secrets
import stat
import time
from pathlib import Path

from kvsidecar.backend.base import KvBackend
from kvsidecar.errors import KvError, SaveFailed
from kvsidecar.files.confined import DirAnchor, lstat_at
from kvsidecar.store.integrity import checksum_from_fd
from kvsidecar.store.state_format import StateFormatError, kv_digest

CANARY_PROMPT = (
    "kvsidecar runtime canary. The quick brown fox jumps over the lazy dog; "
    "0 1 2 3 4 5 6 7 8 9. Pack my box with five dozen liquor jugs."
)
CANARY_FILE = re.compile(r"^kvsidecar-canary\.[0-9a-f]{16}\.bin$")
_MAX_CANARY_BYTES = 256 << 20  # a few hundred tokens of the largest KV there is


def canary_name() -> str:
    return f"kvsidecar-canary.{secrets.token_hex(8)}.bin"


async def measure_canary(
    backend: KvBackend, slot_id: int, directory: DirAnchor | Path, theirs: str | None = None
) -> str:
    """Erase, prefill the canary, save, hash, delete, erase. The caller holds the slot.

    `directory` is the snapshot directory the store holds (a Path: opened now, for a caller without a
    store). llama-server writes the file by path, so right before the save its path (the configured one,
    and `theirs`: llama-server's --slot-save-path as this host sees it) must lead to that directory and
    the name be free, and right after it must still lead there (DirMoved otherwise: nothing is read or
    deleted through it). The file is then read and deleted through the held directory only."""
    anchor = directory if isinstance(directory, DirAnchor) else DirAnchor(Path(directory), area="canary")
    name = canary_name()
    await backend.erase_slot(slot_id)
    try:
        await backend.prefill(slot_id, CANARY_PROMPT)
        await asyncio.to_thread(check_free, anchor, name, theirs)
        saved = await backend.save_slot(slot_id, name)
        anchor.ensure(theirs)  # the path led elsewhere during the save: what the server wrote is not ours
        if saved.tokens <= 0:
            raise SaveFailed("the runtime canary saved no tokens")
        digest = await asyncio.to_thread(_hash_at, anchor, name)
    finally:
        await asyncio.to_thread(remove_at, anchor, name)
        with contextlib.suppress(Exception):
            await backend.erase_slot(slot_id)
    return digest


def check_free(anchor: DirAnchor, name: str, theirs: str | None) -> None:
    """Right before llama-server saves `name` by path: the path leads to the held directory and nothing is
    at the name (SaveFailed otherwise). For the canary and the carry-over proof (coordinator/carry.py)."""
    anchor.ensure(theirs)
    with anchor.fd() as dfd:
        if lstat_at(name, dfd) is not None:
            raise SaveFailed(f"file name {name} is taken in {anchor.path}; not saved")


def _hash_at(anchor: DirAnchor, name: str) -> str:
    """xxh3-128 of the canary file in the held directory: a plain regular file, never through a link."""
    try:
        with anchor.fd() as dfd:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
    except (OSError, KvError) as exc:  # most often: llama-server saved it into another --slot-save-path
        why = exc.strerror if isinstance(exc, OSError) else exc.message
        raise SaveFailed(
            f"runtime canary file {name} is not in {anchor.path} ({why}): is that directory "
            "llama-server's --slot-save-path?"
        ) from None
    return _hash_fd(fd, name)


def _hash_fd(fd: int, name: str) -> str:
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_size > _MAX_CANARY_BYTES:
            raise SaveFailed(f"runtime canary file {name} is not a small plain regular file")
        return _kv_or_file_digest(fd)
    finally:
        os.close(fd)


def _kv_or_file_digest(fd: int) -> str:
    """The digest of the KV in the file, independent of its state format (`state_format.kv_digest`), so
    that two llama.cpp builds that compute the same KV give the same canary even when one writes v3 and the
    other v4 (issue 29); a file in a format not known here is digested whole ("file:" + xxh3-128)."""
    with os.fdopen(os.dup(fd), "rb") as f:
        try:
            return "kv:" + kv_digest(f)
        except StateFormatError:
            pass
    return "file:" + checksum_from_fd(fd).removeprefix("xxh3-128:")


def hash_canary_file(path: Path) -> str:
    """xxh3-128 of a regular file of ours, never read through a link, with a size cap."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:  # most often: llama-server saved it into another --slot-save-path
        raise SaveFailed(
            f"runtime canary file {path.name} is not in {path.parent} ({exc.strerror}): is that "
            "directory llama-server's --slot-save-path?"
        ) from None
    return _hash_fd(fd, path.name)


def remove_at(anchor: DirAnchor, name: str) -> None:
    """Unlink a canary file in the held directory (a link planted there is removed itself, its target
    is never touched; nothing is reached through the directory's path)."""
    if not CANARY_FILE.match(name):
        return
    with contextlib.suppress(OSError, KvError), anchor.fd() as dfd:
        st = lstat_at(name, dfd)
        if st is not None and (stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode)):
            os.unlink(name, dir_fd=dfd)


def remove_canary_file(path: Path) -> None:
    """Unlink a canary file (a link planted there is removed itself, its target is never touched)."""
    if not CANARY_FILE.match(path.name):
        return
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
            path.unlink()


def sweep_canary_files(snapshot_dir: DirAnchor | Path, *, min_age_s: float = 0.0) -> int:
    """Remove canary files a crash left behind; returns how many. In a directory shared by several hosts
    (fleet mode), only those older than `min_age_s`: another host may be measuring its canary right now.
    Through the held directory only, and not at all while its path leads elsewhere."""
    anchor = (
        snapshot_dir if isinstance(snapshot_dir, DirAnchor) else DirAnchor(Path(snapshot_dir), area="canary")
    )
    if anchor.moved() is not None:
        return 0
    removed = 0
    cutoff = time.time() - min_age_s
    with contextlib.suppress(OSError, KvError), anchor.fd() as dfd:
        for name in os.listdir(dfd):
            if not CANARY_FILE.match(name):
                continue
            st = lstat_at(name, dfd)
            if st is None or (min_age_s > 0 and st.st_mtime >= cutoff):
                continue
            if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(name, dir_fd=dfd)
                    removed += 1
    return removed
