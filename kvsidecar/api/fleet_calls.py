"""The hook API's calls in fleet mode (docs/FLEET.md): where an acquire or a restore is served (`routed`:
where the session belongs, this host's answer or another's), and the session calls every host holding
the session answers (`everywhere`: numbers summed). On a single host (no fleet router) both serve here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.responses import Response

from kvsidecar.api.bodies import AcquireBody
from kvsidecar.client.wire import segment
from kvsidecar.coordinator.core import Coordinator
from kvsidecar.http.routes import Call

if TYPE_CHECKING:
    from kvsidecar.fleet.routing import FleetRouter

# The fleet router once fleet mode runs (None before, and on a single host); asked on every call.
FleetHook = Callable[[], "FleetRouter | None"]
Serve = Callable[[], Awaitable[dict[str, Any]]]


def no_fleet() -> FleetRouter | None:
    return None


async def routed(
    coordinator: Coordinator,
    router: FleetRouter | None,
    call: Call,
    action: str,
    serve: Serve,
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


async def everywhere(
    router: FleetRouter | None, call: Call, method: str, action: str, serve: Serve, *sums: str
) -> dict[str, Any]:
    """Fleet mode: here and on the hosts holding the session (purge and invalidate: every live host,
    an owner need not hold it in a slot); each acts on what it holds, numbers summed."""
    if router is None:
        return await serve()
    path = f"/v1/sessions/{segment(call.params['session_id'])}" + (f"/{action}" if action else "")
    body = call.body.model_dump(exclude_none=True) if call.body is not None else None
    every = action in ("", "invalidate")
    sid = call.params["session_id"]
    return await router.everywhere(sid, method, path, body, call.hop, serve, sums, every_host=every)
