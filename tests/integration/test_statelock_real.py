"""Two real `kvsidecar serve` processes on one state directory, kill -9 of the holder, and SIGHUP on a
real daemon; each against a real llama-server."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvsidecar.daemon.statelock import LOCK_NAME, Holder, this_host
from kvsidecar.testing.daemon import DaemonProcess
from kvsidecar.testing.llama import LlamaServer, complete, words
from kvsidecar.testing.poll import eventually
from tests.conftest import StartServer


def daemon(work: Path, server: LlamaServer, **overrides: Any) -> DaemonProcess:
    assert server.slot_save_path is not None
    return DaemonProcess(work, base_url=server.base_url, snapshot_dir=server.slot_save_path, **overrides)


def turn(d: DaemonProcess, server: LlamaServer, session: str, n: int) -> str:
    lease = httpx.post(
        f"{d.url}/v1/sessions/{session}/acquire", json={"provider": "local", "model": "tiny"}, headers=d.auth
    ).json()
    t = complete(server.base_url, words(session, 600 * n), slot_id=lease["slot_id"])
    r = httpx.post(
        f"{d.url}/v1/leases/{lease['lease_id']}/release",
        headers=d.auth,
        json={"status": "ok", "prompt_tokens": t["prompt_n"], "cached_tokens": t["cache_n"]},
    )
    assert r.status_code == 200, r.text
    return str(lease["outcome"])


def test_second_daemon_refuses_naming_the_holder_and_a_killed_holder_is_taken_over(
    start_llama: StartServer, tmp_path: Path
) -> None:
    server = start_llama()
    first = daemon(tmp_path / "first", server).start()
    state = tmp_path / "first" / "state"
    assert first.proc is not None
    try:
        turn(first, server, "A", 1)
        turn(first, server, "B", 1)  # A is saved on the switch
        second = daemon(tmp_path / "second", server, state_dir=str(state))
        with pytest.raises(RuntimeError, match="KV_STATE_LOCKED"):
            second.start()
        assert second.proc is not None and second.proc.returncode == 2
        assert "is in use by kvsidecar" in second.log()
        assert f"(pid {first.proc.pid} on host {this_host()}, since " in second.log()
        assert turn(first, server, "A", 2) == "restored"  # the holder is untouched and still serving
        first.kill()  # kill -9: the lock file stays, its flock goes with the process
        assert Holder.model_validate_json((state / LOCK_NAME).read_bytes()).pid == first.proc.pid
        third = daemon(tmp_path / "third", server, state_dir=str(state)).start()
        try:
            assert third.proc is not None
            taken = [line for line in third.log().splitlines() if "kv.state.lock_taken_over" in line]
            assert len(taken) == 1 and f"holder_pid={first.proc.pid}" in taken[0]
            assert 'reason="holder gone"' in taken[0]
            assert Holder.model_validate_json((state / LOCK_NAME).read_bytes()).pid == third.proc.pid
            assert turn(third, server, "B", 2) == "restored"  # the state it took over is whole
        finally:
            assert third.stop() == 0
        assert not (state / LOCK_NAME).exists()  # released on a clean shutdown
    finally:
        first.stop()


def wait_for_line(d: DaemonProcess, needle: str, timeout_s: float = 30.0) -> str:
    def logged() -> str | None:
        found = next((line for line in d.log().splitlines() if needle in line), None)
        assert found is not None or d.alive, "the daemon exited"
        return found

    try:
        return eventually(logged, timeout_s=timeout_s, what=f"{needle!r} in the log")
    except AssertionError as exc:  # either way, the log says why
        raise AssertionError(f"{exc}; the log:\n{d.log()[-2000:]}") from None


def test_sighup_applies_live_keys_and_reports_restart_only_ones(
    start_llama: StartServer, tmp_path: Path
) -> None:
    """One edit changes the log format (live) and the API address (restart-only): the format applies at
    once, the daemon keeps listening where it was, and the reload names api.listen as needing a restart."""
    server = start_llama()
    d = daemon(tmp_path / "d", server).start()
    try:
        assert turn(d, server, "A", 1) == "cold"
        data = yaml.safe_load(d.config_path.read_text())
        data["logging"] = {"format": "json", "level": "info"}
        data["checkpoint"] = {"idle_s": 5}
        data["api"]["listen"] = "127.0.0.1:1"
        d.config_path.write_text(yaml.safe_dump(data))
        d.signal(signal.SIGHUP)
        line = json.loads(wait_for_line(d, '"event": "kv.config.reloaded"'))
        assert line["needs_restart"] == "api.listen" and line["level"] == "warning"
        assert {"checkpoint.idle_s", "logging.format"} <= set(line["changed"].split(","))
        assert turn(d, server, "A", 2) == "resident"  # same address, same daemon
    finally:
        assert d.stop() == 0
    lines = d.log().splitlines()
    after = lines[next(i for i, x in enumerate(lines) if '"kv.config.reloaded"' in x) + 1 :]
    events = [json.loads(x)["event"] for x in after if x.strip()]  # every later line is JSON
    assert "kv.state.unlocked" in events  # down to the last one, at shutdown
