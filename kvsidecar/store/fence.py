"""Fencing on the shared store (fleet mode): the highest token per session key, kept beside the manifests.

Redis hands out ownership leases with fencing tokens (`kvsidecar.fleet.ownership`), but Redis cannot stop a
holder that was paused after it checked its lease from writing afterwards. The check therefore sits where the
write lands: `<shared_dir>/fences/<key>` holds the highest token any host has presented for the key, and
every manifest write, manifest delete and snapshot delete of that key runs under an exclusive lock on that
file, after comparing the writer's token with the recorded one:

- a token lower than the recorded one is refused (`Fenced`): another host has taken the session since;
- a higher one is recorded first (a new owner announces itself before reading the manifest);
- no token at all is refused (a host that never owned the key writes nothing of it).

The lock is a POSIX record lock (`fcntl.lockf`): NFSv4 and CephFS carry it between hosts. POSIX locks belong
to the process, and closing any descriptor of the file drops them, so within this process one lock per key
serializes every use of a fence file first. Neither lock is waited for without end: a host stopped while it
held one (SIGSTOP) costs the others at most `LOCK_WAIT_S`, then the write is refused (fail closed). The file
holds a decimal integer and nothing else; anything else in it is treated as the highest possible token
(nobody writes that key until an operator looks). Names are the store's own 128-bit hex keys, never a
client's string; files are opened without following links, and only a regular file is used. Fence files
are never deleted: a missing one reads as 0, so **never clean `fences/` by hand** while any host runs.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from kvsidecar.errors import DirMoved, Fenced, KvError, MetadataIO
from kvsidecar.files.confined import DirAnchor
from kvsidecar.logs import event
from kvsidecar.store.naming import KEY

log = logging.getLogger("kvsidecar.store")

UNREADABLE = 2**63 - 1  # a fence file we cannot parse: higher than any token (nobody writes the key)
_MAX_BYTES = 32
LOCK_WAIT_S = 2.0  # longest wait for a fence's lock (a host stopped while holding it must not stall us)
_POLL_S = 0.01


class FenceFiles:
    """The fence files of one shared directory. `token_for(key)` is this host's current token for a key
    (None: it holds none); the owner of the lease state (the fleet gate) provides it."""

    def __init__(
        self, directory: Path, token_for: Callable[[str], int | None], *, anchor: DirAnchor | None = None
    ) -> None:
        self.directory = directory
        # the fences directory held open (the store's): a fence is opened in it, never through its path,
        # and refused (DirMoved, a MetadataIO) while the path leads elsewhere (issue 26 B)
        self.anchor = anchor
        self.token_for = token_for
        self.refused = 0  # writes refused so far (kvsidecar_fleet_fenced_total)
        self.lock_wait_s = LOCK_WAIT_S
        self._locks: dict[str, threading.Lock] = {}  # key -> this process's lock of its fence file
        self._locks_guard = threading.Lock()
        self._held = threading.local()  # keys this thread guards now (a guard inside a guard: no re-lock)

    def _open(self, key: str) -> int:
        if not KEY.match(key):
            raise Fenced(f"not a session key: {key[:40]!r}")
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
        try:
            if self.anchor is not None:
                self.anchor.ensure()
                with self.anchor.fd() as dfd:
                    fd = os.open(key, flags, 0o600, dir_fd=dfd)
            else:
                fd = os.open(self.directory / key, flags, 0o600)
        except DirMoved:
            raise  # a MetadataIO: the write is refused as any fence failure is, with its own code
        except KvError as exc:  # the held directory cannot be opened
            raise MetadataIO(f"cannot open the fence of {key[:8]}: {exc.message}") from None
        except OSError as exc:
            raise MetadataIO(f"cannot open the fence of {key[:8]}: {exc.strerror}") from None
        if not stat.S_ISREG(os.fstat(fd).st_mode):  # a FIFO or device planted at the name
            os.close(fd)
            raise MetadataIO(f"the fence of {key[:8]} is not a regular file")
        return fd

    @staticmethod
    def _read(fd: int) -> int:
        try:
            raw = os.pread(fd, _MAX_BYTES + 1, 0).strip()
        except OSError:
            return UNREADABLE
        if not raw:
            return 0
        if len(raw) > _MAX_BYTES or not raw.isdigit():
            return UNREADABLE
        return int(raw)

    @staticmethod
    def _write(fd: int, token: int) -> None:
        data = str(token).encode()
        os.pwrite(fd, data, 0)
        os.ftruncate(fd, len(data))
        os.fsync(fd)

    def _local_lock(self, key: str) -> threading.Lock:
        with self._locks_guard:
            lock = self._locks.get(key)
            if lock is None:
                lock = self._locks[key] = threading.Lock()
            return lock

    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[int]:
        deadline = time.monotonic() + self.lock_wait_s
        local = self._local_lock(key)
        if not local.acquire(timeout=self.lock_wait_s):
            raise MetadataIO(f"the fence of {key[:8]} is held too long in this process")
        try:
            fd = self._open(key)
            try:
                self._lock_file(fd, key, deadline)
                try:
                    yield fd
                finally:
                    fcntl.lockf(fd, fcntl.LOCK_UN)
            finally:
                os.close(fd)
        finally:
            local.release()

    @staticmethod
    def _lock_file(fd: int, key: str, deadline: float) -> None:
        while True:
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except OSError as exc:
                if exc.errno not in (errno.EACCES, errno.EAGAIN):
                    raise MetadataIO(f"cannot lock the fence of {key[:8]}: {exc.strerror}") from None
            if time.monotonic() >= deadline:  # another host holds it (stopped?): refuse, never hang
                raise MetadataIO(f"the fence of {key[:8]} stayed locked by another host")
            time.sleep(_POLL_S)

    def recorded(self, key: str) -> int:
        """The highest token recorded for the key (0: none yet)."""
        with self._locked(key) as fd:
            return self._read(fd)

    def advance(self, key: str, token: int) -> int:
        """A new owner records its token (never lowering the recorded one); the token recorded before.
        A caller whose token is below the recorded one has lost the key and must not write it."""
        with self._locked(key) as fd:
            before = self._read(fd)
            if token > before:
                self._write(fd, token)
            return before

    @contextlib.contextmanager
    def guard(self, key: str, what: str) -> Iterator[None]:
        """Hold around one write or delete of the key's files: refused (Fenced) unless this host's token is
        the highest recorded. The lock is held until the write is done, so a new owner's `advance` comes
        strictly before or after it."""
        held: set[str] = self._held.__dict__.setdefault("keys", set())
        if key in held:  # this thread guards this key already (a commit's rename, then its manifest write)
            yield
            return
        token = self.token_for(key)
        with self._locked(key) as fd:
            recorded = self._read(fd)
            if token is None or token < recorded:
                self.refused += 1
                event(
                    log,
                    logging.WARNING,
                    "kv.fleet.fenced",
                    code=Fenced.code,
                    snapshot=key[:8],
                    what=what,
                    token=token,
                    recorded=recorded,
                )
                raise Fenced(f"{what} of {key[:8]} refused: fencing token {token} < recorded {recorded}")
            if token > recorded:
                self._write(fd, token)
            held.add(key)
            try:
                yield
            finally:
                held.discard(key)
