"""The systemd units as `install-systemd` renders them: `systemd-analyze verify` has nothing to say about
them, and `systemd-analyze security` rates kvsidecar.service 2.5 or lower and the example
llama-server.service 5.0 or lower (skipped, saying why, where systemd-analyze is not installed).
And `Type=notify`: `serve` sends READY=1 over $NOTIFY_SOCKET once it answers, STOPPING=1 at SIGTERM."""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml

from kvsidecar.cli import main
from kvsidecar.lifecycle import ReadyGate
from kvsidecar.testing.llama import free_port
from kvsidecar.units import UNITS, UnitParams, render

REPO = Path(__file__).resolve().parents[2]
# The highest overall exposure each unit may have (systemd-analyze's 0.0-10.0 scale).
LIMITS = {"kvsidecar.service": 2.5, "llama-server.service": 5.0}

needs_analyze = pytest.mark.skipif(
    shutil.which("systemd-analyze") is None,
    reason="systemd-analyze is not installed here (apt-get install systemd): the units are not scored",
)


def _config(tmp_path: Path, **extra: object) -> Path:
    cfg = {
        "state_dir": "/var/lib/kvsidecar/state",
        "servers": {
            "local": {
                "snapshot_dir": "/var/lib/kvsidecar/snapshots",
                "base_url": "http://127.0.0.1:8080",
            }
        },
        **extra,
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _install(tmp_path: Path, config: Path) -> Path:
    """install-systemd for a system layout; the binaries are stand-ins in tmp_path, because verify checks
    that ExecStart= names an executable (--force: tmp_path is under /tmp, which the units hide)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for exe in ("kvsidecar", "llama-server"):
        (bin_dir / exe).write_text("#!/bin/sh\n")
        (bin_dir / exe).chmod(0o755)
    dest = tmp_path / "units"
    args = ["-c", str(config), "install-systemd", "--dest", str(dest), "--force"]
    args += ["--kvsidecar", str(bin_dir / "kvsidecar"), "--llama-server", str(bin_dir / "llama-server")]
    args += ["--config-path", "/etc/kvsidecar/config.yaml"]
    assert main(args) == 0
    return dest


def exposure(unit: Path) -> float:
    result = subprocess.run(
        ["systemd-analyze", "security", "--offline=true", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        check=True,
    )
    found = re.search(r"Overall exposure level for \S+: (\d+\.\d)", result.stdout)
    assert found, result.stdout[-500:]
    return float(found.group(1))


def test_shipped_units_are_the_default_rendering() -> None:
    for name in UNITS:
        assert (REPO / "systemd" / name).read_text() == render(name, UnitParams()), (
            f"regenerate systemd/{name}"
        )


@needs_analyze
def test_rendered_units_verify_without_a_warning(tmp_path: Path) -> None:
    units = _install(tmp_path, _config(tmp_path))
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", "--generators=no", *(str(units / u) for u in UNITS)],
        capture_output=True,
        text=True,
    )
    # verify exits 0 even for an unknown or misspelt key: any line it prints is a finding.
    assert result.returncode == 0 and result.stderr == "" and result.stdout == "", result.stderr


@needs_analyze
@pytest.mark.parametrize("listen", ["127.0.0.1:8377", "0.0.0.0:8377"])
def test_security_exposure_is_within_the_limits(tmp_path: Path, listen: str) -> None:
    """Also with a public listener, where the unit cannot restrict IP addresses to loopback."""
    extra: dict[str, object] = {"api": {"listen": listen}}
    if listen.startswith("0.0.0.0"):
        (tmp_path / "token").write_text("x" * 32)
        extra = {"api": {"listen": listen, "allow_public_bind": True, "token_file": str(tmp_path / "token")}}
    units = _install(tmp_path, _config(tmp_path, **extra))
    kv = (units / "kvsidecar.service").read_text()
    assert ("IPAddressDeny=any" in kv) == listen.startswith("127.")
    for name, limit in LIMITS.items():
        score = exposure(units / name)
        assert score <= limit, f"{name}: exposure {score} > {limit}"
        threshold = subprocess.run(
            [
                "systemd-analyze",
                "security",
                "--offline=true",
                f"--threshold={int(limit * 10)}",
                str(units / name),
            ],
            capture_output=True,
        )
        assert threshold.returncode == 0, f"{name}: above --threshold={int(limit * 10)}"


@needs_analyze
def test_shipped_default_units_scores() -> None:
    assert exposure(REPO / "systemd" / "kvsidecar.service") <= LIMITS["kvsidecar.service"]
    assert exposure(REPO / "systemd" / "llama-server.service") <= LIMITS["llama-server.service"]


def test_state_directories_replace_manual_setup() -> None:
    kv, llama = (render(name, UnitParams()) for name in UNITS)
    assert "StateDirectory=kvsidecar/state\nStateDirectoryMode=0700" in kv
    # llama-server writes the snapshots; the setgid shared group lets kvsidecar read and delete them.
    assert "StateDirectory=kvsidecar/snapshots\nStateDirectoryMode=2770" in llama
    assert "ReadWritePaths=/var/lib/kvsidecar/snapshots\n" in kv
    assert "Type=notify\nNotifyAccess=main" in kv and "ExecStartPost" not in kv
    # kvsidecar reads another user's process (llama-server) in /proc, and psutil reads /proc/stat.
    assert not re.search(r"^(ProtectProc|ProcSubset)=", kv, re.MULTILINE)
    assert re.search(r"^ProtectProc=invisible$", llama, re.MULTILINE)


def test_directories_outside_var_lib_stay_read_write_paths() -> None:
    params = UnitParams(state_dir="/srv/kv/state", snapshot_dir="/srv/kv/snapshots")
    kv, llama = (render(name, params) for name in UNITS)
    assert "ReadWritePaths=/srv/kv/state /srv/kv/snapshots\n" in kv and "\nStateDirectory=" not in kv
    assert "ReadWritePaths=/srv/kv/snapshots\n" in llama and "\nStateDirectory=" not in llama


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1) to mount a private /proc")
def test_psutil_process_start_time_needs_proc_stat() -> None:
    """Why kvsidecar.service has no ProcSubset=pid: with /proc mounted subset=pid (what it sets), psutil
    cannot tell a process's start time, which is how kvsidecar notices that llama-server restarted."""
    code = "import psutil; print(psutil.Process().create_time())"
    script = f"mount -t proc -o subset=pid proc /proc && exec {sys.executable} -c '{code}'"
    result = subprocess.run(
        ["unshare", "-mpf", "--propagation", "private", "sh", "-c", script], capture_output=True, text=True
    )
    if result.returncode != 0 and "/proc/stat" not in result.stderr:
        pytest.skip(f"cannot mount a private /proc here: {result.stderr.strip()[-200:]}")
    assert result.returncode != 0, "psutil works with subset=pid now: ProcSubset=pid could be set"


class Recorder:
    def __init__(self) -> None:
        self.sent: list[str] = []

    def notify(self, state: str) -> None:
        self.sent.append(state)


def test_ready_gate_waits_for_every_listener_and_stops_once() -> None:
    notes = Recorder()
    gate = ReadyGate(notes, expected=2)  # the API and the proxy
    gate.server_started()
    assert notes.sent == []
    gate.server_started()
    gate.server_stopping()
    gate.server_stopping()  # the second listener's shutdown
    assert [m.split("\n")[0] for m in notes.sent] == ["READY=1", "STOPPING=1"]
    early = Recorder()
    gate = ReadyGate(early, expected=1)
    gate.server_stopping()  # SIGTERM before the listener was up: never READY
    gate.server_started()
    assert [m.split("\n")[0] for m in early.sent] == ["STOPPING=1"]


@pytest.fixture
def notify_socket(tmp_path: Path) -> Iterator[socket.socket]:
    """What systemd listens on for a Type=notify unit: a datagram unix socket named by $NOTIFY_SOCKET."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(str(tmp_path / "notify"))
    sock.settimeout(60)  # a bound on a hang, not a measured time
    yield sock
    sock.close()


def test_serve_notifies_ready_once_it_answers_and_stopping_at_sigterm(
    tmp_path: Path, notify_socket: socket.socket
) -> None:
    port = free_port()
    cfg = {
        "state_dir": str(tmp_path / "state"),
        # no llama-server there: readiness does not wait for the backend (kvsidecar reports it DOWN)
        "servers": {
            "local": {"snapshot_dir": str(tmp_path / "snaps"), "base_url": f"http://127.0.0.1:{free_port()}"}
        },
        "api": {"listen": f"127.0.0.1:{port}"},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(cfg))
    env = {**os.environ, "NOTIFY_SOCKET": str(tmp_path / "notify")}
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvsidecar", "-c", str(tmp_path / "config.yaml"), "serve"],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        ready = notify_socket.recv(4096).decode()
        assert ready.split("\n")[0] == "READY=1", ready
        # Ready means it answers now: one request, no retry.
        assert httpx.get(f"http://127.0.0.1:{port}/healthz").status_code == 200
        proc.send_signal(signal.SIGTERM)
        stopping = notify_socket.recv(4096).decode()
        assert stopping.split("\n")[0] == "STOPPING=1", stopping
        assert proc.wait(timeout=90) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        log.close()
