"""The OpenAPI document says what the server answers (issue 17): every route of the hook API is called with
a bad body, with no token, with a bad Host, over the body cap, during the app's shutdown, and the way it is
meant to be used; each answer's status must be one the document declares for that route (not only
`default`), its error code one of the codes declared for that status, and its body must validate against
the declared schema (schemathesis resolves the `$ref`s and validates with jsonschema_rs)."""

from __future__ import annotations

import asyncio
import contextlib
import copy
import datetime
import re
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import jsonschema_rs
import pytest
import schemathesis
from schemathesis.core.failures import Failure
from schemathesis.specs.openapi.schemas import OpenApiSchema
from starlette.types import ASGIApp, Message

from kvsidecar.api.routes import create_app
from kvsidecar.errors import InvalidSessionId
from kvsidecar.http.router import Router
from kvsidecar.http.routes import Route
from kvsidecar.retention.job import RetentionJob
from kvsidecar.retention.plan import Disk
from kvsidecar.store.naming import validate_session_id
from kvsidecar.testing.poll import until
from tests.unit.coordinator_helpers import Harness, conversation

TOKEN = "c" * 32
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ROOT = Path(__file__).resolve().parents[3]
VALID_BODY: dict[str, dict[str, Any]] = {
    "AcquireBody": {"provider": "local", "model": "m"},
    "ReleaseBody": {"status": "ok"},
    "EventBody": {"type": "flush"},
}
BAD_QUERY = {"DoctorQuery": "deep=maybe", "GcQuery": "dry_run=maybe", "CheckpointQuery": "wait=maybe"}


def closed(doc: dict[str, Any]) -> dict[str, Any]:
    """The document with no undeclared keys allowed in any model: the published one leaves objects open
    (a client keeps working when an answer gains a field), but an answer with a key the models do not
    describe means they no longer mirror the handlers."""
    doc = copy.deepcopy(doc)
    for model in doc["components"]["schemas"].values():
        if "properties" in model:
            model.setdefault("additionalProperties", False)
    return doc


class Api:
    """One app over ASGI, its document, and the document loaded by schemathesis (closed)."""

    def __init__(self, h: Harness, *, lifespan: Any = None) -> None:
        retention = RetentionJob(
            store=h.coordinator.store,
            config=h.coordinator.config.retention,
            metrics=h.coordinator.metrics,
            protected_keys=h.coordinator.protected_keys,
            disk_usage=lambda _p: Disk(total_bytes=10**12, free_bytes=10**12),
        )
        self.app: ASGIApp = create_app(
            h.coordinator, retention=retention, token=TOKEN, max_body_bytes=4096, lifespan=lifespan
        )
        assert isinstance(self.app, Router)
        self.routes: list[Route] = [r for r in self.app.routes if r.in_schema]
        self.doc = self.app.openapi()
        self.schema: OpenApiSchema = schemathesis.openapi.from_dict(closed(self.doc))

    def client(self, *, token: bool = True, host: str = "127.0.0.1:8377") -> httpx.AsyncClient:
        return httpx.AsyncClient(
            transport=httpx.ASGITransport(app=self.app),
            base_url=f"http://{host}",
            headers=AUTH if token else {},
        )

    def check(self, route: Route, r: httpx.Response) -> None:
        """The answer is declared for this route, and its body is the declared one."""
        where = f"{route.method} {route.path} -> {r.status_code} {r.text[:200]}"
        responses = self.doc["paths"][route.path][route.method.lower()]["responses"]
        declared = responses.get(str(r.status_code))
        assert declared is not None, f"status not declared: {where}"
        media_type = r.headers["content-type"].split(";")[0]
        assert media_type in declared["content"], where
        self.schema[route.path][route.method].validate_response(r)
        if r.status_code >= 400:
            code = r.json()["error"]["code"]
            assert code in declared["x-kv-codes"], where
            if code in ("KV_SLOT_BUSY", "KV_SHUTTING_DOWN"):
                assert r.headers.get("retry-after") == "1", where


def url(route: Route, *, session: str = "A", lease: str = "nope", query: str = "") -> str:
    path = route.path.replace("{session_id}", session).replace("{lease_id}", lease)
    return f"{path}?{query}" if query else path


def valid_body(route: Route) -> dict[str, Any] | None:
    return VALID_BODY[route.body.__name__] if route.body is not None else None


async def call(c: httpx.AsyncClient, route: Route, **kw: Any) -> httpx.Response:
    body = kw.pop("json", valid_body(route))
    return await c.request(route.method, url(route, **kw), json=body)


def test_the_document_declares_errors_security_and_no_422(h: Harness) -> None:
    api = Api(h)
    assert "HTTPValidationError" not in api.doc["components"]["schemas"]
    assert api.doc["components"]["securitySchemes"] == {
        "bearer": {"type": "http", "scheme": "bearer", "description": "the token in api.token_file"}
    }
    for route in api.routes:
        op = api.doc["paths"][route.path][route.method.lower()]
        assert "422" not in op["responses"], route.path
        assert {"400", "413", "500", "503"} <= set(op["responses"]), route.path
        assert op["responses"]["200"]["content"], route.path
        if route.public:
            assert "security" not in op and "401" not in op["responses"]
        else:
            assert op["security"] == [{"bearer": []}] and "401" in op["responses"], route.path
    # every 200 of a JSON route has a real schema, not FastAPI's `{}` for "anything"
    for route in api.routes:
        content = api.doc["paths"][route.path][route.method.lower()]["responses"]["200"]["content"]
        assert all(media["schema"] for media in content.values()), route.path


async def test_without_a_token_configured_no_security_is_declared(h: Harness) -> None:
    app = create_app(h.coordinator)
    assert isinstance(app, Router)
    doc = app.openapi()
    assert "securitySchemes" not in doc.get("components", {})
    assert all(
        "security" not in op and "401" not in op["responses"]
        for p in doc["paths"].values()
        for op in p.values()
    )


def test_the_validator_rejects_an_answer_the_document_does_not_describe(h: Harness) -> None:
    """So that the checks below can fail: a wrong body is caught."""
    api = Api(h)
    acquire = next(r for r in api.routes if r.path == "/v1/sessions/{session_id}/acquire")

    def answer(status: int, body: object) -> httpx.Response:
        r = httpx.Response(status, json=body, request=httpx.Request("POST", "http://127.0.0.1/"))
        r.elapsed = datetime.timedelta(0)
        return r

    schema_mismatch = (Failure, BaseExceptionGroup)  # one failure, or several
    with pytest.raises(schema_mismatch):
        api.check(acquire, answer(200, {"outcome": "warm", "lease_id": 5}))
    with pytest.raises(schema_mismatch):
        api.check(acquire, answer(503, {"error": {"code": "KV_SLOT_BUSY"}}))  # no message, no hint
    error = {"code": "KV_SLOT_BUSY", "message": "m", "hint": "h"}
    with pytest.raises(schema_mismatch):
        api.check(acquire, answer(503, {"error": {**error, "undeclared": 1}}))
    with pytest.raises(AssertionError, match="404"):  # a code not declared for that status
        api.check(acquire, answer(404, {"error": {"code": "KV_NOT_FOUND", "message": "", "hint": ""}}))
    with pytest.raises(AssertionError, match="status not declared"):
        api.check(acquire, answer(422, {"detail": []}))


async def test_bad_input_on_every_route_is_declared(h: Harness) -> None:
    api = Api(h)
    async with api.client() as c:
        for route in api.routes:
            r = await c.request(
                route.method,
                url(route, query=BAD_QUERY.get(route.query.__name__, "") if route.query else ""),
                content=b"{bad",
                headers={"content-type": "application/json"},
            )
            api.check(route, r)
            if route.body is not None or route.query is not None:
                assert r.status_code == 400 and r.json()["error"]["code"] == "KV_BAD_REQUEST"
            if "{session_id}" in route.path:
                r = await call(c, route, session="a%00b")
                api.check(route, r)
                assert r.json()["error"]["code"] == "KV_INVALID_SESSION_ID"
            r = await c.request(route.method, url(route), content=b"x" * 5000)
            assert r.status_code == 413
            api.check(route, r)
    async with api.client(host="evil.example.com") as c:
        for route in api.routes:
            r = await call(c, route)
            assert r.status_code == 400
            api.check(route, r)
    assert h.coordinator.session_views() == [] and h.fake.calls == []


async def test_no_token_on_every_route_is_declared(h: Harness) -> None:
    api = Api(h)
    async with api.client(token=False) as c:
        for route in api.routes:
            r = await call(c, route)
            api.check(route, r)
            assert r.status_code == (200 if route.public else 401), route.path
    assert h.coordinator.session_views() == [] and h.fake.calls == []


@contextlib.asynccontextmanager
async def lifespan_of(app: ASGIApp) -> AsyncIterator[tuple[asyncio.Queue[Message], asyncio.Queue[Message]]]:
    """Runs the app's lifespan as uvicorn does (`kvsidecar serve`); yields (to the app, from the app)."""
    inbox: asyncio.Queue[Message] = asyncio.Queue()
    outbox: asyncio.Queue[Message] = asyncio.Queue()
    task = asyncio.ensure_future(app({"type": "lifespan", "asgi": {"version": "3.0"}}, inbox.get, outbox.put))
    await inbox.put({"type": "lifespan.startup"})
    assert (await outbox.get())["type"] == "lifespan.startup.complete"
    try:
        yield inbox, outbox
    finally:
        await task


async def test_every_route_during_and_after_shutdown_is_declared(h: Harness) -> None:
    """Driven like service.Daemon.app: the lifespan's exit closes the coordinator (shutdown checkpoint).
    While it runs, and after, every route but the public ones answers 503 KV_SHUTTING_DOWN."""
    closing, finish = asyncio.Event(), asyncio.Event()

    @contextlib.asynccontextmanager
    async def lifespan(_: Any) -> AsyncIterator[None]:
        yield
        closing.set()
        await finish.wait()
        await h.coordinator.aclose()

    api = Api(h, lifespan=lifespan)
    # a slot that is not free now is KV_SLOT_BUSY at once (never waits)
    h.coordinator.acquirer.acquire_timeout_s = 0
    async with lifespan_of(api.app) as (inbox, outbox), api.client() as c:
        lease = (await c.post("/v1/sessions/A/acquire", json=VALID_BODY["AcquireBody"])).json()["lease_id"]
        await inbox.put({"type": "lifespan.shutdown"})
        await closing.wait()
        during = [(route, await call(c, route, lease=lease)) for route in api.routes]
        finish.set()
        assert (await outbox.get())["type"] == "lifespan.shutdown.complete"
        after = [(route, await call(c, route, lease=lease)) for route in api.routes]
    for route, r in during + after:
        api.check(route, r)
        if route.public:
            assert r.status_code == 200
        else:
            assert r.status_code == 503 and r.json()["error"]["code"] == "KV_SHUTTING_DOWN", route.path
    assert len(h.coordinator.leases) == 1  # the release was refused, not half-done after the checkpoint


async def test_a_request_cancelled_by_the_server_at_shutdown_is_a_declared_503(h: Harness) -> None:
    """uvicorn cancels what still runs when its graceful-shutdown time is over: an acquire waiting for the
    only slot was a bare text/plain 500 from uvicorn, undeclared."""
    api = Api(h)
    acquire = next(r for r in api.routes if r.path == "/v1/sessions/{session_id}/acquire")
    async with api.client() as c:
        first = await call(c, acquire, session="A")
        waiting = asyncio.ensure_future(call(c, acquire, session="B"))
        srv = h.coordinator.servers["local"]
        await until(lambda: h.coordinator.pool.queued(srv), interval_s=0, what="B's acquire to queue")
        waiting.cancel()
        r = await waiting
        api.check(acquire, r)
        assert r.status_code == 503 and r.json()["error"]["code"] == "KV_SHUTTING_DOWN"
        assert not h.coordinator.pool.queued(srv)
        release = await c.post(f"/v1/leases/{first.json()['lease_id']}/release", json={"status": "aborted"})
        assert release.status_code == 200


async def test_every_route_used_as_meant_answers_its_declared_200(h: Harness) -> None:
    api = Api(h)
    by = {(r.method, r.path): r for r in api.routes}
    answers: list[tuple[Route, httpx.Response]] = []

    async def use(method: str, path: str, **kw: Any) -> httpx.Response:
        route = by[(method, path)]
        r = await call(c, route, **kw)
        answers.append((route, r))
        assert r.status_code == 200, f"{method} {path}: {r.text}"
        return r

    acquire, release = "/v1/sessions/{session_id}/acquire", "/v1/leases/{lease_id}/release"
    async with api.client() as c:
        lease = (await use("POST", acquire)).json()
        point = await use("POST", "/v1/leases/{lease_id}/prompt-point", lease=lease["lease_id"])
        assert point.json()["taken"] is False  # no prompt sent: no point asked for
        h.fake.infer(lease["slot_id"], conversation("A", 1))
        await use("POST", release, lease=lease["lease_id"], json={"status": "ok", "prompt_tokens": 50})
        assert (await use("POST", "/v1/sessions/{session_id}/events")).json()["saved"] == 1  # flush
        await use("POST", "/v1/sessions/{session_id}/save")
        other = (await use("POST", acquire, session="B")).json()  # evicts A
        await use("POST", release, lease=other["lease_id"], json={"status": "aborted"})
        assert (await use("POST", "/v1/sessions/{session_id}/restore")).json()["outcome"] == "restored"
        again = (await use("POST", acquire)).json()
        released = await use(
            "POST",
            release,
            lease=again["lease_id"],
            json={"status": "ok", "prompt_tokens": 5, "cached_tokens": 50},
        )
        assert released.json()["restore_verification"] == "effective"
        aux = (await use("POST", "/v1/acquire")).json()
        await use("POST", release, lease=aux["lease_id"], json={"status": "aborted"})
        bypass = await use("POST", acquire, json={"provider": "openai", "model": "gpt"})
        assert bypass.json()["outcome"] == "bypass"
        listed = (await use("GET", "/v1/sessions")).json()["sessions"]
        assert any(v["snapshot"] and v["snapshot"]["generations"] for v in listed)
        await use("GET", "/v1/sessions/{session_id}")
        await use("GET", "/v1/status")
        await use("GET", "/metrics")
        await use("GET", "/v1/doctor")
        await use("POST", "/v1/gc", query="dry_run=true")
        assert (await use("POST", "/v1/checkpoint", query="wait=true")).json()["waited"] is True
        await use("POST", "/v1/sessions/{session_id}/invalidate")
        await use("DELETE", "/v1/sessions/{session_id}")
        await use("GET", "/healthz")
    assert {route.path for route, _ in answers} == {r.path for r in api.routes}  # every route, once at least
    for route, r in answers:
        api.check(route, r)


@pytest.mark.parametrize(
    "session", ["A", "a.b:c@d+e-f_9", "x" * 128, "", "x" * 129, "a b", "a/b", "é", "a\n"]
)
def test_the_documented_session_id_pattern_is_the_servers_rule(h: Harness, session: str) -> None:
    doc = Api(h).doc
    (param,) = doc["paths"]["/v1/sessions/{session_id}/acquire"]["post"]["parameters"]
    documented = jsonschema_rs.validator_for(param["schema"]).is_valid(session)  # ECMA regex, as clients
    try:
        validate_session_id(session)
        served = True
    except InvalidSessionId:
        served = False
    assert documented == served


def documented_routes() -> Iterator[tuple[str, str]]:
    """The `| `METHOD /path` |` rows of docs/API.md's "All routes" table."""
    text = (ROOT / "docs" / "API.md").read_text()
    table = text.split("## All routes", 1)[1].split("\n## ", 1)[0]
    for m in re.finditer(r"^\| `(GET|POST|DELETE|PUT|PATCH) ([^`?\s]+)(?:\?[^`]*)?`", table, re.M):
        yield m.group(1), m.group(2)


def test_docs_api_md_lists_exactly_the_served_routes(h: Harness) -> None:
    api = Api(h)
    assert isinstance(api.app, Router)
    served = {(r.method, r.path) for r in api.app.routes}
    listed = list(documented_routes())
    assert len(listed) == len(set(listed))
    assert set(listed) == served


async def test_no_docs_page_that_would_load_from_a_cdn(h: Harness) -> None:
    """FastAPI's /docs and /redoc pull Swagger UI / ReDoc from a CDN: blank on an offline box. Only the
    document itself is served."""
    api = Api(h)
    async with api.client() as c:
        for path in ("/docs", "/redoc", "/docs/oauth2-redirect"):
            r = await c.get(path)
            assert r.status_code == 404 and r.json()["error"]["code"] == "KV_NOT_FOUND", path
        r = await c.get("/openapi.json")
    assert r.status_code == 200 and r.json() == api.doc
