"""Confined file access: the only way the store touches a file whose name it did not just compute.

Names read from disk (manifest fields, directory listings, watcher events) are hostile. `ConfinedDir`
accepts a name only if it matches the directory's own pattern (one of ours from `naming`: no separators,
ASCII, bounded), and then touches it only relative to a descriptor of the directory opened with
O_NOFOLLOW, never following the final component: a symlink, FIFO, device or directory planted at one of
our names is never opened through, hashed, sized or chmod-ed; at most the entry itself is unlinked.

A file we read must be a regular file with one link, owned by an expected user (ours, or the owner of the
directory: llama-server running as another user of a shared group). Every check is done on the open
descriptor (fstat), so what is checked is what is read.

The directory itself is held (`DirAnchor`): opened once at start and kept open, so that every access goes
through that very directory, whatever its path leads to later; and every path that must lead to it (the
configured one, llama-server's --slot-save-path) is checked, component by component as the kernel resolves
it, against the held descriptor's device and inode (`DirAnchor.moved`). A difference is a fault
(`SNAPSHOT_DIR_MOVED`): nothing is removed or renamed there (`unlink`, `move_aside` refuse), and the store
refuses to save, restore or write metadata until the path leads back.

What this cannot close: llama-server opens snapshot files by path, following links, after our checks (it
reads on restore, creates/truncates on save). Someone who can write the snapshot directory (or retarget a
link on its path) can swap a name between our check and the server's open. Directories are therefore 0700
(or 2770 for a shared group, see `secure_directory`), so that "someone" is limited to our user,
llama-server's user and root; the checks run right before and right after each call, which leaves only a
retarget that is undone within the call's own duration undetected.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import stat
import threading
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvsidecar.errors import DirMoved, SnapshotCorrupt, SnapshotNotFound
from kvsidecar.logs import event

log = logging.getLogger("kvsidecar.store")

_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: opening a FIFO planted at one of our names must not hang the daemon.
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

UNSAFE = "SNAPSHOT_FILE_UNSAFE"  # reason code: not a plain regular file of ours at one of our names
DIR_MOVED = "SNAPSHOT_DIR_MOVED"  # reason code: a path no longer leads to the directory held open


class UnsafeFile(SnapshotCorrupt):
    """A name that is not ours, or an entry that is not a plain regular file of ours (link, FIFO, ...)."""

    reason = UNSAFE


def describe(st: os.stat_result) -> str:
    """What kind of entry this is, for log lines and error messages."""
    mode = st.st_mode
    for test, name in (
        (stat.S_ISLNK, "symlink"),
        (stat.S_ISDIR, "directory"),
        (stat.S_ISFIFO, "fifo"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
    ):
        if test(mode):
            return name
    if stat.S_ISREG(mode):
        return "regular file" if st.st_nlink == 1 else f"regular file with {st.st_nlink} links"
    return "unknown file type"


def problem(st: os.stat_result, uids: frozenset[int]) -> str | None:
    """Why an entry may not be read as one of our files; None if it is a plain regular file of ours."""
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1:
        return f"is a {describe(st)}"
    if st.st_uid not in uids:
        return f"is owned by uid {st.st_uid}, expected one of {sorted(uids)}"
    return None


@dataclass(frozen=True)
class Entry:
    name: str
    st: os.stat_result  # lstat: the entry itself, never what a link points to


DirId = tuple[int, int]  # (st_dev, st_ino)


class DirAnchor:
    """One directory of ours, held open from `hold()` on, and the paths that must keep leading to it.

    Before `hold()` (or for a read-only look that never holds) every access opens `path` as before. Once
    held, `fd()` gives a fresh descriptor of the held directory itself (openat(held, ".")), never reached
    by a path again; `moved()` says whether `path` and every view still resolve to it. Holding it open
    also keeps its inode from being reused, so an equal (device, inode) is the same directory."""

    def __init__(self, path: Path, *, area: str, views: tuple[str, ...] = ()) -> None:
        self.path = Path(path)
        self.area = area  # for logs and status: "snapshots:<server>", "manifests", ...
        self.views = tuple(str(v) for v in views)  # configured paths that must lead here
        self._fd: int | None = None
        self.held_id: DirId | None = None
        self._lock = threading.Lock()
        self._fault: str | None = None  # the last fault seen, logged once per change

    def hold(self) -> None:
        """Open the directory (never through a link at its final component) and keep it open."""
        if self._fd is not None:
            return
        dfd = os.open(self.path, _DIR_FLAGS)
        st = os.fstat(dfd)
        self._fd, self.held_id = dfd, (st.st_dev, st.st_ino)
        # closed with the anchor; `os.close` as it is now (a test's fake filesystem may be gone by then)
        weakref.finalize(self, _close_held, os.close, dfd)

    @property
    def held(self) -> bool:
        return self._fd is not None

    @contextlib.contextmanager
    def fd(self) -> Iterator[int]:
        """A descriptor of the directory: the held one's (a fresh open file description, so that listings
        in several threads never share an offset), or, before `hold`, the path opened without a link."""
        try:
            if self._fd is not None:
                dfd = os.open(".", _DIR_FLAGS, dir_fd=self._fd)
            else:
                dfd = os.open(self.path, _DIR_FLAGS)
        except FileNotFoundError:
            raise SnapshotNotFound(f"{self.path}: no such directory") from None
        except OSError as exc:
            raise UnsafeFile(f"{self.path}: cannot open as a directory ({exc.strerror})") from None
        try:
            yield dfd
        finally:
            os.close(dfd)

    def moved(self, *extra: str | None) -> str | None:
        """Why a path that must lead to the held directory does not (None: they all do, or nothing is
        held). Each path is resolved as an open() of a file in it would be: every component, every link
        followed (os.stat), and its device and inode compared to the held descriptor's. Logged on change:
        `kv.store.dir_moved` (WARNING) when a fault appears or changes, `kv.store.dir_back` when it ends."""
        if self.held_id is None:
            return None
        why: str | None = None
        for view in dict.fromkeys((str(self.path), *self.views, *(e for e in extra if e))):
            try:
                st = os.stat(view)
            except OSError as exc:
                why = f"{view}: {exc.strerror}; kvsidecar holds the directory it opened at start"
                break
            if (st.st_dev, st.st_ino) != self.held_id:
                kind = "a directory" if stat.S_ISDIR(st.st_mode) else f"a {describe(st)}"
                why = f"{view} now leads to {kind} other than the one kvsidecar opened at start"
                break
        self._note(why)
        return why

    def ensure(self, *extra: str | None) -> None:
        """Raise DirMoved unless every path still leads to the held directory."""
        why = self.moved(*extra)
        if why is not None:
            raise DirMoved(why)

    @property
    def fault(self) -> str | None:
        """The fault the last check found (None: none, or never checked)."""
        with self._lock:
            return self._fault

    def _note(self, why: str | None) -> None:
        with self._lock:
            before, self._fault = self._fault, why
        if why == before:
            return
        if why is not None:
            event(log, logging.WARNING, "kv.store.dir_moved", code=DIR_MOVED, area=self.area, detail=why)
        else:
            event(log, logging.INFO, "kv.store.dir_back", area=self.area, path=self.path)


def _close_held(close: Callable[[int], None], fd: int) -> None:
    with contextlib.suppress(Exception):
        close(fd)


class ConfinedDir:
    """One directory of ours and the pattern every name in it must match."""

    def __init__(self, path: Path, names: re.Pattern[str], *, anchor: DirAnchor | None = None) -> None:
        self.path = Path(path)
        self.names = names
        self.anchor = anchor if anchor is not None else DirAnchor(self.path, area=str(self.path))

    def check(self, name: str) -> str:
        if not isinstance(name, str) or not self.names.match(name):
            raise UnsafeFile(f"{name!r:.80} is not one of our file names in {self.path}")
        joined = os.path.join(self.path, name)
        if os.path.dirname(joined) != str(self.path) or os.path.basename(joined) != name:
            raise UnsafeFile(f"{name!r:.80} is not inside {self.path}")  # belt and braces
        return name

    def join(self, name: str) -> Path:
        """The path of a validated name (for callers that hand a name to someone else)."""
        return self.path / self.check(name)

    @contextlib.contextmanager
    def fd(self) -> Iterator[int]:
        """The directory itself (the held one, see `DirAnchor`), never through a symlink planted in its
        place."""
        with self.anchor.fd() as dfd:
            yield dfd

    def owner(self) -> int | None:
        with contextlib.suppress(OSError, SnapshotNotFound), self.fd() as dfd:
            return os.fstat(dfd).st_uid
        return None

    def expected_uids(self) -> frozenset[int]:
        """Who may own our files: us, and the directory's owner (llama-server's user, shared group)."""
        owner = self.owner()
        return frozenset({os.geteuid()} | ({owner} if owner is not None else set()))

    def leads_to(self, name: str, st: os.stat_result, *extra: str | None) -> bool:
        """Whether `name` opened by path, as llama-server opens it (every link followed), through the
        directory's configured path and `extra` ones, is the file `st` (device and inode)."""
        self.check(name)
        for view in dict.fromkeys((str(self.path), *self.anchor.views, *(e for e in extra if e))):
            try:
                seen = os.stat(os.path.join(view, name))
            except OSError:
                return False
            if (seen.st_dev, seen.st_ino) != (st.st_dev, st.st_ino):
                return False
        return True

    def lstat(self, name: str) -> os.stat_result | None:
        self.check(name)
        with self.fd() as dfd:
            try:
                return os.stat(name, dir_fd=dfd, follow_symlinks=False)
            except FileNotFoundError:
                return None

    @contextlib.contextmanager
    def open_file(
        self, name: str, *, uids: frozenset[int] | None = None
    ) -> Iterator[tuple[int, os.stat_result]]:
        """A read-only descriptor of a plain regular file of ours, and its fstat. The entry is lstat'ed
        first, so a device or FIFO is never even opened; the descriptor's own fstat is what counts."""
        self.check(name)
        allowed = uids if uids is not None else self.expected_uids()
        with self.fd() as dfd:
            first = lstat_at(name, dfd)
            if first is None:
                raise SnapshotNotFound(f"{name[:40]}: no such file")
            if not stat.S_ISREG(first.st_mode):
                raise UnsafeFile(f"{name[:40]}: is a {describe(first)}")
            try:
                fd = os.open(name, _READ_FLAGS, dir_fd=dfd)
            except FileNotFoundError:
                raise SnapshotNotFound(f"{name[:40]}: no such file") from None
            except OSError as exc:
                raise UnsafeFile(f"{name[:40]}: not opened ({exc.strerror})") from None
        try:
            st = os.fstat(fd)
            why = problem(st, allowed)
            if why is not None:
                raise UnsafeFile(f"{name[:40]}: {why}")
            yield fd, st
        finally:
            os.close(fd)

    def move_aside(
        self,
        name: str,
        st: os.stat_result,
        *,
        draw: Callable[[], str],
        claim: Callable[[str], bool],
        release: Callable[[str], None],
        keep: Callable[[os.stat_result], bool],
    ) -> str | None:
        """Rename the entry at `name`, which was `st` when the caller checked it, to a fresh name of ours:
        one of up to three `draw()`s that nothing stands at and `claim` accepts (the caller's claim on it,
        made before the rename). A rename takes microseconds whatever the file's size, so the caller can
        free its blocks later, off its path. The entry moved must then be `st` itself (device and inode:
        a regular file, since inode numbers get reused) and pass `keep`; anything swapped in between is put
        back under `name`. None (the claim released) when nothing was moved aside. Refused (DirMoved)
        while the directory's path leads elsewhere."""
        self.check(name)
        self.anchor.ensure()
        with self.fd() as dfd:
            for _ in range(3):  # 32 random bits each: a second draw is already a curiosity
                aside = self.check(draw())
                if lstat_at(aside, dfd) is None and claim(aside):
                    break
            else:
                return None
            try:
                os.rename(name, aside, src_dir_fd=dfd, dst_dir_fd=dfd)
                moved = lstat_at(aside, dfd)
                same = moved is not None and (moved.st_dev, moved.st_ino) == (st.st_dev, st.st_ino)
                if moved is None or not same or not stat.S_ISREG(moved.st_mode) or not keep(moved):
                    if moved is not None and lstat_at(name, dfd) is None:
                        os.rename(aside, name, src_dir_fd=dfd, dst_dir_fd=dfd)
                    raise FileExistsError(name)  # not the file checked: nothing was moved aside
            except OSError:
                release(aside)
                return None
        return aside

    def unlink(self, name: str) -> int | None:
        """Remove the entry itself (a link, never its target). Returns the bytes a plain regular file
        held (0 for other entries), None if nothing was there. A directory at one of our names is left
        alone (UnsafeFile): nothing is ever deleted recursively. Nothing is deleted (DirMoved) while the
        directory's path leads elsewhere."""
        self.check(name)
        self.anchor.ensure()
        with self.fd() as dfd:
            st = lstat_at(name, dfd)
            if st is None:
                return None
            if stat.S_ISDIR(st.st_mode):
                raise UnsafeFile(f"{name[:40]}: is a directory; not removed")
            try:
                os.unlink(name, dir_fd=dfd)
            except FileNotFoundError:
                return None
        return st.st_size if stat.S_ISREG(st.st_mode) and st.st_nlink == 1 else 0

    def scan(self) -> list[Entry]:
        """Entries whose names match the pattern (lstat'ed); everything else is not ours and ignored.
        A missing directory has no entries; one that cannot be opened safely raises UnsafeFile."""
        out: list[Entry] = []
        try:
            with self.fd() as dfd:
                for name in os.listdir(dfd):
                    if not self.names.match(name):
                        continue
                    st = lstat_at(name, dfd)
                    if st is not None:
                        out.append(Entry(name, st))
        except SnapshotNotFound:
            return []
        return out


def lstat_at(name: str, dfd: int) -> os.stat_result | None:
    try:
        return os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return None


def read_capped(fd: int, limit: int) -> bytes:
    """Up to limit + 1 bytes (so the caller can tell "too large" from "exactly at the limit")."""
    chunks: list[bytes] = []
    left = limit + 1
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 16))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)
