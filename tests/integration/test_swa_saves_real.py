"""Through the daemon on a real llama-server running a sliding-window model: without --swa-full no restore is
ever reused, so two sessions taking turns on one slot make no save at all; the class, the reason and the
fix with its memory figure are in status; with --swa-full (the control) the same turns are saved."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsidecar.testing.arch_models import GEMMA3_SWA, generate_arch_model
from kvsidecar.testing.daemon import DaemonProcess
from kvsidecar.testing.llama import LlamaServer, complete, vocab_dir, words
from kvsidecar.testing.poll import eventually
from tests.conftest import StartServer

SESSION_FILE = re.compile(r"^(?!kvsidecar-canary\.)(?!kvsidecar-doctor-).+\.bin$")


def turn(daemon: DaemonProcess, server: LlamaServer, session: str, n: int) -> None:
    """acquire, the prompt on the leased slot, release (the hook API's turn)."""
    lease = httpx.post(
        f"{daemon.url}/v1/sessions/{session}/acquire",
        json={"provider": "local", "model": "gemma3-swa"},
        headers=daemon.auth,
        timeout=60,
    ).json()
    t = complete(server.base_url, words(session, 150 * n), slot_id=lease["slot_id"])
    r = httpx.post(
        f"{daemon.url}/v1/leases/{lease['lease_id']}/release",
        headers=daemon.auth,
        json={"status": "ok", "prompt_tokens": t["prompt_n"], "cached_tokens": t["cache_n"]},
        timeout=60,
    )
    assert r.status_code == 200, r.text


def memory(daemon: DaemonProcess) -> dict[str, Any] | None:
    status = httpx.get(f"{daemon.url}/v1/status", headers=daemon.auth, timeout=10).json()
    found: dict[str, Any] | None = status["servers"][0].get("memory")
    return found


def session_files(server: LlamaServer) -> list[str]:
    assert server.slot_save_path is not None
    return [p.name for p in server.slot_save_path.iterdir() if SESSION_FILE.match(p.name)]


@pytest.mark.parametrize("swa_full", [False, True], ids=["no-swa-full", "swa-full"])
def test_two_sessions_on_one_slot(
    start_llama: StartServer, llama_bin: Path, tmp_path: Path, swa_full: bool
) -> None:
    model = generate_arch_model(GEMMA3_SWA, vocab_dir=vocab_dir(llama_bin))
    extra = ("--cache-ram", "0", "--swa-full") if swa_full else ("--cache-ram", "0")
    server = start_llama(model=model, ctx_size=2048, extra_args=extra)
    assert server.slot_save_path is not None
    daemon = DaemonProcess(
        tmp_path / "d",
        base_url=server.base_url,
        snapshot_dir=server.slot_save_path,
        checkpoint={"policy": "save-before-evict", "idle_s": 3600},
    ).start()
    try:
        m = eventually(lambda: memory(daemon), what="the server's memory class in status")
        assert m["class"] == "swa" and m["n_swa"] == 128 and m["swa_full"] is swa_full
        for n in (1, 2):
            turn(daemon, server, "sess-A", n)
            turn(daemon, server, "sess-B", n)  # evicts A: its save on the switch, or none
        metrics = httpx.get(f"{daemon.url}/metrics", headers=daemon.auth, timeout=10).text
        skipped = re.search(
            r'kvsidecar_save_skipped_total\{reason="swa_window_not_saved",server="local"\} (\S+)', metrics
        )
        if swa_full:
            assert m["saves"] == "on" and m["reason"] is None
            eventually(lambda: session_files(server), what="the switches' saves of A and B")
            assert skipped is None or float(skipped[1]) == 0
        else:
            assert m["saves"] == "off" and m["reason"] == "swa_window_not_saved"
            assert (
                m["fix"] == "add --swa-full to llama-server" and "--swa-full takes the SWA cache" in m["cost"]
            )
            assert not session_files(server)  # nothing a restore could use is written
            assert skipped is not None and float(skipped[1]) >= 3  # A, B, A evicted unsaved
            out = subprocess.run(
                [sys.executable, "-m", "kvsidecar", "-c", str(daemon.config_path), "status"],
                capture_output=True,
                text=True,
                timeout=60,
            ).stdout
            assert "saves off (swa_window_not_saved)" in out and "fix: add --swa-full" in out, out
    finally:
        daemon.stop()
