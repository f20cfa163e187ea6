"""The prompt point's route in fleet mode: an acquire's answer names its lease with the host that serves it
(`FleetRouter.named`: "host~local"), and the hook client calls `POST /v1/leases/{that id}/prompt-point` with
it. The route must take the point on the host the id names (here, or forwarded), as the release route does;
before, it looked the whole named id up in this host's leases and answered KV_LEASE_NOT_FOUND, so in fleet
mode no hook client's prompt point was ever taken (the client swallows the error)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

import httpx

from kvsidecar.api.routes import create_app
from kvsidecar.fleet.routing import LEASE_SEP, FleetRouter
from tests.unit.fleet.test_gate import Host, start_host

__all__ = ["start_host"]  # the fixture (fleet/test_gate.py's two hosts, a real redis-server)

BODY = {"provider": "local", "model": "m"}


async def test_a_fleet_named_lease_takes_its_prompt_point_on_its_host(
    start_host: Callable[..., Awaitable[Host]],
) -> None:
    h1 = await start_host("h1")
    router = FleetRouter(h1.agent, h1.coordinator, token=None)
    app = create_app(h1.coordinator, check_host=False, fleet=lambda: router)
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as http:
            acquired = (await http.post("/v1/sessions/A/acquire", json=BODY)).json()
            lease_id = acquired["lease_id"]
            assert lease_id.startswith(f"h1{LEASE_SEP}")  # named: the id the client holds
            point = await http.post(f"/v1/leases/{lease_id}/prompt-point")
            assert point.status_code == 200, point.text  # the lease is open, on this very host
            assert point.json()["taken"] is False  # no prompt was sent: the plan asked for no point
            for hostile in ("nohost~" + lease_id.split(LEASE_SEP)[1], f"h1{LEASE_SEP}x", "~", "a~b~c"):
                other = await http.post(f"/v1/leases/{hostile}/prompt-point")
                assert other.status_code == 404 and other.json()["error"]["code"] == "KV_LEASE_NOT_FOUND"
                assert hostile not in other.text
            released = await http.post(f"/v1/leases/{lease_id}/release", json={"status": "ok"})
            assert released.status_code == 200
            gone = await http.post(f"/v1/leases/{lease_id}/prompt-point")
            assert gone.status_code == 404 and gone.json()["error"]["code"] == "KV_LEASE_NOT_FOUND"
    finally:
        await router.aclose()
