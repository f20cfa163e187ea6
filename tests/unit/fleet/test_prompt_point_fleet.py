"""`POST /v1/leases/{lease_id}/prompt-point` in fleet mode: the acquire's answer names the lease with its host
(`HOST~LEASE`, as the release takes it); the point is taken with that very id, on the host that holds it
(before the fix the route looked the whole id up in the local table: 404 for every fleet lease)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import httpx

from kvsidecar.api.routes import create_app
from kvsidecar.fleet.routing import FleetRouter
from kvsidecar.testing.poll import until
from tests.fleet_helpers import BoundSocket
from tests.unit.fleet.test_gate import Host, start_host

__all__ = ["start_host"]  # the fixture, shared with fleet/test_gate.py


async def test_a_fleet_lease_takes_its_point_with_the_id_the_acquire_gave(
    start_host: Callable[..., Awaitable[Host]],
) -> None:
    h1 = await start_host("h1")
    r1 = FleetRouter(h1.agent, h1.coordinator, token=None)
    app = create_app(h1.coordinator, check_host=False, fleet=lambda: r1)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            got = await c.post("/v1/sessions/A/acquire", json={"provider": "local", "model": "m"})
            assert got.status_code == 200, got.text
            lease = got.json()["lease_id"]
            assert lease.startswith("h1~")
            point = await c.post(f"/v1/leases/{lease}/prompt-point")
            assert point.status_code == 200, point.text
            assert point.json()["taken"] is False  # no prompt sent: no point asked
            foreign = await c.post("/v1/leases/h9~abc/prompt-point")  # a host nobody has seen
            assert foreign.status_code == 404 and foreign.json()["error"]["code"] == "KV_LEASE_NOT_FOUND"
            done = await c.post(f"/v1/leases/{lease}/release", json={"status": "ok"})
            assert done.status_code == 200, done.text
    finally:
        await r1.aclose()


async def test_a_lease_of_another_live_host_is_taken_there(
    start_host: Callable[..., Awaitable[Host]],
) -> None:
    """h1 is asked for the point of h2's lease: forwarded to h2 (its answer comes back as it came)."""
    api = BoundSocket()
    h1 = await start_host("h1")
    h2 = await start_host("h2", advertise_url=api.url)
    await until(lambda: "h2" in h1.agent.hosts, what="h1 to see h2")
    r1 = FleetRouter(h1.agent, h1.coordinator, token=None)
    r2 = FleetRouter(h2.agent, h2.coordinator, token=None)
    app1 = create_app(h1.coordinator, check_host=False, fleet=lambda: r1)
    app2 = create_app(h2.coordinator, check_host=False, fleet=lambda: r2)
    got = await h2.coordinator.acquire("B", provider="local", model="m")
    assert got.lease_id is not None
    lease = f"h2~{got.lease_id}"
    try:
        async with (
            api.serving(app2, what="h2's hook API"),
            httpx.AsyncClient(transport=httpx.ASGITransport(app=app1), base_url="http://t") as c,
        ):
            point = await c.post(f"/v1/leases/{lease}/prompt-point")
            assert point.status_code == 200, point.text
            assert point.json()["taken"] is False
    finally:
        await h2.coordinator.release(got.lease_id, status="aborted")
        await r1.aclose()
        await r2.aclose()
