"""The proxy's upstream HTTP/1.1 client against a scripted origin: framing, reuse, failures, flow control.

Every test runs on both the standard asyncio loop and uvloop (what `kvsidecar serve` uses).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any

import pytest
import uvloop

from kvsidecar.proxy import upstream as upstream_mod
from kvsidecar.proxy.upstream import Upstream, UpstreamError
from kvsidecar.testing.poll import until
from tests.unit.origin import Origin, OriginConn, Request, keep_alive_origin


def on_both_loops(case: Callable[[], Coroutine[Any, Any, None]]) -> Callable[[str], None]:
    """Run an async test once on asyncio's loop and once on uvloop's."""

    @pytest.mark.parametrize("loop", ["asyncio", "uvloop"])
    def test(loop: str) -> None:
        (uvloop.run if loop == "uvloop" else asyncio.run)(case())

    test.__name__, test.__qualname__, test.__doc__ = case.__name__, case.__qualname__, case.__doc__
    return test


async def started(origin: Origin) -> AsyncIterator[Origin]:
    await origin.start()
    try:
        yield origin
    finally:
        await origin.stop()


def client(origin: Origin, *, read_timeout_s: float = 5.0, path: str = "") -> Upstream:
    return Upstream(origin.url + path, connect_timeout_s=2.0, read_timeout_s=read_timeout_s)


async def until_closed(conns: list[upstream_mod._Conn]) -> None:
    """Until the loop has delivered the end of every one of these connections; 5 s at most."""
    await until(
        lambda: all(conn.closed for conn in conns), timeout_s=5, interval_s=0.001, what="every end delivered"
    )


async def fetch(up: Upstream, target: str = "/x", *, method: str = "GET", body: bytes = b"") -> bytes:
    response = await up.request(method, target, [(b"x-test", b"1")], body)
    try:
        return await response.read()
    finally:
        await response.aclose()


@on_both_loops
async def test_content_length_answers_reuse_one_connection() -> None:
    plain = await keep_alive_origin().start()
    up = client(plain)
    assert await fetch(up, "/a") == b"hello /a"
    assert await fetch(up, "/b", method="POST", body=b'{"k": 1}') == b"hello /b"
    assert up.connects == 1 and plain.connections == 1
    first, second = plain.requests
    assert first.method == "GET" and "content-length" not in first.headers and first.headers["x-test"] == "1"
    assert first.headers["host"] == plain.url.removeprefix("http://")
    assert second.body == b'{"k": 1}' and second.headers["content-length"] == "8"
    await up.aclose()
    await plain.stop()


@on_both_loops
async def test_base_url_path_prefix_and_large_body() -> None:
    plain = await keep_alive_origin().start()
    up = client(plain, path="/llama/")
    big = b"x" * 300_000
    assert await fetch(up, "/completion?a=1", method="POST", body=big) == b"hello /llama/completion?a=1"
    assert plain.requests[0].body == big
    await up.aclose()
    await plain.stop()


@on_both_loops
async def test_chunked_body_streams_piece_by_piece() -> None:
    release = asyncio.Event()

    async def handler(conn: OriginConn) -> None:
        await conn.read_request()
        await conn.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n5\r\nfirst\r\n")
        await release.wait()  # the rest only after the client has seen the first piece
        await conn.send(b"6\r\nsecond\r\n0\r\n\r\n")
        await conn.read_request()

    async for origin in started(Origin(handler)):
        up = client(origin)
        response = await up.request("GET", "/s", [], b"")
        assert response.status_code == 200 and (b"transfer-encoding", b"chunked") in response.headers
        pieces = response.stream()
        assert await anext(pieces) == b"first"
        release.set()
        assert [p async for p in pieces] == [b"second"]
        await response.aclose()
        assert len(up._idle) == 1  # cleanly ended: kept for the next request
        await up.aclose()


@on_both_loops
async def test_body_delimited_by_close_is_complete_and_not_reused() -> None:
    async def handler(conn: OriginConn) -> None:
        await conn.read_request()
        await conn.send(b"HTTP/1.1 200 OK\r\nconnection: close\r\n\r\nuntil the end")
        conn.close()

    async for origin in started(Origin(handler)):
        up = client(origin)
        assert await fetch(up) == b"until the end"
        assert await fetch(up) == b"until the end"
        assert origin.connections == 2
        await up.aclose()


@on_both_loops
async def test_kept_alive_connection_closed_by_the_server_is_retried_once() -> None:
    """llama-server may close a kept-alive connection just as the next request goes out: that request got
    no answer at all, so it is sent again on a new connection."""

    async def handler(conn: OriginConn) -> None:
        first = await conn.read_request()
        origin.recording(first)
        if conn.index == 1:
            await conn.respond(b"one")
            origin.recording(await conn.read_request())
            return  # closes without answering the second request
        await conn.respond(b"two")
        await conn.read_request()

    origin = Origin(handler)
    async for _ in started(origin):
        up = client(origin)
        assert await fetch(up, "/1") == b"one"
        assert await fetch(up, "/2") == b"two"
        assert [r.target for r in origin.requests] == ["/1", "/2", "/2"] and up.connects == 2
        await up.aclose()


@on_both_loops
async def test_idle_connection_the_server_closed_is_not_used() -> None:
    async def handler(conn: OriginConn) -> None:
        await conn.read_request()
        await conn.respond(b"bye", headers=(("keep-alive", "timeout=0"),))
        conn.close()

    async for origin in started(Origin(handler)):
        up = client(origin)
        assert await fetch(up) == b"bye"
        await until_closed(list(up._idle))  # the server's FIN reaches the idle connection
        assert await fetch(up) == b"bye"
        assert origin.connections == 2
        await up.aclose()


@on_both_loops
async def test_new_connection_closed_without_answer_is_an_error_and_not_resent() -> None:
    seen: list[Request | None] = []

    async def handler(conn: OriginConn) -> None:
        seen.append(await conn.read_request())

    async for origin in started(Origin(handler)):
        up = client(origin)
        with pytest.raises(UpstreamError, match="without answering"):
            await fetch(up, method="POST", body=b"{}")
        assert len(seen) == 1
        await up.aclose()


@on_both_loops
async def test_truncated_body_is_an_error_not_an_end() -> None:
    async def handler(conn: OriginConn) -> None:
        await conn.read_request()
        await conn.send(b"HTTP/1.1 200 OK\r\ncontent-length: 100\r\n\r\nonly ten b")
        conn.close()

    async for origin in started(Origin(handler)):
        up = client(origin)
        response = await up.request("GET", "/", [], b"")
        with pytest.raises(UpstreamError, match="middle of a response"):
            await response.read()
        await response.aclose()
        assert not up._idle
        await up.aclose()


@on_both_loops
async def test_malformed_response_is_an_error() -> None:
    async def handler(conn: OriginConn) -> None:
        await conn.read_request()
        await conn.send(b"SMTP ready\r\n\r\n")
        await conn.read_request()

    async for origin in started(Origin(handler)):
        up = client(origin)
        with pytest.raises(UpstreamError, match="malformed"):
            await fetch(up)
        await up.aclose()


@on_both_loops
async def test_silence_is_a_timeout() -> None:
    async def handler(conn: OriginConn) -> None:
        await conn.read_request()
        await conn.read_request()  # never answers

    async for origin in started(Origin(handler)):
        up = client(origin, read_timeout_s=0.2)
        with pytest.raises(UpstreamError, match=r"sent nothing for 0\.2 s"):
            await fetch(up)
        await up.aclose()


@on_both_loops
async def test_connect_refused() -> None:
    origin = await keep_alive_origin().start()
    url = origin.url
    await origin.stop()
    up = Upstream(url, connect_timeout_s=1.0, read_timeout_s=1.0)
    with pytest.raises(UpstreamError, match="cannot connect"):
        await fetch(up)


@on_both_loops
async def test_abandoned_response_closes_the_connection() -> None:
    """A client that goes away mid-answer: the upstream connection is closed, which is how llama-server
    learns to stop generating."""
    eof = asyncio.Event()

    async def handler(conn: OriginConn) -> None:
        await conn.read_request()
        await conn.send(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n3\r\nabc\r\n")
        if await conn.read_request() is None:
            eof.set()

    async for origin in started(Origin(handler)):
        up = client(origin)
        response = await up.request("GET", "/", [], b"")
        assert await anext(response.stream()) == b"abc"
        await response.aclose()
        await asyncio.wait_for(eof.wait(), 2)
        assert not up._idle
        await up.aclose()


@on_both_loops
async def test_slow_reader_pauses_the_upstream() -> None:
    total = 4 * 1024 * 1024

    async def handler(conn: OriginConn) -> None:
        await conn.read_request()
        await conn.send(b"HTTP/1.1 200 OK\r\ncontent-length: %d\r\n\r\n" % total)
        for _ in range(total // 65536):
            await conn.send(b"z" * 65536)
        await conn.read_request()

    async for origin in started(Origin(handler)):
        up = client(origin)
        response = await up.request("GET", "/", [], b"")
        await asyncio.sleep(0.3)  # nobody reads: what piles up in memory is bounded
        conn = response._conn
        assert conn.paused and conn.buffered < upstream_mod._HIGH_WATER + 512 * 1024
        assert len(await response.read()) == total
        await response.aclose()
        await up.aclose()


@on_both_loops
async def test_head_response_has_no_body() -> None:
    async def handler(conn: OriginConn) -> None:
        await conn.read_request()
        await conn.send(b"HTTP/1.1 200 OK\r\ncontent-length: 1234\r\n\r\n")
        await conn.read_request()

    async for origin in started(Origin(handler)):
        up = client(origin)
        assert await fetch(up, method="HEAD") == b""
        await up.aclose()


def test_rejects_non_http_base_url() -> None:
    with pytest.raises(ValueError):
        Upstream("unix:///run/llama.sock", connect_timeout_s=1, read_timeout_s=1)


@on_both_loops
async def test_informational_responses_are_skipped_and_extra_answers_distrusted() -> None:
    async def handler(conn: OriginConn) -> None:
        await conn.read_request()
        await conn.send(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </a>\r\n\r\n")
        await conn.send(b"HTTP/1.1 201 Created\r\ncontent-length: 2\r\n\r\nok")
        await conn.send(b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\n\r\nextra")  # nobody asked
        await conn.read_request()

    async for origin in started(Origin(handler)):
        up = client(origin)
        response = await up.request("POST", "/", [], b"{}")
        assert response.status_code == 201 and response.headers == [(b"content-length", b"2")]
        assert await response.read() == b"ok"
        await response.aclose()
        await until_closed([response._conn])  # once the answer nobody asked for is in
        assert await fetch(up) == b"ok" and origin.connections == 2  # the confused connection was dropped
        await up.aclose()


@on_both_loops
async def test_silence_while_the_server_is_still_working_is_not_a_timeout() -> None:
    """A long prefill sends nothing until it is done: past the silence timeout the client asks whether
    llama-server is still busy, and keeps waiting while it is."""
    asked: list[float] = []

    async def handler(conn: OriginConn) -> None:
        await conn.read_request()
        await asyncio.sleep(0.5)  # "prefilling", silent for longer than the 0.1 s timeout
        await conn.respond(b"done")
        await conn.read_request()

    async def still_working() -> bool:
        asked.append(asyncio.get_running_loop().time())
        return True

    async for origin in started(Origin(handler)):
        up = client(origin, read_timeout_s=0.1)
        response = await up.request("GET", "/", [], b"", still_working=still_working)
        assert await response.read() == b"done"
        await response.aclose()
        assert 2 <= len(asked) <= 6  # asked about every 0.1 s of silence, not in a busy loop

        async def not_working() -> bool:
            return False

        async def broken() -> bool:
            raise OSError("llama-server unreachable")

        for check in (not_working, broken):
            with pytest.raises(UpstreamError, match="sent nothing"):
                await up.request("GET", "/", [], b"", still_working=check)
        await up.aclose()
