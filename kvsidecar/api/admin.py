"""The hook API's views and maintenance: the sessions kvsidecar knows, status, Prometheus metrics, the
doctor's checks (spec §48), a retention run on demand, and the checkpoint of every dirty slot before a
planned stop of llama-server (`kvsidecar checkpoint`: a unit's ExecStop, llama-swap's cmdStop).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from starlette.responses import Response

from kvsidecar.api import models as api_models
from kvsidecar.api.bodies import CheckpointQuery, DoctorQuery, GcQuery
from kvsidecar.api.table import SLOT, STRICT, json_route
from kvsidecar.coordinator.core import Coordinator
from kvsidecar.doctor.checks import Doctor
from kvsidecar.errors import MetadataIO, NotFound, OperationTimeout, SaveFailed, ShuttingDown
from kvsidecar.http.routes import Call, Route
from kvsidecar.retention.job import RetentionJob


def admin_routes(coordinator: Coordinator, retention: RetentionJob | None) -> list[Route]:
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

    async def checkpoint(call: Call) -> dict[str, Any]:
        """Save every dirty slot of a server (all servers without `server`) now, before a planned stop of
        llama-server; with `wait`, answer once every save has committed."""
        q = call.query_as(CheckpointQuery)
        return await coordinator.checkpoint(q.server, wait=q.wait, timeout_s=q.timeout_s)

    m = api_models
    table = [
        json_route("GET", "/v1/sessions", sessions, m.SessionsResponse),
        json_route("GET", "/v1/sessions/{session_id}", session, m.SessionResponse, (NotFound,)),
        json_route("GET", "/v1/status", status, m.StatusResponse),
        Route(method="GET", path="/metrics", handler=metrics, media_type="text/plain"),
        # deep: the round trip holds a slot (its owner is checkpointed first)
        json_route("GET", "/v1/doctor", doctor, m.DoctorResponse, SLOT + STRICT, query=DoctorQuery),
        json_route(
            "POST",
            "/v1/checkpoint",
            checkpoint,
            m.CheckpointResponse,
            (NotFound, SaveFailed, OperationTimeout, ShuttingDown),
            query=CheckpointQuery,
        ),
    ]
    if retention is not None:

        async def gc(call: Call) -> dict[str, Any]:
            """Run retention now: the plan (what, why), and what was removed unless dry_run."""
            return await retention.run(dry_run=call.query_as(GcQuery).dry_run)

        table.append(json_route("POST", "/v1/gc", gc, m.GcResponse, (MetadataIO,), query=GcQuery))
    return table


async def _doctor(coordinator: Coordinator, *, deep: bool) -> dict[str, Any]:
    reports = []
    for name, srv in list(coordinator.servers.items()):  # a router's model may be found meanwhile

        async def hold(fn: Callable[[int], Awaitable[Any]], name: str = name) -> Any:
            return await coordinator.with_slot(name, fn)

        config = coordinator.config
        if name not in config.servers:  # a router's model discovered: checked with its own entry's settings
            config = config.model_copy(update={"servers": {**config.servers, name: srv.config}})
        doc = Doctor(
            config=config,
            server=name,
            backend=srv.backend,
            hold_slot=hold,
            snapshot_anchor=coordinator.store.snapshot_anchor(name),  # the directory the daemon holds
            served=coordinator.guard.exits.served(name),  # its processes: only their crashes count
        )
        reports.append((await doc.run(deep=deep)).to_dict())
    return {"result": api_models.worst_verdict(r["result"] for r in reports), "servers": reports}
