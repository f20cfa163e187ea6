"""What `install-systemd` checks before it writes a unit: every path and name it renders, or that the
config hands the daemon, must mean the same thing inside the units' sandbox as here.

Each finding is a PathProblem with a stable reason. Only PRIVATE_TMP and PROTECT_HOME (a path the sandbox
hides: a deliberate test layout may want it anyway) can be overridden with --force; the others would
render a unit that systemd misparses or a daemon that cannot start, and always refuse.
"""

from __future__ import annotations

import os
import re
import stat
from dataclasses import dataclass
from pathlib import PurePosixPath

# Compared with only; nothing is created there. PrivateTmp=yes, PrivateDevices=yes: private per unit.
PRIVATE = ("/tmp", "/var/tmp", "/dev/shm")  # noqa: S108
HIDDEN = ("/home", "/root", "/run/user")  # ProtectHome=yes: absent
RUNTIME = "/run/kvsidecar"  # RuntimeDirectory=kvsidecar
# Never made writable for a socket: the system itself, or a directory other services share.
SYSTEM_ROOTS = ("/etc", "/usr", "/boot", "/dev", "/proc", "/sys", "/bin", "/sbin", "/lib", "/lib64")
SHARED_DIRS = ("/var/lib", "/var/cache", "/var/log", "/var/spool", "/var/opt", "/opt/local", "/usr/local")
FORCEABLE = frozenset({"PRIVATE_TMP", "PROTECT_HOME"})
# systemd splits on whitespace, expands % specifiers and $VARIABLES, and unquotes and unescapes quotes and
# backslashes; a control character ends the line or is refused. A path with any of them is refused.
UNIT_SPECIAL = frozenset("%$'\"\\")
NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_.-]{0,30}")  # a user or group name, as useradd accepts it

WHY = {
    "PRIVATE_TMP": "each unit has its own private /tmp, /var/tmp and /dev/shm (PrivateTmp=yes)",
    "PROTECT_HOME": "the units cannot see /home, /root or /run/user (ProtectHome=yes)",
    "NOT_ABSOLUTE": "the daemon would resolve it against its working directory (/ under systemd): "
    "write it absolute",
    "NOT_NORMALIZED": "a '..' component: systemd refuses it in ReadWritePaths= and a link makes it "
    "ambiguous; write it without '..'",
    "NOT_FOUND": "no such executable on PATH: give its absolute path",
    "NOT_LITERAL": "it starts with '~': the daemon expands that itself, under systemd to its own user's "
    "home, not this shell's: write the path out in the config",
    "NOT_A_FILE": "the daemon reads this file at start: name an existing regular file (not a directory, "
    "not a missing path)",
    "UNIT_SYNTAX": "systemd would split, expand or unescape it (whitespace, %, $, a quote, a backslash "
    "or a control character): use a path or name without them",
    "NESTED": "the state directory and the snapshot directories must not contain one another: each has "
    "its own owner and mode (state 0700 kvsidecar, snapshots 2770 llama)",
    "RUNTIME_DIR": "/run is read-only under ProtectSystem=strict and emptied at boot: put the socket under "
    "/run/kvsidecar/ (RuntimeDirectory=kvsidecar)",
    "SYSTEM_DIR": "its directory would have to be writable (ReadWritePaths=) and is a system or shared "
    "directory: use /run/kvsidecar/ or a directory of its own",
}


@dataclass(frozen=True)
class PathProblem:
    reason: str  # a key of WHY
    what: str  # the setting: state_dir, servers.local.snapshot_dir, --model, ...
    path: str
    other: str = ""  # NESTED: the setting and path it collides with

    def __str__(self) -> str:
        quoted = self.reason in {"UNIT_SYNTAX", "NOT_LITERAL"}
        text = f"{self.reason}: {self.what} {self.path!r}" if quoted else None
        text = text or f"{self.reason}: {self.what} {self.path}"
        if self.other:
            text += f" and {self.other}"
        return f"{text}: {WHY[self.reason]}"


def under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == root or path.startswith(root.rstrip("/") + "/") for root in roots)


def _views(path: str) -> list[str]:
    """The path as written (normalised) and, if it exists, where its links lead."""
    absolute = os.path.normpath(path)
    return list(dict.fromkeys([absolute, os.path.realpath(absolute)]))


def form_problems(paths: dict[str, str]) -> list[PathProblem]:
    """Config paths the daemon resolves itself: relative, or with '..'."""
    out = []
    for what, path in paths.items():
        if not path.startswith("/"):
            out.append(PathProblem("NOT_ABSOLUTE", what, path))
        elif ".." in PurePosixPath(path).parts:
            out.append(PathProblem("NOT_NORMALIZED", what, path))
    return out


def literal_problems(written: dict[str, str]) -> list[PathProblem]:
    """Config paths as written (before expansion) that the daemon would expand: a leading '~' (its own
    user's home: NOT_LITERAL) or a '$VARIABLE' (its own environment, and systemd's syntax: UNIT_SYNTAX).
    Whatever this shell makes of them is a guess at what the daemon will use."""
    out = [PathProblem("NOT_LITERAL", what, path) for what, path in written.items() if path.startswith("~")]
    return out + [
        PathProblem("UNIT_SYNTAX", what, path)
        for what, path in written.items()
        if "$" in path and not path.startswith("~")
    ]


def file_problems(paths: dict[str, str], *, must_exist: frozenset[str]) -> list[PathProblem]:
    """Files the daemon reads: an existing one that is not a regular file (a directory, a device), and
    one of `must_exist` that is missing."""
    out = []
    for what, path in paths.items():
        try:
            mode = os.stat(path).st_mode
        except OSError:
            if what in must_exist:
                out.append(PathProblem("NOT_A_FILE", what, path))
            continue
        if not stat.S_ISREG(mode):
            out.append(PathProblem("NOT_A_FILE", what, path))
    return out


def hidden_problems(paths: dict[str, str]) -> list[PathProblem]:
    out = []
    for what, path in paths.items():
        for view in _views(path):
            if under(view, PRIVATE) or under(view, HIDDEN):
                out.append(PathProblem("PRIVATE_TMP" if under(view, PRIVATE) else "PROTECT_HOME", what, view))
                break
    return out


def unit_safe(text: str) -> bool:
    return text != "" and not any(c in UNIT_SPECIAL or c.isspace() or not c.isprintable() for c in text)


def syntax_problems(paths: dict[str, str], names: dict[str, str]) -> list[PathProblem]:
    out = [PathProblem("UNIT_SYNTAX", what, p) for what, p in paths.items() if not unit_safe(p)]
    return out + [PathProblem("UNIT_SYNTAX", what, n) for what, n in names.items() if not NAME.fullmatch(n)]


def nested_problems(state_dir: str, snapshot_dirs: dict[str, str]) -> list[PathProblem]:
    """state_dir against each snapshot directory (equal, or either inside the other), and snapshot
    directories strictly inside one another; as written and where links lead."""
    dirs = [("state_dir", state_dir), *snapshot_dirs.items()]
    out = []
    for i, (what, path) in enumerate(dirs):
        for other_what, other in dirs[i + 1 :]:
            equal_ok = i > 0  # two servers sharing one directory is the store's business
            if overlaps(path, other, equal_ok=equal_ok):
                out.append(PathProblem("NESTED", what, path, f"{other_what} {other}"))
    return out


def overlaps(a: str, b: str, *, equal_ok: bool = False) -> bool:
    """Equal (unless `equal_ok`) or either inside the other, as written or where links lead."""
    for view in (os.path.normpath, os.path.realpath):
        va, vb = view(a), view(b)
        if va == vb and not equal_ok:
            return True
        if va != vb and (under(va, (vb,)) or under(vb, (va,))):
            return True
    return False


def socket_directory(socket: str, writable: list[str]) -> tuple[str | None, PathProblem | None]:
    """The directory to add to kvsidecar's ReadWritePaths= for api.unix_socket (None: already writable),
    or why it cannot be."""
    path = os.path.normpath(socket)
    if path.startswith("/var/run/"):
        path = "/run/" + path.removeprefix("/var/run/")
    parent = os.path.dirname(path)
    if under(parent, (RUNTIME,)) or under(parent, tuple(writable)):
        return None, None
    if under(parent, ("/run",)):
        return None, PathProblem("RUNTIME_DIR", "api.unix_socket", socket)
    shallow = len(PurePosixPath(parent).parts) < 3  # "/", "/srv", "/var"
    if shallow or under(parent, SYSTEM_ROOTS) or parent in SHARED_DIRS:
        return None, PathProblem("SYSTEM_DIR", "api.unix_socket", socket)
    return parent, None
