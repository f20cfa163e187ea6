"""The whole daemon (uvicorn, hook API, client) on a real llama-server, over real loopback HTTP."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx

from kvsidecar.client import KvSidecarClient
from kvsidecar.config import config_from_mapping
from kvsidecar.daemon.service import build_server
from kvsidecar.testing.daemon import DaemonProcess
from kvsidecar.testing.llama import LlamaServer, complete, free_port, words
from kvsidecar.testing.poll import until
from tests.conftest import StartServer

TOKEN = "integration-token-0123456789"


def started(uv: Any, task: asyncio.Future[Any]) -> bool:
    """The listener serves; a server that ended before that fails the wait with its exception."""
    assert not task.done(), task.exception()
    return bool(uv.started)


def daemon_config(server: LlamaServer, tmp_path: Path, port: int) -> dict[str, Any]:
    (tmp_path / "token").write_text(TOKEN)
    return {
        "state_dir": str(tmp_path / "state"),
        "servers": {"local": {"base_url": server.base_url, "snapshot_dir": str(server.save_dir)}},
        "routes": {"local": "local"},
        "api": {
            "listen": f"127.0.0.1:{port}",
            "token_file": str(tmp_path / "token"),
            "unix_socket": str(tmp_path / "api.sock"),
        },
    }


@asynccontextmanager
async def running_daemon(server: LlamaServer, tmp_path: Path) -> AsyncIterator[str]:
    port = free_port()
    uv, socks, _ = build_server(config_from_mapping(daemon_config(server, tmp_path, port)))
    task = asyncio.ensure_future(uv.serve(sockets=socks))
    try:
        await until(lambda: started(uv, task), timeout_s=60, what="uvicorn to serve")
        yield f"http://127.0.0.1:{port}"
    finally:
        uv.should_exit = True
        await asyncio.wait_for(task, 60)
        for s in socks:
            s.close()


async def harness_turn(kv: KvSidecarClient, session: str, n: int, llama: str) -> tuple[str, int, int]:
    async with kv.acquire(session, provider="local", model="tiny") as lease:
        t = await asyncio.to_thread(complete, llama, words(session, 600 * n), slot_id=lease.slot_id)
        lease.report(prompt_tokens=t["prompt_n"], cached_tokens=t["cache_n"])
    return lease.outcome, t["prompt_n"], t["cache_n"]


async def test_hooks_over_http_and_unix_socket(start_llama: StartServer, tmp_path: Path) -> None:
    server = start_llama()
    async with running_daemon(server, tmp_path) as url:
        async with KvSidecarClient(url, token=TOKEN) as kv:
            assert (await harness_turn(kv, "A", 1, server.base_url))[0] == "cold"
            assert (await harness_turn(kv, "A", 2, server.base_url))[0] == "resident"
            assert (await harness_turn(kv, "B", 1, server.base_url))[0] == "cold"
            outcome, pn, cn = await harness_turn(kv, "A", 3, server.base_url)
            assert outcome == "restored" and cn > pn
            status = await kv.status()
            assert status["stats"]["restore_hits"] == 1 and status["snapshots"]["valid"] == 2
        sock = tmp_path / "api.sock"
        assert sock.stat().st_mode & 0o777 == 0o600
        transport = httpx.AsyncHTTPTransport(uds=str(sock))
        async with httpx.AsyncClient(transport=transport, base_url="http://localhost") as c:
            assert (await c.get("/v1/status")).status_code == 401
            r = await c.get("/v1/status", headers={"Authorization": f"Bearer {TOKEN}"})
            assert r.status_code == 200
        async with httpx.AsyncClient() as c:
            assert (await c.get(f"{url}/healthz")).status_code == 200
            assert (await c.get(f"{url}/metrics")).status_code == 401


def test_sigterm_checkpoints_a_dirty_session(start_llama: StartServer, tmp_path: Path) -> None:
    """`kvsidecar serve` as a process: SIGTERM saves the dirty slot before exiting."""
    server = start_llama()
    daemon = DaemonProcess(tmp_path / "d", base_url=server.base_url, snapshot_dir=server.save_dir)
    daemon.start()
    try:

        async def one_turn() -> None:
            async with KvSidecarClient(daemon.url, token=daemon.token) as kv:
                await harness_turn(kv, "A", 1, server.base_url)

        asyncio.run(one_turn())
        assert not list(server.save_dir.glob("*.bin"))
    finally:
        code = daemon.stop(timeout_s=60)
    err = daemon.log()
    # uvicorn re-raises the signal after a clean shutdown; systemd counts SIGTERM as a clean exit.
    assert code in (0, -signal.SIGTERM), err
    assert "kv.session.save.success" in err and "trigger=shutdown" in err
    assert len(list(server.save_dir.glob("*.a.bin"))) == 1
    assert "A " not in err.replace("session=", "")  # full session ids are not logged at info
