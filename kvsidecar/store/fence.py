"""Fencing on the shared store (fleet mode): the highest token per session key, kept beside the manifests.

Redis hands out ownership leases with fencing tokens (`kvsidecar.fleet.ownership`), but Redis cannot stop a
holder that was paused after it checked its lease from writing afterwards. The check therefore sits where the
write lands: `<shared_dir>/fences/<key>` holds the highest token any host has presented for the key, and
every manifest write, manifest delete and snapshot delete of that key runs under an exclusive lock on that
file, after comparing the writer's token with the recorded one:

- a token lower than the recorded one is refused (`Fenced`): another host has taken the session since;
- a higher one is recorded first (a new owner announces itself before reading the manifest);
- no token at all is refused (a host that never owned the key writes nothing of it).

The lock is a POSIX record lock (`fcntl.lockf`): NFSv4 and CephFS carry it between hosts. The file holds a
decimal integer and nothing else; anything else in it is treated as the highest possible token (fail closed:
nobody writes that key until an operator looks). Names are the store's own 128-bit hex keys, never a client's
string, and files are opened without following links.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from kvsidecar.errors import Fenced, MetadataIO
from kvsidecar.logs import event
from kvsidecar.store.naming import KEY

log = logging.getLogger("kvsidecar.store")

UNREADABLE = 2**63 - 1  # a fence file we cannot parse: higher than any token (nobody writes the key)
_MAX_BYTES = 32


class FenceFiles:
    """The fence files of one shared directory. `token_for(key)` is this host's current token for a key
    (None: it holds none); the owner of the lease state (the fleet gate) provides it."""

    def __init__(self, directory: Path, token_for: Callable[[str], int | None]) -> None:
        self.directory = directory
        self.token_for = token_for
        self.refused = 0  # writes refused so far (kvsidecar_fleet_fenced_total)

    def _open(self, key: str) -> int:
        if not KEY.match(key):
            raise Fenced(f"not a session key: {key[:40]!r}")
        flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            return os.open(self.directory / key, flags, 0o600)
        except OSError as exc:
            raise MetadataIO(f"cannot open the fence of {key[:8]}: {exc.strerror}") from None

    @staticmethod
    def _read(fd: int) -> int:
        raw = os.pread(fd, _MAX_BYTES + 1, 0).strip()
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

    @contextlib.contextmanager
    def _locked(self, key: str) -> Iterator[int]:
        fd = self._open(key)
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX)
            try:
                yield fd
            finally:
                fcntl.lockf(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

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
            yield
