"""Issue 26 C on the whole daemon (uvicorn with its listener, the hook API) and a real llama-server: an
acquire whose HTTP client timed out while it waited for the slot grants nothing, so the next session gets
the slot at once; a lease nobody uses ends at its claim TTL, and one whose model call ran keeps its TTL
(llama-server's own `/slots` says which)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsidecar.config import config_from_mapping
from kvsidecar.daemon.service import Daemon, build_server
from kvsidecar.testing.llama import LlamaServer, complete, free_port, words
from kvsidecar.testing.poll import until
from tests.conftest import StartServer

TOKEN = "integration-token-lease-holder-0123"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
BODY = {"provider": "local", "model": "tiny"}


def started(uv: Any, task: asyncio.Future[Any]) -> bool:
    """The listener serves; a server that ended before that fails the wait with its exception."""
    assert not task.done(), task.exception()
    return bool(uv.started)


@asynccontextmanager
async def daemon_on(server: LlamaServer, tmp_path: Path, **api: Any) -> AsyncIterator[tuple[str, Daemon]]:
    (tmp_path / "token").write_text(TOKEN)
    port = free_port()
    config = config_from_mapping(
        {
            "state_dir": str(tmp_path / "state"),
            "servers": {
                "local": {
                    "base_url": server.base_url,
                    "snapshot_dir": str(server.save_dir),
                    "slot_wait_s": 10,  # before the fix the next session waited this long, then 503
                }
            },
            "routes": {"local": "local"},
            "api": {"listen": f"127.0.0.1:{port}", "token_file": str(tmp_path / "token"), **api},
        }
    )
    uv, socks, daemon = build_server(config)
    task = asyncio.ensure_future(uv.serve(sockets=socks))
    try:
        await until(lambda: started(uv, task), timeout_s=60, what="uvicorn to serve")
        yield f"http://127.0.0.1:{port}", daemon
    finally:
        uv.should_exit = True
        await asyncio.wait_for(task, 60)
        for s in socks:
            s.close()


async def acquire(c: httpx.AsyncClient, url: str, session: str) -> httpx.Response:
    return await c.post(f"{url}/v1/sessions/{session}/acquire", json=BODY, headers=AUTH)


async def release(c: httpx.AsyncClient, url: str, lease: str, **body: Any) -> httpx.Response:
    return await c.post(f"{url}/v1/leases/{lease}/release", json={"status": "ok", **body}, headers=AUTH)


async def test_a_client_that_timed_out_mid_acquire_leaves_the_slot_to_the_next_session(
    start_llama: StartServer, tmp_path: Path
) -> None:
    server = start_llama()
    async with daemon_on(server, tmp_path) as (url, daemon), httpx.AsyncClient(timeout=30) as c:
        first = await acquire(c, url, "A")
        assert first.status_code == 200, first.text
        srv = daemon.coordinator.servers["local"]
        async with httpx.AsyncClient() as impatient:  # a harness whose HTTP timeout is shorter than the wait
            gave_up = asyncio.ensure_future(
                impatient.post(
                    f"{url}/v1/sessions/B/acquire",
                    json=BODY,
                    headers=AUTH,
                    timeout=httpx.Timeout(30, read=1.0),
                )
            )
            await until(
                lambda: bool(daemon.coordinator.pool.queued(srv)),
                timeout_s=30.0,
                interval_s=0.02,
                what="B's acquire to wait for the slot",
            )
            with pytest.raises(httpx.ReadTimeout):
                await gave_up
        # the model call of A's turn, then its release: the slot is free now
        t = await asyncio.to_thread(
            complete, server.base_url, words("A", 300), slot_id=first.json()["slot_id"]
        )
        done = await release(c, url, first.json()["lease_id"], prompt_tokens=t["prompt_n"], cached_tokens=0)
        assert done.status_code == 200, done.text
        nxt = await acquire(c, url, "C")
        assert nxt.status_code == 200, f"the next session got {nxt.status_code}: {nxt.text}"
        assert len(daemon.coordinator.leases) == 1  # C's; B's client left, B holds nothing
        assert (await release(c, url, nxt.json()["lease_id"], status="aborted")).status_code == 200


async def test_an_unused_lease_ends_at_its_claim_ttl_and_a_used_one_keeps_its_ttl(
    start_llama: StartServer, tmp_path: Path
) -> None:
    server = start_llama()
    async with (
        daemon_on(server, tmp_path, lease_claim_ttl_s=2.0) as (url, daemon),
        httpx.AsyncClient(timeout=30) as c,
    ):
        leases = daemon.coordinator.leases
        unused = await acquire(c, url, "A")  # granted; its answer "never arrives": no model call, no release
        assert unused.status_code == 200, unused.text
        lease_id = unused.json()["lease_id"]
        await until(
            lambda: lease_id not in leases,
            timeout_s=30.0,
            interval_s=0.02,
            what="the unused lease to end at its claim TTL",
        )
        assert (await release(c, url, lease_id)).status_code == 404
        used = await acquire(c, url, "B")  # the slot is free again: no wait
        assert used.status_code == 200, used.text
        lease = leases.get(used.json()["lease_id"])
        assert lease is not None and not lease.active
        t = await asyncio.to_thread(
            complete, server.base_url, words("B", 300), slot_id=used.json()["slot_id"]
        )
        await until(
            lambda: lease.active,
            timeout_s=30.0,
            interval_s=0.02,
            what="llama-server's /slots to show the lease in use",
        )
        done = await release(c, url, used.json()["lease_id"], prompt_tokens=t["prompt_n"], cached_tokens=0)
        assert done.status_code == 200 and done.json()["dirty"] is True, done.text
