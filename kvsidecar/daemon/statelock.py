"""One daemon per state directory: `<state_dir>/lock`, after restic's lock files.

A second daemon on the same state_dir would sweep, reconcile and delete under the first one's feet, so it
refuses to start instead (`KV_STATE_LOCKED`, exit code 2 from `serve`), naming the holder.

How it works:
- The lock is `flock(LOCK_EX | LOCK_NB)` on the file, through a descriptor kept open for the daemon's
  lifetime. The kernel drops it when the process ends, however it ends (kill -9, OOM), so a crash never
  leaves a lock that blocks the next start, and two starters cannot both take over a stale lock: flock
  picks one. O_CREAT|O_EXCL alone leaves the file behind after a crash; staleness then depends on a pid
  check, and two starters can both take over. POSIX fcntl locks belong to the process: they do not
  keep out a second daemon in the same process, and closing any descriptor of the file drops them.
- flock does not say who holds it, so the holder writes a record into the file: host, pid, the process's
  create time, kvsidecar version and the time it took the lock. The record names the holder when a
  start is refused. When flock says the lock is free, the record decides:
  - empty: free;
  - from this host, and its process is gone or its pid now belongs to a process started at another time
    (pid reuse): stale; taken over, and `kv.state.lock_taken_over` is logged;
  - from this host, and its process is still running: refused (this filesystem does not honour flock);
  - from another host: never assumed stale (flock may not reach across hosts on a network filesystem).
    The start is refused, and the message gives the `rm` that clears the lock once that daemon is known
    to be gone;
  - unreadable: taken over (nobody on this kernel holds the flock), and logged.
  When flock says the lock is held, it is held, whatever the record says. An unreadable record there means
  the holder is unknown.
- A clean shutdown unlinks the file while still holding the lock, then closes it. A starter that had
  opened the old file and then got its flock sees that the path no longer names that file, and starts over.
- The file is hostile input. It is opened with O_NOFOLLOW (a symlink there is refused, never followed). It
  must be a regular file with one link: a hard link to another file is never written. At most 4 KiB of it
  is read, under a nesting cap, into an exact schema.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import socket
import stat
import time
from pathlib import Path
from types import TracebackType

import psutil
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from kvsidecar import __version__
from kvsidecar.errors import MetadataIO, StateLocked
from kvsidecar.files.atomic import ensure_private_dir
from kvsidecar.files.confined import describe
from kvsidecar.files.documents import LOCK_RECORD, DocumentError
from kvsidecar.logs import event

log = logging.getLogger("kvsidecar.statelock")

LOCK_NAME = "lock"
MAX_RECORD_BYTES = LOCK_RECORD.max_bytes
_PRINTABLE = r"^[\x21-\x7e]{1,255}$"  # no spaces or control characters: safe in a log line or a message
_FLAGS = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_ATTEMPTS = 5  # a lock file released (unlinked) under us sends us round again
_LATEST = 1e11  # seconds since the epoch (year 5138): bounds what time.gmtime() is asked to format


class Holder(BaseModel):
    """The lock record: who holds the state directory."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)

    format: int = Field(default=1, ge=1, le=1)
    host: str = Field(pattern=_PRINTABLE)
    pid: int = Field(ge=1, le=2**31 - 1)
    create_time: float = Field(ge=0, le=_LATEST, allow_inf_nan=False)  # psutil: the process's start
    version: str = Field(pattern=_PRINTABLE, max_length=64)
    since: float = Field(ge=0, le=_LATEST, allow_inf_nan=False)  # when it took the lock

    def describe(self) -> str:
        return f"kvsidecar {self.version} (pid {self.pid} on host {self.host}, since {_iso(self.since)})"


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def this_host() -> str:
    name = socket.gethostname()
    safe = "".join(c if "\x21" <= c <= "\x7e" else "_" for c in name)[:255]
    return safe or "unknown"


def read_holder(fd: int) -> tuple[Holder | None, str | None]:
    """(record, None); (None, None) for an empty file; (None, why) for anything unreadable."""
    try:
        raw = os.pread(fd, MAX_RECORD_BYTES + 1, 0)
    except OSError as exc:
        return None, f"cannot read it ({exc.strerror})"
    if not raw.strip():
        return None, None
    try:
        return Holder.model_validate(LOCK_RECORD.read(raw)), None
    except DocumentError as exc:
        return None, f"not a lock record: {exc.reason}: {exc.message}"
    except ValidationError as exc:
        err = exc.errors()[0]
        where = ".".join(str(p) for p in err["loc"]) or "record"
        return None, f"not a lock record: {where}: {err['msg'][:80]}"


def _process_is(holder: Holder) -> str:
    """'alive', 'gone', or 'reused' (the pid now names a process started at another time)."""
    try:
        proc = psutil.Process(holder.pid)
        if proc.status() == psutil.STATUS_ZOMBIE:  # exited: its descriptors, and flock, are gone
            return "gone"
        created = proc.create_time()
    except psutil.NoSuchProcess:
        return "gone"
    except psutil.Error:  # cannot look (hidepid, permissions): assume it is the holder
        return "alive"
    return "alive" if abs(created - holder.create_time) < 1e-3 else "reused"


class StateLock:
    """Held from `acquire()` to `release()`; also a context manager."""

    def __init__(self, path: Path, dir_fd: int, fd: int, holder: Holder) -> None:
        self.path, self.holder = path, holder
        self._dir_fd, self._fd = dir_fd, fd

    @classmethod
    def acquire(cls, state_dir: Path) -> StateLock:
        """Create the state directory (0700) if needed and take its lock, or raise `StateLocked`."""
        directory = Path(os.path.realpath(state_dir))
        try:
            ensure_private_dir(directory)
            dir_fd = os.open(directory, _DIR_FLAGS)
        except OSError as exc:
            raise MetadataIO(f"state_dir {directory}: cannot open it ({exc.strerror})") from None
        try:
            for _ in range(_ATTEMPTS):
                lock = _try_lock(directory / LOCK_NAME, dir_fd)
                if lock is not None:
                    return lock
        except BaseException:
            os.close(dir_fd)
            raise
        os.close(dir_fd)
        raise StateLocked(
            f"state_dir {directory}: the lock file kept being replaced while this daemon tried to take it",
            hint="Another kvsidecar is starting or stopping with this state_dir; try again.",
        )

    @property
    def held(self) -> bool:
        return self._fd >= 0

    def release(self) -> None:
        """Unlink the file (only if the path still names ours) while still locked, then unlock."""
        if self._fd < 0:
            return
        try:
            with contextlib.suppress(OSError):
                mine = os.fstat(self._fd)
                there = os.stat(LOCK_NAME, dir_fd=self._dir_fd, follow_symlinks=False)
                if (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino):
                    os.unlink(LOCK_NAME, dir_fd=self._dir_fd)
        finally:
            os.close(self._fd)
            os.close(self._dir_fd)
            self._fd = self._dir_fd = -1
        event(log, logging.INFO, "kv.state.unlocked", path=self.path)

    def __enter__(self) -> StateLock:
        return self

    def __exit__(
        self, typ: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


def _try_lock(path: Path, dir_fd: int) -> StateLock | None:
    """One attempt: the lock, `StateLocked`, or None when the file was replaced under us."""
    try:
        fd = os.open(LOCK_NAME, _FLAGS, 0o600, dir_fd=dir_fd)
    except OSError as exc:
        raise _unusable(path, dir_fd, exc) from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
            raise _planted(path, describe(st))
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise _held(path, *read_holder(fd)) from None
        try:
            there = os.stat(LOCK_NAME, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            there = None
        if there is None or (there.st_dev, there.st_ino) != (st.st_dev, st.st_ino):
            os.close(fd)  # released (unlinked) by its holder after we opened it: take the new one
            return None
        _judge_previous(path, *read_holder(fd))
        me = Holder(
            host=this_host(),
            pid=os.getpid(),
            create_time=psutil.Process().create_time(),
            version=__version__,
            since=time.time(),
        )
        _write(fd, me.model_dump_json().encode() + b"\n")
    except BaseException:
        with contextlib.suppress(OSError):
            os.close(fd)  # our flock, if we got it, goes with it; the file is left as it was
        raise
    event(log, logging.INFO, "kv.state.locked", path=path, pid=me.pid)
    return StateLock(path, dir_fd, fd, me)


def _write(fd: int, data: bytes) -> None:
    # No fsync: after a power loss nobody holds the flock, and an empty or torn record is taken over.
    os.ftruncate(fd, 0)
    view = memoryview(data)
    offset = 0
    while offset < len(view):
        offset += os.pwrite(fd, view[offset:], offset)


def _judge_previous(path: Path, previous: Holder | None, problem: str | None) -> None:
    """The flock was free: raise if the record still says someone holds the directory, else log a takeover."""
    if previous is None:
        if problem is not None:
            event(log, logging.WARNING, "kv.state.lock_taken_over", path=path, reason=problem)
        return
    if previous.host != this_host():
        raise StateLocked(
            f"state_dir {path.parent} is locked by {previous.describe()}; a lock from another host is "
            "never taken over automatically",
            hint=f"If no kvsidecar runs with this state_dir on {previous.host} any more, remove the "
            f"lock: rm {path}",
        )
    state = _process_is(previous)
    if state == "alive" and previous.pid != os.getpid():
        raise StateLocked(
            f"state_dir {path.parent} is locked by {previous.describe()}, which is still running although "
            "its file lock is free (does this filesystem support flock?)",
            hint=f"Stop pid {previous.pid} first, or give this daemon another state_dir.",
        )
    event(
        log,
        logging.WARNING,
        "kv.state.lock_taken_over",
        path=path,
        reason="holder gone" if state == "gone" else "pid reused" if state == "reused" else "our own",
        holder_pid=previous.pid,
        holder_since=_iso(previous.since),
    )


def _held(path: Path, holder: Holder | None, problem: str | None) -> StateLocked:
    if holder is not None:
        return StateLocked(
            f"state_dir {path.parent} is in use by {holder.describe()}",
            hint="Stop that daemon first, or give this one another state_dir.",
        )
    why = problem or "it has not written its record yet"
    return StateLocked(
        f"state_dir {path.parent} is locked by a process that cannot be named ({why})",
        hint=f"`fuser -v {path}` shows the process holding it.",
    )


def _planted(path: Path, what: str) -> StateLocked:
    return StateLocked(
        f"state_dir lock {path} is a {what}, not a lock file kvsidecar wrote; it is left untouched",
        hint=f"Remove it (rm {path}) and start again.",
    )


def _unusable(path: Path, dir_fd: int, exc: OSError) -> StateLocked:
    """Opening failed: a symlink (ELOOP), a directory (EISDIR), or no permission."""
    if exc.errno in (errno.ELOOP, errno.EISDIR):
        with contextlib.suppress(OSError):
            return _planted(path, describe(os.stat(LOCK_NAME, dir_fd=dir_fd, follow_symlinks=False)))
    return StateLocked(
        f"state_dir lock {path}: cannot open it ({exc.strerror})",
        hint="Check the owner and mode of the state directory and of the lock file.",
    )
