"""The hook API's hot path (docs/PRODUCT.md): liveness, acquire (a session's, or an auxiliary request's)
and release, the calls that run around every model call.
"""

from __future__ import annotations

from dataclasses import asdict
from functools import partial
from typing import Any

from starlette.responses import Response

from kvsidecar import __version__
from kvsidecar.api import models as api_models
from kvsidecar.api.bodies import AcquireBody, ReleaseBody, acquire_prompt_tokens
from kvsidecar.api.fleet_calls import FleetHook, routed
from kvsidecar.api.table import SLOT, STRICT, json_route
from kvsidecar.backend.prompts import PromptTokens
from kvsidecar.coordinator.core import Coordinator
from kvsidecar.errors import LeaseNotFound
from kvsidecar.http.routes import Call, Route


def hook_routes(coordinator: Coordinator, fleet: FleetHook) -> list[Route]:
    async def healthz(_: Call) -> dict[str, str]:
        """Liveness: no token needed."""
        return {"status": "ok", "version": __version__}

    return [
        Route(method="GET", path="/healthz", handler=healthz, public=True, returns=api_models.Health),
        *_acquire_routes(coordinator, fleet),
        _release_route(coordinator, fleet),
        _prompt_point_route(coordinator),
    ]


async def _prompt_tokens(coordinator: Coordinator, body: AcquireBody) -> PromptTokens | None:
    """The tokens of the acquire's `prompt` (None when it sent none): what its start is planned from."""
    srv = coordinator.route(body.provider, body.model) if body.prompt is not None else None
    return None if srv is None else await acquire_prompt_tokens(body, srv.backend)


def _acquire_routes(coordinator: Coordinator, fleet: FleetHook) -> list[Route]:
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
                prompt=partial(_prompt_tokens, coordinator, body),  # once let in: a router's model loaded
            )
            return result.to_dict()

        return await routed(coordinator, fleet(), call, "acquire", serve, body.purpose)

    async def acquire_auxiliary(call: Call) -> dict[str, Any]:
        """An auxiliary request with no session (titles, compaction): it never becomes a session's state."""
        body = call.body_as(AcquireBody)
        result = await coordinator.acquire(
            None, provider=body.provider, model=body.model, purpose=body.purpose, caller=call.caller
        )
        router = fleet()  # fleet: served here, and its lease id names this host (released anywhere)
        return router.named(result.to_dict()) if router is not None else result.to_dict()

    acquired = api_models.AcquireResponse
    return [
        json_route(
            "POST",
            "/v1/sessions/{session_id}/acquire",
            acquire,
            acquired,
            SLOT + STRICT,
            body=AcquireBody,
            waits=True,
        ),
        json_route(
            "POST", "/v1/acquire", acquire_auxiliary, acquired, SLOT + STRICT, body=AcquireBody, waits=True
        ),
    ]


def _release_route(coordinator: Coordinator, fleet: FleetHook) -> Route:
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

    return json_route(
        "POST",
        "/v1/leases/{lease_id}/release",
        release,
        api_models.ReleaseResponse,
        (LeaseNotFound,),
        body=ReleaseBody,
    )


def _prompt_point_route(coordinator: Coordinator) -> Route:
    async def prompt_point(call: Call) -> dict[str, Any]:
        """Take the save point the lease's start plan asked for (`prompt_point` in the acquire's answer):
        a prefill of the prompt but its last token on the lease's slot, then a save, as the proxy does before
        it forwards. The hook client calls it between the acquire and its model call; never fails that call
        (a failed prefill or save is in the answer)."""
        lease_id = call.params["lease_id"]
        if coordinator.leases.get(lease_id) is None:
            raise LeaseNotFound(f"lease {lease_id[:8]}... is not open on this host")
        taken = await coordinator.savepoints.take(lease_id)
        if taken is None:
            return {
                "taken": False,
                "tokens": None,
                "computed": None,
                "saved": False,
                "prefill_ms": None,
                "save_ms": None,
                "error": None,
            }
        return {"taken": True, **asdict(taken)}

    return json_route(
        "POST",
        "/v1/leases/{lease_id}/prompt-point",
        prompt_point,
        api_models.PromptPointResponse,
        (LeaseNotFound,),
        waits=True,
    )
