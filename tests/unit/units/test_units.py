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

from kvsidecar.cli import build_parser, cmd_checkpoint, main
from kvsidecar.daemon.lifecycle import ReadyGate
from kvsidecar.testing.llama import free_port
from kvsidecar.units import UNITS, UnitParams, render

REPO = Path(__file__).resolve().parents[3]
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


def _stand_ins(tmp_path: Path) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for exe in ("kvsidecar", "llama-server"):
        (bin_dir / exe).write_text("#!/bin/sh\n")
        (bin_dir / exe).chmod(0o755)
    return bin_dir


def _run(tmp_path: Path, config: Path, *extra: str) -> tuple[int, Path]:
    """install-systemd for a system layout; the binaries are stand-ins in tmp_path, because verify checks
    that ExecStart= names an executable (--force: tmp_path is under /tmp, which the units hide)."""
    bin_dir = _stand_ins(tmp_path)
    dest = tmp_path / "units"
    args = ["-c", str(config), "install-systemd", "--dest", str(dest), "--force"]
    args += ["--kvsidecar", str(bin_dir / "kvsidecar"), "--llama-server", str(bin_dir / "llama-server")]
    args += ["--config-path", str(config), *extra]  # it must exist: the daemon reads it
    return main(args), dest


def _install(tmp_path: Path, config: Path, *extra: str) -> Path:
    code, dest = _run(tmp_path, config, *extra)
    assert code == 0
    return dest


def assert_verifies(units: Path) -> None:
    if shutil.which("systemd-analyze") is None:
        return  # scored where it is installed (needs_analyze says why it is not here)
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", "--generators=no", *(str(units / u) for u in UNITS)],
        capture_output=True,
        text=True,
    )
    # verify exits 0 even for an unknown or misspelt key: any line it prints is a finding.
    assert result.returncode == 0 and result.stderr == "" and result.stdout == "", result.stderr
    for name, limit in LIMITS.items():
        assert exposure(units / name) <= limit, name


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
    assert_verifies(_install(tmp_path, _config(tmp_path)))


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


# --- what install-systemd refuses, and what it resolves (issue 17: D2-D6) ---


def _refused(tmp_path: Path, config: Path, capsys: pytest.CaptureFixture[str], *extra: str) -> str:
    """Refused even with --force (which _run passes): exit 2, nothing written; its stderr."""
    code, dest = _run(tmp_path, config, *extra)
    err = capsys.readouterr().err
    assert code == 2 and not dest.exists(), err
    assert "KV_UNIT_PATH_UNSAFE" in err and "Traceback" not in err
    return err


def test_relative_config_paths_are_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """The daemon resolves them against its own working directory (/ under systemd): never guessed."""
    cfg = _config(
        tmp_path,
        state_dir="state",
        servers={"local": {"snapshot_dir": "snaps", "base_url": "http://127.0.0.1:8080"}},
        api={"token_file": "token", "unix_socket": "kv.sock"},
    )
    err = _refused(tmp_path, cfg, capsys)
    for what in ("state_dir state", "servers.local.snapshot_dir snaps", "api.token_file", "api.unix_socket"):
        assert f"NOT_ABSOLUTE: {what}" in err
    cfg = _config(tmp_path, state_dir="/var/lib/kvsidecar/../state")
    assert "NOT_NORMALIZED: state_dir /var/lib/kvsidecar/../state" in _refused(tmp_path, cfg, capsys)


def test_command_line_paths_are_made_absolute(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    bin_dir = _stand_ins(tmp_path)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", str(bin_dir))
    cfg = _config(tmp_path)
    args = ["-c", "config.yaml", "install-systemd", "--dest", "units", "--force", "--model", "m.gguf"]
    args += ["--kvsidecar", "kvsidecar", "--llama-server", "bin/llama-server", "--config-path", "config.yaml"]
    assert main(args) == 0
    assert f"wrote {tmp_path / 'units' / 'kvsidecar.service'}" in capsys.readouterr().out
    kv, llama = ((tmp_path / "units" / u).read_text() for u in UNITS)
    assert f"ExecStart={bin_dir / 'kvsidecar'} serve\n" in kv
    assert f"Environment=KVSIDECAR_CONFIG={cfg}\n" in kv
    assert f"ExecStart={bin_dir / 'llama-server'} -m {tmp_path / 'm.gguf'} " in llama
    assert_verifies(tmp_path / "units")
    # a bare name that is not on PATH is not guessed
    code = main([*args[:-6], "--llama-server", "no-such-llama-server"])
    assert code == 2 and "NOT_FOUND: --llama-server no-such-llama-server" in capsys.readouterr().err


@pytest.mark.parametrize("char", [" ", "%", "$", "'", '"', "\\", "\n", "\t", "\x7f", "\u00a0"])
def test_what_systemd_would_split_or_expand_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], char: str
) -> None:
    bad = f"/srv/kv{char}x"
    server = {"snapshot_dir": f"{bad}/snaps", "base_url": "http://127.0.0.1:8080"}
    err = _refused(tmp_path, _config(tmp_path, servers={"local": server}), capsys)
    assert f"UNIT_SYNTAX: servers.local.snapshot_dir {f'{bad}/snaps'!r}" in err
    err = _refused(tmp_path, _config(tmp_path, state_dir=bad), capsys)
    assert f"UNIT_SYNTAX: state_dir {bad!r}" in err
    assert "UNIT_SYNTAX: --model" in _refused(tmp_path, _config(tmp_path), capsys, "--model", f"{bad}.gguf")
    assert "UNIT_SYNTAX: --group" in _refused(tmp_path, _config(tmp_path), capsys, "--group", f"g{char}x")


def test_next_steps_are_shell_quoted(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A path systemd takes as written may still mean something to a shell: every word is quoted."""
    server = {"snapshot_dir": "/srv/kv;touch&x/snaps", "base_url": "http://127.0.0.1:8080"}
    units = _install(tmp_path, _config(tmp_path, servers={"local": server}))
    out = capsys.readouterr().out
    assert "mkdir -p '/srv/kv;touch&x/snaps'; chown llama:llama '/srv/kv;touch&x/snaps'" in out
    assert_verifies(units)


def test_every_servers_snapshot_dir_is_writable(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    servers = {
        "a": {"snapshot_dir": "/var/lib/kvsidecar/snapshots", "base_url": "http://127.0.0.1:8080"},
        "b": {"snapshot_dir": "/srv/kv/snap-b", "base_url": "http://127.0.0.1:8081"},
        "c": {"snapshot_dir": "/var/lib/kvsidecar/snap-c", "base_url": "http://127.0.0.1:8082"},
    }
    units = _install(tmp_path, _config(tmp_path, servers=servers, routes={"a": "a"}))
    kv, llama = ((units / u).read_text() for u in UNITS)
    rw = "ReadWritePaths=/var/lib/kvsidecar/snapshots /srv/kv/snap-b /var/lib/kvsidecar/snap-c\n"
    assert rw in kv and "--port 8080 " in llama and "snap-b" not in llama
    out = capsys.readouterr().out
    assert "llama-server.service is an example for server a only" in out and "each of b, c" in out
    # no unit creates b's and c's directories: the steps do
    assert "mkdir -p /srv/kv/snap-b;" in out and "mkdir -p /var/lib/kvsidecar/snap-c;" in out
    assert_verifies(units)


def test_fleet_mode_makes_the_shared_metadata_directory_writable_and_checks_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    fleet = {"enabled": True, "host_id": "gpu-a", "shared_dir": "/srv/kv/meta"}
    servers = {"local": {"snapshot_dir": "/srv/kv/slots", "base_url": "http://127.0.0.1:8080"}}
    units = _install(tmp_path, _config(tmp_path, servers=servers, fleet=fleet))
    kv, llama = ((units / u).read_text() for u in UNITS)
    assert "ReadWritePaths=/srv/kv/slots /srv/kv/meta\n" in kv and "/srv/kv/meta" not in llama
    assert "mkdir -p /srv/kv/meta;" in capsys.readouterr().out
    assert_verifies(units)
    bad = {**fleet, "shared_dir": "/srv/kv me/meta"}
    (other := tmp_path / "bad").mkdir()
    err = _refused(other, _config(other, servers=servers, fleet=bad), capsys)
    assert "UNIT_SYNTAX: fleet.shared_dir '/srv/kv me/meta'" in err


@pytest.mark.parametrize(
    ("socket", "writable"),
    [
        ("/run/kvsidecar/api.sock", None),
        ("/srv/kv/run/api.sock", "/srv/kv/run"),
        ("/var/lib/kvsidecar/state/a.sock", None),
    ],
)
def test_unix_socket_directory_is_writable(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], socket: str, writable: str | None
) -> None:
    """ProtectSystem=strict: only /run/kvsidecar (RuntimeDirectory=) and the ReadWritePaths= are writable."""
    units = _install(tmp_path, _config(tmp_path, api={"unix_socket": socket}))
    kv = (units / "kvsidecar.service").read_text()
    line = re.search(r"^ReadWritePaths=(.*)$", kv, re.MULTILINE)
    assert line and line.group(1).split() == [
        "/var/lib/kvsidecar/snapshots",
        *([writable] if writable else []),
    ]
    if writable:
        assert f"mkdir -p {writable}; chown kvsidecar:llama {writable}; chmod 0750" in capsys.readouterr().out
    assert_verifies(units)


@pytest.mark.parametrize(
    ("socket", "reason"),
    [
        ("/run/kvsidecar.sock", "RUNTIME_DIR"),
        ("/var/run/kv/api.sock", "RUNTIME_DIR"),
        ("/srv/api.sock", "SYSTEM_DIR"),
        ("/etc/kvsidecar/api.sock", "SYSTEM_DIR"),
        ("/var/lib/api.sock", "SYSTEM_DIR"),
    ],
)
def test_unix_socket_where_it_cannot_be_created_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], socket: str, reason: str
) -> None:
    err = _refused(tmp_path, _config(tmp_path, api={"unix_socket": socket}), capsys)
    assert f"{reason}: api.unix_socket {socket}" in err


@pytest.mark.parametrize(
    ("state", "snaps"),
    [
        ("/var/lib/kvsidecar", "/var/lib/kvsidecar/snapshots"),
        ("/var/lib/kvsidecar/snapshots/state", "/var/lib/kvsidecar/snapshots"),
        ("/var/lib/kvsidecar/kv", "/var/lib/kvsidecar/kv"),
    ],
)
def test_nested_state_and_snapshot_directories_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], state: str, snaps: str
) -> None:
    server = {"snapshot_dir": snaps, "base_url": "http://127.0.0.1:8080"}
    err = _refused(tmp_path, _config(tmp_path, state_dir=state, servers={"local": server}), capsys)
    assert f"NESTED: state_dir {state} and servers.local.snapshot_dir {snaps}" in err


def test_next_steps_let_the_service_read_its_config_and_secrets(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`config init` as root writes root:root 0640: the service's own user could not read its config; its
    token is its alone (0600), llama-server's API key is shared with llama-server through the group."""
    (tmp_path / "token").write_text("t" * 32)
    (tmp_path / "key").write_text("k" * 32)
    server = {
        "snapshot_dir": "/var/lib/kvsidecar/snapshots",
        "base_url": "http://127.0.0.1:8080",
        "api_key_file": str(tmp_path / "key"),
    }
    config = _config(tmp_path, servers={"local": server}, api={"token_file": str(tmp_path / "token")})
    _install(tmp_path, config, "--force")
    out = capsys.readouterr().out
    assert f"chown root:llama {config}; chmod 0640 {config}" in out
    assert f"chown kvsidecar {tmp_path / 'token'}; chmod 0600 {tmp_path / 'token'}" in out
    assert f"chown root:llama {tmp_path / 'key'}; chmod 0640 {tmp_path / 'key'}" in out


def test_config_paths_are_checked_as_written_not_as_this_shell_expands_them(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The daemon expands '~' and '$VAR' itself, under systemd with another HOME and no shell variables:
    what the installer's environment makes of them is not what the daemon will use. Fatal, even --force."""
    monkeypatch.setenv("KVREVIEW", "/srv/review")
    monkeypatch.setenv("HOME", "/srv/home")
    err = _refused(tmp_path, _config(tmp_path, state_dir="$KVREVIEW/kv"), capsys)
    assert "UNIT_SYNTAX: state_dir '$KVREVIEW/kv'" in err and "/srv/review" not in err
    server = {"snapshot_dir": "~/snaps", "base_url": "http://127.0.0.1:8080"}
    err = _refused(tmp_path, _config(tmp_path, servers={"local": server}), capsys)
    assert "NOT_LITERAL: servers.local.snapshot_dir '~/snaps'" in err and "/srv/home" not in err
    unset = tmp_path / "defaults.yaml"  # no state_dir: the default, ~/.local/state/kvsidecar/state
    unset.write_text(yaml.safe_dump({"servers": {"local": {"snapshot_dir": "/var/lib/kvsidecar/snapshots"}}}))
    assert "NOT_LITERAL: state_dir '~/.local/state/kvsidecar/state'" in _refused(tmp_path, unset, capsys)


def test_a_config_path_that_is_not_a_file_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The unit passes it to the daemon, and the next steps chmod it 0640: a directory (or nothing) there
    would stop the daemon at start, and the chmod would lock the directory."""
    cfg = _config(tmp_path)
    for bad in (tmp_path, tmp_path / "missing.yaml"):
        err = _refused(tmp_path, cfg, capsys, "--config-path", str(bad))
        assert f"NOT_A_FILE: --config-path {bad}" in err and "chmod" not in err
    (tmp_path / "token.d").mkdir()
    err = _refused(tmp_path, _config(tmp_path, api={"token_file": str(tmp_path / "token.d")}), capsys)
    assert f"NOT_A_FILE: api.token_file {tmp_path / 'token.d'}" in err


def test_a_dest_that_is_a_file_is_a_clean_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = _config(tmp_path)
    afile = tmp_path / "afile"
    afile.write_text("keep")
    for dest in (afile, afile / "x"):
        code = main(
            ["-c", str(cfg), "install-systemd", "--dest", str(dest), "--force", "--config-path", str(cfg)]
        )
        err = capsys.readouterr().err
        assert code == 2 and "KV_UNIT_PATH_UNSAFE" in err and f"--dest {dest}: cannot create" in err, err
        assert "Traceback" not in err and afile.read_text() == "keep"


def test_units_are_replaced_atomically_and_never_written_through_a_link(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = _config(tmp_path)
    units = _install(tmp_path, cfg)
    old = (units / "kvsidecar.service").stat().st_ino
    _install(tmp_path, cfg)  # a second run renames a new file over the old one
    assert (units / "kvsidecar.service").stat().st_ino != old
    assert [p.name for p in units.iterdir() if p.name.startswith(".")] == []  # no temporary file left
    capsys.readouterr()
    (units / "kvsidecar.service").unlink()
    (units / "kvsidecar.service").symlink_to(os.devnull)  # what `systemctl mask` leaves
    before = (units / "llama-server.service").read_text()
    code, _ = _run(tmp_path, cfg)
    err = capsys.readouterr().err
    assert code == 2 and "KV_UNIT_PATH_UNSAFE" in err and "is masked" in err and "systemctl unmask" in err
    assert os.readlink(units / "kvsidecar.service") == os.devnull  # still masked, and said so
    assert (units / "llama-server.service").read_text() == before  # nothing written
    other = tmp_path / "elsewhere.service"
    other.write_text("theirs")
    (units / "llama-server.service").unlink()
    (units / "llama-server.service").symlink_to(other)
    (units / "kvsidecar.service").unlink()
    code, _ = _run(tmp_path, cfg)
    assert code == 2 and f"is a link to {other}" in capsys.readouterr().err
    assert other.read_text() == "theirs" and not (units / "kvsidecar.service").exists()


def _exec_stop(unit: str) -> str:
    (line,) = [x for x in unit.splitlines() if x.startswith("ExecStop=")]
    return line.removeprefix("ExecStop=")


def test_llama_servers_stop_saves_every_dirty_slot_first(tmp_path: Path) -> None:
    """`ExecStop=` runs `kvsidecar checkpoint --wait` for the unit's server before systemd sends SIGTERM:
    as root (`+`: it reads kvsidecar's config and token), its failure ignored (`-`: at shutdown kvsidecar
    stops first); its timeout is the shutdown checkpoint's, within TimeoutStopSec=."""
    config = _config(
        tmp_path,
        servers={
            "gpu": {"snapshot_dir": "/var/lib/kvsidecar/snapshots", "base_url": "http://127.0.0.1:8080"}
        },
        routes={"local": "gpu"},
        checkpoint={"shutdown_timeout_s": 90.5},
    )
    dest = _install(tmp_path, config)
    unit = (dest / "llama-server.service").read_text()
    command = _exec_stop(unit)
    assert command.startswith("-+")
    argv = command[2:].split()
    assert argv == [
        str(tmp_path / "bin" / "kvsidecar"),
        "-c",
        str(config),
        "checkpoint",
        "--server",
        "gpu",
        "--wait",
        "--timeout",
        "91",
    ]
    args = build_parser().parse_args(argv[1:])  # the command the unit runs is one this CLI takes
    assert (args.func, args.server, args.wait, args.timeout) == (cmd_checkpoint, "gpu", True, 91.0)
    assert "TimeoutStopSec=120" in unit.splitlines()
    assert "ExecStop=" not in (dest / "kvsidecar.service").read_text()  # its SIGTERM is its checkpoint
    assert_verifies(dest)
    shipped = _exec_stop((REPO / "systemd" / "llama-server.service").read_text())
    assert shipped.endswith("checkpoint --server local --wait --timeout 60")


def test_a_server_name_systemd_would_split_is_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    server = {"snapshot_dir": "/var/lib/kvsidecar/snapshots", "base_url": "http://127.0.0.1:8080"}
    err = _refused(
        tmp_path, _config(tmp_path, servers={"my gpu": server}, routes={"local": "my gpu"}), capsys
    )
    assert "UNIT_SYNTAX: servers (its ExecStop's --server) 'my gpu'" in err
