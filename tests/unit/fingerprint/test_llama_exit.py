"""How a llama-server that is not ours ended (issue 25, item 4): the daemon and `doctor` say "killed by SIGILL",
not only "backend unavailable", when a build this CPU cannot run keeps dying."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import psutil
import pytest

from kvsidecar.backend.llamacpp import LlamaCppBackend
from kvsidecar.coordinator.exits import ExitWatch
from kvsidecar.doctor.checks import Doctor
from kvsidecar.fingerprint.llama_exit import (
    ExitEvidence,
    ExitHistory,
    parse_journal,
    parse_kmsg,
    parse_kmsg_crashes,
    read_kmsg,
    unit_of,
)
from kvsidecar.fingerprint.llama_process import ProcessInfo
from tests.unit.coordinator_helpers import make_config

KMSG = (
    "6,1201,5000000,-;llama-server[4242]: segfault at 0 ip 00007f sp 00007ffd error 4 in libggml-cpu.so\n"
    "6,1202,5100000,-;traps: llama-server[4243] trap invalid opcode ip:7f12 sp:7ffd error:0 in libggml-cpu.so\n"
    "6,1203,5200000,-;traps: other-prog[4244] trap invalid opcode ip:1 sp:2 error:0\n"
)
JOURNAL = (
    "Started llama.cpp server.\n"
    "llama-server.service: Main process exited, code=killed, status=4/ILL\n"
    "llama-server.service: Failed with result 'signal'.\n"
    "llama-server.service: Main process exited, code=dumped, status=11/SEGV\n"
    "llama-server.service: Main process exited, code=exited, status=1/FAILURE\n"
)


def test_kernel_log_lines_name_the_signal_of_a_pid() -> None:
    assert parse_kmsg(KMSG, 4243) == "SIGILL"
    assert parse_kmsg(KMSG, 4242) == "SIGSEGV"
    assert parse_kmsg(KMSG, 999) is None
    assert parse_kmsg_crashes(KMSG) == [(4242, "SIGSEGV"), (4243, "SIGILL")]  # other programs left out
    assert parse_kmsg_crashes(KMSG, since_us=5_050_000) == [(4243, "SIGILL")]  # older records left out


def test_journal_lines_name_each_exit() -> None:
    assert parse_journal(JOURNAL) == ["SIGILL", "SIGSEGV", None]
    assert parse_journal("nothing here\n") == []


def test_unit_is_read_from_the_cgroup(tmp_path: Path) -> None:
    (tmp_path / "7").mkdir()
    (tmp_path / "7" / "cgroup").write_text("0::/system.slice/llama-server.service\n")
    assert unit_of(7, proc=str(tmp_path)) == "llama-server.service"
    (tmp_path / "8").mkdir()
    (tmp_path / "8" / "cgroup").write_text("0::/user.slice/user-0.slice/session-3.scope\n")
    assert unit_of(8, proc=str(tmp_path)) is None
    assert unit_of(9, proc=str(tmp_path)) is None  # gone: no cgroup file


def test_a_crash_loop_is_two_crashes_of_one_signal_in_the_window() -> None:
    now = [1000.0]
    history = ExitHistory(window_s=600, clock=lambda: now[0])
    history.record(ExitEvidence(pid=1, signal="SIGILL"))
    assert history.crash_loop() is None
    history.record(ExitEvidence(pid=2, signal=None, status=0))
    assert history.crash_loop() is None
    now[0] += 30
    history.record(ExitEvidence(pid=3, signal="SIGILL"))
    assert history.crash_loop() == "SIGILL"
    now[0] += 601  # both out of the window
    assert history.crash_loop() is None


@pytest.mark.skipif(shutil.which("cc") is None, reason="needs a C compiler")
def test_a_real_sigill_is_found_in_the_kernel_log(tmp_path: Path) -> None:
    """A process that executes an invalid instruction: the kernel's own record of it, found by its pid. (Not
    named llama-server: doctor runs in other tests read this machine's kernel log for llama-server crashes.)"""
    if not read_kmsg():
        pytest.skip("the kernel log is not readable here (not root, or a container)")
    if sys.platform != "linux" or os.uname().machine not in ("x86_64", "aarch64"):
        pytest.skip("x86-64/aarch64 Linux only")
    src = tmp_path / "trap.c"
    src.write_text("int main(void) { __builtin_trap(); }\n")
    binary = tmp_path / "trap-probe"
    subprocess.run(["cc", "-O0", "-o", str(binary), str(src)], check=True)
    proc = subprocess.Popen([str(binary)])
    assert proc.wait() in (-signal.SIGILL, -signal.SIGTRAP)
    # The kernel rate-limits these lines; when it printed one for the process, it is read back as SIGILL.
    text = read_kmsg()
    if f"[{proc.pid}]" not in text:
        pytest.skip("the kernel printed no trap line (show_unhandled_signals off, or rate-limited)")
    assert parse_kmsg(text, proc.pid) == "SIGILL"


class _Telemetry:
    def __init__(self) -> None:
        self.calls: list[tuple[str, ExitEvidence, str | None]] = []

    def server_exited(self, server: str, evidence: ExitEvidence, crash_loop: str | None) -> None:
        self.calls.append((server, evidence, crash_loop))


def _process(pid: int) -> ProcessInfo:
    return ProcessInfo(pid=pid, create_time=psutil.Process(pid).create_time(), exe=None, cmdline=(), flags={})


async def test_the_daemon_reports_each_gone_process_once_and_a_crash_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Real processes, really killed by SIGILL; the host's record of how they ended is injected."""
    telemetry = _Telemetry()
    watch = ExitWatch(telemetry=telemetry)  # type: ignore[arg-type]
    monkeypatch.setattr(
        "kvsidecar.coordinator.exits.exit_evidence",
        lambda pid, unit: ExitEvidence(pid=pid, signal="SIGILL", source="kernel log"),
    )
    for n in range(2):
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        info = _process(child.pid)
        srv: Any = SimpleNamespace(name="local", process=info, available=True)
        watch.note(srv, None)  # first seen alive
        watch.note(srv, info)  # still the same process: nothing to say
        assert len(telemetry.calls) == n
        child.send_signal(signal.SIGILL)
        child.wait()
        srv.available, srv.process = False, info  # the probe failed; the last process found is kept
        watch.note(srv, info)
        watch.note(srv, info)  # once per process
        await asyncio.sleep(0.05)
        for task in list(watch._tasks):
            await task
        assert len(telemetry.calls) == n + 1
        assert telemetry.calls[-1][1].pid == child.pid
    assert telemetry.calls[0][2] is None  # one crash is not a loop
    assert telemetry.calls[1][2] == "SIGILL"  # two are
    assert watch.last("local") is not None and watch.last("local").signal == "SIGILL"  # type: ignore[union-attr]
    await watch.aclose()


async def test_the_crash_loop_is_logged_with_what_to_do(caplog: pytest.LogCaptureFixture) -> None:
    from kvsidecar.coordinator.costs import CostModel
    from kvsidecar.coordinator.telemetry import Telemetry
    from kvsidecar.metrics import Metrics

    telemetry = Telemetry(Metrics(), CostModel())
    with caplog.at_level(logging.WARNING):
        telemetry.server_exited("local", ExitEvidence(pid=5, signal="SIGILL", source="kernel log"), "SIGILL")
    text = caplog.text
    assert "kv.backend.exited" in text and "SIGILL" in text
    assert "kv.backend.crash_loop" in text and "provision-llama-server" in text
    value = telemetry.metrics.registry.get_sample_value(
        "kvsidecar_backend_exits_total", {"server": "local", "signal": "SIGILL"}
    )
    assert value == 1


async def test_doctor_says_sigill_when_the_server_keeps_dying(tmp_path: Path) -> None:
    (tmp_path / "snaps").mkdir()

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    config = make_config(tmp_path)
    backend = LlamaCppBackend(base_url="http://127.0.0.1:9", transport=httpx.MockTransport(refuse))
    seen: list[str | None] = []

    def crashes(unit: str | None) -> tuple[list[str], str]:
        seen.append(unit)
        return ["SIGILL", "SIGILL", "SIGILL"], "journal:llama-server.service"

    doctor = Doctor(
        config=config, server="local", backend=backend, process_finder=lambda _u: None, crash_reader=crashes
    )
    report = await doctor.run()
    check = next(c for c in report.checks if c.name == "llama-server crashes")
    assert check.status == "FAIL" and report.result == "NOT READY"
    assert "SIGILL x3" in check.detail and "journal:llama-server.service" in check.detail
    assert "CPU" in check.detail
    assert "rebuild" in check.fix and "buildcheck smoke" in check.fix
    assert seen == ["llama-server.service"]


async def test_doctor_says_nothing_about_crashes_when_there_were_none(tmp_path: Path) -> None:
    (tmp_path / "snaps").mkdir()

    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    config = make_config(tmp_path)
    backend = LlamaCppBackend(base_url="http://127.0.0.1:9", transport=httpx.MockTransport(refuse))
    doctor = Doctor(
        config=config,
        server="local",
        backend=backend,
        process_finder=lambda _u: None,
        crash_reader=lambda _unit: ([], "kernel log"),
    )
    report = await doctor.run()
    assert not [c for c in report.checks if c.name == "llama-server crashes"]
