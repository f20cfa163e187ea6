"""The CLI against a live daemon process, and doctor against real llama-server set-ups, good and bad."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvsidecar.testing.arch_models import GEMMA3_SWA, generate_arch_model
from kvsidecar.testing.daemon import DaemonProcess
from kvsidecar.testing.llama import LlamaServer, complete, free_port, vocab_dir, words
from tests.conftest import StartServer

TOKEN = "cli-token-0123456789abcdef"


def write_config(
    tmp_path: Path,
    server: LlamaServer | None,
    *,
    snapshot_dir: Path | None = None,
    base_url: str | None = None,
    api_key_file: Path | None = None,
) -> Path:
    (tmp_path / "token").write_text(TOKEN)
    local: dict[str, Any] = {
        "base_url": base_url or (server.base_url if server else "http://127.0.0.1:9"),
        "snapshot_dir": str(snapshot_dir or (server.slot_save_path if server else tmp_path)),
    }
    if api_key_file is not None:
        local["api_key_file"] = str(api_key_file)
    cfg = {
        "state_dir": str(tmp_path / "state"),
        "servers": {"local": local},
        "api": {"listen": f"127.0.0.1:{free_port()}", "token_file": str(tmp_path / "token")},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def cli(config: Path, *args: str) -> tuple[int, str, str]:
    r = subprocess.run(
        [sys.executable, "-m", "kvsidecar", "-c", str(config), *args],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return r.returncode, r.stdout, r.stderr


@pytest.fixture
def daemon(start_llama: StartServer, tmp_path: Path) -> Iterator[tuple[Path, LlamaServer]]:
    server = start_llama()
    assert server.slot_save_path is not None
    proc = DaemonProcess(
        tmp_path / "d", base_url=server.base_url, snapshot_dir=server.slot_save_path, token=TOKEN
    )
    proc.start()
    try:
        assert cli(proc.config_path, "wait-ready", "--timeout", "30")[0] == 0
        yield proc.config_path, server
    finally:
        proc.stop()


def harness_turn(config: Path, server: LlamaServer, session: str, n: int) -> dict[str, Any]:
    port = yaml.safe_load(config.read_text())["api"]["listen"]
    h = {"Authorization": f"Bearer {TOKEN}"}
    lease = httpx.post(
        f"http://{port}/v1/sessions/{session}/acquire", json={"provider": "local", "model": "tiny"}, headers=h
    ).json()
    t = complete(server.base_url, words(session, 500 * n), slot_id=lease["slot_id"])
    httpx.post(
        f"http://{port}/v1/leases/{lease['lease_id']}/release",
        headers=h,
        json={"status": "ok", "prompt_tokens": t["prompt_n"], "cached_tokens": t["cache_n"]},
    )
    return dict(lease)


def test_cli_against_a_live_daemon(daemon: tuple[Path, LlamaServer]) -> None:
    config, server = daemon
    harness_turn(config, server, "sess-A", 1)
    harness_turn(config, server, "sess-B", 1)
    code, out, _ = cli(config, "status")
    assert code == 0 and "server local" in out and "restores" in out
    code, out, _ = cli(config, "sessions", "--json")
    views = json.loads(out)
    states = sorted(v["state"] for v in views)
    # B is resident: dirty, being cleaned ahead in the background (cost-aware policy), or already clean
    assert code == 0 and len(views) == 2 and "saved" in states
    assert set(states) - {"saved"} <= {"active_dirty", "saving", "active_clean"}
    code, out, _ = cli(config, "show", "sess-A", "--json")
    assert code == 0 and json.loads(out)["session"][0]["session"] == "sess-A"
    assert cli(config, "save", "sess-B")[0] == 0
    code, out, _ = cli(config, "restore", "sess-A", "--provider", "local", "--model", "tiny", "--json")
    assert code == 0 and json.loads(out)["outcome"] == "restored"
    assert cli(config, "invalidate", "sess-B")[0] == 0
    code, out, _ = cli(config, "gc", "--dry-run")
    assert code == 0 and "invalid" in out and "dry run" in out
    code, out, _ = cli(config, "gc", "--json")
    assert code == 0 and [d["reason"] for d in json.loads(out)["deletions"]] == ["invalid"]
    assert cli(config, "purge", "sess-A")[0] == 0
    code, _, err = cli(config, "purge", "sess-A")
    assert code == 1 and "KV_NOT_FOUND" in err
    code, out, _ = cli(config, "doctor", "--json")
    assert code == 0 and json.loads(out)["result"] == "READY"


def test_doctor_good_setup_with_deep_round_trip(start_llama: StartServer, tmp_path: Path) -> None:
    server = start_llama()
    code, out, _ = cli(write_config(tmp_path, server), "doctor", "--deep", "--offline")
    assert code == 0, out
    assert "Result: READY" in out and "OK    restore compatibility (deep): supported" in out, out
    assert "a probe save appeared" in out
    assert not list(server.save_dir.iterdir())  # probes cleaned up


def test_doctor_deep_round_trip_with_llama_servers_api_key(start_llama: StartServer, tmp_path: Path) -> None:
    """Issue 14: the deep check posted /completion itself, without the key: 401, "round trip failed"."""
    key = tmp_path / "llama.key"
    key.write_text("llama-secret-0123456789\n")  # the same file llama-server reads
    server = start_llama(extra_args=("--cache-ram", "0", "--api-key-file", str(key)))
    config = write_config(tmp_path, server, api_key_file=key)
    code, out, _ = cli(config, "doctor", "--deep", "--offline")
    assert code == 0 and "OK    restore compatibility (deep)" in out and "Result: READY" in out, out
    daemon = DaemonProcess(
        tmp_path / "d",
        base_url=server.base_url,
        snapshot_dir=server.save_dir,
        token=TOKEN,
        servers={"local": {"api_key_file": str(key)}},
    ).start()
    try:
        code, out, _ = cli(daemon.config_path, "doctor", "--deep")  # through the daemon's /v1/doctor
        assert code == 0 and "OK    restore compatibility (deep)" in out, out
    finally:
        daemon.stop()
    assert not list(server.save_dir.iterdir())


def test_doctor_wrong_save_path(start_llama: StartServer, tmp_path: Path) -> None:
    server = start_llama()
    other = tmp_path / "elsewhere"
    other.mkdir()
    code, out, _ = cli(write_config(tmp_path, server, snapshot_dir=other), "doctor", "--offline")
    assert code == 1 and "Result: NOT READY" in out
    assert "FAIL  --slot-save-path" in out and "fix:" in out


def test_doctor_server_down(tmp_path: Path) -> None:
    code, out, _ = cli(
        write_config(tmp_path, None, base_url=f"http://127.0.0.1:{free_port()}"), "doctor", "--offline"
    )
    assert code == 1 and "FAIL  server reachable" in out


@pytest.mark.parametrize("swa_full", [False, True])
def test_doctor_on_a_sliding_window_model_needs_swa_full(
    start_llama: StartServer, llama_bin: Path, tmp_path: Path, swa_full: bool
) -> None:
    """The generated gemma3-swa (window 128); Gemma 3 270M itself: tests/integration/test_doctor_classes_real.py."""
    model = generate_arch_model(GEMMA3_SWA, vocab_dir=vocab_dir(llama_bin))
    extra = ("--cache-ram", "0", "--swa-full") if swa_full else ("--cache-ram", "0")
    server = start_llama(model=model, ctx_size=2048, extra_args=extra)
    code, out, _ = cli(write_config(tmp_path, server), "doctor", "--deep", "--offline")
    if swa_full:
        assert code == 0 and "OK    model memory" in out and "Result: READY" in out, out
        assert "OK    restore compatibility (deep): supported" in out
    else:
        assert code == 4 and "Result: DEGRADED" in out, out
        assert "WARN  model memory" in out and "add --swa-full" in out
        assert "WARN  restore compatibility (deep): broken" in out  # and the check proves it: nothing reused
    assert not list(server.save_dir.iterdir())


def test_sighup_reloads_instead_of_killing_the_daemon(
    daemon: tuple[Path, LlamaServer], tmp_path: Path
) -> None:
    config, _ = daemon
    data = yaml.safe_load(config.read_text())
    data["checkpoint"] = {"idle_s": 5}
    config.write_text(yaml.safe_dump(data))
    pid = next(p for p in _children() if "serve" in p[1])[0]
    os.kill(pid, 1)  # SIGHUP
    assert cli(config, "wait-ready", "--timeout", "10")[0] == 0  # still serving


def _children() -> list[tuple[int, str]]:
    import psutil

    return [(c.pid, " ".join(c.cmdline())) for c in psutil.Process().children()]
