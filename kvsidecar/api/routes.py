"""The hook API (docs/PRODUCT.md): a thin adapter over the coordinator, as one table of routes.

Every route is defined here once, served and documented by `kvsidecar.router`. Every route but `/healthz`
needs `Authorization: Bearer <token>` when a token is configured. Errors are `{"error": {"code", "message",
"hint"}}` with the stable codes of `kvsidecar.errors`, whose `HTTP_STATUS` is the only code -> status
mapping. Bodies are capped (`api.max_body_bytes`); on a loopback listener the Host header must name a
loopback host (a DNS-rebinding page cannot reach us).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Path
from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import Response
from starlette.types import ASGIApp

from kvsidecar import __version__
from kvsidecar.api import models as api_models
from kvsidecar.client.wire import segment
from kvsidecar.config import is_loopback
from kvsidecar.coordinator.core import Coordinator, EventType, ReleaseStatus
from kvsidecar.doctor.checks import Doctor
from kvsidecar.errors import (
    BackendUnavailable,
    BackendUnsupported,
    EraseFailed,
    InvalidSessionId,
    KvError,
    LeaseNotFound,
    MetadataIO,
    NotFound,
    OperationTimeout,
    RestoreFailed,
    SaveFailed,
    ShuttingDown,
    SlotBusy,
    SlotNotFound,
    SnapshotCorrupt,
    SnapshotIncompatible,
    SnapshotNotFound,
)
from kvsidecar.http.router import (
    Call,
    ClientGone,
    Handler,
    Lifespan,
    Param,
    Route,
    Router,
    error_response,
    read_body,
    refuse,
)
from kvsidecar.retention.job import RetentionJob
from kvsidecar.store.naming import validate_session_id

if TYPE_CHECKING:
    from kvsidecar.fleet.routing import FleetRouter

__all__ = ["ClientGone", "create_app", "error_response", "is_loopback", "read_body", "refuse", "routes"]

_Label = Annotated[str, Field(min_length=1, max_length=256)]

# What handlers raise, for the OpenAPI document (kvsidecar.openapi adds what every request can meet).
# SLOT: the route waits for a slot. STRICT: a save or restore failure, raised only with failure.strict
# (otherwise it falls back to a cold start).
SLOT: tuple[type[KvError], ...] = (SlotBusy, ShuttingDown)
STRICT: tuple[type[KvError], ...] = (
    SnapshotNotFound,
    SnapshotIncompatible,
    SnapshotCorrupt,
    MetadataIO,
    BackendUnavailable,
    BackendUnsupported,
    SlotNotFound,
    SaveFailed,
    RestoreFailed,
    EraseFailed,
    OperationTimeout,
)


def _lease_id(value: str) -> str:
    """Any string: a lease id the coordinator does not hold, however it looks, is 404 KV_LEASE_NOT_FOUND
    from the coordinator, so a malformed id and an expired one get the same answer."""
    return value


PARAMS = {
    "session_id": Param(
        convert=validate_session_id,
        schema=Annotated[
            str,
            Path(
                description="opaque harness session id, 1-128 of [A-Za-z0-9._:@+-]",
                pattern=r"^[A-Za-z0-9._:@+\-]{1,128}$",  # kvsidecar.store.naming's rule, for the document
            ),
        ],
        errors=(InvalidSessionId,),
    ),
    "lease_id": Param(
        convert=_lease_id, schema=Annotated[str, Path(description="the lease id acquire returned")]
    ),
}


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class AcquireBody(_Body):
    provider: _Label
    model: _Label
    purpose: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    seq: Annotated[int, Field(ge=0)] | None = None
    # Issue 28: a cold start may begin from this session's newest snapshot (same provider and model); the
    # id is checked as a session id (400 KV_INVALID_SESSION_ID), never used as a path
    prefix_from: (
        Annotated[
            str,
            Field(
                min_length=1,
                max_length=256,
                description="a session (same provider and model) whose newest snapshot a cold start of "
                "this one may begin from; checked as a session id (400 KV_INVALID_SESSION_ID)",
            ),
        ]
        | None
    ) = None


class ReleaseBody(_Body):
    status: ReleaseStatus
    prompt_tokens: Annotated[int, Field(ge=0)] | None = None
    cached_tokens: Annotated[int, Field(ge=0)] | None = None
    # llama-server's timings.prompt_ms for the computed tokens: teaches the cost model the prefill speed
    prompt_ms: Annotated[float, Field(ge=0, lt=1e9)] | None = None


class EventBody(_Body):
    type: EventType
    seq: Annotated[int, Field(ge=0)] | None = None


class DoctorQuery(_Body):
    deep: bool = Field(False, description="also run a save/erase/restore round trip on a held slot")


class GcQuery(_Body):
    dry_run: bool = Field(False, description="plan only: delete nothing")


def create_app(
    coordinator: Coordinator,
    *,
    retention: RetentionJob | None = None,
    token: str | None = None,
    max_body_bytes: int = 64 * 1024,
    check_host: bool = True,
    lifespan: Lifespan | None = None,
    fleet: FleetHook | None = None,
) -> ASGIApp:
    """The hook API as an ASGI app (lifespan: started with the app, closed at its shutdown). `fleet`: the
    fleet router once fleet mode runs (None before, and on a single host)."""
    return Router(
        routes(coordinator, retention, fleet),
        PARAMS,
        token=token,
        check_host=check_host,
        max_body_bytes=max_body_bytes,
        lifespan=lifespan,
        title="kvsidecar",
        version=__version__,
        description="KV-cache persistence for llama-server",
    )


FleetHook = Callable[[], "FleetRouter | None"]


def _no_fleet() -> FleetRouter | None:
    return None


def routes(
    coordinator: Coordinator, retention: RetentionJob | None = None, fleet: FleetHook | None = None
) -> list[Route]:
    """Every route of the hook API, once."""
    fleet = fleet or _no_fleet
    return [
        *_hook_routes(coordinator, fleet),
        *_session_routes(coordinator, fleet),
        *_view_routes(coordinator, retention),
    ]


def _route(
    method: str,
    path: str,
    handler: Handler,
    returns: type[BaseModel],
    errors: tuple[type[KvError], ...] = (),
    *,
    body: type[BaseModel] | None = None,
    query: type[BaseModel] | None = None,
    waits: bool = False,
) -> Route:
    """A JSON route: its 200 model and the errors its handler raises are for the OpenAPI document.
    `waits`: it waits for a slot and watches its caller (`Call.caller`)."""
    return Route(
        method=method,
        path=path,
        handler=handler,
        body=body,
        query=query,
        returns=returns,
        errors=errors,
        waits=waits,
    )


async def _routed(
    coordinator: Coordinator,
    router: FleetRouter | None,
    call: Call,
    action: str,
    serve: Callable[[], Awaitable[dict[str, Any]]],
    purpose: str | None,
) -> dict[str, Any] | Response:
    """An acquire or a restore: served here on a single host; in fleet mode where the session belongs
    (kvsidecar.fleet.routing), this host's answer or another's."""
    if router is None:
        return await serve()
    body, session_id = call.body_as(AcquireBody), call.params["session_id"]
    key, server = coordinator.session_key(session_id, body.provider, body.model, purpose)
    path = f"/v1/sessions/{segment(session_id)}/{action}"
    return await router.acquire(
        key, server, path, body.model_dump(exclude_none=True), call.hop, serve, caller=call.caller
    )


def _hook_routes(coordinator: Coordinator, fleet: FleetHook) -> list[Route]:
    async def healthz(_: Call) -> dict[str, str]:
        """Liveness: no token needed."""
        return {"status": "ok", "version": __version__}

    async def acquire(call: Call) -> dict[str, Any] | Response:
        """Prepare the session's slot (restore when needed) and lease it; see docs/API.md."""
        body = call.body_as(AcquireBody)
        session_id = call.params["session_id"]

        async def serve() -> dict[str, Any]:
            result = await coordinator.acquire(
                session_id,
                provider=body.provider,
                model=body.model,
                purpose=body.purpose,
                seq=body.seq,
                caller=call.caller,
                prefix_from=body.prefix_from,
            )
            return result.to_dict()

        return await _routed(coordinator, fleet(), call, "acquire", serve, body.purpose)

    async def acquire_auxiliary(call: Call) -> dict[str, Any]:
        """An auxiliary request with no session (titles, compaction): it never becomes a session's state."""
        body = call.body_as(AcquireBody)
        result = await coordinator.acquire(
            None, provider=body.provider, model=body.model, purpose=body.purpose, caller=call.caller
        )
        router = fleet()  # fleet: served here, and its lease id names this host (released anywhere)
        return router.named(result.to_dict()) if router is not None else result.to_dict()

    async def release(call: Call) -> dict[str, Any] | Response:
        """End a lease with the request's outcome and the engine's prompt/cache token counts."""
        body = call.body_as(ReleaseBody)

        async def serve(lease_id: str) -> dict[str, Any]:
            return await coordinator.release(
                lease_id,
                status=body.status,
                prompt_tokens=body.prompt_tokens,
                cached_tokens=body.cached_tokens,
                prompt_ms=body.prompt_ms,
            )

        router = fleet()
        if router is None:
            return await serve(call.params["lease_id"])
        return await router.release(
            call.params["lease_id"], body.model_dump(exclude_none=True), call.hop, serve
        )

    acquired = api_models.AcquireResponse
    return [
        Route(method="GET", path="/healthz", handler=healthz, public=True, returns=api_models.Health),
        _route(
            "POST",
            "/v1/sessions/{session_id}/acquire",
            acquire,
            acquired,
            SLOT + STRICT,
            body=AcquireBody,
            waits=True,
        ),
        _route(
            "POST", "/v1/acquire", acquire_auxiliary, acquired, SLOT + STRICT, body=AcquireBody, waits=True
        ),
        _route(
            "POST",
            "/v1/leases/{lease_id}/release",
            release,
            api_models.ReleaseResponse,
            (LeaseNotFound,),
            body=ReleaseBody,
        ),
    ]


def _session_routes(coordinator: Coordinator, fleet: FleetHook) -> list[Route]:
    async def everywhere(
        call: Call, method: str, action: str, serve: Callable[[], Awaitable[dict[str, Any]]], *sums: str
    ) -> dict[str, Any]:
        """Fleet mode: here and on the hosts holding the session (purge and invalidate: every live host,
        an owner need not hold it in a slot); each acts on what it holds, numbers summed."""
        router = fleet()
        if router is None:
            return await serve()
        path = f"/v1/sessions/{segment(call.params['session_id'])}" + (f"/{action}" if action else "")
        body = call.body.model_dump(exclude_none=True) if call.body is not None else None
        every = action in ("", "invalidate")
        sid = call.params["session_id"]
        return await router.everywhere(sid, method, path, body, call.hop, serve, sums, every_host=every)

    async def session_event(call: Call) -> dict[str, Any]:
        """A harness lifecycle event: `flush` (and enabled turn/step ends) checkpoint; `disposed` lets go."""
        body = call.body_as(EventBody)

        async def serve() -> dict[str, Any]:
            return await coordinator.session_event(call.params["session_id"], body.type, seq=body.seq)

        return await everywhere(call, "POST", "events", serve, "saved")

    async def save(call: Call) -> dict[str, Any]:
        """Checkpoint the session now if it is dirty."""
        return await everywhere(
            call, "POST", "save", lambda: coordinator.save(call.params["session_id"]), "saved", "checked"
        )

    async def restore(call: Call) -> dict[str, Any] | Response:
        """Bring a session into its slot now (normally restores are lazy, on the first acquire)."""
        body = call.body_as(AcquireBody)
        session_id = call.params["session_id"]

        async def serve() -> dict[str, Any]:
            result = await coordinator.acquire(
                session_id, provider=body.provider, model=body.model, caller=call.caller
            )
            if result.lease_id is not None:
                await coordinator.release(result.lease_id, status="aborted")
            out = result.to_dict()
            out.pop("lease_id", None)
            return out

        return await _routed(coordinator, fleet(), call, "restore", serve, None)  # purpose ignored

    async def invalidate(call: Call) -> dict[str, Any]:
        """Mark the session's snapshots invalid (retention deletes them)."""
        return await everywhere(
            call,
            "POST",
            "invalidate",
            lambda: coordinator.invalidate(call.params["session_id"]),
            "invalidated",
        )

    async def purge(call: Call) -> dict[str, Any]:
        """Forget the session and delete its snapshots."""
        return await everywhere(
            call, "DELETE", "", lambda: coordinator.purge(call.params["session_id"]), "purged", "bytes_freed"
        )

    path = "/v1/sessions/{session_id}"
    m = api_models
    return [
        _route("POST", f"{path}/events", session_event, m.EventResponse, SLOT + STRICT, body=EventBody),
        _route("POST", f"{path}/save", save, m.SaveResponse, (NotFound, *SLOT, *STRICT)),
        _route(
            "POST", f"{path}/restore", restore, m.RestoreResponse, SLOT + STRICT, body=AcquireBody, waits=True
        ),
        _route("POST", f"{path}/invalidate", invalidate, m.InvalidateResponse, (MetadataIO,)),
        _route("DELETE", path, purge, m.PurgeResponse, (NotFound, *SLOT, MetadataIO)),
    ]


def _view_routes(coordinator: Coordinator, retention: RetentionJob | None) -> list[Route]:
    async def sessions(_: Call) -> dict[str, Any]:
        """Every session kvsidecar knows (ids shortened)."""
        return {"sessions": coordinator.session_views()}

    async def session(call: Call) -> dict[str, Any]:
        """One session's state, slots and snapshots."""
        views = coordinator.session_views(call.params["session_id"])
        if not views:
            raise NotFound("no such session")
        return {"session": views}

    async def status(_: Call) -> dict[str, Any]:
        """Servers, slots, breakers and counters."""
        return coordinator.status()

    async def metrics(_: Call) -> Response:
        """Prometheus text format."""
        return Response(coordinator.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    async def doctor(call: Call) -> dict[str, Any]:
        """Spec §48 checks for every server; `deep` runs a save/erase/restore round trip on a held slot."""
        return await _doctor(coordinator, deep=call.query_as(DoctorQuery).deep)

    m = api_models
    table = [
        _route("GET", "/v1/sessions", sessions, m.SessionsResponse),
        _route("GET", "/v1/sessions/{session_id}", session, m.SessionResponse, (NotFound,)),
        _route("GET", "/v1/status", status, m.StatusResponse),
        Route(method="GET", path="/metrics", handler=metrics, media_type="text/plain"),
        # deep: the round trip holds a slot (its owner is checkpointed first)
        _route("GET", "/v1/doctor", doctor, m.DoctorResponse, SLOT + STRICT, query=DoctorQuery),
    ]
    if retention is not None:

        async def gc(call: Call) -> dict[str, Any]:
            """Run retention now: the plan (what, why), and what was removed unless dry_run."""
            return await retention.run(dry_run=call.query_as(GcQuery).dry_run)

        table.append(_route("POST", "/v1/gc", gc, m.GcResponse, (MetadataIO,), query=GcQuery))
    return table


async def _doctor(coordinator: Coordinator, *, deep: bool) -> dict[str, Any]:
    reports = []
    for name, srv in coordinator.servers.items():

        async def hold(fn: Callable[[int], Awaitable[Any]], name: str = name) -> Any:
            return await coordinator.with_slot(name, fn)

        doc = Doctor(
            config=coordinator.config,
            server=name,
            backend=srv.backend,
            hold_slot=hold,
            snapshot_anchor=coordinator.store.snapshot_anchor(name),  # the directory the daemon holds
        )
        reports.append((await doc.run(deep=deep)).to_dict())
    order = list(api_models.VERDICT_ORDER)
    return {"result": max((r["result"] for r in reports), key=order.index), "servers": reports}
