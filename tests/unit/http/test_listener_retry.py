"""The listener's own 503 (every connection busy: `KV_TOO_MANY_CONNECTIONS`) says when to try again, as the
apps' 503s do: `Retry-After: 1`, on the hook API's listener and on the proxy's (OpenAI-shaped body), and the
OpenAPI document declares that header on the 503 it declares for every route (issue 17)."""

from __future__ import annotations

from pathlib import Path

import h11
import pytest

from kvsidecar.api.routes import create_app
from kvsidecar.http.limits import Limits, ListenerState
from kvsidecar.http.router import Router
from kvsidecar.proxy.answers import openai_error
from tests.unit.coordinator_helpers import start_harness
from tests.unit.http.test_listener import accepted, heads_read, serve_api
from tests.unit.rawhttp import open_socket, read_until_closed

LIMITS = Limits(max_connections=1, header_timeout_s=5, body_timeout_s=5, client_stall_s=5)


def parse(answer: bytes) -> tuple[int, dict[str, str], bytes]:
    """A whole HTTP/1.1 answer, read by h11 as a client would (it refuses a malformed head)."""
    conn = h11.Connection(h11.CLIENT)
    conn.send(h11.Request(method="GET", target="/", headers=[("host", "x")]))
    conn.send(h11.EndOfMessage())
    conn.receive_data(answer)
    head = conn.next_event()
    assert isinstance(head, h11.Response), head
    data = conn.next_event()
    assert isinstance(data, h11.Data) and isinstance(conn.next_event(), h11.EndOfMessage)
    return head.status_code, {k.decode(): v.decode() for k, v in head.headers}, bytes(data.data)


@pytest.mark.parametrize("shape", [None, openai_error], ids=["api", "proxy"])
def test_the_canned_503_says_retry_after_and_the_408_does_not(shape: object) -> None:
    state = ListenerState("x", LIMITS, shape=openai_error if shape else None)
    status, headers, body = parse(state.refused_answer)
    assert status == 503 and headers["retry-after"] == "1" and headers["connection"] == "close"
    assert b'"code": "KV_TOO_MANY_CONNECTIONS"' in body
    status, headers, _ = parse(state.timed_out_answer)
    assert status == 408 and "retry-after" not in headers


async def test_a_refused_newcomer_reads_retry_after(tmp_path: Path) -> None:
    """Over a real socket, as `kvsidecar serve` runs the hook API."""
    async for each in serve_api(tmp_path, max_connections=1, header_timeout_s=5, body_timeout_s=5):
        busy = open_socket(each.url)
        try:  # a head in, its body pending: busy with a request, not evictable
            busy.sendall(b"POST /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 10\r\n\r\n")
            await accepted(each.listener, 1)
            await heads_read(each.listener)
            newcomer = open_socket(each.url)
            answer = await read_until_closed(newcomer, within_s=10)
            newcomer.close()
        finally:
            busy.close()
        assert answer is not None
        status, headers, _ = parse(answer)
        assert status == 503 and headers["retry-after"] == "1"


async def test_the_document_declares_retry_after_on_every_503(tmp_path: Path) -> None:
    h = await start_harness(tmp_path)
    try:
        app = create_app(h.coordinator, token="t" * 32)
        assert isinstance(app, Router)
        doc = app.openapi()
    finally:
        await h.coordinator.aclose()
    ops = [op for p in doc["paths"].values() for op in p.values()]
    assert ops
    for op in ops:
        declared = op["responses"]["503"]
        assert "KV_TOO_MANY_CONNECTIONS" in declared["x-kv-codes"]
        header = declared["headers"]["Retry-After"]
        assert header["schema"] == {"type": "integer"}
        assert "KV_TOO_MANY_CONNECTIONS" in header["description"]
