"""The hook API (docs/PRODUCT.md): a thin adapter over the coordinator, as one table of routes.

Every route is defined once, in `kvsidecar.api.hooks`, `kvsidecar.api.sessions` or `kvsidecar.api.admin`,
gathered here, and served and documented by `kvsidecar.http.router`. Every route but `/healthz` needs
`Authorization: Bearer <token>` when a token is configured. Errors are `{"error": {"code", "message",
"hint"}}` with the stable codes of `kvsidecar.errors`, whose `HTTP_STATUS` is the only code -> status
mapping. Bodies are capped (`api.max_body_bytes`); on a loopback listener the Host header must name a
loopback host (a DNS-rebinding page cannot reach us).
"""

from __future__ import annotations

from starlette.types import ASGIApp

from kvsidecar import __version__
from kvsidecar.api.admin import admin_routes
from kvsidecar.api.fleet_calls import FleetHook, no_fleet
from kvsidecar.api.hooks import hook_routes
from kvsidecar.api.sessions import session_routes
from kvsidecar.api.table import PARAMS
from kvsidecar.coordinator.core import Coordinator
from kvsidecar.http.router import Lifespan, Router
from kvsidecar.http.routes import Route
from kvsidecar.retention.job import RetentionJob

__all__ = ["PARAMS", "create_app", "routes"]


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


def routes(
    coordinator: Coordinator, retention: RetentionJob | None = None, fleet: FleetHook | None = None
) -> list[Route]:
    """Every route of the hook API, once: the hot path (`kvsidecar.api.hooks`), session commands
    (`kvsidecar.api.sessions`), views and maintenance (`kvsidecar.api.admin`)."""
    fleet = fleet or no_fleet
    return [
        *hook_routes(coordinator, fleet),
        *session_routes(coordinator, fleet),
        *admin_routes(coordinator, retention),
    ]
