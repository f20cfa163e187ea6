"""Connection limits of the listeners (issue 16, items 11 and 13): half-sent requests are timed out,
connections are capped without starving /healthz, and a client that stops reading its answer is cut (in
the proxy: upstream closed, lease released). Real sockets on loopback, uvicorn as `kvsidecar serve` runs it.
The daemon-level check with a low descriptor limit is tests/integration/test_limits_real.py."""

from __future__ import annotations

import asyncio
import resource
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvsidecar.api.routes import create_app
from kvsidecar.daemon import listen
from kvsidecar.daemon.service import _uvicorn
from kvsidecar.errors import ConfigError
from kvsidecar.http.limits import Limits, ListenerState
from kvsidecar.testing.poll import until
from kvsidecar.units import UNITS, UnitParams, render
from tests.unit.coordinator_helpers import Harness, make_config, start_harness
from tests.unit.origin import Origin, OriginConn
from tests.unit.proxy.test_app import AUTH, rig
from tests.unit.rawhttp import closed_by_peer, open_socket, read_until_closed

TOKEN = "p" * 32  # the proxy rig's token


@dataclass
class Api:
    h: Harness
    url: str
    listener: ListenerState


async def serve_api(tmp_path: Path, **limits: float) -> AsyncIterator[Api]:
    h = await start_harness(tmp_path, api=limits)
    listener = ListenerState("api", Limits.of(h.coordinator.config.api))
    server = _uvicorn(create_app(h.coordinator, token=TOKEN), lifespan="off", listener=listener)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    await until(lambda: server.started, what="uvicorn to serve")
    try:
        yield Api(h, f"http://127.0.0.1:{sock.getsockname()[1]}", listener)
    finally:
        server.should_exit = True
        await task
        await h.coordinator.aclose()


async def accepted(listener: ListenerState, n: int) -> None:
    """Until the server has taken in `n` more connections (accepted, admitted or turned away)."""
    await until(lambda: listener.accepted >= n, what=f"{n} connections accepted")


async def heads_read(listener: ListenerState) -> None:
    """Until no open connection waits for its request head (each is busy with a request)."""
    await until(lambda: not any(c.waiting_for_head for c in listener.open), what="every head read")


@pytest.fixture
async def api(tmp_path: Path) -> AsyncIterator[Api]:
    async for each in serve_api(tmp_path, max_connections=8, header_timeout_s=0.5, body_timeout_s=0.5):
        yield each


async def test_half_sent_requests_are_closed_and_healthz_still_answers(api: Api) -> None:
    socks = [open_socket(api.url) for _ in range(24)]  # three times the cap
    try:
        for s in socks:
            s.sendall(b"GET /v1/status HTTP/1.1\r\nHost: 127.0.0.1\r\n")  # and never the blank line
        await accepted(api.listener, len(socks))
        assert len(api.listener.open) <= 8
        async with httpx.AsyncClient(base_url=api.url, timeout=5) as c:
            r = await c.get("/healthz")  # at the cap: the oldest half-sent request makes room
        assert r.status_code == 200
        closed = await asyncio.gather(*(closed_by_peer(s, within_s=10) for s in socks))
        assert all(closed)  # evicted at the cap, or timed out after header_timeout_s
        assert api.listener.evicted + api.listener.timed_out >= len(socks)
    finally:
        for s in socks:
            s.close()


async def test_a_head_that_never_ends_gets_a_408(api: Api) -> None:
    s = open_socket(api.url)
    try:
        s.sendall(b"POST /v1/sessions/A/acquire HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        answer = await read_until_closed(s, within_s=10)  # answered, and closed
        assert answer is not None and answer.startswith(b"HTTP/1.1 408 ") and b"KV_REQUEST_TIMEOUT" in answer
    finally:
        s.close()
    assert api.h.coordinator.status()["stats"]["acquires"] == 0


async def test_a_body_that_never_ends_is_dropped_not_processed(api: Api) -> None:
    s = open_socket(api.url)
    try:
        s.sendall(
            b"POST /v1/sessions/A/acquire HTTP/1.1\r\nHost: 127.0.0.1\r\n"
            b"Authorization: Bearer " + TOKEN.encode() + b"\r\nContent-Length: 60\r\n\r\n"
            b'{"provider": "local", "model": "m"}'  # 35 of the 60 bytes promised
        )
        assert await closed_by_peer(s, within_s=10)
    finally:
        s.close()
    assert api.h.coordinator.status()["stats"]["acquires"] == 0  # a short body was never taken for whole


async def test_at_the_cap_with_every_connection_busy_a_newcomer_is_refused(tmp_path: Path) -> None:
    async for each in serve_api(tmp_path, max_connections=2, header_timeout_s=5, body_timeout_s=5):
        busy = [open_socket(each.url) for _ in range(2)]
        try:
            for s in busy:  # heads in, bodies pending: busy with a request, not evictable
                s.sendall(b"POST /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 10\r\n\r\n")
            await accepted(each.listener, 2)
            await heads_read(each.listener)
            newcomer = open_socket(each.url)
            answer = await read_until_closed(newcomer, within_s=10)
            newcomer.close()
            assert answer is not None and answer.startswith(b"HTTP/1.1 503 ")
            assert b"KV_TOO_MANY_CONNECTIONS" in answer
            assert each.listener.refused == 1 and len(each.listener.open) == 2
        finally:
            for s in busy:
                s.close()


async def test_kept_alive_connections_serve_many_requests(api: Api) -> None:
    async with httpx.AsyncClient(base_url=api.url, timeout=5) as c:
        for _ in range(20):
            assert (await c.get("/healthz")).status_code == 200
    assert api.listener.accepted == 1 and api.listener.timed_out == 0


async def test_proxy_client_that_stops_reading_is_cut_and_its_lease_released(tmp_path: Path) -> None:
    upstream_closed = asyncio.Event()

    async def handler(conn: OriginConn) -> None:
        await conn.read_request()
        await conn.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n")
        chunk = b"data: " + b"x" * 16_000 + b"\n\n"
        try:
            while True:  # generates until the proxy hangs up
                await conn.send(b"%x\r\n%s\r\n" % (len(chunk), chunk))
        except ConnectionError:
            upstream_closed.set()

    async for each in rig(tmp_path, Origin(handler), proxy={"client_stall_s": 0.3}):
        s = open_socket(each.url, rcvbuf=4096)
        try:
            body = b'{"prompt": "x", "stream": true}'
            s.sendall(
                b"POST /completion HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Session-Id: S\r\n"
                b"Authorization: " + AUTH["Authorization"].encode() + b"\r\n"
                b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
            )  # and then never reads a byte
            await asyncio.wait_for(upstream_closed.wait(), 20)
            assert await each.leases_after_release() == 0
            assert each.h.coordinator.status()["stats"]["leases_expired"] == 0  # cut, not expired
        finally:
            s.close()


def test_units_raise_the_descriptor_limit() -> None:
    for name in UNITS:
        assert "\nLimitNOFILE=65536\n" in render(name, UnitParams())


def test_caps_must_fit_the_descriptor_limit(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    limits = {"soft": 1024, "hard": 4096}

    def getrlimit(_: int) -> tuple[int, int]:
        return limits["soft"], limits["hard"]

    def setrlimit(_: int, value: tuple[int, int]) -> None:
        limits["soft"] = value[0]

    monkeypatch.setattr(resource, "getrlimit", getrlimit)
    monkeypatch.setattr(resource, "setrlimit", setrlimit)
    fits = make_config(
        tmp_path, api={"max_connections": 1000}, proxy={"enabled": True, "max_connections": 1000}
    )
    assert listen.ensure_fd_budget(fits) == 4096  # raised as far as the hard limit allows
    limits["soft"] = 1024
    too_many = make_config(tmp_path, proxy={"enabled": True, "max_connections": 5000})
    with pytest.raises(ConfigError) as caught:
        listen.ensure_fd_budget(too_many)
    assert caught.value.message.startswith("api.max_connections: the listeners may hold 10384")
