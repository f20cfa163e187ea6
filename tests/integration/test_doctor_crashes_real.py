"""doctor's crash check against a real llama-server: its process is recognized by what the kernel's records
name (pid, the kernel's name for it, the files it maps), the daemon remembers the processes it has seen
serve the port, and a SIGILL's instruction is read from the real library the server runs, at the address
a record gives. Records of another llama-server of the same binary never count."""

from __future__ import annotations

import functools
import os
import re
import shutil
import subprocess
from pathlib import Path

import psutil
import pytest

from kvsidecar.backend.llamacpp import LlamaCppBackend
from kvsidecar.doctor.checks import Doctor
from kvsidecar.fingerprint.llama_crashes import CrashScope, recent_crashes, served_by
from kvsidecar.fingerprint.llama_process import find_llama_process
from tests.conftest import StartServer
from tests.integration.real_helpers import real_harness
from tests.unit.coordinator_helpers import make_config

_INSN = re.compile(r"^\s*([0-9a-f]+):\s+((?:[0-9a-f]{2} )+)", re.MULTILINE)


def _vector_instruction(lib: str) -> tuple[int, str]:
    """(file offset, extension) of the first EVEX (AVX-512) or two-byte VEX (AVX) instruction objdump finds
    in the library's executable segment: judged here by its first byte, independently of the code."""
    segments = subprocess.run(["readelf", "-lW", lib], capture_output=True, text=True, check=True).stdout
    load = next(
        ln.split() for ln in segments.splitlines() if ln.split()[:1] == ["LOAD"] and "E" in ln.split()[-2]
    )
    p_offset, p_vaddr = int(load[1], 16), int(load[2], 16)
    text = subprocess.run(["objdump", "-d", lib], capture_output=True, text=True, check=True).stdout
    for m in _INSN.finditer(text):
        first = m.group(2).split()[0]
        if first in ("62", "c5"):
            return int(m.group(1), 16) - p_vaddr + p_offset, "AVX-512" if first == "62" else "AVX"
    pytest.skip("no AVX instruction in this build")


def _mapping(pid: int, lib: str) -> tuple[int, int, int]:
    """(start, size, file offset) of the library's executable mapping in the process, as the kernel has it."""
    with open(f"/proc/{pid}/maps", encoding="utf-8") as f:
        for line in f:
            fields = line.split()
            if len(fields) >= 6 and fields[1] == "r-xp" and os.path.realpath(fields[5]) == lib:
                start, end = (int(x, 16) for x in fields[0].split("-"))
                return start, end - start, int(fields[2], 16)
    raise AssertionError(f"{lib} is not mapped executable in {pid}")


@pytest.mark.skipif(shutil.which("objdump") is None or shutil.which("readelf") is None, reason="binutils")
async def test_a_sigill_of_the_real_server_names_its_instruction_and_another_servers_does_not_count(
    start_llama: StartServer, tmp_path: Path
) -> None:
    server = start_llama()
    other = start_llama()  # another llama-server of the same binary on this host (a test instance)
    process, stranger = find_llama_process(server.base_url), find_llama_process(other.base_url)
    assert process is not None and stranger is not None
    seen = served_by(process)
    assert seen.comm == "llama-server"  # what the kernel calls it: read from the process, not assumed
    lib = next(f for f in seen.files if os.path.basename(f).startswith("libggml-cpu"))
    file_offset, extension = _vector_instruction(lib)
    start, size, map_offset = _mapping(process.pid, lib)
    ip = start + file_offset - map_offset
    stamp = int((process.create_time - psutil.boot_time() + 1) * 1e6)
    trap = "6,{seq},{stamp},-;traps: llama-server[{pid}] trap invalid opcode ip:{ip:x} sp:7ffd error:0 in {lib}[{start:x}+{size:x}]\n"
    name = os.path.basename(lib)
    kmsg = "".join(
        trap.format(seq=n, stamp=stamp, pid=pid, ip=ip, lib=name, start=start, size=size)
        for n, pid in enumerate((stranger.pid, process.pid, stranger.pid))
    )
    reader = functools.partial(
        recent_crashes, kmsg=lambda: kmsg, journal=lambda _u, _s: [], serves=lambda _u, _p: False
    )
    port = server.base_url.rsplit(":", 1)[1]
    record = reader(CrashScope(port=port, processes=(seen,)))
    assert [(c.pid, c.signal, c.isa, c.where) for c in record.crashes] == [
        (process.pid, "SIGILL", extension, name)
    ]

    config = make_config(
        tmp_path, servers={"local": {"base_url": server.base_url, "snapshot_dir": str(server.slot_save_path)}}
    )
    backend = LlamaCppBackend(base_url=server.base_url)
    try:
        report = await Doctor(config=config, server="local", backend=backend, crash_reader=reader).run()
    finally:
        await backend.aclose()
    check = next(c for c in report.checks if c.name == "llama-server crashes")
    assert check.status == "WARN" and "SIGILL x1" in check.detail  # one crash of a server that runs now
    assert f"at an {extension} instruction (in {name})" in check.detail


async def test_the_daemon_remembers_the_processes_that_served_its_server(
    start_llama: StartServer, tmp_path: Path
) -> None:
    server = start_llama()
    h = await real_harness(server, tmp_path)
    try:
        process = find_llama_process(server.base_url)
        assert process is not None
        (seen,) = h.coordinator.guard.exits.served("local")
        assert (seen.pid, seen.comm, seen.started) == (process.pid, "llama-server", process.create_time)
        assert any(os.path.basename(f).startswith("libggml-cpu") for f in seen.files)
    finally:
        await h.coordinator.aclose()
