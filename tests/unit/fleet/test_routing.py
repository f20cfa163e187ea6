"""Issue 26 C in fleet mode: a forwarded acquire whose sender gave up grants nothing on the receiver, a
forwarded call carries the budget its sender waits (X-KV-Deadline-Ms), and a release for a lease whose
host is not live is kept for that host and applied when it is back.

Two coordinators on the fake backend sharing one directory and a real redis-server (fleet/test_gate.py's
setup); the receiving host's hook API is served by a real uvicorn on a loopback socket, so a sender that
gives up closes a real connection.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

import httpx
import pytest

from kvsidecar.api.routes import create_app
from kvsidecar.coordinator.caller import Caller
from kvsidecar.errors import LeaseNotFound, SlotBusy
from kvsidecar.fleet.plane import awaited
from kvsidecar.fleet.routing import FleetRouter
from kvsidecar.http.guards import DEADLINE_HEADER, HOP_HEADER
from kvsidecar.testing.poll import until
from tests.fleet_helpers import BoundSocket, stop
from tests.unit.fleet.test_gate import Host, key_of, start_host

__all__ = ["start_host"]  # the fixture, shared with fleet/test_gate.py

BODY = {"provider": "local", "model": "m"}


async def test_a_forwarded_acquire_whose_sender_gave_up_grants_nothing_on_the_receiver(
    start_host: Callable[..., Awaitable[Host]],
) -> None:
    """h1 forwards an acquire of A to h2 (A's owner), where it waits for h2's only slot. h1 gives up on it
    (its own client left; the same happens when h1 stops waiting for a stopped h2). Before the fix h2's
    acquire went on waiting and took the slot when it freed: a lease nobody holds, for lease_ttl_s."""
    api = BoundSocket()
    h1 = await start_host("h1", owner_lease_ttl_s=60.0)
    h2 = await start_host("h2", owner_lease_ttl_s=60.0, advertise_url=api.url)
    await until(lambda: "h2" in h1.agent.hosts, what="h1 to see h2")
    k = key_of("A")
    await h2.h.turn("A")  # A belongs to h2
    other = await h2.coordinator.acquire("Z", provider="local", model="m")  # and h2's only slot is held
    assert other.lease_id is not None
    r1 = FleetRouter(h1.agent, h1.coordinator, token=None)
    r2 = FleetRouter(h2.agent, h2.coordinator, token=None)
    app2 = create_app(h2.coordinator, check_host=False, fleet=lambda: r2)
    srv2 = h2.coordinator.servers["local"]
    caller = Caller()

    async def serve() -> dict[str, Any]:
        raise AssertionError("A belongs to h2: h1 must not serve it")

    try:
        async with api.serving(app2, what="h2's hook API"):
            forwarded = asyncio.ensure_future(
                r1.acquire(k, "local", "/v1/sessions/A/acquire", BODY, 0, serve, caller=caller)
            )
            await until(
                lambda: bool(h2.coordinator.pool.queued(srv2)), what="the forwarded acquire to wait on h2"
            )
            caller.leave()  # h1's caller is gone: h1 gives up the forward (its connection closes)
            with pytest.raises(SlotBusy):
                await forwarded
            await until(lambda: not h2.coordinator.pool.queued(srv2), what="h2 to see its caller leave")
            await h2.coordinator.release(other.lease_id, status="aborted")  # the slot is free now
            assert len(h2.coordinator.leases) == 0, "h2 granted a lease to a caller that had left"
            slot = srv2.slots[0]
            assert slot.holder is None and slot.claimed_by is None
    finally:
        await r1.aclose()
        await r2.aclose()


async def test_a_peers_error_answer_is_passed_back_as_it_came(
    start_host: Callable[..., Awaitable[Host]],
) -> None:
    """The router sends through the hook-API client (`AsyncKvSidecar.send`), which maps nothing: a peer's
    error answer comes back with its status, body, Content-Type and Retry-After, and the call carried the
    fleet token, the hop count and the deadline."""
    h1 = await start_host("h1")
    await start_host("h2", advertise_url="http://127.0.0.2:9")  # never reached: a mock transport answers
    await until(lambda: "h2" in h1.agent.hosts, what="h1 to see h2")
    seen: list[httpx.Request] = []
    error = {"error": {"code": "KV_SLOT_BUSY", "message": "every slot is busy", "hint": "retry"}}

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(503, json=error, headers={"Retry-After": "2", "X-Other": "dropped"})

    router = FleetRouter(h1.agent, h1.coordinator, token="t" * 32, transport=httpx.MockTransport(answer))
    try:
        forwarded = await router.forward("h2", "POST", "/v1/sessions/A%2FB/acquire", BODY, 0)
    finally:
        await router.aclose()
    assert forwarded.status_code == 503 and json.loads(bytes(forwarded.body)) == error
    assert forwarded.headers["retry-after"] == "2" and forwarded.headers["content-type"] == "application/json"
    assert "x-other" not in forwarded.headers
    (request,) = seen
    assert str(request.url) == "http://127.0.0.2:9/v1/sessions/A%2FB/acquire"
    assert json.loads(request.content) == BODY
    assert request.headers["authorization"] == "Bearer " + "t" * 32
    assert request.headers[HOP_HEADER] == "1" and int(request.headers[DEADLINE_HEADER]) > 0


async def test_a_forwarded_call_carries_the_budget_its_sender_waits(
    start_host: Callable[..., Awaitable[Host]],
) -> None:
    """The receiver counts the budget from its receipt (clocks differ), less a margin: it gives up first."""
    h1 = await start_host("h1", forward_timeout_s=40.0)
    await start_host("h2", advertise_url="http://127.0.0.2:9")  # never reached: a mock transport answers
    await until(lambda: "h2" in h1.agent.hosts, what="h1 to see h2")
    seen: list[httpx.Headers] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers)
        return httpx.Response(200, json={"outcome": "cold", "lease_id": "h2~x"})

    router = FleetRouter(h1.agent, h1.coordinator, token=None, transport=httpx.MockTransport(answer))
    try:
        await router.forward("h2", "POST", "/v1/sessions/A/acquire", BODY, 0)
        loop = asyncio.get_running_loop()
        caller = Caller(deadline=loop.time() + 5.0)
        await router.forward("h2", "POST", "/v1/sessions/A/acquire", BODY, 0, caller)
    finally:
        await router.aclose()
    budgets = [int(h[DEADLINE_HEADER]) for h in seen]
    assert budgets[0] == 40_000  # forward_timeout_s: what the sender waits at most
    assert 0 < budgets[1] <= 5_000  # what is left of its own caller's deadline


async def test_a_release_for_a_host_that_is_not_live_is_applied_when_it_is_back(
    start_host: Callable[..., Awaitable[Host]],
) -> None:
    """Before: 404 KV_LEASE_NOT_FOUND, and the lease held its slot until its TTL on the host's return."""
    h1 = await start_host("h1")
    h2 = await start_host("h2")
    await until(lambda: "h2" in h1.agent.hosts, what="h1 to see h2")
    r1 = FleetRouter(h1.agent, h1.coordinator, token=None)
    r2 = FleetRouter(h2.agent, h2.coordinator, token=None)
    try:
        await h1.agent.heartbeat()  # h1 has seen h2 live (its agent records it)
        lease = await h2.coordinator.acquire("A", provider="local", model="m")
        assert lease.lease_id is not None and lease.slot_id is not None
        named = r2.named(lease.to_dict())["lease_id"]
        for task in h2.agent._tasks:  # h2 stops heartbeating (SIGSTOP, partition)
            await stop(task)
        await h1.agent.client.delete("t:host:h2")
        await awaited(h1.agent.client.srem("t:hosts", "h2"))
        await until(lambda: "h2" not in h1.agent.hosts, what="h1 to see h2 gone")

        async def serve(local: str) -> dict[str, Any]:
            raise AssertionError("the lease is h2's")

        answer = await r1.release(named, {"status": "ok", "prompt_tokens": 7, "cached_tokens": 0}, 0, serve)
        assert isinstance(answer, dict)
        assert answer["queued"] is True and answer["released"] is False and answer["host"] == "h2"
        # hostile entries beside it: skipped, never raised
        for junk in ("not json", "[]", '{"lease": 5}', '{"lease": "x", "status": "maybe"}', "x" * 5000):
            await awaited(h1.agent.client.rpush("t:releases:h2", junk))
        with pytest.raises(LeaseNotFound):  # a host never seen live: no lease to queue for
            await r1.release("h7~abc", {"status": "ok"}, 0, serve)
        assert lease.lease_id in h2.coordinator.leases
        await h2.agent.heartbeat()  # h2 is back: its first heartbeat applies what was kept for it
        assert lease.lease_id not in h2.coordinator.leases
        slot = h2.coordinator.servers["local"].slots[lease.slot_id]
        assert slot.holder is None
        assert await awaited(h2.agent.client.llen("t:releases:h2")) == 0
        rt = h2.coordinator.sessions.by_key[key_of("A")]
        assert rt.dirty_revision == 1  # released "ok", as the client sent it
    finally:
        await r1.aclose()
        await r2.aclose()


def test_the_release_answer_model_describes_a_queued_release() -> None:
    from kvsidecar.api.models import ReleaseResponse

    doc = ReleaseResponse.model_validate({"released": False, "dirty": False, "queued": True, "host": "h2"})
    assert json.loads(doc.model_dump_json())["queued"] is True


async def test_a_forwarded_budget_always_fits_the_header_its_receiver_takes(
    start_host: Callable[..., Awaitable[Host]],
) -> None:
    """`fleet.forward_timeout_s` has no cap: a budget over 9 digits of milliseconds was sent as is, and
    every receiver refused it (400), so no forwarded call ever ran. It is sent as the 9-digit maximum."""
    h1 = await start_host("h1", forward_timeout_s=2_000_000.0)  # 2e9 ms: 10 digits
    await start_host("h2", advertise_url="http://127.0.0.2:9")
    await until(lambda: "h2" in h1.agent.hosts, what="h1 to see h2")
    seen: list[httpx.Headers] = []

    def answer(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers)
        return httpx.Response(200, json={"outcome": "cold", "lease_id": "h2~x"})

    router = FleetRouter(h1.agent, h1.coordinator, token=None, transport=httpx.MockTransport(answer))
    try:
        await router.forward("h2", "POST", "/v1/sessions/A/acquire", BODY, 0)
    finally:
        await router.aclose()
    from kvsidecar.http.guards import deadline_budget

    sent = seen[0][DEADLINE_HEADER]
    assert sent == "999999999"
    assert deadline_budget([(DEADLINE_HEADER.lower().encode(), sent.encode())]) == 999_999.999
