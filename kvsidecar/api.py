"""The hook API (docs/PRODUCT.md): a thin FastAPI adapter over the coordinator.

Every route but `/healthz` needs `Authorization: Bearer <token>` when a token is configured. Errors are
`{"error": {"code", "message", "hint"}}` with the stable codes of `kvsidecar.errors`, whose `HTTP_STATUS` is
the only code -> status mapping. Bodies are capped (`api.max_body_bytes`); on a loopback listener the Host
header must name a loopback host (a DNS-rebinding page cannot reach us).
"""

from __future__ import annotations

import hmac
import ipaddress
import re
from collections.abc import Awaitable, Callable, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Annotated, Any, TypeVar

from fastapi import FastAPI, Path, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from kvsidecar import __version__
from kvsidecar.coordinator.core import Coordinator, EventType, ReleaseStatus
from kvsidecar.doctor import Doctor
from kvsidecar.errors import (
    BadRequest,
    KvError,
    LeaseNotFound,
    NotFound,
    PayloadTooLarge,
    SlotBusy,
    Unauthorized,
    http_status,
)
from kvsidecar.retention import RetentionJob
from kvsidecar.store.naming import validate_session_id

SessionIdPath = Annotated[str, Path(description="opaque harness session id, 1-128 of [A-Za-z0-9._:@+-]")]
LeaseIdPath = Annotated[str, Path(min_length=1, max_length=64)]
_Label = Annotated[str, Field(min_length=1, max_length=256)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class AcquireBody(_Body):
    provider: _Label
    model: _Label
    purpose: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    seq: Annotated[int, Field(ge=0)] | None = None


class ReleaseBody(_Body):
    status: ReleaseStatus
    prompt_tokens: Annotated[int, Field(ge=0)] | None = None
    cached_tokens: Annotated[int, Field(ge=0)] | None = None


class EventBody(_Body):
    type: EventType
    seq: Annotated[int, Field(ge=0)] | None = None


BodyT = TypeVar("BodyT", bound=_Body)


def error_response(exc: KvError) -> JSONResponse:
    headers = {"Retry-After": "1"} if isinstance(exc, SlotBusy) else None
    return JSONResponse({"error": exc.to_dict()}, status_code=http_status(exc), headers=headers)


class Guard:
    """Pure ASGI middleware in front of every route: Host check, bearer token, body cap.

    Pure ASGI (not BaseHTTPMiddleware) because this sits on the resident hot path. Bodies here are small:
    the whole body is read up to the cap, then replayed to the app.
    """

    def __init__(self, app: ASGIApp, *, token: str | None, check_host: bool, max_bytes: int) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode() if token is not None else None
        self.check_host = check_host
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        refusal = self._refuse(scope, headers)
        if refusal is not None:
            await error_response(refusal)(scope, receive, send)
            return
        try:
            body = await read_body(receive, self.max_bytes)
        except ClientGone:
            return  # nobody to answer
        if body is None:
            await error_response(PayloadTooLarge(f"request body is over {self.max_bytes} bytes"))(
                scope, receive, send
            )
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": bytes(body), "more_body": False}

        await self.app(scope, replay, send)

    def _refuse(self, scope: Scope, headers: dict[bytes, bytes]) -> KvError | None:
        refusal = refuse(scope, headers, expected=self.expected, check_host=self.check_host)
        if refusal is not None:
            return refusal
        length = headers.get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return PayloadTooLarge(f"request body is over {self.max_bytes} bytes")
        return None


def refuse(
    scope: Scope,
    headers: dict[bytes, bytes],
    *,
    expected: bytes | None,
    check_host: bool,
    exempt: bool | None = None,
) -> KvError | None:
    """The checks every listener makes before reading a request: loopback Host, bearer token.

    `exempt`: the route needs no token (default: the path is our `/healthz`)."""
    if check_host and not _loopback_host(headers.get(b"host", b"").decode("latin-1")):
        return BadRequest("Host header must name a loopback address", hint="DNS rebinding guard")
    if exempt is None:
        exempt = scope.get("path") == "/healthz"  # liveness probe
    if (
        expected is not None
        and not exempt
        and not hmac.compare_digest(headers.get(b"authorization", b""), expected)
    ):
        return Unauthorized("missing or wrong bearer token")
    return None


class ClientGone(Exception):
    """The client left (or was cut by a listener limit) before its request body was complete."""


async def read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole request body, or None when it is over `limit` bytes. Raises `ClientGone` when the
    connection ends first: a partial body is never taken for a whole one."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientGone("the client left before its request body was complete")
        body += message.get("body", b"")
        if len(body) > limit:
            return None
        if not message.get("more_body", False):
            return bytes(body)


def validation_message(errors: Sequence[Any]) -> str:
    """One line naming the first offending field, the same for FastAPI's and our own validation."""
    err = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
    return f"{where}: {err.get('msg')}" if where else str(err.get("msg"))


def _parse(model: type[BodyT], raw: bytes) -> BodyT:
    try:
        return model.model_validate_json(raw or b"null")
    except ValidationError as exc:
        raise BadRequest(validation_message(exc.errors())) from None


_ACQUIRE = re.compile(r"^/v1/sessions/([^/]+)/acquire$")
_RELEASE = re.compile(r"^/v1/leases/([^/]+)/release$")


class HotPath:
    """acquire and release answered right here, in front of the whole FastAPI stack.

    They run around every model call, so they skip FastAPI's middleware layers, routing and dependency
    solving (measured: about a third of the daemon's CPU per call). Same bodies, same validation, same
    errors as their FastAPI twins, which stay registered so the OpenAPI document describes them.
    Everything else goes to FastAPI. Sits inside `Guard`, so Host, token and body cap are already checked.
    """

    def __init__(self, app: ASGIApp, coordinator: Coordinator) -> None:
        self.app = app
        self.coordinator = coordinator

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["method"] == "POST":
            path = scope["path"]
            if (m := _ACQUIRE.match(path)) is not None:
                await self._answer(self._acquire(m.group(1), receive), scope, receive, send)
                return
            if (m := _RELEASE.match(path)) is not None:
                await self._answer(self._release(m.group(1), receive), scope, receive, send)
                return
        await self.app(scope, receive, send)

    @staticmethod
    async def _answer(work: Awaitable[dict[str, Any]], scope: Scope, receive: Receive, send: Send) -> None:
        try:
            response: Response = JSONResponse(await work)
        except KvError as exc:
            response = error_response(exc)
        await response(scope, receive, send)

    async def _acquire(self, session_id: str, receive: Receive) -> dict[str, Any]:
        body = _parse(AcquireBody, await _one_body(receive))
        return await acquire_session(self.coordinator, session_id, body)

    async def _release(self, lease_id: str, receive: Receive) -> dict[str, Any]:
        body = _parse(ReleaseBody, await _one_body(receive))
        if not 0 < len(lease_id) <= 64:
            raise LeaseNotFound("no such lease")
        return await release_lease(self.coordinator, lease_id, body)


async def acquire_session(coordinator: Coordinator, session_id: str, body: AcquireBody) -> dict[str, Any]:
    """The acquire hook, for both HotPath and its FastAPI twin."""
    result = await coordinator.acquire(
        validate_session_id(session_id),
        provider=body.provider,
        model=body.model,
        purpose=body.purpose,
        seq=body.seq,
    )
    return result.to_dict()


async def release_lease(coordinator: Coordinator, lease_id: str, body: ReleaseBody) -> dict[str, Any]:
    """The release hook, for both HotPath and its FastAPI twin."""
    return await coordinator.release(
        lease_id, status=body.status, prompt_tokens=body.prompt_tokens, cached_tokens=body.cached_tokens
    )


async def _one_body(receive: Receive) -> bytes:
    body = await read_body(receive, 1 << 30)  # already capped by Guard
    return body or b""


def is_loopback(host: str) -> bool:
    """A loopback host name or address (no port)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _loopback_host(host_header: str) -> bool:
    host = host_header.rsplit(":", 1)[0] if not host_header.endswith("]") else host_header
    return is_loopback(host.strip("[]").lower())


def create_app(
    coordinator: Coordinator,
    *,
    retention: RetentionJob | None = None,
    token: str | None = None,
    max_body_bytes: int = 64 * 1024,
    check_host: bool = True,
    lifespan: Callable[[FastAPI], AbstractAsyncContextManager[None]] | None = None,
) -> ASGIApp:
    """The hook API as an ASGI app: Guard -> HotPath (acquire, release) -> FastAPI (everything else)."""
    app = FastAPI(
        title="kvsidecar",
        version=__version__,
        description="KV-cache persistence for llama-server",
        lifespan=lifespan,
    )
    app.state.coordinator = coordinator
    _install_error_handlers(app)
    _install_routes(app, coordinator)
    _install_doctor(app, coordinator)
    if retention is not None:
        _install_gc(app, retention)
    return Guard(HotPath(app, coordinator), token=token, check_host=check_host, max_bytes=max_body_bytes)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(KvError)
    async def kv_error(_: Request, exc: KvError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(BadRequest(validation_message(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            return error_response(NotFound("no such route"))
        code = "KV_METHOD_NOT_ALLOWED" if exc.status_code == 405 else "KV_BAD_REQUEST"
        return JSONResponse(
            {"error": {"code": code, "message": str(exc.detail), "hint": ""}}, exc.status_code
        )


def _install_routes(app: FastAPI, coordinator: Coordinator) -> None:
    @app.get("/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok", "version": __version__}

    @app.post("/v1/sessions/{session_id}/acquire")
    async def acquire(session_id: SessionIdPath, body: AcquireBody) -> dict[str, Any]:
        return await acquire_session(coordinator, session_id, body)

    @app.post("/v1/acquire")
    async def acquire_auxiliary(body: AcquireBody) -> dict[str, Any]:
        """An auxiliary request with no session (titles, compaction): it never becomes a session's state."""
        result = await coordinator.acquire(
            None, provider=body.provider, model=body.model, purpose=body.purpose
        )
        return result.to_dict()

    @app.post("/v1/leases/{lease_id}/release")
    async def release(lease_id: LeaseIdPath, body: ReleaseBody) -> dict[str, Any]:
        return await release_lease(coordinator, lease_id, body)

    @app.post("/v1/sessions/{session_id}/events")
    async def session_event(session_id: SessionIdPath, body: EventBody) -> dict[str, Any]:
        return await coordinator.session_event(validate_session_id(session_id), body.type, seq=body.seq)

    @app.post("/v1/sessions/{session_id}/save")
    async def save(session_id: SessionIdPath) -> dict[str, Any]:
        return await coordinator.save(validate_session_id(session_id))

    @app.post("/v1/sessions/{session_id}/restore")
    async def restore(session_id: SessionIdPath, body: AcquireBody) -> dict[str, Any]:
        """Bring a session into its slot now (normally restores are lazy, on the first acquire)."""
        result = await coordinator.acquire(
            validate_session_id(session_id), provider=body.provider, model=body.model
        )
        if result.lease_id is not None:
            await coordinator.release(result.lease_id, status="aborted")
        out = result.to_dict()
        out.pop("lease_id", None)
        return out

    @app.post("/v1/sessions/{session_id}/invalidate")
    async def invalidate(session_id: SessionIdPath) -> dict[str, Any]:
        return await coordinator.invalidate(validate_session_id(session_id))

    @app.delete("/v1/sessions/{session_id}")
    async def purge(session_id: SessionIdPath) -> dict[str, Any]:
        return await coordinator.purge(validate_session_id(session_id))

    _install_view_routes(app, coordinator)


def _install_doctor(app: FastAPI, coordinator: Coordinator) -> None:
    @app.get("/v1/doctor")
    async def doctor(deep: bool = False) -> dict[str, Any]:
        """Spec §48 checks for every server; `deep` runs a save/erase/restore round trip on a held slot."""
        reports = []
        for name, srv in coordinator.servers.items():

            async def hold(fn: Callable[[int], Awaitable[Any]], name: str = name) -> Any:
                return await coordinator.with_slot(name, fn)

            doc = Doctor(config=coordinator.config, server=name, backend=srv.backend, hold_slot=hold)
            reports.append((await doc.run(deep=deep)).to_dict())
        order = ["READY", "DEGRADED", "NOT READY"]
        return {"result": max((r["result"] for r in reports), key=order.index), "servers": reports}


def _install_gc(app: FastAPI, retention: RetentionJob) -> None:
    @app.post("/v1/gc")
    async def gc(dry_run: bool = False) -> dict[str, Any]:
        """Run retention now: the plan (what, why), and what was removed unless dry_run."""
        return await retention.run(dry_run=dry_run)


def _install_view_routes(app: FastAPI, coordinator: Coordinator) -> None:
    @app.get("/v1/sessions")
    async def sessions() -> dict[str, Any]:
        return {"sessions": coordinator.session_views()}

    @app.get("/v1/sessions/{session_id}")
    async def session(session_id: SessionIdPath) -> dict[str, Any]:
        views = coordinator.session_views(validate_session_id(session_id))
        if not views:
            raise NotFound("no such session")
        return {"session": views}

    @app.get("/v1/status")
    async def status() -> dict[str, Any]:
        return coordinator.status()

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(coordinator.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")
