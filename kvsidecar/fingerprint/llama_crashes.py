"""Which crashes the host recorded are the configured server's, and what their records say about the cause.

The kernel log holds every process's faults, and a test run or another llama-server on the same host crashes
too: counting every `llama-server[...]` segfault once kept a healthy set-up at NOT READY, blamed on the
CPU. Here a record counts only when it names a process of the configured server (`CrashScope`):

- the process serving the configured port now, and those kvsidecar has seen serve it (`ServedBy`: pid,
  start time, the kernel's name for it (`/proc/<pid>/comm`: `llama-server`, or `llama` for the unified
  binary: whatever the configured server runs), its binary and libraries (realpath), its systemd unit): a
  kernel record matches by pid and name, stamped after that process started (a pid used again by another
  program is not it);
- the systemd units those processes ran in, and the unit `install-systemd` writes (`llama-server.service`)
  when its own command serves the configured port: their journals' "Main process exited" lines.

The cause is named only where the record names it: a SIGILL whose faulting instruction is AMX, AVX-512 or
AVX (`crash_site.py`: from the record's `Code:` line, or read from the configured server's own file at the
recorded address) is an instruction-set mismatch; a SIGILL without it is an instruction the CPU refused;
SIGSEGV, SIGBUS and SIGFPE are crashes, with no claim about the CPU. Every reader returns nothing when it
cannot tell, never raises.
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import shutil
import subprocess
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import psutil

from kvsidecar.fingerprint.crash_site import code_bytes, isa_of, read_at, same_file
from kvsidecar.fingerprint.llama_exit import (
    CRASH_SIGNALS,
    KMSG_PATTERNS,
    journal_exits,
    kmsg_stamp,
    read_kmsg,
    unit_of,
    uptime_us,
)
from kvsidecar.fingerprint.llama_process import ProcessInfo
from kvsidecar.fingerprint.llama_settings import parse_settings

INSTALLED_UNIT = "llama-server.service"  # the unit `kvsidecar install-systemd` writes
_RECORD = re.compile(r"(?:^|[\s;])(?P<comm>[^\s\[\];]{1,15})\[(?P<pid>\d{1,10})\][: ]")
_FILE = re.compile(r" in (?P<file>[^\s\[\]]{1,255})\[(?P<start>[0-9a-f]{1,16})\+[0-9a-f]{1,16}\]")
_IP = re.compile(r"\bip[: ](?P<ip>[0-9a-f]{1,16})\b")
_START_SLACK_US = 2_000_000  # a process's start time (psutil) against the kernel's clock


@dataclass(frozen=True, kw_only=True)
class ServedBy:
    """A process seen serving the configured server: what its crash records are recognized by."""

    pid: int
    started: float  # seconds since the epoch (its create time)
    comm: str | None  # the kernel's name for it, as a record prints it
    unit: str | None = None
    files: tuple[str, ...] = ()  # its binary and llama.cpp/ggml libraries, resolved


def served_by(process: ProcessInfo, *, proc: str = "/proc") -> ServedBy:
    """What identifies `process` in the host's records (read while it lives: its cgroup goes with it)."""
    comm = None
    with (
        contextlib.suppress(OSError, UnicodeDecodeError),
        open(f"{proc}/{process.pid}/comm", encoding="utf-8") as f,
    ):
        comm = f.read(64).strip() or None
    files = []
    for path in (process.binary, process.exe, *(process.libraries or ())):
        if path:
            with contextlib.suppress(OSError, ValueError):
                files.append(os.path.realpath(path))
    return ServedBy(
        pid=process.pid,
        started=process.create_time,
        comm=comm,
        unit=unit_of(process.pid, proc=proc),
        files=tuple(dict.fromkeys(files)),
    )


@dataclass(frozen=True, kw_only=True)
class CrashScope:
    """Whose crashes count: the configured server's processes, and the port it serves."""

    port: str
    processes: tuple[ServedBy, ...] = ()

    @property
    def units(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(p.unit for p in self.processes if p.unit))

    @property
    def files(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(f for p in self.processes for f in p.files))

    def owner(self, pid: int, comm: str, stamp_us: int, boot: float | None) -> ServedBy | None:
        for p in self.processes:
            if p.pid != pid or p.comm != comm:
                continue
            if boot is None or stamp_us < 0 or stamp_us + _START_SLACK_US >= (p.started - boot) * 1e6:
                return p
        return None


@dataclass(frozen=True, kw_only=True)
class Crash:
    signal: str
    source: str  # "kernel log", "journal:<unit>"
    pid: int | None = None
    isa: str | None = None  # "AMX", "AVX-512", "AVX": a SIGILL's instruction, where its record shows it
    where: str | None = None  # the file the kernel says the instruction was in


@dataclass(frozen=True, kw_only=True)
class CrashRecord:
    """The configured server's recent crashes, where they were read, and the instruction evidence."""

    crashes: list[Crash] = field(default_factory=list)
    source: str = "kernel log"

    @property
    def signals(self) -> list[str]:
        return [c.signal for c in self.crashes]

    @property
    def isa_crash(self) -> Crash | None:
        """A SIGILL whose record shows an instruction of an extension the CPU may lack."""
        return next((c for c in self.crashes if c.signal == "SIGILL" and c.isa), None)


def kernel_crashes(
    text: str, scope: CrashScope, *, since_us: int | None = None, boot: float | None = None
) -> list[Crash]:
    """The kernel's records of crashes of the scope's processes, oldest first (/dev/kmsg's records:
    `level,seq,usec,flags;message`); a `Code:` record right after a crash belongs to it."""
    crashes: list[Crash] = []
    pending: tuple[Crash, ServedBy] | None = None  # the last crash, which a Code: line may follow
    for line in text.splitlines():
        message = line.split(";", 1)[-1]
        if pending is not None and message.startswith("Code:"):
            crashes[-1] = _with_code(*pending, message)
            pending = None
            continue
        pending = None
        m = _RECORD.search(message)
        stamp = kmsg_stamp(line)
        if m is None or (since_us is not None and stamp < since_us):
            continue
        signal = next((name for pattern, name in KMSG_PATTERNS if pattern.search(message)), None)
        owner = scope.owner(int(m.group("pid")), m.group("comm"), stamp, boot) if signal else None
        if signal is None or owner is None:
            continue
        crashes.append(_crash(message, signal, owner))
        pending = (crashes[-1], owner)
    return crashes


def _crash(message: str, signal: str, owner: ServedBy) -> Crash:
    where = _FILE.search(message)
    ip = _IP.search(message)
    isa = None
    if signal == "SIGILL" and where is not None and ip is not None:
        path = same_file(where.group("file"), owner.files)
        code = read_at(path, int(where.group("start"), 16), int(ip.group("ip"), 16)) if path else None
        isa = isa_of(code) if code else None
    return Crash(
        signal=signal,
        source="kernel log",
        pid=owner.pid,
        isa=isa,
        where=where.group("file") if where is not None else None,
    )


def _with_code(crash: Crash, owner: ServedBy, message: str) -> Crash:
    if crash.signal != "SIGILL" or crash.isa is not None:
        return crash
    code = code_bytes(message)
    isa = isa_of(code) if code else None
    return Crash(signal=crash.signal, source=crash.source, pid=crash.pid, isa=isa, where=crash.where)


def unit_serves_port(unit: str, port: str, *, timeout_s: float = 3.0) -> bool:
    """Whether systemd's unit `unit` runs a command that serves `port` (its ExecStart and Environment, read
    the way llama.cpp reads them); False where it cannot be read."""
    if shutil.which("systemctl") is None:
        return False
    cmd = ["systemctl", "show", unit, "--no-pager", "-p", "ExecStart", "-p", "Environment"]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, check=False).stdout
    except (OSError, subprocess.SubprocessError):
        return False
    return unit_command_port(out[: 1 << 16]) == port


def unit_command_port(show: str) -> str | None:
    """The port the command of a `systemctl show -p ExecStart -p Environment` answer serves, or None."""
    argv = re.search(r"argv\[\]=(.*?) ;", show)
    env_line = next((ln for ln in show.splitlines() if ln.startswith("Environment=")), "Environment=")
    try:
        cmdline = shlex.split(argv.group(1)) if argv else []
        environ = dict(kv.split("=", 1) for kv in shlex.split(env_line[12:]) if "=" in kv)
    except ValueError:
        return None
    if not cmdline:
        return None
    return parse_settings(cmdline, environ).effective("port") or "8080"


def recent_crashes(
    scope: CrashScope,
    *,
    since_s: float = 3600.0,
    kmsg: Callable[[], str] = read_kmsg,
    journal: Callable[[str, float], list[str | None]] | None = None,
    serves: Callable[[str, str], bool] = unit_serves_port,
) -> CrashRecord:
    """The configured server's crashes the host recorded lately (its units' journals, which cover the last
    `since_s`; else the kernel log, whatever the ring buffer still holds), and the kernel's record of what
    instruction a SIGILL stopped at. For `doctor`, which may run while no llama-server is up to ask."""
    read_journal = journal or (lambda unit, since: journal_exits(unit, since_s=since))
    units = list(scope.units)
    if INSTALLED_UNIT not in units and serves(INSTALLED_UNIT, scope.port):
        units.append(INSTALLED_UNIT)
    uptime = uptime_us()
    since_us = None if uptime is None else max(0, uptime - int(since_s * 1e6))
    boot = None
    with contextlib.suppress(Exception):
        boot = psutil.boot_time()
    kernel = kernel_crashes(kmsg(), scope, since_us=since_us, boot=boot)
    for unit in units:
        exits = [s for s in read_journal(unit, since_s) if s in CRASH_SIGNALS]
        if exits:  # one crash per exit; the kernel's record of a SIGILL of the same processes adds its cause
            crashes = [Crash(signal=s, source=f"journal:{unit}") for s in exits]
            evidence = next((c for c in kernel if c.signal == "SIGILL" and c.isa), None)
            if evidence is not None and "SIGILL" in exits:
                i = exits.index("SIGILL")
                crashes[i] = replace(crashes[i], pid=evidence.pid, isa=evidence.isa, where=evidence.where)
            return CrashRecord(crashes=crashes, source=f"journal:{unit}")
    return CrashRecord(crashes=kernel, source="kernel log")
