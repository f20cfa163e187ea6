"""The hook API's session commands: lifecycle events, save, restore, invalidate and purge of one session
(in fleet mode on every host that holds it, `kvsidecar.api.fleet_calls`).
"""

from __future__ import annotations

from typing import Any

from starlette.responses import Response

from kvsidecar.api import models as api_models
from kvsidecar.api.bodies import AcquireBody, EventBody
from kvsidecar.api.fleet_calls import FleetHook, everywhere, routed
from kvsidecar.api.table import SLOT, STRICT, json_route
from kvsidecar.coordinator.core import Coordinator
from kvsidecar.errors import MetadataIO, NotFound
from kvsidecar.http.routes import Call, Route

PATH = "/v1/sessions/{session_id}"


def session_routes(coordinator: Coordinator, fleet: FleetHook) -> list[Route]:
    async def session_event(call: Call) -> dict[str, Any]:
        """A harness lifecycle event: `flush` (and enabled turn/step ends) checkpoint; `disposed` lets go."""
        body = call.body_as(EventBody)

        async def serve() -> dict[str, Any]:
            return await coordinator.session_event(call.params["session_id"], body.type, seq=body.seq)

        return await everywhere(fleet(), call, "POST", "events", serve, "saved")

    async def save(call: Call) -> dict[str, Any]:
        """Checkpoint the session now if it is dirty."""
        return await everywhere(
            fleet(),
            call,
            "POST",
            "save",
            lambda: coordinator.save(call.params["session_id"]),
            "saved",
            "checked",
        )

    m = api_models
    return [
        json_route("POST", f"{PATH}/events", session_event, m.EventResponse, SLOT + STRICT, body=EventBody),
        json_route("POST", f"{PATH}/save", save, m.SaveResponse, (NotFound, *SLOT, *STRICT)),
        _restore_route(coordinator, fleet),
        *_forget_routes(coordinator, fleet),
    ]


def _restore_route(coordinator: Coordinator, fleet: FleetHook) -> Route:
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

        return await routed(coordinator, fleet(), call, "restore", serve, None)  # purpose ignored

    return json_route(
        "POST",
        f"{PATH}/restore",
        restore,
        api_models.RestoreResponse,
        SLOT + STRICT,
        body=AcquireBody,
        waits=True,
    )


def _forget_routes(coordinator: Coordinator, fleet: FleetHook) -> list[Route]:
    async def invalidate(call: Call) -> dict[str, Any]:
        """Mark the session's snapshots invalid (retention deletes them)."""
        return await everywhere(
            fleet(),
            call,
            "POST",
            "invalidate",
            lambda: coordinator.invalidate(call.params["session_id"]),
            "invalidated",
        )

    async def purge(call: Call) -> dict[str, Any]:
        """Forget the session and delete its snapshots."""
        return await everywhere(
            fleet(),
            call,
            "DELETE",
            "",
            lambda: coordinator.purge(call.params["session_id"]),
            "purged",
            "bytes_freed",
        )

    m = api_models
    return [
        json_route("POST", f"{PATH}/invalidate", invalidate, m.InvalidateResponse, (MetadataIO,)),
        json_route("DELETE", PATH, purge, m.PurgeResponse, (NotFound, *SLOT, MetadataIO)),
    ]
