"""`kvsidecar status` against a live daemon and a real llama-server whose `--slot-save-path` is not the
server's `snapshot_dir` (issue 17): the server view carries the warning and the text says so instead of
"persistence healthy"; with the two the same, no warning and "healthy"."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from kvsidecar.testing.daemon import DaemonProcess
from tests.conftest import StartServer


def cli(config: Path, *args: str) -> str:
    r = subprocess.run(
        [sys.executable, "-m", "kvsidecar", "-c", str(config), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    return r.stdout


def test_status_names_a_snapshot_dir_llama_server_does_not_save_into(
    start_llama: StartServer, tmp_path: Path
) -> None:
    server = start_llama(slot_save_path=tmp_path / "llama-saves")
    for name, snapshot_dir, warned in [
        ("elsewhere", tmp_path / "kv-snapshots", True),
        ("same", tmp_path / "llama-saves", False),
    ]:
        daemon = DaemonProcess(tmp_path / name, base_url=server.base_url, snapshot_dir=snapshot_dir).start()
        try:
            cli(daemon.config_path, "wait-ready", "--timeout", "60")
            [view] = json.loads(cli(daemon.config_path, "status", "--json"))["servers"]
            text = cli(daemon.config_path, "status")
        finally:
            daemon.stop()
        if warned:
            [warning] = view["warnings"]
            assert warning["code"] == "KV_SAVE_PATH_MISMATCH"
            assert (
                str(tmp_path / "llama-saves") in warning["message"]
                and str(snapshot_dir) in warning["message"]
            )
            assert "persistence MISCONFIGURED (KV_SAVE_PATH_MISMATCH" in text and "healthy" not in text
            assert "fix: make servers.local.snapshot_dir and llama-server's --slot-save-path" in text
        else:
            assert view["warnings"] == [] and "persistence healthy" in text and "warning" not in text
