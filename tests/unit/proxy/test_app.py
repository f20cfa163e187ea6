"""The proxy under uvicorn (as `kvsidecar serve` runs it) in front of a scripted origin, with the fake backend
behind the coordinator: what reaches llama-server, what reaches the client, and failures mid-answer.
The real-llama-server suite is tests/integration/test_proxy_real.py."""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsidecar.backend.llama_http import pin
from kvsidecar.daemon.service import _uvicorn
from kvsidecar.proxy.app import Proxy
from kvsidecar.testing.poll import until
from tests.unit.coordinator_helpers import Harness, start_harness
from tests.unit.origin import Origin, OriginConn, Request, keep_alive_origin

TOKEN = "p" * 32
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@dataclass
class Rig:
    h: Harness
    origin: Origin
    url: str
    app: Any = None  # the Proxy (its listener state: app.listener)

    def client(self) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.url, headers=AUTH, timeout=10)

    async def leases_after_release(self) -> int:
        """Open leases once the proxy has had up to 2 s to notice a disconnect and release."""
        with contextlib.suppress(AssertionError):  # the caller judges what is left
            await until(
                lambda: self.h.coordinator.status()["leases"] == 0,
                timeout_s=2.0,
                interval_s=0.02,
                what="no lease",
            )
        return int(self.h.coordinator.status()["leases"])


async def rig(
    tmp_path: Path,
    origin: Origin,
    *,
    proxy: Mapping[str, Any] | None = None,
    server: Mapping[str, Any] | None = None,
    base_path: str = "",
    **overrides: Any,
) -> AsyncIterator[Rig]:
    """The proxy under uvicorn (with the listener limits `kvsidecar serve` uses) in front of `origin`;
    `server` adds to servers.local, `base_path` is a path prefix of its base_url."""
    await origin.start()
    if server and server.get("api_key_file"):  # the config then needs a token of our own
        (tmp_path / "token").write_text(TOKEN)
        overrides["api"] = {**(overrides.get("api") or {}), "token_file": str(tmp_path / "token")}
    h = await start_harness(
        tmp_path,
        servers={"local": {"base_url": origin.url + base_path, **(server or {})}},
        proxy={"enabled": True, **(proxy or {})},
        **overrides,
    )
    app = Proxy(h.coordinator, h.coordinator.config, token=TOKEN, check_host=True)
    uv = _uvicorn(app, lifespan="off", listener=app.listener)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    task = asyncio.ensure_future(uv.serve(sockets=[sock]))
    await until(lambda: uv.started, what="uvicorn to serve")
    try:
        yield Rig(h, origin, f"http://127.0.0.1:{sock.getsockname()[1]}", app)
    finally:
        uv.should_exit = True
        await task
        await app.aclose()
        await h.coordinator.aclose()
        await origin.stop()


TIMINGS = {"timings": {"prompt_n": 40, "cache_n": 0}}


async def echo(request: Request) -> tuple[int, bytes, tuple[tuple[str, str], ...]]:
    body = json.dumps({"content": "hi", **TIMINGS}).encode()
    return 200, body, (("connection", "x-secret"), ("x-secret", "s"), ("content-type", "application/json"))


@pytest.fixture
async def r(tmp_path: Path) -> AsyncIterator[Rig]:
    async for each in rig(tmp_path, keep_alive_origin(echo)):
        yield each


async def test_managed_request_is_pinned_and_released(r: Rig) -> None:
    raw = b'{"prompt": "caf\\u00e9 \xe2\x98\x95", "n_predict": 2}'
    async with r.client() as c:
        resp = await c.post(
            "/completion?x=1", content=raw, headers={"X-Session-Id": "s1", "Content-Type": "application/json"}
        )
    assert resp.status_code == 200 and resp.headers["x-kv-outcome"] == "cold"
    sent = r.origin.requests[0]
    assert sent.target == "/completion?x=1"
    assert sent.body == raw[:-1] + b',"id_slot":0,"cache_prompt":true}'  # spliced, the rest byte for byte
    assert "x-session-id" not in sent.headers and "authorization" not in sent.headers
    status = r.h.coordinator.status()
    assert status["leases"] == 0 and status["stats"]["acquires"] == 1


async def test_hop_by_hop_headers_stop_at_the_proxy_both_ways(r: Rig) -> None:
    async with r.client() as c:
        resp = await c.get(
            "/props",
            headers={"Connection": "keep-alive, X-Hop", "X-Hop": "1", "TE": "trailers", "X-End": "2"},
        )
    sent = r.origin.requests[0]
    assert sent.headers.get("x-end") == "2" and "x-hop" not in sent.headers and "te" not in sent.headers
    assert "x-secret" not in resp.headers and resp.headers["content-type"] == "application/json"
    assert resp.headers["content-length"] == str(len(resp.content))  # llama-server's own framing
    assert "x-kv-outcome" not in resp.headers and r.h.coordinator.status()["stats"]["acquires"] == 0


async def test_llama_answer_cut_mid_body_reaches_the_client_as_cut(tmp_path: Path) -> None:
    async def handler(conn: OriginConn) -> None:
        await conn.read_request()
        await conn.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n6\r\ndata: \r\n")
        conn.close()  # llama-server died mid-stream

    async for each in rig(tmp_path, Origin(handler)):
        async with each.client() as c:
            with pytest.raises(httpx.RemoteProtocolError):
                await c.post(
                    "/completion", json={"prompt": "x", "stream": True}, headers={"X-Session-Id": "s"}
                )
        status = each.h.coordinator.status()
        assert status["leases"] == 0 and status["stats"]["restore_hits"] == 0


async def test_silent_llama_is_a_504_with_a_stable_code(tmp_path: Path) -> None:
    async def handler(conn: OriginConn) -> None:
        await conn.read_request()
        await conn.read_request()  # never answers

    async for each in rig(tmp_path, Origin(handler), proxy={"upstream_timeout_s": 0.3}):
        async with each.client() as c:
            resp = await c.post("/completion", json={"prompt": "x"}, headers={"X-Session-Id": "s"})
        assert resp.status_code == 504 and resp.json()["error"]["code"] == "KV_OPERATION_TIMEOUT"
        assert "sent nothing for 0.3 s" in resp.json()["error"]["message"]
        assert each.h.coordinator.status()["leases"] == 0


def test_pin_splices_or_reencodes() -> None:
    body = b' {"a": [1, {"b": "}"}]}\n '
    assert pin(body, json.loads(body), 3) == b' {"a": [1, {"b": "}"}],"id_slot":3,"cache_prompt":true}'
    own = b'{"id_slot": 7, "cache_prompt": false, "p": "x"}'
    assert json.loads(pin(own, json.loads(own), 1)) == {"id_slot": 1, "cache_prompt": True, "p": "x"}
    assert json.loads(pin(b"{}", {}, 0)) == {"id_slot": 0, "cache_prompt": True}
    bom = b'\xef\xbb\xbf{"p": 1}'
    assert json.loads(pin(bom, json.loads(bom), 2)) == {"p": 1, "id_slot": 2, "cache_prompt": True}


async def test_client_gone_mid_stream_aborts_upstream_and_lease(tmp_path: Path) -> None:
    upstream_closed = asyncio.Event()

    async def handler(conn: OriginConn) -> None:
        await conn.read_request()
        await conn.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        try:
            while True:  # generates until the proxy hangs up
                await conn.send(b"c\r\ndata: {}\n\n\r\n")
                await asyncio.sleep(0.02)
        except ConnectionError:
            upstream_closed.set()

    async for each in rig(tmp_path, Origin(handler)):
        async with (
            each.client() as c,
            c.stream("POST", "/completion", json={"stream": True}, headers={"X-Session-Id": "s"}) as resp,
        ):
            assert resp.headers["x-kv-outcome"] == "cold"
            assert (await anext(resp.aiter_lines())).startswith("data: ")
        await asyncio.wait_for(upstream_closed.wait(), 5)
        assert await each.leases_after_release() == 0


async def test_oversized_body_is_refused_before_llama_sees_it(tmp_path: Path) -> None:
    async for each in rig(tmp_path, keep_alive_origin(echo), proxy={"max_body_bytes": 1000}):
        async with each.client() as c:
            resp = await c.post("/completion", json={"prompt": "x" * 2000}, headers={"X-Session-Id": "s"})
            ok = await c.post("/completion", json={"prompt": "x" * 100}, headers={"X-Session-Id": "s"})
        assert resp.status_code == 413 and resp.json()["error"]["code"] == "KV_PAYLOAD_TOO_LARGE"
        assert ok.status_code == 200 and len(each.origin.requests) == 1


async def test_client_gone_before_llama_answers_aborts_the_prefill(tmp_path: Path) -> None:
    """A harness that gives up during a long prefill: llama-server has sent nothing yet, and must still learn
    (its connection closes) so that the slot is not busy for minutes on an answer nobody reads."""
    upstream_closed, prefilling = asyncio.Event(), asyncio.Event()

    async def handler(conn: OriginConn) -> None:
        await conn.read_request()
        prefilling.set()
        if await conn.read_request() is None:  # "prefilling" until the proxy hangs up
            upstream_closed.set()

    async for each in rig(tmp_path, Origin(handler)):
        async with each.client() as c:
            call = asyncio.ensure_future(
                c.post("/completion", json={"prompt": "long"}, headers={"X-Session-Id": "s"})
            )
            await asyncio.wait_for(prefilling.wait(), 5)  # llama-server has the request
            call.cancel()
        await asyncio.wait_for(upstream_closed.wait(), 5)
        assert await each.leases_after_release() == 0


async def test_lease_outlives_its_ttl_while_llama_is_busy(tmp_path: Path) -> None:
    async def slow(request: Request) -> tuple[int, bytes, tuple[tuple[str, str], ...]]:
        await asyncio.sleep(1.0)  # a prefill longer than the lease TTL, with nothing sent meanwhile
        return await echo(request)

    async for each in rig(tmp_path, keep_alive_origin(slow), api={"lease_ttl_s": 0.3}):
        async with each.client() as c:
            resp = await c.post("/completion", json={"prompt": "x"}, headers={"X-Session-Id": "s"})
        assert resp.status_code == 200 and resp.headers["x-kv-outcome"] == "cold"
        status = each.h.coordinator.status()
        assert status["stats"]["leases_expired"] == 0 and status["leases"] == 0


async def test_proxy_metrics_count_requests_by_kind_and_result(r: Rig) -> None:
    async with r.client() as c:
        await c.post("/completion", json={"prompt": "a"}, headers={"X-Session-Id": "s"})
        await c.post("/completion", json={"prompt": "ab"}, headers={"X-Session-Id": "s"})  # grown in place
        await c.get("/props")
        await c.post("/completion", json={"prompt": "c"}, headers={"X-Session-Id": "../x"})
        await c.get("/props", headers={"Authorization": "Bearer wrong"})
    registry = r.h.coordinator.metrics.registry

    def count(kind: str, result: str) -> float | None:
        return registry.get_sample_value("kvsidecar_proxy_request_total", {"kind": kind, "result": result})

    assert count("managed", "ok") == 2 and count("passthrough", "ok") == 1
    assert count("refused", "KV_INVALID_SESSION_ID") == 1 and count("refused", "KV_UNAUTHORIZED") == 1
    # one kept-alive connection
    assert registry.get_sample_value("kvsidecar_proxy_upstream_connect_total") == 1


async def test_long_silent_prefill_is_waited_for_while_the_slot_is_busy(tmp_path: Path) -> None:
    async def handler(conn: OriginConn) -> None:
        await conn.read_request()
        await asyncio.sleep(1.0)  # longer than upstream_timeout_s, with the slot reported busy
        await conn.respond(json.dumps(TIMINGS).encode())
        await conn.read_request()

    async for each in rig(tmp_path, Origin(handler), proxy={"upstream_timeout_s": 0.3}):
        each.h.fake.slots[0].is_processing = True
        async with each.client() as c:
            resp = await c.post("/completion", json={"prompt": "x"}, headers={"X-Session-Id": "s"})
        assert resp.status_code == 200 and resp.json() == TIMINGS
        assert each.h.coordinator.status()["leases"] == 0
