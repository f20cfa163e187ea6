"""Why a local llama-server process went away: the evidence the host keeps about a process that is not ours.

kvsidecar does not start llama-server (systemd does), so it never sees the exit status. When the process it
watched vanishes, this module looks where the host records the cause, without privileges it may lack:

- systemd's journal for the unit the process ran in (read from `/proc/<pid>/cgroup` while it was alive):
  `Main process exited, code=killed, status=4/ILL`;
- the kernel log (`/dev/kmsg`, readable by root outside most containers): `traps: llama-server[1234] trap
  invalid opcode` (SIGILL), `segfault at` / `general protection` (SIGSEGV).

A build whose kernels this CPU does not execute dies with SIGILL or SIGSEGV at its first decode, again after
every restart (issue 25): `CRASH_SIGNALS` names those, and `crash_hint` says what to do. Every reader here
returns None or nothing when it cannot tell, never raises.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import subprocess
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

# Signals that mean "this binary cannot run here" when they repeat at start: an instruction the CPU (or the
# VM) does not execute, or a kernel that touches state it was never given.
CRASH_SIGNALS = frozenset({"SIGILL", "SIGSEGV", "SIGBUS", "SIGFPE"})

_UNIT_RE = re.compile(r"/([A-Za-z0-9:_.@\\-]{1,200}\.service)(?:/|$)")
_JOURNAL_RE = re.compile(r"Main process exited, code=(exited|killed|dumped), status=(\d+)(?:/([A-Z0-9]+))?")
_KMSG_PATTERNS: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"trap invalid opcode"), "SIGILL"),
    (re.compile(r"segfault at"), "SIGSEGV"),
    (re.compile(r"general protection"), "SIGSEGV"),
    (re.compile(r"trap divide error"), "SIGFPE"),
    (re.compile(r"bus error"), "SIGBUS"),
)
_KMSG_MAX_BYTES = 4 << 20  # the ring buffer is at most a few MB; never read past this


@dataclass(frozen=True, kw_only=True)
class ExitEvidence:
    pid: int
    signal: str | None  # "SIGILL", ...; None: not known
    status: int | None = None  # exit status where it exited normally
    source: str = "unknown"  # "journal:<unit>", "kernel log", "unknown"

    @property
    def crashed(self) -> bool:
        return self.signal in CRASH_SIGNALS

    def describe(self) -> str:
        if self.signal is not None:
            how = f"was killed by {self.signal}"
        elif self.status is not None:
            how = f"exited with status {self.status}"
        else:
            how = "exited (cause not recorded where kvsidecar can read it)"
        return f"llama-server (pid {self.pid}) {how}" + (
            "" if self.source == "unknown" else f" [{self.source}]"
        )


def unit_of(pid: int, *, proc: str = "/proc") -> str | None:
    """The systemd service a process runs in, from its cgroup path; None outside one."""
    try:
        with open(f"{proc}/{pid}/cgroup", encoding="utf-8", errors="replace") as f:
            text = f.read(65536)
    except OSError:
        return None
    for line in text.splitlines():
        path = line.split(":", 2)[-1]
        units = _UNIT_RE.findall(path)
        if units:
            return str(units[-1])
    return None


def parse_journal(text: str) -> list[str | None]:
    """The signal (None: a normal exit) of each "Main process exited" line of a journal, oldest first."""
    exits: list[str | None] = []
    for line in text.splitlines():
        m = _JOURNAL_RE.search(line)
        if m:
            code, status, name = m.group(1), int(m.group(2)), m.group(3)
            exits.append(None if code == "exited" else _signal_name(status, name))
    return exits


def _signal_name(number: int, name: str | None) -> str:
    if name:
        return name if name.startswith("SIG") else f"SIG{name}"
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def journal_exits(unit: str, *, since_s: float = 3600.0, timeout_s: float = 3.0) -> list[str | None]:
    """Signals (None: a normal exit) of the unit's main-process exits in the last `since_s`, oldest first."""
    if shutil.which("journalctl") is None or not _UNIT_RE.search("/" + unit):
        return []
    cmd = ["journalctl", "--no-pager", "-q", "-o", "cat", "-u", unit, "--since", f"-{int(since_s)}s"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    return parse_journal(out[-(1 << 20) :])


def parse_kmsg(text: str, pid: int) -> str | None:
    """The signal the kernel logged for `pid` (the last such line), or None."""
    found = None
    marker = f"[{pid}]"
    for line in text.splitlines():
        if marker not in line:
            continue
        for pattern, name in _KMSG_PATTERNS:
            if pattern.search(line):
                found = name
                break
    return found


_COMM_PID_RE = re.compile(r"\bllama-server\[(\d+)\]")


def parse_kmsg_crashes(text: str, *, since_us: int | None = None) -> list[tuple[int, str]]:
    """(pid, signal) of every llama-server crash the kernel logged, oldest first (any pid); with `since_us`,
    only records stamped at or after that many microseconds since boot (`/dev/kmsg`'s third field)."""
    crashes: list[tuple[int, str]] = []
    for line in text.splitlines():
        m = _COMM_PID_RE.search(line)
        if not m or (since_us is not None and _kmsg_stamp(line) < since_us):
            continue
        for pattern, name in _KMSG_PATTERNS:
            if pattern.search(line):
                crashes.append((int(m.group(1)), name))
                break
    return crashes


def _kmsg_stamp(line: str) -> int:
    """A /dev/kmsg record's time in microseconds since boot; -1 where the line has none."""
    prefix = line.split(";", 1)[0].split(",")
    try:
        return int(prefix[2])
    except (IndexError, ValueError):
        return -1


def _uptime_us() -> int | None:
    try:
        with open("/proc/uptime", encoding="ascii") as f:
            return int(float(f.read().split()[0]) * 1e6)
    except (OSError, ValueError, IndexError):
        return None


def recent_crashes(unit: str | None, *, since_s: float = 3600.0) -> tuple[list[str], str]:
    """Crash signals of llama-server processes the host recorded lately, and where they were read.

    The unit's journal when there is one (it covers the last `since_s`), else the kernel log (whatever the
    ring buffer still holds). For `doctor`, which may run while no llama-server is up to ask."""
    if unit is not None:
        signals = [s for s in journal_exits(unit, since_s=since_s) if s in CRASH_SIGNALS]
        if signals:
            return signals, f"journal:{unit}"
    uptime = _uptime_us()
    since_us = None if uptime is None else max(0, uptime - int(since_s * 1e6))
    signals = [sig for _, sig in parse_kmsg_crashes(read_kmsg(), since_us=since_us)]
    return signals, "kernel log"


def read_kmsg(path: str = "/dev/kmsg") -> str:
    """What the kernel ring buffer holds now, or "" where it cannot be read (no root, a container)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return ""
    chunks: list[bytes] = []
    total = 0
    try:
        while total < _KMSG_MAX_BYTES:
            try:
                record = os.read(fd, 8192)
            except OSError as e:
                if e.errno == errno.EPIPE:  # a record was overwritten while reading: go on from the next
                    continue
                break  # EAGAIN: the end of the buffer
            if not record:
                break
            chunks.append(record)
            total += len(record)
    finally:
        with contextlib.suppress(OSError):
            os.close(fd)
    return b"".join(chunks).decode(errors="replace")


def exit_evidence(pid: int, unit: str | None) -> ExitEvidence:
    """What the host recorded about how `pid` ended (blocking: call it in a thread)."""
    sig = parse_kmsg(read_kmsg(), pid)
    if sig is not None:
        return ExitEvidence(pid=pid, signal=sig, source="kernel log")
    if unit is not None:
        exits = journal_exits(unit, since_s=600)
        if exits:
            return ExitEvidence(pid=pid, signal=exits[-1], source=f"journal:{unit}")
    return ExitEvidence(pid=pid, signal=None)


class ExitHistory:
    """The last exits of one server's process, to tell one crash from a crash loop."""

    def __init__(self, *, window_s: float = 600.0, clock: Callable[[], float] = time.time) -> None:
        self.window_s = window_s
        self._clock = clock
        self._exits: deque[tuple[float, ExitEvidence]] = deque(maxlen=32)

    def record(self, evidence: ExitEvidence) -> None:
        self._exits.append((self._now(), evidence))

    def _now(self) -> float:
        return self._clock()

    def recent(self) -> list[ExitEvidence]:
        horizon = self._now() - self.window_s
        return [e for at, e in self._exits if at >= horizon]

    def crash_loop(self) -> str | None:
        """The crash signal if it ended the process at least twice in the window, else None."""
        crashes = [e.signal for e in self.recent() if e.crashed]
        for sig in dict.fromkeys(crashes):
            if crashes.count(sig) >= 2:
                return sig
        return None

    def last(self) -> ExitEvidence | None:
        return self._exits[-1][1] if self._exits else None


def crash_hint(sig: str | None) -> str:
    """What to do about a process that dies with `sig`."""
    if sig in ("SIGILL", "SIGSEGV", "SIGBUS"):
        return (
            f"{sig} again and again usually means the llama-server build runs instructions this CPU does not "
            "execute (a build made for another CPU, or ggml's AMX kernels on some Xeon VMs): rebuild it on "
            "this machine without AMX (scripts/provision-llama-server does, and proves it with a decode), "
            "and run `kvsidecar doctor`"
        )
    if sig == "SIGKILL":
        return "SIGKILL is often the kernel's OOM killer: check `dmesg` and the model's memory"
    return "see llama-server's own log (journalctl -u llama-server)"
