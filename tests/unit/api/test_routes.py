"""The hook API over ASGI with the fake backend: the contract of docs/PRODUCT.md, errors, auth, limits."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from kvsidecar.api.routes import create_app
from kvsidecar.client import KvSidecarClient, SidecarError
from tests.unit.coordinator_helpers import Harness, conversation

TOKEN = "t" * 32


def http(h: Harness, *, token: str | None = TOKEN, host: str = "127.0.0.1:8377") -> httpx.AsyncClient:
    app = create_app(h.coordinator, token=TOKEN, max_body_bytes=4096)
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app), base_url=f"http://{host}", headers=headers
    )


def client(h: Harness) -> KvSidecarClient:
    app = create_app(h.coordinator, token=TOKEN)
    return KvSidecarClient("http://127.0.0.1:8377", token=TOKEN, transport=httpx.ASGITransport(app=app))


async def test_acquire_release_contract(h: Harness) -> None:
    async with http(h) as c:
        r = await c.post("/v1/sessions/A/acquire", json={"provider": "local", "model": "m", "seq": 3})
        assert r.status_code == 200
        body = r.json()
        assert {
            "lease_id",
            "server",
            "base_url",
            "slot_id",
            "outcome",
            "restored_tokens",
            "restore_ms",
            "evicted",
        } <= set(body)
        assert body["outcome"] == "cold" and body["slot_id"] == 0 and body["server"] == "local"
        r = await c.post(
            f"/v1/leases/{body['lease_id']}/release",
            json={"status": "ok", "prompt_tokens": 10, "cached_tokens": 0},
        )
        assert r.status_code == 200 and r.json()["dirty"] is True
        r = await c.post("/v1/sessions/A/acquire", json={"provider": "local", "model": "m"})
        assert r.json()["outcome"] == "resident"
        await c.post(f"/v1/leases/{r.json()['lease_id']}/release", json={"status": "aborted"})


async def test_bypass_for_unmanaged_provider(h: Harness) -> None:
    async with http(h) as c:
        r = await c.post("/v1/sessions/A/acquire", json={"provider": "openai", "model": "gpt-5"})
        assert r.status_code == 200 and r.json()["outcome"] == "bypass" and r.json()["lease_id"] is None


async def test_client_context_manager_releases_and_aborts(h: Harness) -> None:
    async with client(h) as kv:
        async with kv.acquire("A", provider="local", model="m") as lease:
            lease.report(prompt_tokens=5, cached_tokens=0)
        assert lease.release_result is not None and lease.release_result["dirty"] is True
        with pytest.raises(RuntimeError):
            async with kv.acquire("A", provider="local", model="m") as lease2:
                raise RuntimeError("harness failed mid-request")
        assert lease2.release_result == {"released": True, "dirty": False}
        assert len(h.coordinator.leases) == 0
        sessions = await kv.sessions()
        assert len(sessions) == 1 and sessions[0]["session"] != "A"
        status = await kv.status()
        assert status["servers"][0]["slots"][0]["state"] == "dirty"


async def test_events_save_restore_invalidate_purge(h: Harness) -> None:
    async with client(h) as kv:
        async with kv.acquire("A", provider="local", model="m") as lease:
            assert lease.slot_id is not None
            h.fake.infer(lease.slot_id, conversation("A", 1))
        assert (await kv.event("A", "flush"))["saved"] == 1
        async with kv.acquire("B", provider="local", model="m"):
            pass
        restored = await kv.restore("A", provider="local", model="m")
        assert restored["outcome"] == "restored" and "lease_id" not in restored
        assert (await kv.save("A"))["checked"] == 1
        assert (await kv.invalidate("A"))["invalidated"] == 1
        assert (await kv.purge("A"))["purged"] == 1
        with pytest.raises(SidecarError) as info:
            await kv.purge("A")
        assert info.value.code == "KV_NOT_FOUND" and info.value.status == 404


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "code"),
    [
        (
            "POST",
            "/v1/sessions/..%2F..%2Fetc%2Fpasswd/acquire",  # one segment: the session id `../../etc/passwd`
            {"provider": "local", "model": "m"},
            400,
            "KV_INVALID_SESSION_ID",
        ),
        (
            "POST",
            "/v1/sessions/a%00b/acquire",
            {"provider": "local", "model": "m"},
            400,
            "KV_INVALID_SESSION_ID",
        ),
        (
            "POST",
            "/v1/sessions/" + "x" * 200 + "/acquire",
            {"provider": "local", "model": "m"},
            400,
            "KV_INVALID_SESSION_ID",
        ),
        ("POST", "/v1/sessions/A/acquire", {"provider": 5, "model": "m"}, 400, "KV_BAD_REQUEST"),
        ("POST", "/v1/sessions/A/acquire", {"model": "m"}, 400, "KV_BAD_REQUEST"),
        (
            "POST",
            "/v1/sessions/A/acquire",
            {"provider": "local", "model": "m", "seq": -1},
            400,
            "KV_BAD_REQUEST",
        ),
        ("POST", "/v1/leases/nope/release", {"status": "ok"}, 404, "KV_LEASE_NOT_FOUND"),
        ("POST", "/v1/leases/nope/release", {"status": "maybe"}, 400, "KV_BAD_REQUEST"),
        ("POST", "/v1/sessions/A/events", {"type": "explode"}, 400, "KV_BAD_REQUEST"),
        ("GET", "/v1/sessions/unknown", None, 404, "KV_NOT_FOUND"),
        ("GET", "/v1/nothing", None, 404, "KV_NOT_FOUND"),
        ("DELETE", "/v1/status", None, 405, "KV_METHOD_NOT_ALLOWED"),
    ],
)
async def test_bad_input_gets_a_stable_code_and_changes_nothing(
    h: Harness, method: str, path: str, body: object, status: int, code: str
) -> None:
    async with http(h) as c:
        r = await c.request(method, path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert err["code"] == code and err["message"]
    assert h.coordinator.sessions.by_key == {} and h.fake.calls == []


async def test_malformed_json_body(h: Harness) -> None:
    async with http(h) as c:
        r = await c.post(
            "/v1/sessions/A/acquire", content=b"{not json", headers={"content-type": "application/json"}
        )
    assert r.status_code == 400 and r.json()["error"]["code"] == "KV_BAD_REQUEST"


async def test_oversized_body_is_refused(h: Harness) -> None:
    async with http(h) as c:
        r = await c.post(
            "/v1/sessions/A/acquire", json={"provider": "local", "model": "m", "pad": "x" * 10_000}
        )
    assert r.status_code == 413 and r.json()["error"]["code"] == "KV_PAYLOAD_TOO_LARGE"
    assert h.coordinator.sessions.by_key == {}


async def test_streamed_oversized_body_is_refused(h: Harness) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(10):
            yield b" " * 1000

    async with http(h) as c:
        r = await c.post(
            "/v1/sessions/A/acquire", content=chunks(), headers={"content-type": "application/json"}
        )
    assert r.status_code == 413


async def test_auth(h: Harness) -> None:
    async with http(h, token=None) as c:
        assert (await c.get("/healthz")).status_code == 200
        for path in ("/v1/status", "/v1/sessions", "/metrics", "/openapi.json"):
            r = await c.get(path)
            assert r.status_code == 401 and r.json()["error"]["code"] == "KV_UNAUTHORIZED"
    async with http(h, token="wrong" * 8) as c:
        assert (await c.get("/v1/status")).status_code == 401


async def test_host_header_guard_against_dns_rebinding(h: Harness) -> None:
    async with http(h, host="evil.example.com") as c:
        r = await c.get("/v1/status")
    assert r.status_code == 400
    for ok_host in ("localhost:8377", "[::1]:8377", "127.0.0.1"):
        async with http(h, host=ok_host) as c:
            assert (await c.get("/v1/status")).status_code == 200


async def test_metrics_and_openapi(h: Harness) -> None:
    async with client(h) as kv, kv.acquire("A", provider="local", model="m"):
        pass
    async with http(h) as c:
        text = (await c.get("/metrics")).text
        assert 'kvsidecar_acquire_total{outcome="cold",server="local"} 1.0' in text
        assert "# TYPE kvsidecar_restore_duration_seconds histogram" in text
        spec = (await c.get("/openapi.json")).json()
    assert (
        "/v1/sessions/{session_id}/acquire" in spec["paths"]
        and "/v1/leases/{lease_id}/release" in spec["paths"]
    )


async def test_slot_busy_has_retry_after(h: Harness) -> None:
    h.coordinator.acquirer.acquire_timeout_s = 0.05
    async with http(h) as c:
        first = await c.post("/v1/sessions/A/acquire", json={"provider": "local", "model": "m"})
        r = await c.post("/v1/sessions/B/acquire", json={"provider": "local", "model": "m"})
        assert r.status_code == 503 and r.headers["retry-after"] == "1"
        assert r.json()["error"]["code"] == "KV_SLOT_BUSY"
        await c.post(f"/v1/leases/{first.json()['lease_id']}/release", json={"status": "ok"})
