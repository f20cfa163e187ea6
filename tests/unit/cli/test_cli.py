"""The kvsidecar command offline: config check, sessions and gc from the state directory, unit rendering,
output into a closed pipe, a taken port at serve, and the human text of show and status."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvsidecar import cli
from kvsidecar.backend.base import BackendCapabilities
from kvsidecar.cli import main, table
from kvsidecar.cli.text import persistence_state, render_sessions, render_status
from kvsidecar.client import KvSidecar
from kvsidecar.fingerprint.llama_process import ProcessInfo
from kvsidecar.store.naming import SnapshotIdentity
from kvsidecar.store.snapshots import SnapshotStore
from kvsidecar.testing.poll import until
from tests.unit.coordinator_helpers import start_harness
from tests.unit.http.test_openapi import Api
from tests.unit.store.test_snapshots import FP, server_writes
from tests.unit.test_readme import serve_daemon


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


def _install(tmp_path: Path, config: Path, *extra: str) -> tuple[int, Path]:
    dest = tmp_path / "units"
    code = main(["-c", str(config), "install-systemd", "--dest", str(dest), *extra])
    return code, dest


def test_install_systemd_refuses_paths_the_units_hide(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """Both units have PrivateTmp=yes (each its own /tmp) and ProtectHome=yes (no /home, /root)."""
    cfg = write_config(tmp_path)  # state and snapshot directories under pytest's /tmp
    system = ["--kvsidecar", "/usr/local/bin/kvsidecar", "--config-path", str(cfg)]  # it must exist
    code, dest = _install(tmp_path, cfg, *system, "--model", "/home/ann/models/m.gguf")
    assert code == 2 and not dest.exists()  # nothing written
    err = capsys.readouterr().err
    assert f"KV_UNIT_PATH_UNSAFE PRIVATE_TMP: state_dir {tmp_path / 'state'}" in err
    assert f"PRIVATE_TMP: servers.local.snapshot_dir {tmp_path / 'snaps'}" in err
    assert f"PRIVATE_TMP: --config-path {cfg}" in err
    assert "PROTECT_HOME: --model /home/ann/models/m.gguf" in err
    assert "kvsidecar: KV_UNIT_PATH_UNSAFE: 4 path(s)" in err and "Traceback" not in err
    code, dest = _install(tmp_path, cfg, "--kvsidecar", "/root/.local/bin/kvsidecar")
    assert code == 2 and "PROTECT_HOME: --kvsidecar /root/.local/bin/kvsidecar" in capsys.readouterr().err
    # --force writes them anyway, still warning
    code, dest = _install(tmp_path, cfg, *system, "--force")
    assert code == 0 and "PRIVATE_TMP" in capsys.readouterr().err
    unit = (dest / "kvsidecar.service").read_text()
    assert f"ReadWritePaths={tmp_path / 'state'} {tmp_path / 'snaps'}" in unit
    assert "TimeoutStopSec=90" in unit and "NoNewPrivileges=yes" in unit and "ProtectSystem=strict" in unit
    llama = (dest / "llama-server.service").read_text()
    assert f"--slot-save-path {tmp_path / 'snaps'}" in llama and "--swa-full" in llama


def test_install_systemd_for_a_system_layout_is_quiet(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "config.yaml"
    cfg.write_text(
        yaml.safe_dump(
            {
                "state_dir": "/var/lib/kvsidecar/state",
                "servers": {"local": {"snapshot_dir": "/var/lib/kvsidecar/snapshots"}},
            }
        )
    )
    # the config the unit names must exist: this one, under pytest's /tmp, is the only path warned about
    system = ["--kvsidecar", "/usr/local/bin/kvsidecar", "--config-path", str(cfg), "--force"]
    code, dest = _install(tmp_path, cfg, *system)
    captured = capsys.readouterr()
    assert code == 0 and captured.err.splitlines() == [
        f"kvsidecar: warning: KV_UNIT_PATH_UNSAFE PRIVATE_TMP: --config-path {cfg}: "
        "each unit has its own private /tmp, /var/tmp and /dev/shm (PrivateTmp=yes)"
    ]
    assert "StateDirectory=kvsidecar/state" in (dest / "kvsidecar.service").read_text()
    # systemd creates both directories (StateDirectory=): no mkdir/chown step is printed
    assert "mkdir" not in captured.out and "create users kvsidecar and llama" in captured.out


def test_table() -> None:
    assert table([[1, None, "x"]], ["a", "b", "c"]).splitlines() == ["a  b  c", "-  -  -", "1     x"]


def _kvsidecar(*args: str, stdout: int | None = subprocess.PIPE) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvsidecar", *args],
        stdout=stdout,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
    )


def test_output_into_a_closed_pipe_ends_quietly(tmp_path: Path) -> None:
    """`kvsidecar status | head -2`: the reader is gone before we write. No traceback, no "Exception
    ignored" at exit: the exit status a Unix tool killed by SIGPIPE has (141)."""
    populate(tmp_path, 3)
    cfg = str(write_config(tmp_path))
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader left: every write now fails with EPIPE
    try:
        result = _kvsidecar("-c", cfg, "sessions", "--offline", stdout=write_end)
    finally:
        os.close(write_end)
    assert result.stderr == "" and result.returncode == 141


def test_serve_on_a_taken_port_has_its_own_code(tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        cfg = write_config(tmp_path, api={"listen": f"127.0.0.1:{port}"})
        result = _kvsidecar("-c", str(cfg), "serve")
    assert result.returncode == 2, result.stderr
    assert f"KV_LISTEN_IN_USE: api.listen: 127.0.0.1:{port} is already in use" in result.stderr
    assert "KV_CONFIG_INVALID" not in result.stderr and "Traceback" not in result.stderr


SESSION = {
    "session": [
        {
            "session": "abcdef0123456789",
            "provider": "local",
            "model": "m",
            "server": "local",
            "state": "saved",
            "resident_slot": None,
            "dirty_revision": 3,
            "saved_revision": 3,
            "last_error": None,
            "snapshot": {
                "current": "b",
                "bytes": 4096,
                "updated_at": 1_700_000_000.0,
                "generations": {
                    "b": {"tokens": 48, "bytes": 2048, "invalid_reason": None, "saved_at": 1_700_000_000.0},
                    "a": {
                        "tokens": 40,
                        "bytes": 2048,
                        "invalid_reason": "CHECKSUM",
                        "saved_at": 1_699_000_000.0,
                    },
                },
            },
        }
    ]
}


def fake_daemon(monkeypatch: pytest.MonkeyPatch, answer: Callable[[httpx.Request], httpx.Response]) -> None:
    """The CLI's hook-API client (`kvsidecar.client.KvSidecar`, built as the CLI builds it) answered by
    `answer` instead of a daemon."""
    real = KvSidecar

    def client(base_url: str, **kwargs: Any) -> KvSidecar:
        return real(base_url, **{**kwargs, "uds": None, "transport": httpx.MockTransport(answer)})

    monkeypatch.setattr(cli, "KvSidecar", client)


def test_show_prints_text_and_json_only_with_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_daemon(monkeypatch, lambda _request: httpx.Response(200, json=SESSION))
    cfg = str(write_config(tmp_path))
    assert main(["-c", cfg, "show", "abcdef0123456789"]) == 0
    out = capsys.readouterr().out
    with pytest.raises(json.JSONDecodeError):
        json.loads(out)
    assert "session abcdef0123456789 (local/m) on local: saved" in out
    assert "b *" in out and "CHECKSUM" in out and "generation" in out
    assert main(["-c", cfg, "show", "abcdef0123456789", "--json"]) == 0
    assert json.loads(capsys.readouterr().out) == SESSION


def test_the_commands_send_the_hook_api_calls_of_the_client(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Every live command goes through `kvsidecar.client`: its paths (a session id is one encoded path
    segment), its bodies, the token of api.token_file."""
    token = tmp_path / "token"
    token.write_text("t" * 32)
    cfg = str(write_config(tmp_path, api={"listen": "127.0.0.1:9", "token_file": str(token)}))
    sent: list[tuple[str, str, Any, str | None]] = []

    def answer(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None  # httpx's spacing varies by version
        sent.append(
            (request.method, request.url.raw_path.decode(), body, request.headers.get("authorization"))
        )
        if request.url.path == "/v1/sessions":
            return httpx.Response(200, json={"sessions": []})
        if request.url.path == "/v1/doctor":
            return httpx.Response(200, json={"result": "DEGRADED", "servers": []})
        if request.url.path == "/v1/gc":
            return httpx.Response(200, json={"dry_run": True, "deletions": []})
        return httpx.Response(200, json={"ok": True})

    fake_daemon(monkeypatch, answer)
    for argv in (
        ["show", "a/b", "--json"],
        ["save", "s1"],
        ["invalidate", "s1"],
        ["purge", "s1"],
        ["restore", "s1", "--provider", "p", "--model", "m"],
        ["sessions", "--json"],
        ["gc", "--dry-run", "--json"],
        ["doctor", "--deep", "--json"],
        ["wait-ready", "--timeout", "5"],
    ):
        expected = 4 if argv[0] == "doctor" else 0  # DEGRADED
        assert main(["-c", cfg, *argv]) == expected, argv
    capsys.readouterr()
    assert [(m, p, b) for m, p, b, _ in sent] == [
        ("GET", "/v1/sessions/a%2Fb", None),
        ("POST", "/v1/sessions/s1/save", None),
        ("POST", "/v1/sessions/s1/invalidate", None),
        ("DELETE", "/v1/sessions/s1", None),
        ("POST", "/v1/sessions/s1/restore", {"provider": "p", "model": "m"}),
        ("GET", "/v1/sessions", None),
        ("POST", "/v1/gc?dry_run=true", None),
        ("GET", "/v1/doctor?deep=true", None),
        ("GET", "/healthz", None),
    ]
    assert {auth for *_, auth in sent} == {"Bearer " + "t" * 32}


@pytest.mark.parametrize(
    ("answer", "shown"),
    [
        (
            httpx.Response(404, json={"error": {"code": "KV_NOT_FOUND", "message": "no such session"}}),
            "kvsidecar: KV_NOT_FOUND: no such session",
        ),
        (httpx.Response(502, text="bad gateway"), "kvsidecar: 502: bad gateway"),  # not the daemon's answer
    ],
    ids=["the daemon's error", "another server's"],
)
def test_an_error_answer_is_shown_with_its_code_and_fails(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    answer: httpx.Response,
    shown: str,
) -> None:
    fake_daemon(monkeypatch, lambda _request: answer)
    assert main(["-c", str(write_config(tmp_path)), "show", "s1"]) == 1
    assert capsys.readouterr().err.strip() == shown


async def test_status_headline_follows_the_real_state(tmp_path: Path) -> None:
    """Not "persistence healthy" while the server is down or runs without --slots."""
    h = await start_harness(tmp_path)
    try:
        srv = h.coordinator.servers["local"]
        assert "up, persistence healthy" in render_status(h.coordinator.status())
        assert h.coordinator.status()["servers"][0]["persistence_now"] == {"state": "healthy", "reason": None}
        h.fake.knobs.unavailable = True
        await srv.refresh()
        down: dict[str, Any] = h.coordinator.status()
        text = render_status(down)
        assert "DOWN, persistence UNAVAILABLE (server down: fake backend is unavailable)" in text
        assert "healthy" not in text
        # the API says it too (the breaker's own state, `persistence`, is still "healthy")
        assert down["servers"][0]["persistence_now"] == {"state": "unavailable", "reason": "SERVER_DOWN"}
        h.fake.knobs.unavailable = False
        caps = await h.fake.probe()
        no_slots = dataclasses.replace(caps, slots_endpoint=False)

        async def probe() -> BackendCapabilities:
            return no_slots

        h.fake.probe = probe  # type: ignore[method-assign]  # llama-server started without --slots
        await srv.refresh()
        status: dict[str, Any] = h.coordinator.status()
        assert status["servers"][0]["slots_endpoint"] is False
        assert status["servers"][0]["persistence_now"] == {
            "state": "unavailable",
            "reason": "NO_SLOTS_ENDPOINT",
        }
        text = render_status(status)
        assert "up, persistence UNAVAILABLE (llama-server runs without --slots)" in text
        assert "healthy" not in text
    finally:
        await h.coordinator.aclose()


def test_status_text_reads_an_older_daemon_without_persistence_now() -> None:
    """An upgrade before the daemon restarts: its status has no `persistence_now`. The headline is derived
    from the fields it does send (no KeyError)."""

    def server(**fields: Any) -> dict[str, Any]:
        base: dict[str, Any] = {
            "name": "local",
            "endpoint": "http://127.0.0.1:8080",
            "available": True,
            "mode": "auto",
        }
        return {**base, "slots_endpoint": True, "persistence": "healthy", "slots": [], **fields}

    cases: list[tuple[dict[str, Any], str]] = [
        ({}, "up, persistence healthy"),
        (
            {"available": False, "last_error": "refused"},
            "DOWN, persistence UNAVAILABLE (server down: refused)",
        ),
        ({"slots_endpoint": False}, "persistence UNAVAILABLE (llama-server runs without --slots)"),
        ({"persistence": "open"}, "persistence OPEN (circuit breaker)"),
    ]
    snapshots = {"known": 0, "valid": 0, "invalid": 0, "bytes": 0}
    stats = dict.fromkeys(
        ["acquires", "resident", "restore_hits", "restores", "cold_starts", "cold_fallbacks", "saves"], 0
    )
    stats |= {"save_failures": 0, "restore_ineffective": 0}
    for fields, headline in cases:
        status = {"servers": [server(**fields)], "snapshots": snapshots, "leases": 0, "stats": stats}
        assert headline in render_status(status)
    assert persistence_state(server(), enabled=False) == "persistence OFF (enabled: false)"


async def test_status_shows_a_snapshot_dir_llama_server_does_not_save_into(tmp_path: Path) -> None:
    """`status` (API and text) warns when llama-server's --slot-save-path is not the server's snapshot_dir,
    and its headline does not say "healthy" then; the same directory, or no process to read, is no warning."""
    h = await start_harness(tmp_path)
    try:
        srv = h.coordinator.servers["local"]
        assert h.coordinator.status()["servers"][0]["warnings"] == []  # no local process found: not judged
        elsewhere = tmp_path / "elsewhere"

        async def llama_saving_into(path: Path, pid: int) -> str:
            flags = {"slot_save_path": str(path)}
            h.process[0] = ProcessInfo(
                pid=pid, create_time=float(pid), exe=None, cmdline=("llama-server",), flags=flags, cwd="/"
            )
            await srv.refresh()
            return render_status(h.coordinator.status())

        text = await llama_saving_into(elsewhere, 1)
        [warning] = h.coordinator.status()["servers"][0]["warnings"]
        assert warning["code"] == "KV_SAVE_PATH_MISMATCH" and warning["server"] == "local"
        assert "up, persistence MISCONFIGURED (KV_SAVE_PATH_MISMATCH" in text and "healthy" not in text
        assert f"warning KV_SAVE_PATH_MISMATCH: llama-server (pid 1) saves into {elsewhere}" in text
        assert "fix: make servers.local.snapshot_dir and llama-server's --slot-save-path" in text
        api = Api(h)  # GET /v1/status with the warning matches the OpenAPI document (no undeclared key)
        [route] = [r for r in api.routes if r.path == "/v1/status"]
        async with api.client() as c:
            answer = await c.get("/v1/status")
        assert answer.json()["servers"][0]["warnings"] == [warning]
        api.check(route, answer)
        text = await llama_saving_into(tmp_path / "snaps", 2)
        assert h.coordinator.status()["servers"][0]["warnings"] == []
        assert "up, persistence healthy" in text and "warning" not in text
    finally:
        await h.coordinator.aclose()


async def test_sessions_shows_the_client_signal_visible_id_reuse_and_last_outcome(tmp_path: Path) -> None:
    """`kvsidecar sessions`: one place to watch a real client (which prints its id, never X-KV-* headers)."""
    h = await start_harness(tmp_path)
    try:
        sid = "e78d36c2-3f10-4cac-a0e9-67dcc9470789"  # a Claude Code session id
        for _ in range(2):
            result = await h.coordinator.acquire(
                sid,
                provider="local",
                model="m",
                signal="header:x-claude-code-session-id",
                client="claude-code",
            )
            assert result.slot_id is not None and result.lease_id is not None
            prompt_n, cache_n = h.fake.infer(result.slot_id, list(range(100 * (h.turns.get(sid, 0) + 1))))
            h.turns[sid] = h.turns.get(sid, 0) + 1
            await h.coordinator.release(
                result.lease_id, status="ok", prompt_tokens=prompt_n, cached_tokens=cache_n
            )
        text = render_sessions(h.coordinator.session_views())
    finally:
        await h.coordinator.aclose()
    head, _, row = text.splitlines()
    assert head.split()[:9] == [
        "id",
        "session",
        "client",
        "signal",
        "model",
        "state",
        "slot",
        "last",
        "reuse",
    ]
    assert row.split()[:9] == [
        "e78d36c2…0789",
        SnapshotIdentity(server="local", provider="local", model="m", session_id=sid).short,
        "claude-code",
        "header:x-claude-code-session-id",
        "m",
        "active_dirty",
        "0",
        "resident",
        "0/100",
    ]
    assert "100/200" in row and sid not in text


async def test_checkpoint_command_over_the_hook_api(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`kvsidecar checkpoint [--server] [--wait] [--timeout]` against the daemon serving on a loopback port
    (the fake backend): exit 0 once committed; 1 naming what a save failed or did not finish in time; 3
    with no daemon; 2 for a bad --timeout."""
    (tmp_path / "d").mkdir()
    async with serve_daemon(tmp_path / "d") as served:
        token = tmp_path / "d" / "token"
        cfg = str(
            write_config(
                tmp_path, api={"listen": served.url.removeprefix("http://"), "token_file": str(token)}
            )
        )
        coordinator = served.daemon.coordinator

        async def run(*argv: str) -> tuple[int, str, str]:
            code = await asyncio.to_thread(main, ["-c", cfg, "checkpoint", *argv])
            out = capsys.readouterr()
            return code, out.out, out.err

        async def dirty_turn() -> str:
            lease = await coordinator.acquire("S", provider="local", model="m")
            assert lease.slot_id is not None and lease.lease_id is not None
            n = len(served.fake.slots[lease.slot_id].tokens) + 50
            prompt_n, cache_n = served.fake.infer(lease.slot_id, list(range(n)))
            await coordinator.release(
                lease.lease_id, status="ok", prompt_tokens=prompt_n, cached_tokens=cache_n
            )
            return str(coordinator.session_views()[0]["session"])

        short = await dirty_turn()
        assert await run("--wait") == (0, "saved 1 dirty session(s) of local: nothing unsaved\n", "")
        assert coordinator.session_views()[0]["unsaved_turns"] == 0
        await dirty_turn()
        served.fake.fail_next_save()
        code, _, err = await run("--wait", "--server", "local")
        assert code == 1 and err.startswith(
            f"kvsidecar: KV_SAVE_FAILED: 1 of 1 dirty session(s) not saved: {short}"
        )
        hold = served.fake.hold("save")
        code, _, err = await run("--wait", "--timeout", "0.3")
        assert code == 1 and "KV_OPERATION_TIMEOUT" in err
        hold.release()
        await until(
            lambda: coordinator.session_views()[0]["unsaved_turns"] == 0, what="the save left running"
        )
        code, out, _ = await run("--json", "--server", "local")
        assert code == 0 and json.loads(out) == {
            "servers": ["local"],
            "dirty": 0,
            "waited": False,
            "saved": None,
        }
        code, _, err = await run("--server", "elsewhere")
        assert code == 1 and "KV_NOT_FOUND: no such server: 'elsewhere'" in err
    assert (await run("--wait"))[0] == 3  # the daemon is gone
    with pytest.raises(SystemExit) as usage:
        main(["-c", cfg, "checkpoint", "--timeout", "0"])
    assert usage.value.code == 2
