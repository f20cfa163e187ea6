"""Hostile input that still got through (issue 26, class D): request heads and credentials at the
listeners (items 8, 9, 10) and Redis host records used as URLs (item 7). Real sockets, uvicorn as
`kvsidecar serve` runs it, a scripted origin standing in for llama-server (the same against a real one:
tests/integration/test_proxy_guard_real.py)."""

from __future__ import annotations

import asyncio
import json
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from kvsidecar.config import config_from_mapping, http_origin
from kvsidecar.config.errors import ConfigInvalid
from kvsidecar.fleet.plane import HostRecord, awaited
from kvsidecar.fleet.routing import FleetRouter
from kvsidecar.http.limits import ListenerState
from kvsidecar.http.listener import MAX_HEADERS
from kvsidecar.proxy.app import Proxy
from kvsidecar.proxy.conversations import ANONYMOUS
from kvsidecar.testing.poll import until
from tests.unit.fleet.test_gate import Host, key_of, start_host
from tests.unit.origin import keep_alive_origin
from tests.unit.proxy.test_app import AUTH, TOKEN, Rig, echo, rig
from tests.unit.rawhttp import open_socket, raw_request, read_until_closed

__all__ = ["start_host"]  # the fixture, shared with fleet/test_gate.py

COMPLETION = json.dumps({"prompt": "hi", "n_predict": 1}).encode()


@pytest.fixture
async def r(tmp_path: Path) -> AsyncIterator[Rig]:
    async for each in rig(tmp_path, keep_alive_origin(echo)):
        yield each


async def raw(url: str, head: bytes, body: bytes = b"") -> bytes:
    """One request written byte for byte (duplicate headers, odd targets); everything until close."""
    sock = open_socket(url)
    try:
        sock.sendall(head + body)
        answer = await read_until_closed(sock, within_s=10)
    finally:
        sock.close()
    assert answer is not None
    return answer


def status_and_code(answer: bytes) -> tuple[int, str | None]:
    head, _, body = answer.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    try:
        return status, json.loads(body)["error"]["code"]
    except (ValueError, KeyError, TypeError):
        return status, None


def post(target: str, *lines: str, body: bytes | None = COMPLETION) -> bytes:
    """A request head with `lines`, and its body (None: the head alone, the body promised)."""
    head = f"POST {target} HTTP/1.1\r\n" + "".join(f"{x}\r\n" for x in lines)
    head += f"content-length: {len(COMPLETION if body is None else body)}\r\nconnection: close\r\n\r\n"
    return head.encode("latin-1") + (body or b"")


# item 8: oversized heads are refused before any acquire, in the proxy's error shape ------------------
@pytest.mark.parametrize(
    "headers",
    [
        {f"x-h{i}": "v" * 100 for i in range(500)},  # 500 headers (llama-server takes 100)
        {"x-big": "v" * 60_000},  # one 60 KB header (llama-server: 8 KiB a line)
        {f"x-h{i}": "v" * 7000 for i in range(6)},  # 42 KB in lines each under 8 KiB
    ],
    ids=["500-headers", "60KB-header", "42KB-head"],
)
async def test_an_oversized_head_never_reaches_the_coordinator_or_llama(
    r: Rig, headers: dict[str, str]
) -> None:
    resp = await raw_request(
        r.url, "POST", "/completion", headers={**AUTH, "X-Session-Id": "A", **headers}, body=COMPLETION
    )
    assert resp.status == 431
    error = resp.json()["error"]
    assert error["code"] == "KV_HEADERS_TOO_LARGE" and error["type"] == "invalid_request_error"
    assert r.origin.requests == []
    assert r.h.coordinator.status()["stats"]["acquires"] == 0  # no session acquired, no slot prepared
    assert r.h.fake.calls == []


async def test_a_long_target_is_refused_and_a_head_within_the_limits_is_forwarded(r: Rig) -> None:
    resp = await raw_request(r.url, "GET", "/v1/models?x=" + "a" * 9000, headers=AUTH)
    assert resp.status == 431 and resp.json()["error"]["code"] == "KV_HEADERS_TOO_LARGE"
    many = {f"x-h{i}": "v" * 100 for i in range(MAX_HEADERS - 5)}  # + host, connection, length, auth, id
    ok = await raw_request(
        r.url, "POST", "/completion", headers={**AUTH, "X-Session-Id": "A", **many}, body=COMPLETION
    )
    assert ok.status == 200
    assert len(r.origin.requests) == 1


# item 9: one credential's slow bodies cannot hold the listener ---------------------------------------
async def slow_bodies(url: str, n: int) -> list[socket.socket]:
    """`n` authenticated requests whose heads are in and whose bodies never come."""
    socks = []
    for _ in range(n):
        s = open_socket(url)
        s.sendall(
            post(
                "/completion",
                "host: 127.0.0.1",
                f"authorization: Bearer {TOKEN}",
                "x-session-id: A",
                body=None,
            )
        )
        socks.append(s)
    return socks


async def bodies_pending(listener: ListenerState, n: int) -> None:
    await until(lambda: sum(c.body_pending for c in listener.open) >= n, what=f"{n} bodies pending")


async def bodies_cut(listener: ListenerState, n: int) -> None:
    await until(lambda: listener.too_slow >= n, what=f"{n} slow bodies cut")


async def test_at_the_cap_one_credentials_slow_bodies_make_room_for_a_whole_request(tmp_path: Path) -> None:
    """The listener full of one credential's bodies that never come (the issue: 300 of them, a
    legitimate client got 503 for `body_timeout_s`): the newcomer is served, the oldest slow body is
    told 429 `KV_TOO_MANY_BODIES` (Retry-After) and closed."""
    limits = {"max_connections": 6, "max_slow_bodies": 2, "slow_body_s": 60, "body_timeout_s": 120}
    async for each in rig(tmp_path, keep_alive_origin(echo), proxy=limits):
        listener = each.app.listener
        socks = await slow_bodies(each.url, 6)
        try:
            await bodies_pending(listener, 6)
            async with each.client() as c:
                ok = await c.post("/completion", json={"prompt": "hi"}, headers={"X-Session-Id": "B"})
            assert ok.status_code == 200
            first = await read_until_closed(socks[0], within_s=10)
            assert first is not None and status_and_code(first) == (429, "KV_TOO_MANY_BODIES")
            assert b"retry-after: 1" in first.lower()
            assert json.loads(first.partition(b"\r\n\r\n")[2])["error"]["type"] == "rate_limit_error"
            assert listener.refused == 0 and listener.too_slow == 1
        finally:
            for s in socks:
                s.close()
        assert [q.json()["prompt"] for q in each.origin.requests] == ["hi"]


async def test_past_slow_body_s_a_credential_holds_at_most_max_slow_bodies(tmp_path: Path) -> None:
    limits = {"max_slow_bodies": 2, "slow_body_s": 0.1, "body_timeout_s": 120}
    async for each in rig(tmp_path, keep_alive_origin(echo), proxy=limits):
        listener = each.app.listener
        socks = await slow_bodies(each.url, 6)
        try:
            await bodies_cut(listener, 4)  # the slow bodies over the cap
            answers = [await read_until_closed(s, within_s=2) for s in socks]  # None: still held
            cut = [a for a in answers if a is not None]
            assert len(cut) == 4 and all(status_and_code(a) == (429, "KV_TOO_MANY_BODIES") for a in cut)
            assert len(listener.slow[b"token"]) == 2
            async with each.client() as c:  # a whole request of the same credential is not a slow one
                ok = await c.post("/completion", json={"prompt": "hi"}, headers={"X-Session-Id": "B"})
            assert ok.status_code == 200
        finally:
            for s in socks:
                s.close()
        assert each.h.coordinator.status()["stats"]["acquires"] == 1


# item 10: the Host guard and the credentials ---------------------------------------------------------
@pytest.mark.parametrize(
    ("target", "lines"),
    [
        ("http://evil.example/completion", ["host: 127.0.0.1"]),  # the target names the authority
        ("http://evil.example:8378/completion", ["host: 127.0.0.1:8378"]),
        ("/completion", ["host: 127.0.0.1:evil"]),
        ("/completion", ["host: 127.0.0.1:"]),
        ("/completion", ["host: 127.0.0.1:99999"]),
        ("/completion", ["host: [127.0.0.1]"]),
        ("/completion", ["host: 127.0.0.1", "host: evil.example"]),
        ("/completion", ["host: evil.example", "host: 127.0.0.1"]),
        ("*", ["host: 127.0.0.1"]),
        ("127.0.0.1:8378", ["host: 127.0.0.1"]),
        ("http://user@127.0.0.1/completion", ["host: 127.0.0.1"]),
        ("ftp://127.0.0.1/completion", ["host: 127.0.0.1"]),
    ],
)
async def test_the_host_guard_reads_every_authority_a_request_names(
    r: Rig, target: str, lines: list[str]
) -> None:
    answer = await raw(r.url, post(target, *lines, f"authorization: Bearer {TOKEN}", "x-session-id: A"))
    assert status_and_code(answer) == (400, "KV_BAD_REQUEST"), answer[:300]
    assert r.origin.requests == []
    assert r.h.coordinator.status()["stats"]["acquires"] == 0


async def test_an_absolute_target_naming_loopback_is_served(r: Rig) -> None:
    answer = await raw(
        r.url, post("http://127.0.0.1/completion", "host: evil.example", f"authorization: Bearer {TOKEN}")
    )
    assert status_and_code(answer)[0] == 200
    assert [q.target for q in r.origin.requests] == ["/completion"]


@pytest.mark.parametrize(
    "lines",
    [
        ["authorization: Bearer wrong", f"authorization: Bearer {TOKEN}"],  # the last one was checked
        [f"authorization: Bearer {TOKEN}", "authorization: Bearer wrong"],
        [f"authorization: Bearer {TOKEN}", "x-api-key: a", "x-api-key: b"],
    ],
)
async def test_two_credentials_are_refused_whichever_comes_last(r: Rig, lines: list[str]) -> None:
    answer = await raw(r.url, post("/completion", "host: 127.0.0.1", *lines))
    assert status_and_code(answer) == (400, "KV_BAD_REQUEST")
    assert r.origin.requests == []


async def test_the_hook_api_has_the_same_guard(tmp_path: Path) -> None:
    from tests.unit.http.test_listener import serve_api

    async for api in serve_api(tmp_path):
        for head in (
            b"GET http://evil.example/v1/status HTTP/1.1\r\nhost: 127.0.0.1\r\n",
            b"GET /v1/status HTTP/1.1\r\nhost: 127.0.0.1:evil\r\n",
            b"GET /v1/status HTTP/1.1\r\nhost: 127.0.0.1\r\nhost: 127.0.0.1\r\n",
            b"GET /v1/status HTTP/1.1\r\nhost: 127.0.0.1\r\nauthorization: Bearer x\r\n",
        ):
            auth = f"authorization: Bearer {TOKEN}\r\n".encode()
            answer = await raw(api.url, head + auth + b"connection: close\r\n\r\n")
            assert status_and_code(answer) == (400, "KV_BAD_REQUEST"), head
        big = b"GET /v1/status HTTP/1.1\r\nhost: 127.0.0.1\r\n" + b"x-a: b\r\n" * 200 + b"\r\n"
        assert status_and_code(await raw(api.url, big)) == (431, "KV_HEADERS_TOO_LARGE")


# item 7: a host record names an origin, never a path, query or a llama-server ---------------------------
@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:8080/slots/0?action=erase&x=",
        "http://127.0.0.1:8080/slots/0",
        "http://127.0.0.1:8080?action=erase",
        "http://127.0.0.1:8080/#x",
        "http://127.0.0.1:8080//",
        "http://user:pw@127.0.0.1:8080",
        "http://127.0.0.1",  # no explicit port
        "http://127.0.0.1:0",
        "http://127.0.0.1:65536",
        "http://127.0.0.1:8080 ",
        "http://127.0.0.1:8080\n",
        "http://127.0.0.1:80\r\nx: y",
        "http://%31%32%37.0.0.1:8080",
        "http://127.0.0.1%2f:8080",
        "http://exämple.com:8080",
        "http://[::1:8080",
        "http://[zz::1]:8080",
        "https://:8080",
        "ftp://127.0.0.1:21",
        "HTTP://127.0.0.1:8080",
    ],
)
@pytest.mark.parametrize("field", ["advertise_url", "proxy_url"])
def test_a_host_record_with_anything_but_an_origin_is_not_a_host(field: str, url: str) -> None:
    data = json.loads(
        HostRecord(host_id="h9", advertise_url="http://10.0.0.9:8377", version="x", time=1.0).to_json()
    )
    data[field] = url
    assert HostRecord.from_json(json.dumps(data)) is None


def test_an_origin_is_kept_in_one_spelling() -> None:
    data = json.loads(
        HostRecord(
            host_id="h9",
            advertise_url="http://Node-9.Example:8377/",
            version="x",
            time=1.0,
            proxy_url="http://[0:0::1]:8378",
        ).to_json()
    )
    parsed = HostRecord.from_json(json.dumps(data))
    assert parsed is not None
    assert parsed.advertise_url == "http://node-9.example:8377" and parsed.proxy_url == "http://[::1]:8378"


def test_a_fleet_that_advertises_more_than_an_origin_does_not_start(tmp_path: Path) -> None:
    base: dict[str, Any] = {
        "state_dir": str(tmp_path / "state"),
        "servers": {"local": {"snapshot_dir": str(tmp_path / "s")}},
        "fleet": {"enabled": True, "shared_dir": str(tmp_path / "shared"), "host_id": "h1"},
    }
    for url in ("http://10.0.0.1:8377/api", "http://10.0.0.1", "http://10.0.0.1:8377?x=1"):
        with pytest.raises(ConfigInvalid) as caught:
            config_from_mapping({**base, "fleet": {**base["fleet"], "advertise_url": url}})
        assert "fleet.advertise_url: must be an origin only" in str(caught.value)
    assert http_origin(config_from_mapping(base).advertise_url()) == "http://127.0.0.1:8377"


async def forge(host: Host, host_id: str, **fields: Any) -> None:
    """A host record written into Redis by someone else than a kvsidecar (fields verbatim)."""
    data = {"v": 1, "host_id": host_id, "version": "x", "time": time.time(), "servers": [], **fields}
    data.setdefault("advertise_url", "http://10.255.255.1:8377")
    await host.agent.client.set(f"t:host:{host_id}", json.dumps(data), px=60_000)
    await awaited(host.agent.client.sadd("t:hosts", host_id))


async def test_a_forged_advertise_url_never_sends_an_acquire_to_a_slot_action(
    start_host: Callable[..., Awaitable[Host]],
) -> None:
    """The issue's case: `advertise_url` = llama-server's erase action, a query left open for our path."""
    llama = keep_alive_origin()
    await llama.start()
    h1 = await start_host("h1")
    router = FleetRouter(h1.agent, h1.coordinator, token=None)
    try:
        await forge(h1, "h9", advertise_url=f"{llama.url}/slots/0?action=erase&x=")
        k = key_of("A")
        await h1.agent.client.set(f"t:owner:{k}", "h9|5", px=60_000)
        await until(lambda: h1.agent.plane.refused_records > 0, what="h1 to read the forged record")
        assert "h9" not in h1.agent.hosts

        async def serve() -> dict[str, Any]:
            return {"lease_id": "local", "outcome": "cold"}

        answer = await router.acquire(k, "local", "/v1/sessions/A/acquire", {}, 0, serve)
        assert isinstance(answer, dict) and answer["host"] == "h1"  # served here
        assert llama.requests == []
        metric = h1.coordinator.metrics.registry.get_sample_value("kvsidecar_fleet_records_refused_total")
        assert metric is not None and metric >= 1
    finally:
        await router.aclose()
        await llama.stop()


@pytest.mark.parametrize(
    "spelling",
    # a connection to the unspecified address, to an IPv4-mapped loopback, or to a name this machine
    # resolves to loopback itself, reaches the local llama-server as well as 127.0.0.1 does
    [
        *("127.0.0.1", "localhost", "[::1]", "127.0.0.2", "0.0.0.0", "[::]", "[::ffff:127.0.0.1]"),
        *("llama.localhost", "ip6-localhost", socket.gethostname().lower()),
    ],
)
async def test_a_record_naming_a_llama_server_is_refused(
    start_host: Callable[..., Awaitable[Host]], spelling: str
) -> None:
    """An origin that is a llama-server (this host's, in any loopback spelling, or one another record
    lists) is refused as a peer's hook API or proxy: only the proxy's allowlist may reach it."""
    h1 = await start_host("h1")  # its llama-server: servers.local.base_url, http://127.0.0.1:8080
    await forge(h1, "h8", advertise_url=f"http://{spelling}:8080")
    await forge(h1, "h7", proxy_url=f"http://{spelling}:8080")
    llama_of_h6: dict[str, Any] = {"name": "local", "base_url": "http://10.1.1.6:9090/llama"}
    llama_of_h6 |= {"fingerprint": None, "slots_total": 1, "slots_free": 1, "slots_clean": 0}
    await forge(h1, "h6", advertise_url="http://10.1.1.6:8377", servers=[llama_of_h6])
    await forge(h1, "h5", proxy_url="http://10.1.1.6:9090")  # h6's llama-server
    await until(lambda: h1.agent.plane.refused_hosts == {"h5", "h7", "h8"}, what="h1 to refuse h5, h7, h8")
    assert sorted(h1.agent.hosts) == ["h1", "h6"]


async def test_a_peer_proxy_that_is_not_a_kvsidecar_never_answers_the_client(
    start_host: Callable[..., Awaitable[Host]],
) -> None:
    """A record whose proxy_url is an origin but not a kvsidecar (a llama-server under a name no record
    lists, any service): its answer, without the peer's `X-KV-Fleet-Host`, is not passed on; the session is
    served here, pinned by this host's own proxy."""
    other = keep_alive_origin(
        lambda _q: _answer(200, b'{"content": "forged", "timings": {"prompt_n": 1, "cache_n": 0}}')
    )
    await other.start()
    h1 = await start_host("h1")
    router = FleetRouter(h1.agent, h1.coordinator, token=None)
    proxy = Proxy(h1.coordinator, h1.coordinator.config, token=None, check_host=False, fleet=lambda: router)
    served_here: list[bytes] = []

    class LocalLlama:  # this host's llama-server: what is served here
        async def forward(
            self, scope: Scope, out: Any, receive: Receive, send: Send, **_: Any
        ) -> tuple[str, None]:
            served_here.append(out.body)
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b'{"content": "here"}', "more_body": False})
            return "ok", None

    proxy.forwarder = LocalLlama()  # type: ignore[assignment]
    try:
        await forge(h1, "h9", proxy_url=other.url)
        await until(lambda: "h9" in h1.agent.hosts, what="h1 to see h9")
        k = key_of("A", ANONYMOUS)  # a proxy client without a credential: its session's key is in that scope
        await h1.agent.client.set(f"t:owner:{k}", "h9|5", px=60_000)
        transport = httpx.ASGITransport(app=proxy)
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            answer = await client.post(
                "/completion", json={"model": "m", "prompt": "hi"}, headers={"X-Session-Id": "A"}
            )
        assert len(other.requests) == 1  # it was asked (nothing says what it is before it answers) ...
        assert answer.status_code == 200 and answer.json() == {"content": "here"}  # ... never believed
        assert len(served_here) == 1 and json.loads(served_here[0])["id_slot"] == 0  # pinned here
        holder = await h1.agent.leases.holder(k)
        assert holder is not None and holder.holder == "h1"
    finally:
        await proxy.aclose()
        await router.aclose()
        await other.stop()


async def test_a_peer_proxy_names_itself_on_every_answer_to_a_forwarded_request(
    start_host: Callable[..., Awaitable[Host]],
) -> None:
    h1 = await start_host("h1")
    router = FleetRouter(h1.agent, h1.coordinator, token=None)
    proxy = Proxy(h1.coordinator, h1.coordinator.config, token=None, check_host=False, fleet=lambda: router)
    transport = httpx.ASGITransport(app=proxy)
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
            refused = await client.post("/slots/0?action=erase", headers={"X-KV-Fleet-Hop": "1"})
            plain = await client.post("/slots/0?action=erase")
        assert refused.status_code == 403 and refused.headers["x-kv-fleet-host"] == "h1"
        assert "x-kv-fleet-host" not in plain.headers
    finally:
        await proxy.aclose()
        await router.aclose()


async def _answer(status: int, body: bytes) -> tuple[int, bytes, tuple[tuple[str, str], ...]]:
    return status, body, (("content-type", "application/json"),)


async def test_a_client_still_sending_its_oversized_head_reads_the_431(tmp_path: Path) -> None:
    """The 431 goes out while most of the client's head is still unread: the listener ends its side after
    the answer and reads on, so the connection is never reset under the answer (a close with unread bytes
    sends a reset, and a client reading to the end of the stream then gets an error, not the 431)."""
    from tests.unit.http.test_listener import serve_api

    async for api in serve_api(tmp_path):
        host, port = api.url.removeprefix("http://").split(":")
        reader, writer = await asyncio.open_connection(host, int(port.rstrip("/")))
        try:
            writer.write(b"GET /v1/status HTTP/1.1\r\nhost: 127.0.0.1\r\n" + b"x-a: b\r\n" * 60_000)
            answer = await asyncio.wait_for(reader.read(), 10)
        finally:
            writer.close()
        assert status_and_code(answer) == (431, "KV_HEADERS_TOO_LARGE"), answer[:200]
