"""The runtime canary: the KV of a fixed prompt, as a fingerprint of everything that shapes KV.

Flags and `/props` say what an operator asked for; they do not show settings given as `LLAMA_ARG_*`
variables, a model file replaced in place, or the command line of a server on another host. The bytes of
the KV that the server computes for a fixed prompt show all of them: the same model and settings give the
same bytes on every start (seen on CPU across restarts, thread counts and batch sizes), another model or
another RoPE setting gives other bytes. So once per server start the coordinator prefills this prompt into
a slot it holds and is about to erase anyway, saves the slot, hashes the file and deletes it; the digest
becomes the fingerprint's `canary_kv` component. A false difference costs a cold prefill, never a wrong
conversation.
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
from kvsidecar.errors import SaveFailed
from kvsidecar.store.integrity import checksum_from_fd

CANARY_PROMPT = (
    "kvsidecar runtime canary. The quick brown fox jumps over the lazy dog; "
    "0 1 2 3 4 5 6 7 8 9. Pack my box with five dozen liquor jugs."
)
CANARY_FILE = re.compile(r"^kvsidecar-canary\.[0-9a-f]{16}\.bin$")
_MAX_CANARY_BYTES = 256 << 20  # a few hundred tokens of the largest KV there is


def canary_name() -> str:
    return f"kvsidecar-canary.{secrets.token_hex(8)}.bin"


async def measure_canary(backend: KvBackend, slot_id: int, snapshot_dir: Path) -> str:
    """Erase, prefill the canary, save, hash, delete, erase. The caller holds the slot."""
    name = canary_name()
    await backend.erase_slot(slot_id)
    try:
        await backend.prefill(slot_id, CANARY_PROMPT)
        saved = await backend.save_slot(slot_id, name)
        if saved.tokens <= 0:
            raise SaveFailed("the runtime canary saved no tokens")
        digest = await asyncio.to_thread(hash_canary_file, snapshot_dir / name)
    finally:
        await asyncio.to_thread(remove_canary_file, snapshot_dir / name)
        with contextlib.suppress(Exception):
            await backend.erase_slot(slot_id)
    return digest


def hash_canary_file(path: Path) -> str:
    """xxh3-128 of a regular file of ours, never read through a link, with a size cap."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:  # most often: llama-server saved it into another --slot-save-path
        raise SaveFailed(
            f"runtime canary file {path.name} is not in {path.parent} ({exc.strerror}): is that "
            "directory llama-server's --slot-save-path?"
        ) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > _MAX_CANARY_BYTES:
            raise SaveFailed(f"runtime canary file {path.name} is not a small regular file")
        return checksum_from_fd(fd).removeprefix("xxh3-128:")
    finally:
        os.close(fd)


def remove_canary_file(path: Path) -> None:
    """Unlink a canary file (a link planted there is removed itself, its target is never touched)."""
    if not CANARY_FILE.match(path.name):
        return
    with contextlib.suppress(FileNotFoundError):
        st = os.lstat(path)
        if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
            path.unlink()


def sweep_canary_files(snapshot_dir: Path, *, min_age_s: float = 0.0) -> int:
    """Remove canary files a crash left behind; returns how many. In a directory shared by several hosts
    (fleet mode), only those older than `min_age_s`: another host may be measuring its canary right now."""
    removed = 0
    cutoff = time.time() - min_age_s
    with contextlib.suppress(OSError):
        for entry in os.scandir(snapshot_dir):
            if CANARY_FILE.match(entry.name):
                if min_age_s > 0 and entry.stat(follow_symlinks=False).st_mtime >= cutoff:
                    continue
                remove_canary_file(Path(entry.path))
                removed += 1
    return removed
