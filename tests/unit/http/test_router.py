"""One router (issue 14, item 3): every route of the hook API is defined once, served by one dispatcher and
documented from the same table. The same malformed input gets the same status and the same error body on
every route that takes it, in-process and over a real listener alike."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
from starlette.types import Message

from kvsidecar.api.bodies import AcquireBody, EventBody, ReleaseBody
from kvsidecar.api.routes import PARAMS, create_app, routes
from kvsidecar.daemon.service import _uvicorn
from kvsidecar.http.limits import Limits, ListenerState
from kvsidecar.http.router import Router
from kvsidecar.http.routes import Call, Route
from kvsidecar.testing.poll import until
from tests.unit.coordinator_helpers import Harness

TOKEN = "r" * 32
AUTH = {"Authorization": f"Bearer {TOKEN}"}
VALID: dict[type, dict[str, Any]] = {
    AcquireBody: {"provider": "local", "model": "m"},
    ReleaseBody: {"status": "ok"},
    EventBody: {"type": "flush"},
}
BAD_SESSION_IDS = ["a%00b", "x" * 129, "a%20b", "%C3%A9", "a%0Ab", ".." + "x" * 200]
# Malformed whatever the route's body model is.
BAD_BODIES = [b"", b"   ", b"{bad", b"[]", b"null", b'"x"', b"1", b"[" * 5000 + b"]" * 5000, b"\xff\xfe"]
BAD_LEASE_IDS = ["nope", "x" * 65, "x" * 2000, "%00", "a%20b", "%2E%2E", "%FF"]

Answer = tuple[int, dict[str, Any]]


def asgi(h: Harness) -> httpx.AsyncClient:
    app = create_app(h.coordinator, token=TOKEN)
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url="http://127.0.0.1:8377", headers=AUTH
    )


@contextlib.asynccontextmanager
async def listening(h: Harness) -> AsyncIterator[httpx.AsyncClient]:
    """The same app behind uvicorn and kvsidecar's listener protocol, as `kvsidecar serve` runs it."""
    listener = ListenerState("api", Limits.of(h.coordinator.config.api))
    server = _uvicorn(create_app(h.coordinator, token=TOKEN), lifespan="off", listener=listener)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    task = asyncio.ensure_future(server.serve(sockets=[sock]))
    await until(lambda: server.started, what="uvicorn to serve")
    try:
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        async with httpx.AsyncClient(base_url=url, headers=AUTH, timeout=10) as c:
            yield c
    finally:
        server.should_exit = True
        await task


async def answer(c: httpx.AsyncClient, method: str, path: str, body: bytes | None) -> Answer:
    r = await c.request(method, path, content=body, headers={"content-type": "application/json"})
    return r.status_code, r.json()


def table(h: Harness) -> list[Route]:
    return routes(h.coordinator)


def with_body(route: Route) -> bytes | None:
    return httpx.Request("POST", "/", json=VALID[route.body]).content if route.body is not None else None


def session_cases(h: Harness) -> Iterator[tuple[str, str, bytes | None]]:
    for route in table(h):
        if "{session_id}" in route.path:
            yield route.method, route.path, with_body(route)


def assert_nothing_changed(h: Harness) -> None:
    assert h.coordinator.session_views() == [] and h.fake.calls == []


async def test_every_route_is_defined_once_and_documented_from_the_same_table(h: Harness) -> None:
    served = {(r.method, r.path) for r in table(h)}
    assert len(served) == len(table(h))
    async with asgi(h) as c:
        spec = (await c.get("/openapi.json")).json()
    documented = {(m.upper(), p) for p, ops in spec["paths"].items() for m in ops}
    assert documented == served
    for ops in spec["paths"].values():
        for op in ops.values():
            assert "422" not in op["responses"]  # FastAPI's validation answer is never ours
            assert op["responses"]["default"]["content"]["application/json"]["schema"]["$ref"].endswith(
                "/ErrorBody"
            )
    acquire = spec["paths"]["/v1/sessions/{session_id}/acquire"]["post"]
    assert acquire["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/AcquireBody")
    assert [p["name"] for p in spec["paths"]["/v1/doctor"]["get"]["parameters"]] == ["deep"]


@pytest.mark.parametrize("bad", BAD_SESSION_IDS)
async def test_a_malformed_session_id_gets_one_answer_on_every_route(h: Harness, bad: str) -> None:
    async with asgi(h) as c:
        answers = {
            (method, path): await answer(c, method, path.replace("{session_id}", bad), body)
            for method, path, body in session_cases(h)
        }
        # the id is checked before the body: a bad body does not change the answer
        answers |= {
            ("bad body", path): await answer(c, method, path.replace("{session_id}", bad), b"{bad")
            for method, path, body in session_cases(h)
            if body is not None
        }
    distinct = set(map(repr, answers.values()))
    assert len(distinct) == 1, answers
    status, data = next(iter(answers.values()))
    assert status == 400 and data["error"]["code"] == "KV_INVALID_SESSION_ID"
    assert_nothing_changed(h)


@pytest.mark.parametrize("bad", BAD_BODIES, ids=lambda b: repr(b[:12]))
async def test_a_malformed_body_gets_one_answer_on_every_route_that_takes_one(h: Harness, bad: bytes) -> None:
    async with asgi(h) as c:
        answers = {
            (r.method, r.path): await answer(c, r.method, r.path.replace("{session_id}", "A"), bad)
            for r in table(h)
            if r.body is not None
        }
    assert len(answers) >= 5
    assert len(set(map(repr, answers.values()))) == 1, answers
    status, data = next(iter(answers.values()))
    assert status == 400 and data["error"]["code"] == "KV_BAD_REQUEST" and data["error"]["message"]
    assert_nothing_changed(h)


@pytest.mark.parametrize(
    "bad",
    [
        {"provider": 5, "model": "m"},
        {"model": "m"},
        {"provider": "", "model": "m"},
        {"provider": "local", "model": "m" * 257},
        {"provider": "local", "model": "m", "purpose": ""},
    ],
)
async def test_an_invalid_acquire_body_gets_one_answer_on_each_route_that_reads_it(
    h: Harness, bad: dict[str, Any]
) -> None:
    body = httpx.Request("POST", "/", json=bad).content
    async with asgi(h) as c:
        answers = [
            await answer(c, "POST", path, body)
            for path in ("/v1/sessions/A/acquire", "/v1/acquire", "/v1/sessions/A/restore")
        ]
    assert len(set(map(repr, answers))) == 1, answers
    assert answers[0][0] == 400 and answers[0][1]["error"]["code"] == "KV_BAD_REQUEST"
    assert_nothing_changed(h)


async def test_a_malformed_lease_id_is_answered_like_an_unknown_one(h: Harness) -> None:
    """Issue 14: it was 404 on the hot path and 400 on its FastAPI twin."""
    async with asgi(h) as c:
        answers = [
            await answer(c, "POST", f"/v1/leases/{bad}/release", b'{"status": "ok"}') for bad in BAD_LEASE_IDS
        ]
    assert len(set(map(repr, answers))) == 1, answers
    assert answers[0][0] == 404 and answers[0][1]["error"]["code"] == "KV_LEASE_NOT_FOUND"
    assert_nothing_changed(h)


async def test_a_real_listener_answers_exactly_like_the_app(h: Harness) -> None:
    cases: list[tuple[str, str, bytes | None]] = [
        (method, path.replace("{session_id}", bad), body)
        for method, path, body in session_cases(h)
        for bad in BAD_SESSION_IDS[:3]
    ]
    cases += [("POST", "/v1/sessions/A/acquire", bad) for bad in BAD_BODIES]
    cases += [("POST", f"/v1/leases/{bad}/release", b'{"status": "ok"}') for bad in BAD_LEASE_IDS]
    cases += [
        ("GET", "/v1/status/", None),
        ("GET", "/v1/sessions/..%2F..%2Fetc/acquire", None),
        ("DELETE", "/v1/status", None),
        ("GET", "/v1/sessions/A/acquire", None),
        ("GET", "/v1/doctor?deep=maybe", None),
        ("PUT", "/nothing", b"{}"),
    ]
    async with asgi(h) as c:
        in_process = [await answer(c, *case) for case in cases]
    async with listening(h) as c:
        over_http = [await answer(c, *case) for case in cases]
    assert over_http == in_process
    assert_nothing_changed(h)


async def test_unknown_routes_and_wrong_methods(h: Harness) -> None:
    async with asgi(h) as c:
        for path in ("/v1/status/", "//v1/status", "/V1/status", "/v1/sessions/A/acquire/"):
            r = await c.post(path, json=VALID[AcquireBody])
            assert r.status_code == 404 and r.json()["error"]["code"] == "KV_NOT_FOUND", path
        r = await c.get("/v1/sessions/A/acquire")
        assert r.status_code == 405 and r.headers["allow"] == "POST"
        assert r.json()["error"]["code"] == "KV_METHOD_NOT_ALLOWED"
        r = await c.put("/v1/sessions/A")
        assert r.status_code == 405 and r.headers["allow"] == "DELETE, GET"
    async with asgi(h) as c:
        c.headers.pop("Authorization")
        assert (await c.get("/v1/nothing")).status_code == 401  # no route map for strangers
        assert (await c.post("/healthz")).status_code == 405  # a public path stays public


async def test_query_parameters_are_validated(h: Harness) -> None:
    async with asgi(h) as c:
        r = await c.get("/v1/doctor", params={"deep": "maybe"})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("deep: ")


async def test_an_unexpected_error_is_a_json_500_and_logged(
    h: Harness, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken() -> dict[str, Any]:
        raise RuntimeError("boom")

    monkeypatch.setattr(h.coordinator, "status", broken)
    with caplog.at_level(logging.ERROR, logger="kvsidecar.api"):
        async with asgi(h) as c:
            r = await c.get("/v1/status")
    assert r.status_code == 500 and r.json()["error"]["code"] == "KV_INVARIANT"
    assert "boom" not in r.text and "RuntimeError: boom" in caplog.text


async def test_lifespan_enters_and_leaves_the_context(h: Harness) -> None:
    seen: list[str] = []

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        seen.append("start")
        yield
        seen.append("stop")

    app = create_app(h.coordinator, token=TOKEN, lifespan=lifespan)
    inbox = [{"type": "lifespan.shutdown"}, {"type": "lifespan.startup"}]
    sent: list[str] = []

    async def receive() -> Message:
        return inbox.pop()

    async def send(message: Message) -> None:
        sent.append(message["type"])

    await app({"type": "lifespan"}, receive, send)
    assert seen == ["start", "stop"]
    assert sent == ["lifespan.startup.complete", "lifespan.shutdown.complete"]


def test_a_route_cannot_be_defined_twice_or_with_an_unknown_parameter() -> None:
    async def handler(_: Call) -> dict[str, Any]:
        return {}

    one = Route(method="GET", path="/v1/x/{session_id}", handler=handler)
    with pytest.raises(ValueError, match="defined twice"):
        Router([one, one], PARAMS, token=None, check_host=False, max_body_bytes=1024)
    with pytest.raises(ValueError, match="no converter"):
        Router(
            [Route(method="GET", path="/v1/{what}", handler=handler)],
            PARAMS,
            token=None,
            check_host=False,
            max_body_bytes=1024,
        )
