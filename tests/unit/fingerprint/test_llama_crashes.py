"""Only the configured server's crashes count, and the cause is named only where the record names it.

The host's kernel log holds every process's faults: test instances of llama-server, another server on the
same host, an old process whose pid is used again. Counting every `llama-server[...]` segfault kept a
healthy set-up at NOT READY, blamed on the CPU. Recorded kernel-log and journal lines of other processes
are fed here; the configured server's own processes are recognized by pid, kernel name and start time, its
units by what they run."""

from __future__ import annotations

import functools
from pathlib import Path

import httpx
import psutil
import pytest

from kvsidecar.backend.llamacpp import LlamaCppBackend
from kvsidecar.doctor.checks import Doctor
from kvsidecar.fingerprint.llama_crashes import (
    INSTALLED_UNIT,
    CrashScope,
    ServedBy,
    kernel_crashes,
    recent_crashes,
    served_by,
    unit_command_port,
)
from kvsidecar.fingerprint.llama_process import ProcessInfo
from tests.unit.coordinator_helpers import make_config
from tests.unit.fingerprint.test_crash_site import TILERELEASE, UD2, VFMADD231PS, elf_with_text

BOOT = 1_000_000.0  # psutil.boot_time(), in these records
OURS = ServedBy(pid=4242, started=BOOT + 50, comm="llama-server", unit=None)  # started 50 s after boot
NEXT = ServedBy(pid=4300, started=BOOT + 80, comm="llama-server", unit=None)  # restarted on the port
SCOPE = CrashScope(port="8080", processes=(OURS, NEXT))


def kmsg(stamp_s: float, message: str, seq: int = 1) -> str:
    return f"6,{seq},{int(stamp_s * 1e6)},-;{message}\n"


OTHERS = (  # test instances of the same binary, another program, a pid used again before ours started
    kmsg(60, "llama-server[5555]: segfault at 0 ip 00007f12 sp 00007ffd error 4 in libggml-cpu.so[7f00+1000]")
    + kmsg(61, "traps: llama-server[5556] trap invalid opcode ip:7f12 sp:7ffd error:0 in libggml-cpu.so")
    + kmsg(62, "llama-server[5557]: segfault at 8 ip 00007f13 sp 00007ffe error 6 in libllama.so[7f00+1000]")
    + kmsg(63, "other-prog[4242]: segfault at 0 ip 00001 sp 00002 error 4 in other-prog[400000+1000]")
    + kmsg(40, "llama-server[4242]: segfault at 0 ip 00001 sp 00002 error 4 in libggml-cpu.so[1000+1000]")
)


def test_only_the_configured_servers_own_processes_count() -> None:
    ours = kmsg(70, "llama-server[4242]: segfault at 0 ip 00007f sp 00007ffd error 4 in libggml-base.so[1+2]")
    restarted = kmsg(90, "traps: llama-server[4300] general protection fault ip:7f sp:7ffd error:0")
    crashes = kernel_crashes(OTHERS + ours + restarted, SCOPE, boot=BOOT)
    assert [(c.pid, c.signal) for c in crashes] == [(4242, "SIGSEGV"), (4300, "SIGSEGV")]
    assert kernel_crashes(OTHERS, SCOPE, boot=BOOT) == []  # 5 crash records of others: none is ours
    assert kernel_crashes(ours, SCOPE, since_us=int(80e6), boot=BOOT) == []  # older than the window
    assert kernel_crashes(OTHERS + ours, CrashScope(port="8080"), boot=BOOT) == []  # nothing known: none


def test_the_unified_binary_is_recognized_by_its_own_name() -> None:
    """llama.cpp's `llama serve` runs as comm `llama`: the name is the configured process's, never a literal."""
    unified = ServedBy(pid=777, started=BOOT + 10, comm="llama")
    scope = CrashScope(port="8080", processes=(unified,))
    text = kmsg(20, "llama[777]: segfault at 0 ip 1 sp 2 error 4 in libggml-cpu.so[1000+1000]")
    text += kmsg(21, "llama-server[777]: segfault at 0 ip 1 sp 2 error 4 in libggml-cpu.so[1000+1000]")
    assert [(c.pid, c.signal) for c in kernel_crashes(text, scope, boot=BOOT)] == [(777, "SIGSEGV")]


def test_a_sigill_names_the_extension_of_the_instruction_it_stopped_at(tmp_path: Path) -> None:
    lib = tmp_path / "libggml-cpu.so.0.26.0"
    elf_with_text(lib, UD2 * 8 + TILERELEASE + VFMADD231PS)
    ours = ServedBy(pid=4242, started=BOOT + 50, comm="llama-server", files=(str(lib),))
    scope = CrashScope(port="8080", processes=(ours,))
    start = 0x7F3A12C31000
    trap = "traps: llama-server[4242] trap invalid opcode ip:{ip:x} sp:7ffd error:0 in {name}[{start:x}+2000]"
    amx = kmsg(70, trap.format(ip=start + 16, name=lib.name, start=start))
    avx = kmsg(71, trap.format(ip=start + 21, name=lib.name, start=start))
    plain = kmsg(72, trap.format(ip=start, name=lib.name, start=start))
    unknown_file = kmsg(73, trap.format(ip=start + 16, name="libother.so", start=start))
    found = kernel_crashes(amx + avx + plain + unknown_file, scope, boot=BOOT)
    assert [(c.signal, c.isa, c.where) for c in found] == [
        ("SIGILL", "AMX", lib.name),
        ("SIGILL", "AVX", lib.name),
        ("SIGILL", None, lib.name),  # ud2: an invalid opcode, but no extension: no ISA claim
        ("SIGILL", None, "libother.so"),  # not a file of the configured server: not read
    ]


def test_a_code_line_shows_a_sigills_instruction_but_a_segfault_makes_no_isa_claim() -> None:
    code = "Code: 48 89 e5 41 57 <62> f1 7d 48 fe c1 5d c3"
    sigill = kmsg(70, "traps: llama-server[4242] trap invalid opcode ip:7f sp:7ffd error:0") + kmsg(
        70, code, 2
    )
    segv = kmsg(71, "llama-server[4242]: segfault at 0 ip 7f sp 7ffd error 4 in libggml-cpu.so[1+2]", 3)
    segv += kmsg(71, code, 4)
    found = kernel_crashes(sigill + segv, SCOPE, boot=BOOT)
    assert [(c.signal, c.isa) for c in found] == [("SIGILL", "AVX-512"), ("SIGSEGV", None)]


def test_the_journal_of_the_servers_own_unit_only() -> None:
    read: list[str] = []

    def journal(unit: str, _since: float) -> list[str | None]:
        read.append(unit)
        exits: dict[str, list[str | None]] = {
            "llama-a.service": ["SIGSEGV", "SIGILL", None],
            INSTALLED_UNIT: ["SIGILL"] * 5,
        }
        return exits.get(unit, [])

    ours = ServedBy(pid=4242, started=BOOT + 50, comm="llama-server", unit="llama-a.service")
    scope = CrashScope(port="8080", processes=(ours,))
    reader = functools.partial(recent_crashes, kmsg=lambda: OTHERS, journal=journal)
    record = reader(scope, serves=lambda _unit, _port: False)
    assert (record.signals, record.source) == (["SIGSEGV", "SIGILL"], "journal:llama-a.service")
    assert read == ["llama-a.service"]  # llama-server.service runs something else: never read
    record = reader(
        CrashScope(port="8080"), serves=lambda unit, port: (unit, port) == (INSTALLED_UNIT, "8080")
    )
    assert record.signals == ["SIGILL"] * 5  # the installed unit, proven to serve the configured port
    assert reader(CrashScope(port="8080"), serves=lambda _u, _p: False).signals == []


def test_the_installed_units_command_is_read_the_way_llama_cpp_reads_it() -> None:
    show = (
        "ExecStart={ path=/opt/llama-server ; argv[]=/opt/llama-server -m /m.gguf --port 8091 --slots ; "
        "ignore_errors=no ; start_time=[n/a] ; stop_time=[n/a] ; pid=0 ; code=(null) ; status=0/0 }\n"
        "Environment=LLAMA_ARG_CTX_SIZE=4096\n"
    )
    assert unit_command_port(show) == "8091"
    env_port = show.replace(" --port 8091", "").replace("CTX_SIZE=4096", "PORT=8092")
    assert unit_command_port(env_port) == "8092"
    assert unit_command_port(show.replace(" --port 8091", "")) == "8080"  # llama-server's default
    assert unit_command_port("ExecStart=\nEnvironment=\n") is None
    assert unit_command_port('ExecStart={ path=/x ; argv[]=/x "unclosed ; }') is None


def test_what_identifies_a_live_process(tmp_path: Path) -> None:
    (tmp_path / "31").mkdir()
    (tmp_path / "31" / "comm").write_text("llama\n")
    (tmp_path / "31" / "cgroup").write_text("0::/system.slice/llama-b.service\n")
    binary = tmp_path / "llama"
    binary.write_bytes(b"")
    (tmp_path / "llama-link").symlink_to(binary)
    process = ProcessInfo(pid=31, create_time=5.0, exe=str(tmp_path / "llama-link"), cmdline=(), flags={})
    seen = served_by(process, proc=str(tmp_path))
    assert (seen.comm, seen.unit, seen.files) == ("llama", "llama-b.service", (str(binary),))


async def test_crashes_of_other_llama_servers_leave_a_healthy_set_up_ready(tmp_path: Path) -> None:
    """The set-up that was held at NOT READY: the configured server is fine; test instances crashed."""
    (tmp_path / "snaps").mkdir()
    config = make_config(tmp_path)

    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    backend = LlamaCppBackend(base_url="http://127.0.0.1:9", transport=httpx.MockTransport(down))
    boot = psutil.boot_time()
    others = "".join(
        kmsg(1, f"llama-server[{9000 + n}]: segfault at 0 ip 1 sp 2 error 4 in libggml-cpu.so[1+2]", n)
        for n in range(20)
    )
    reader = functools.partial(
        recent_crashes, kmsg=lambda: others, journal=lambda _u, _s: [], serves=lambda _u, _p: False
    )
    seen = ServedBy(pid=9003, started=boot + 3600 * 24 * 365, comm="llama-server")  # started after them
    doctor = Doctor(
        config=config,
        server="local",
        backend=backend,
        process_finder=lambda _u: None,
        crash_reader=reader,
        served=(seen,),
    )
    report = await doctor.run()
    assert not [c for c in report.checks if c.name == "llama-server crashes"]


@pytest.mark.parametrize(
    ("signals", "isa", "says", "never"),
    [
        (["SIGSEGV", "SIGSEGV"], None, "crashed lately: SIGSEGV x2", ("CPU", "instructions this CPU")),
        (["SIGILL"], None, "does not show the instruction", ("CPU ", "at an")),
        (["SIGILL", "SIGILL"], "AVX-512", "at an AVX-512 instruction", ()),
    ],
)
def test_the_cause_is_named_only_where_the_record_names_it(
    signals: list[str], isa: str | None, says: str, never: tuple[str, ...]
) -> None:
    from kvsidecar.doctor.llama import crash_check
    from kvsidecar.doctor.report import DoctorReport
    from kvsidecar.fingerprint.llama_crashes import Crash, CrashRecord

    crashes = [
        Crash(signal=s, source="kernel log", pid=1, isa=isa if s == "SIGILL" else None) for s in signals
    ]
    report = DoctorReport(server="local", endpoint="http://127.0.0.1:8080")
    crash_check(report, True, CrashRecord(crashes=crashes))
    (check,) = report.checks
    assert says in check.detail and not any(n in check.detail for n in never), check.detail
    assert check.status == ("FAIL" if len(signals) >= 2 else "WARN")
    if "SIGILL" not in signals:
        assert "rebuild" not in check.fix and "log" in check.fix
