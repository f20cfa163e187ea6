"""A request the HTTP parser refuses (issue 17, D1) is answered by kvsidecar's listener, not by uvicorn's
plain-text `400 Invalid HTTP request received.`: 400 `KV_BAD_REQUEST` in the listener's own error shape (the
hook API's `{"error": {code, message, hint}}`, the proxy's OpenAI-shaped one), then the connection is
closed. Raw sockets on both listeners, as `kvsidecar serve` runs them; the app never sees the request."""

from __future__ import annotations

import asyncio
import json
import logging
import socket
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from kvsidecar.api.routes import create_app
from kvsidecar.daemon.service import _uvicorn
from kvsidecar.http.limits import Limits, ListenerState
from kvsidecar.http.listener import LimitedHttpProtocol
from kvsidecar.http.openapi import ErrorBody
from kvsidecar.http.router import Router
from kvsidecar.proxy.answers import openai_error
from kvsidecar.testing.poll import until
from tests.unit.coordinator_helpers import start_harness
from tests.unit.http.test_listener import TOKEN as API_TOKEN
from tests.unit.http.test_listener import serve_api
from tests.unit.http.test_listener_retry import parse
from tests.unit.origin import Origin, OriginConn
from tests.unit.proxy.test_app import AUTH as PROXY_AUTH
from tests.unit.proxy.test_app import rig
from tests.unit.rawhttp import open_socket, read_until_closed

ROUTES = {"api": b"POST /v1/sessions/A/acquire", "proxy": b"POST /v1/chat/completions"}
TOKENS = {"api": f"Bearer {API_TOKEN}".encode(), "proxy": PROXY_AUTH["Authorization"].encode()}


def malformed(listener: str) -> dict[str, bytes]:
    """Each a request the parser refuses; otherwise well-formed (token, Host), on a route that exists."""
    head = ROUTES[listener] + b" HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: " + TOKENS[listener] + b"\r\n"
    return {
        "space in a header name": head + b"Bad Header: x\r\nContent-Length: 2\r\n\r\n{}",
        "bad chunk size": head + b"Transfer-Encoding: chunked\r\n\r\nZZ\r\n{}\r\n0\r\n\r\n",
        "two content-lengths": head + b"Content-Length: 2\r\nContent-Length: 3\r\n\r\n{}",
        "garbage request line": b"GARBAGE\r\n\r\n",
        "control byte in the target": b"GET /v1/st\x01atus HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        "bad http version": b"GET /healthz HTTP/9.Z\r\nHost: 127.0.0.1\r\n\r\n",
        "header without a colon": head + b"NoColonHere\r\nContent-Length: 2\r\n\r\n{}",
    }


CASES = list(malformed("api"))
LIMITS = Limits(max_connections=1, header_timeout_s=1, body_timeout_s=1, client_stall_s=1)


async def exchange(url: str, data: bytes) -> bytes:
    sock = open_socket(url)
    try:
        sock.sendall(data)
        answer = await read_until_closed(sock, within_s=10)  # closed after the answer, not kept alive
    finally:
        sock.close()
    assert answer is not None, "the connection was left open"
    return answer


def check_api(answer: bytes) -> dict[str, Any]:
    status, headers, body = parse(answer)
    assert status == 400 and headers["content-type"] == "application/json", answer
    assert headers["connection"] == "close"
    doc: dict[str, Any] = json.loads(body)
    assert set(doc) == {"error"} and set(doc["error"]) == {"code", "message", "hint"}
    assert doc["error"]["code"] == "KV_BAD_REQUEST"
    return doc


def check_proxy(answer: bytes) -> None:
    status, headers, body = parse(answer)
    assert status == 400 and headers["content-type"] == "application/json", answer
    assert headers["connection"] == "close"
    error = json.loads(body)["error"]
    assert error["code"] == "KV_BAD_REQUEST" and error["type"] == "invalid_request_error"
    assert error["param"] is None and error["message"]


@pytest.mark.parametrize("case", CASES)
async def test_the_hook_api_answers_a_malformed_request_in_its_shape(
    tmp_path: Path, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO)
    async for each in serve_api(tmp_path):
        check_api(await exchange(each.url, malformed("api")[case]))
        assert each.listener.bad_requests == 1
        assert each.h.coordinator.session_views() == [] and each.h.fake.calls == []
    assert [r for r in caplog.records if "kv.listener.bad_request" in r.getMessage()]


@pytest.mark.parametrize("case", CASES)
async def test_the_proxy_answers_a_malformed_request_in_openai_shape(tmp_path: Path, case: str) -> None:
    async def never(conn: OriginConn) -> None:
        raise AssertionError("a malformed request reached the upstream")

    async for each in rig(tmp_path, Origin(never)):
        check_proxy(await exchange(each.url, malformed("proxy")[case]))
        assert each.origin.connections == 0


async def test_a_malformed_request_after_a_good_one_on_a_kept_alive_connection(tmp_path: Path) -> None:
    """The first answer is whole, then the 400; nothing is written into the middle of an answer."""
    async for each in serve_api(tmp_path):
        good = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n"
        answer = await exchange(each.url, good + malformed("api")["space in a header name"])
        first, sep, rest = answer.partition(b"\r\n\r\n")
        assert first.startswith(b"HTTP/1.1 200 ") and sep
        length = next(
            int(line.split(b":")[1])
            for line in first.split(b"\r\n")
            if line.lower().startswith(b"content-length")
        )
        check_api(rest[length:])


def test_the_answer_is_the_listeners_own_shape() -> None:
    assert b"invalid_request_error" not in ListenerState("api", LIMITS).bad_request_answer
    assert (
        b'"type": "invalid_request_error"'
        in ListenerState("p", LIMITS, shape=openai_error).bad_request_answer
    )


def test_serve_uses_the_httptools_protocol_whatever_is_installed() -> None:
    """uvicorn picks h11 or httptools only for `http="auto"`; kvsidecar passes its own class (a subclass of
    the httptools protocol, httptools being a hard dependency), so the override above is what answers."""
    listener = ListenerState("api", LIMITS)

    async def app(scope: Any, receive: Any, send: Any) -> None:
        raise AssertionError("not called")

    server = _uvicorn(app, lifespan="off", listener=listener)
    config: uvicorn.Config = server.config
    config.load()
    assert issubclass(config.http_protocol_class, LimitedHttpProtocol)
    assert config.http_protocol_class.listener is listener


@pytest.mark.parametrize("check_host", [True, False])
async def test_the_document_declares_the_listeners_400_on_every_route(
    tmp_path: Path, check_host: bool
) -> None:
    h = await start_harness(tmp_path)
    try:
        app = create_app(h.coordinator, token="t" * 32, check_host=check_host)
        assert isinstance(app, Router)
        doc = app.openapi()
    finally:
        await h.coordinator.aclose()
    ops = [op for p in doc["paths"].values() for op in p.values()]
    assert ops
    for op in ops:
        declared = op["responses"]["400"]
        assert "KV_BAD_REQUEST" in declared["x-kv-codes"]
        assert declared["content"] == {
            "application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}
        }
    body = ListenerState("api", LIMITS).bad_request_answer.partition(b"\r\n\r\n")[2]
    ErrorBody.model_validate_json(body)


# A bad request behind an answer in progress (review17b item 1) --------------------------------------

HOST = b"Host: 127.0.0.1\r\n"
SLOW = b"GET /slow HTTP/1.1\r\n" + HOST + b"\r\n"  # streamed: chunk0, then waits for the test, then end
QUICK = b"GET /quick HTTP/1.1\r\n" + HOST + b"\r\n"
BAD = {
    "bad chunked body": b"POST /x HTTP/1.1\r\n" + HOST + b"Transfer-Encoding: chunked\r\n\r\nZZ\r\n",
    "bad head": b"POST /x HTTP/1.1\r\nBad Header: x\r\n\r\n",
}


class Streamer:
    """A streaming ASGI app on the real listener: `/slow` sends its first chunk, then holds its answer
    open until `release` is set; anything else answers at once. It records what it saw."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.paths: list[str] = []
        self.finished: list[str] = []

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return
        self.paths.append(scope["path"])
        while (await receive()).get("more_body"):
            pass
        headers = [(b"content-type", b"text/plain"), (b"transfer-encoding", b"chunked")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        if scope["path"] == "/slow":
            await send({"type": "http.response.body", "body": b"chunk0\n", "more_body": True})
            await self.release.wait()
            await send({"type": "http.response.body", "body": b"chunk1\n", "more_body": True})
        await send({"type": "http.response.body", "body": b"end\n"})
        self.finished.append(scope["path"])


@dataclass
class Streaming:
    url: str
    listener: ListenerState
    app: Streamer


async def serve_streamer() -> AsyncIterator[Streaming]:
    listener = ListenerState("api", LIMITS)
    app = Streamer()
    server = _uvicorn(app, lifespan="off", listener=listener)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    await until(lambda: server.started, what="uvicorn to serve")
    try:
        yield Streaming(f"http://127.0.0.1:{sock.getsockname()[1]}", listener, app)
    finally:
        app.release.set()
        server.should_exit = True
        await task


def next_answer(data: bytes) -> tuple[int, bytes, bytes]:
    """The first whole answer in `data` (status, body) and the bytes after it; its framing is checked
    strictly, so another answer written into its body fails here."""
    head, sep, rest = data.partition(b"\r\n\r\n")
    assert sep, data
    lines = head.split(b"\r\n")
    status = int(lines[0].split(b" ")[1])
    fields = dict(line.lower().split(b": ", 1) for line in lines[1:])
    if b"content-length" in fields:
        size = int(fields[b"content-length"])
        assert len(rest) >= size, data
        return status, rest[:size], rest[size:]
    assert fields[b"transfer-encoding"] == b"chunked", data
    body = bytearray()
    while True:
        size_line, sep, rest = rest.partition(b"\r\n")
        assert sep and size_line.isalnum(), data
        size = int(size_line, 16)
        assert rest[size : size + 2] == b"\r\n", data
        body += rest[:size]
        rest = rest[size + 2 :]
        if size == 0:
            return status, bytes(body), rest


async def recv_until(sock: socket.socket, marker: bytes) -> bytes:
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    data = b""
    while marker not in data:
        chunk = await asyncio.wait_for(loop.sock_recv(sock, 65536), 10)
        assert chunk, data
        data += chunk
    return data


async def answers_then_400(each: Streaming, sock: socket.socket, seen: bytes, paths: list[str]) -> None:
    """Once the 400 is due, `/slow` is let go; the answers to `paths` arrive whole and in order, then
    the 400, then the connection closes. The bad request never reached the app."""
    await until(lambda: each.listener.bad_requests == 1, what="the listener to see the bad request")
    each.app.release.set()
    rest = await read_until_closed(sock, within_s=10)
    assert rest is not None, "the connection was left open after the 400"
    data = seen + rest
    for path in paths:
        status, body, data = next_answer(data)
        expected = b"chunk0\nchunk1\nend\n" if path == "/slow" else b"end\n"
        assert (status, body) == (200, expected), (path, data)
    check_api(data)
    assert each.app.paths == paths and each.app.finished == paths


@pytest.mark.parametrize("bad", list(BAD))
async def test_a_bad_request_after_a_running_answer_waits_for_it(bad: str) -> None:
    """Two writes: the bad request arrives while `/slow` is streaming (its first chunk is out)."""
    async for each in serve_streamer():
        sock = open_socket(each.url)
        try:
            sock.sendall(SLOW)
            seen = await recv_until(sock, b"chunk0\n")
            await asyncio.get_running_loop().sock_sendall(sock, BAD[bad])
            await answers_then_400(each, sock, seen, ["/slow"])
        finally:
            sock.close()


@pytest.mark.parametrize("bad", list(BAD))
@pytest.mark.parametrize("queued", [False, True], ids=["alone", "behind a queued request"])
async def test_a_bad_request_pipelined_in_one_write_is_answered_last(bad: str, queued: bool) -> None:
    """One write: `/slow` (and maybe a whole `/quick`) then the bad request; the 400 is not taken as
    the first answer, and the handlers before it are answered normally."""
    async for each in serve_streamer():
        sock = open_socket(each.url)
        try:
            sock.sendall(SLOW + (QUICK if queued else b"") + BAD[bad])
            paths = ["/slow", "/quick"] if queued else ["/slow"]
            await answers_then_400(each, sock, b"", paths)
        finally:
            sock.close()
