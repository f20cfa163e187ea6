"""Issue 26 C: a lease exists only while someone holds it.

On the fake backend, the race windows driven by hand (events and the fake's holds, no sleeps): an acquire
whose caller leaves while it waits for a slot, while its slot is prepared, or in the very step the slot is
handed over, gets no lease and leaves the slot free; a caller past its deadline gets nothing; a lease
never seen in use ends at its claim TTL, one in use keeps its full TTL. Through the hook API's ASGI app: the
disconnect of the client (ASGI `http.disconnect`) and the `X-KV-Deadline-Ms` header.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kvsidecar.api.routes import create_app
from kvsidecar.coordinator.caller import Caller, deadline_from_budget
from kvsidecar.coordinator.pool import SlotPool
from kvsidecar.coordinator.server import ServerRuntime
from kvsidecar.coordinator.state import Outcome
from kvsidecar.errors import LeaseNotFound, SlotBusy
from kvsidecar.store.naming import SnapshotIdentity
from kvsidecar.testing.poll import until
from tests.unit.coordinator_helpers import Harness, conversation, start_harness

BODY = {"provider": "local", "model": "m"}


def key(session: str) -> str:
    return SnapshotIdentity(server="local", provider="local", model="m", session_id=session).key


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    harness = await start_harness(tmp_path)
    yield harness
    await harness.coordinator.aclose()


def nobody_queued(pool: SlotPool, srv: ServerRuntime) -> bool:
    return not pool.queued(srv)


async def queued(h: Harness, n: int = 1) -> None:
    """Until `n` acquires wait in the queue (each loop step lets the waiting task run)."""
    srv = h.coordinator.servers["local"]
    await until(lambda: h.coordinator.pool.queued(srv) >= n, interval_s=0, what=f"{n} acquires queued")


def slot_free(h: Harness) -> bool:
    slot = h.coordinator.servers["local"].slots[0]
    return slot.holder is None and slot.claimed_by is None


async def next_session_gets_the_slot_at_once(h: Harness, session: str = "C") -> None:
    """A slot nobody holds is taken without waiting: KV_SLOT_BUSY at once otherwise."""
    h.coordinator.acquirer.acquire_timeout_s = 0
    r = await h.coordinator.acquire(session, provider="local", model="m")
    assert r.lease_id is not None
    await h.coordinator.release(r.lease_id, status="aborted")
    h.coordinator.acquirer.acquire_timeout_s = None


# the caller leaves -------------------------------------------------------------------------------------
async def test_a_caller_that_leaves_while_waiting_for_a_slot_gets_no_lease(h: Harness) -> None:
    first = await h.coordinator.acquire("A", provider="local", model="m")
    caller = Caller()
    waiting = asyncio.ensure_future(h.coordinator.acquire("B", provider="local", model="m", caller=caller))
    await queued(h)
    caller.leave()
    with pytest.raises(SlotBusy, match="abandoned"):
        await waiting
    assert not h.coordinator.pool.queued(h.coordinator.servers["local"])
    assert first.lease_id is not None
    await h.coordinator.release(first.lease_id, status="ok")
    # before the fix B got the slot here and held it for lease_ttl_s: the next session waited, then 503
    assert len(h.coordinator.leases) == 0 and slot_free(h)
    await next_session_gets_the_slot_at_once(h)


async def test_a_caller_that_leaves_as_the_slot_is_handed_over_gets_no_lease(h: Harness) -> None:
    """The release hands the slot to the waiter synchronously; the caller leaves in the same step, before
    the waiting task runs again: the slot goes back, not into a lease."""
    first = await h.coordinator.acquire("A", provider="local", model="m")
    caller = Caller()
    waiting = asyncio.ensure_future(h.coordinator.acquire("B", provider="local", model="m", caller=caller))
    await queued(h)
    assert first.lease_id is not None
    await h.coordinator.release(first.lease_id, status="ok")  # B's waiter has its slot now
    caller.leave()
    with pytest.raises(SlotBusy):
        await waiting
    assert len(h.coordinator.leases) == 0 and slot_free(h)
    assert h.coordinator.servers["local"].slots[0].owner == key("A")  # B's prepare never ran
    await next_session_gets_the_slot_at_once(h)


async def test_a_caller_that_leaves_during_the_restore_gets_no_lease_and_the_restore_stands(
    h: Harness,
) -> None:
    """The restore under way runs to its end (the slot holds what the records say); no lease is granted,
    nothing is erased or saved for it, and the session's next acquire finds it resident."""
    await h.turn("B")
    assert (await h.coordinator.session_event("B", "flush"))["saved"] == 1
    await h.turn("A")  # B is saved and evicted: its next acquire restores
    h.calls()
    hold = h.fake.hold("restore")
    caller = Caller()
    waiting = asyncio.ensure_future(h.coordinator.acquire("B", provider="local", model="m", caller=caller))
    await hold.entered.wait()
    caller.leave()
    hold.release()
    with pytest.raises(SlotBusy):
        await waiting
    assert len(h.coordinator.leases) == 0 and slot_free(h)
    assert h.coordinator.servers["local"].slots[0].owner == key("B")
    calls = h.calls()
    assert calls.count("restore") == 1 and "erase" not in calls, calls
    again = await h.coordinator.acquire("B", provider="local", model="m")
    assert again.outcome is Outcome.RESIDENT and h.calls() == []
    assert again.lease_id is not None
    await h.coordinator.release(again.lease_id, status="ok")


async def test_a_caller_past_its_deadline_claims_and_waits_for_nothing(h: Harness) -> None:
    loop = asyncio.get_running_loop()
    caller = Caller(deadline=loop.time() - 1)
    with pytest.raises(SlotBusy):
        await h.coordinator.acquire("A", provider="local", model="m", caller=caller)
    assert h.calls() == [] and len(h.coordinator.leases) == 0 and slot_free(h)


async def test_a_deadline_ends_the_wait_for_a_slot(h: Harness) -> None:
    """slot_wait_s is long (30 s); the caller's deadline, here one loop step away, ends the wait first."""
    first = await h.coordinator.acquire("A", provider="local", model="m")
    loop = asyncio.get_running_loop()
    caller = Caller(deadline=loop.time())
    with pytest.raises(SlotBusy):
        await asyncio.wait_for(h.coordinator.acquire("B", provider="local", model="m", caller=caller), 10)
    assert not h.coordinator.pool.queued(h.coordinator.servers["local"])
    assert first.lease_id is not None
    await h.coordinator.release(first.lease_id, status="ok")
    assert len(h.coordinator.leases) == 0 and slot_free(h)


def test_a_forwarded_budget_ends_before_the_sender_gives_up() -> None:
    for budget in (0.5, 5.0, 600.0):
        assert deadline_from_budget(budget, 100.0) < 100.0 + budget
    assert deadline_from_budget(0.0, 100.0) < 100.0  # nothing left: already past


# the claim TTL -----------------------------------------------------------------------------------------
async def test_a_lease_never_used_ends_at_its_claim_ttl(h: Harness) -> None:
    r = await h.coordinator.acquire("A", provider="local", model="m")
    assert r.lease_id is not None
    lease = h.coordinator.leases.get(r.lease_id)
    assert lease is not None and not lease.active and lease.expiry is not None
    api = h.coordinator.config.api
    assert lease.expiry.when() == pytest.approx(lease.granted_at + api.lease_claim_ttl_s)
    assert api.lease_claim_ttl_s < api.lease_ttl_s
    await h.coordinator.lease_ends.check_claim(r.lease_id)  # what the claim timer does
    assert r.lease_id not in h.coordinator.leases and slot_free(h)
    assert h.coordinator.sessions.by_key[key("A")].dirty_revision == 0  # ended as aborted
    with pytest.raises(LeaseNotFound):
        await h.coordinator.release(r.lease_id, status="ok")
    await next_session_gets_the_slot_at_once(h)


async def test_a_lease_whose_slot_is_working_keeps_its_full_ttl(h: Harness) -> None:
    r = await h.coordinator.acquire("A", provider="local", model="m")
    assert r.lease_id is not None and r.slot_id is not None
    h.fake.slots[r.slot_id].is_processing = True  # the harness' model call runs on it
    await h.coordinator.lease_ends.check_claim(r.lease_id)
    lease = h.coordinator.leases.get(r.lease_id)
    assert lease is not None and lease.active and lease.expiry is not None
    assert lease.expiry.when() == pytest.approx(lease.granted_at + h.coordinator.config.api.lease_ttl_s)
    h.fake.slots[r.slot_id].is_processing = False
    out = await h.coordinator.release(r.lease_id, status="ok")
    assert out["released"] is True


async def test_a_lease_whose_model_call_already_ran_keeps_its_full_ttl(h: Harness) -> None:
    """The call came and went (the slot's tokens moved since the grant); the release is still to come."""
    r = await h.coordinator.acquire("A", provider="local", model="m")
    assert r.lease_id is not None and r.slot_id is not None and r.outcome is Outcome.COLD
    prompt_n, cache_n = h.fake.infer(r.slot_id, conversation("A", 1))
    await h.coordinator.lease_ends.check_claim(r.lease_id)
    lease = h.coordinator.leases.get(r.lease_id)
    assert lease is not None and lease.active
    out = await h.coordinator.release(r.lease_id, status="ok", prompt_tokens=prompt_n, cached_tokens=cache_n)
    assert out["dirty"] is True


async def test_a_claim_the_engine_cannot_judge_is_asked_again_not_ended(h: Harness) -> None:
    r = await h.coordinator.acquire("A", provider="local", model="m")
    assert r.lease_id is not None
    h.fake.set_unavailable()
    await h.coordinator.lease_ends.check_claim(r.lease_id)
    lease = h.coordinator.leases.get(r.lease_id)
    assert lease is not None and not lease.active and lease.expiry is not None
    loop = asyncio.get_running_loop()
    assert lease.expiry.when() == pytest.approx(
        loop.time() + h.coordinator.config.api.lease_claim_ttl_s, abs=1
    )
    h.fake.set_unavailable(False)
    await h.coordinator.release(r.lease_id, status="aborted")


async def test_a_renewed_lease_is_active_with_the_full_ttl(h: Harness) -> None:
    r = await h.coordinator.acquire("A", provider="local", model="m")
    assert r.lease_id is not None
    h.coordinator.renew(r.lease_id)
    await h.coordinator.lease_ends.check_claim(r.lease_id)  # a late claim timer changes nothing
    lease = h.coordinator.leases.get(r.lease_id)
    assert lease is not None and lease.active and lease.expiry is not None
    loop = asyncio.get_running_loop()
    assert lease.expiry.when() == pytest.approx(loop.time() + h.coordinator.config.api.lease_ttl_s, abs=1)
    await h.coordinator.release(r.lease_id, status="aborted")


async def test_the_claim_timer_itself_ends_an_unused_lease(tmp_path: Path) -> None:
    """The timer, not a direct call: a claim TTL of one loop step."""
    h = await start_harness(tmp_path, api={"lease_claim_ttl_s": 0.001})
    try:
        r = await h.coordinator.acquire("A", provider="local", model="m")
        assert r.lease_id is not None
        await until(lambda: r.lease_id not in h.coordinator.leases, interval_s=0.001, what="the lease ended")
        assert slot_free(h)
    finally:
        await h.coordinator.aclose()


# through the hook API ----------------------------------------------------------------------------------
class Client:
    """One ASGI request driven by hand: the body, then `http.disconnect` once `hang_up` is set."""

    def __init__(
        self, path: str, body: dict[str, Any], headers: list[tuple[bytes, bytes]] | None = None
    ) -> None:
        self.scope: dict[str, Any] = {
            "type": "http",
            "method": "POST",
            "path": path,
            "raw_path": path.encode(),
            "query_string": b"",
            "headers": [
                (b"host", b"127.0.0.1:8377"),
                (b"content-type", b"application/json"),
                *(headers or []),
            ],
        }
        self.body = json.dumps(body).encode()
        self.sent_body = False
        self.hang_up = asyncio.Event()
        self.answer: dict[str, Any] = {}

    async def receive(self) -> dict[str, Any]:
        if not self.sent_body:
            self.sent_body = True
            return {"type": "http.request", "body": self.body, "more_body": False}
        await self.hang_up.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            self.answer["status"] = message["status"]
        elif message["type"] == "http.response.body":
            self.answer["body"] = self.answer.get("body", b"") + message.get("body", b"")

    async def run(self, app: Any) -> dict[str, Any]:
        await app(self.scope, self.receive, self.send)
        return self.answer


async def test_hook_api_acquire_of_a_client_that_hung_up_grants_nothing(h: Harness) -> None:
    app = create_app(h.coordinator, check_host=True)
    first = await Client("/v1/sessions/A/acquire", BODY).run(app)
    assert first["status"] == 200
    client = Client("/v1/sessions/B/acquire", BODY)
    waiting = asyncio.ensure_future(client.run(app))
    await queued(h)
    client.hang_up.set()  # the client timed out and closed its connection
    lease = json.loads(first["body"])["lease_id"]
    released = await Client(f"/v1/leases/{lease}/release", {"status": "ok"}).run(app)
    assert released["status"] == 200  # the slot is free now: before the fix B's acquire took it here
    await waiting
    assert len(h.coordinator.leases) == 0 and slot_free(h)
    third = await Client("/v1/sessions/C/acquire", BODY).run(app)
    assert third["status"] == 200, third


async def test_hook_api_acquire_honours_the_deadline_header(h: Harness) -> None:
    app = create_app(h.coordinator, check_host=True)
    first = await Client("/v1/sessions/A/acquire", BODY).run(app)
    assert first["status"] == 200
    spent = await Client("/v1/sessions/B/acquire", BODY, [(b"x-kv-deadline-ms", b"0")]).run(app)
    assert spent["status"] == 503 and json.loads(spent["body"])["error"]["code"] == "KV_SLOT_BUSY"
    assert not h.coordinator.pool.queued(h.coordinator.servers["local"]) and len(h.coordinator.leases) == 1
    for bad in (b"soon", b"-1", b"1e3", b"1234567890", b""):
        answer = await Client("/v1/sessions/B/acquire", BODY, [(b"x-kv-deadline-ms", bad)]).run(app)
        assert answer["status"] == 400, bad
        assert json.loads(answer["body"])["error"]["code"] == "KV_BAD_REQUEST"
    assert len(h.coordinator.leases) == 1


async def test_hook_api_repeated_deadline_headers_are_refused_and_whitespace_is_not_the_value(
    h: Harness,
) -> None:
    """Two X-KV-Deadline-Ms headers: which one counts would be a guess (before: the last one won, so a
    caller's own short budget could be overridden by a later one). Whitespace around the digits is not
    part of the value (RFC 9110 §5.5): ` 0 ` is 0."""
    app = create_app(h.coordinator, check_host=True)
    first = await Client("/v1/sessions/A/acquire", BODY).run(app)
    assert first["status"] == 200
    for pair in ((b"1", b"60000"), (b"60000", b"1"), (b"5", b"5")):
        headers = [(b"x-kv-deadline-ms", v) for v in pair]
        answer = await Client("/v1/sessions/B/acquire", BODY, headers).run(app)
        assert answer["status"] == 400, pair
        assert json.loads(answer["body"])["error"]["code"] == "KV_BAD_REQUEST"
        assert "more than one" in json.loads(answer["body"])["error"]["message"]
    spent = await Client("/v1/sessions/B/acquire", BODY, [(b"x-kv-deadline-ms", b" 0\t")]).run(app)
    assert spent["status"] == 503 and json.loads(spent["body"])["error"]["code"] == "KV_SLOT_BUSY"
    assert not h.coordinator.pool.queued(h.coordinator.servers["local"]) and len(h.coordinator.leases) == 1


async def test_hook_api_acquire_with_a_request_pipelined_behind_it_grants_nothing_once_the_client_leaves(
    tmp_path: Path,
) -> None:
    """Keep-alive with pipelining, over a real socket: the client sends an acquire that waits for a slot
    and a second request behind it, then closes. uvicorn tells only the newest request that the client
    left; before the fix the waiting acquire never heard of it and got the lease once the slot freed."""
    from functools import partial

    from tests.unit.http.test_listener import TOKEN, serve_api
    from tests.unit.rawhttp import open_socket, raw_request

    auth = {"authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
    body = json.dumps(BODY).encode()
    async for api in serve_api(tmp_path):
        srv = api.h.coordinator.servers["local"]
        pool = api.h.coordinator.pool
        first = await raw_request(api.url, "POST", "/v1/sessions/A/acquire", headers=auth, body=body)
        assert first.status == 200
        head = "".join(f"{k}: {v}\r\n" for k, v in auth.items())
        acquire = (
            f"POST /v1/sessions/B/acquire HTTP/1.1\r\nhost: 127.0.0.1\r\n{head}"
            f"content-length: {len(body)}\r\n\r\n"
        ).encode() + body
        sock = open_socket(api.url)
        try:
            sock.sendall(acquire + b"GET /healthz HTTP/1.1\r\nhost: 127.0.0.1\r\n\r\n")
            await until(partial(pool.queued, srv), what="B's acquire to wait for the slot")
        finally:
            sock.close()  # the client gives up
        await until(partial(nobody_queued, pool, srv), what="B's acquire to see it leave")
        lease = first.json()["lease_id"]
        released = await raw_request(
            api.url, "POST", f"/v1/leases/{lease}/release", headers=auth, body=b'{"status": "ok"}'
        )
        assert released.status == 200
        assert len(api.h.coordinator.leases) == 0
        slot = srv.slots[0]
        assert slot.holder is None and slot.claimed_by is None
