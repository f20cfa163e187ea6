"""The kvsidecar command offline: config check, sessions and gc from the state directory, unit rendering."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from kvsidecar.cli import main, table
from kvsidecar.store.naming import SnapshotIdentity
from kvsidecar.store.snapshots import SnapshotStore
from kvsidecar.units import UNITS, UnitParams, render
from tests.unit.test_store import FP, server_writes

REPO = Path(__file__).resolve().parents[2]


def write_config(tmp_path: Path, **extra: object) -> Path:
    cfg = {
        "state_dir": str(tmp_path / "state"),
        "servers": {"local": {"snapshot_dir": str(tmp_path / "snaps"), "base_url": "http://127.0.0.1:9"}},
        "api": {"listen": "127.0.0.1:9"},
        **extra,
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def populate(tmp_path: Path, n: int) -> None:
    store = SnapshotStore(state_dir=tmp_path / "state", snapshot_dirs={"local": tmp_path / "snaps"})
    store.open()
    for i in range(n):
        plan = store.begin_save(
            SnapshotIdentity(server="local", provider="local", model="m", session_id=f"s{i}")
        )
        store.commit_save(plan, server_writes(plan, 10 + i), fingerprint=FP, revision=1)


def test_config_check(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-c", str(write_config(tmp_path)), "config", "check"]) == 0
    assert "config OK" in capsys.readouterr().out
    bad = tmp_path / "bad.yaml"
    bad.write_text("checkpoint:\n  idle_s: soon\n")
    assert main(["-c", str(bad), "config", "check"]) == 2
    err = capsys.readouterr().err
    assert "checkpoint.idle_s" in err and "Traceback" not in err


def test_sessions_offline_and_fallback_when_daemon_is_down(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    populate(tmp_path, 3)
    cfg = str(write_config(tmp_path))
    assert main(["-c", cfg, "sessions", "--offline", "--json"]) == 0
    views = json.loads(capsys.readouterr().out)
    assert len(views) == 3 and all(v["state"] == "saved" for v in views)
    assert all(v["session"] not in {"s0", "s1", "s2"} for v in views)  # abbreviated ids
    assert main(["-c", cfg, "sessions"]) == 0  # daemon unreachable: falls back to the state directory
    captured = capsys.readouterr()
    assert "not reachable" in captured.err and "session" in captured.out.splitlines()[0]


def test_live_commands_report_an_unreachable_daemon(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = str(write_config(tmp_path))
    assert main(["-c", cfg, "status"]) == 3
    assert "not reachable" in capsys.readouterr().err


def test_gc_offline_is_a_dry_run(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    populate(tmp_path, 3)
    cfg = str(
        write_config(tmp_path, retention={"max_sessions": 1, "low_watermark": 1.0, "max_age_days": None})
    )
    assert main(["-c", cfg, "gc", "--offline", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert out.count("lru") == 2 and "dry run: nothing deleted" in out
    assert len(list((tmp_path / "snaps").iterdir())) == 3


def test_shipped_units_are_the_default_rendering() -> None:
    for name in UNITS:
        assert (REPO / "systemd" / name).read_text() == render(name, UnitParams()), (
            f"regenerate systemd/{name}"
        )


def test_install_systemd_renders_and_verifies(tmp_path: Path) -> None:
    fake_bin = tmp_path / "bin"
    fake_bin.mkdir()
    for exe in ("kvsidecar", "llama-server"):
        (fake_bin / exe).write_text("#!/bin/sh\n")
        (fake_bin / exe).chmod(0o755)
    cfg = write_config(tmp_path)
    code = main(
        [
            "-c",
            str(cfg),
            "install-systemd",
            "--dest",
            str(tmp_path / "units"),
            "--user",
            "root",
            "--llama-user",
            "root",
            "--group",
            "root",
            "--kvsidecar",
            str(fake_bin / "kvsidecar"),
            "--llama-server",
            str(fake_bin / "llama-server"),
            "--model",
            str(cfg),
        ]
    )
    assert code == 0
    unit = (tmp_path / "units" / "kvsidecar.service").read_text()
    assert f"ReadWritePaths={tmp_path / 'state'} {tmp_path / 'snaps'}" in unit
    assert "TimeoutStopSec=90" in unit and "NoNewPrivileges=yes" in unit and "ProtectSystem=strict" in unit
    llama = (tmp_path / "units" / "llama-server.service").read_text()
    assert f"--slot-save-path {tmp_path / 'snaps'}" in llama and "--swa-full" in llama
    if shutil.which("systemd-analyze") is None:
        pytest.skip("systemd-analyze is not installed here")
    result = subprocess.run(
        ["systemd-analyze", "verify", "--man=no", *(str(tmp_path / "units" / u) for u in UNITS)],
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, result.stderr


def test_table() -> None:
    assert table([[1, None, "x"]], ["a", "b", "c"]).splitlines() == ["a  b  c", "-  -  -", "1     x"]
