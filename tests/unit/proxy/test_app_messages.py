"""Issue 28 item 4, Claude Code on a pool: `/v1/messages` through the proxy is converted to a chat completion
pinned to the session's slot (`kvsidecar.proxy_anthropic`), on `--parallel 2` as on one slot; its answer
comes back in Anthropic's shape, streamed and not; `HEAD /` and `HEAD /api/hello` are answered locally; the proxy's token is
accepted as `Authorization: Bearer` and as `X-Api-Key`. The real-llama-server suite:
tests/integration/test_proxy_messages_real.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.anthropic_helpers import accumulate, check_message, parse_sse
from tests.unit.origin import Request, keep_alive_origin
from tests.unit.proxy.test_app import AUTH, TOKEN, Rig, rig

TIMINGS = {"prompt_n": 30, "cache_n": 10}
CHAT = {
    "id": "chatcmpl-1",
    "model": "tiny",
    "choices": [{"message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 40, "completion_tokens": 1, "prompt_tokens_details": {"cached_tokens": 10}},
    "timings": TIMINGS,
}


def stream_body() -> bytes:
    chunks: list[dict[str, Any]] = [
        {
            "id": "c1",
            "model": "tiny",
            "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}],
        },
        {"id": "c1", "model": "tiny", "choices": [{"index": 0, "delta": {"content": "hi"}}]},
        {"id": "c1", "model": "tiny", "choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
        {"id": "c1", "model": "tiny", "choices": [], "usage": CHAT["usage"], "timings": TIMINGS},
    ]
    return b"".join(b"data: " + json.dumps(c).encode() + b"\n\n" for c in chunks) + b"data: [DONE]\n\n"


async def llama(request: Request) -> tuple[int, bytes, tuple[tuple[str, str], ...]]:
    """A chat completion (streamed when asked), or llama-server's error for a prompt marked "fail"."""
    if request.target != "/v1/chat/completions":
        return 200, b'{"object": "list", "data": []}', (("content-type", "application/json"),)
    data = request.json()
    if "fail" in json.dumps(data.get("messages")):
        error = {"error": {"code": 400, "message": "the prompt is too long", "type": "invalid_request_error"}}
        return 400, json.dumps(error).encode(), (("content-type", "application/json"),)
    if data.get("stream"):
        return 200, stream_body(), (("content-type", "text/event-stream"),)
    return 200, json.dumps(CHAT).encode(), (("content-type", "application/json"),)


@pytest.fixture(params=[2, 1], ids=["pool", "one-slot"])
async def r(tmp_path: Path, request: pytest.FixtureRequest) -> AsyncIterator[Rig]:
    async for each in rig(
        tmp_path, keep_alive_origin(llama), server={"mode": "managed-slots"}, total_slots=request.param
    ):
        yield each


MESSAGE: dict[str, Any] = {
    "model": "claude-sonnet",
    "max_tokens": 8,
    "system": [{"type": "text", "text": "You are terse."}],
    "messages": [{"role": "user", "content": [{"type": "text", "text": "hello"}]}],
}
CLAUDE_HEADERS = {
    "anthropic-version": "2023-06-01",
    "anthropic-beta": "claude-code-20250219",
    "x-claude-code-session-id": "0f5c1d9e-3f0b-4a43-9a51-1c9b5ad0c2aa",
    "content-type": "application/json",
}


async def post(r: Rig, body: Any, *, auth: dict[str, str] | None = None, **headers: str) -> httpx.Response:
    """POST /v1/messages?beta=true with Claude Code's headers (`headers` replace them; `_` for `-`)."""
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with httpx.AsyncClient(base_url=r.url, timeout=10) as c:
        return await c.post(
            "/v1/messages?beta=true",
            content=content,
            headers={
                **CLAUDE_HEADERS,
                **(AUTH if auth is None else auth),
                **{k.replace("_", "-"): v for k, v in headers.items()},
            },
        )


async def test_messages_are_converted_and_pinned_to_the_sessions_slot(r: Rig) -> None:
    resp = await post(r, MESSAGE)
    assert resp.status_code == 200, resp.text
    assert resp.headers["x-kv-outcome"] == "cold"
    assert resp.headers["x-kv-signal"] == "header:x-claude-code-session-id"
    assert resp.headers["content-length"] == str(len(resp.content))
    message = resp.json()
    check_message(message)
    assert message["content"] == [{"type": "text", "text": "hi"}]
    assert message["usage"] == {"cache_read_input_tokens": 10, "input_tokens": 30, "output_tokens": 1}
    sent = r.origin.requests[-1]
    assert sent.target == "/v1/chat/completions"  # no `?beta=true`
    chat = sent.json()
    assert chat["id_slot"] in range(len(r.h.fake.slots)) and chat["cache_prompt"] is True
    assert chat["messages"][0] == {"role": "system", "content": "You are terse."}
    assert sent.headers["content-type"] == "application/json"
    for name in ("authorization", "x-api-key", "anthropic-version", "anthropic-beta"):
        assert name not in sent.headers, name
    status = r.h.coordinator.status()
    assert status["leases"] == 0 and status["stats"]["acquires"] == 1
    # the second turn goes back to the same slot, resident
    turns: list[Any] = list(MESSAGE["messages"])
    again = await post(r, {**MESSAGE, "messages": [*turns, {"role": "assistant", "content": "hi"}, *turns]})
    assert again.headers["x-kv-outcome"] == "resident"
    assert r.origin.requests[-1].json()["id_slot"] == chat["id_slot"]


async def test_streamed_messages_become_an_anthropic_event_stream(r: Rig) -> None:
    resp = await post(r, {**MESSAGE, "stream": True})
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
    assert "content-length" not in resp.headers
    assert r.origin.requests[-1].json()["stream_options"] == {"include_usage": True}
    message = accumulate(parse_sse(resp.content))
    check_message(message)
    assert message["content"] == [{"type": "text", "text": "hi"}]
    assert message["usage"]["cache_read_input_tokens"] == 10
    status = r.h.coordinator.status()
    assert status["leases"] == 0 and status["stats"]["acquires"] == 1
    registry = r.h.coordinator.metrics.registry
    ok = registry.get_sample_value("kvsidecar_proxy_request_total", {"kind": "managed", "result": "ok"})
    assert ok == 1


async def test_requests_without_a_session_run_pinned_to_an_auxiliary_lease(tmp_path: Path) -> None:
    origin = keep_alive_origin(llama)
    async for each in rig(
        tmp_path, origin, server={"mode": "managed-slots"}, total_slots=2, proxy={"content_identity": False}
    ):
        resp = await post(each, MESSAGE, x_claude_code_session_id="")
        assert resp.status_code == 200, resp.text
        assert "x-kv-outcome" not in resp.headers and resp.headers["x-kv-signal"] == "none"
        chat = each.origin.requests[-1].json()
        assert isinstance(chat["id_slot"], int) and "cache_prompt" not in chat
        assert each.h.coordinator.status()["leases"] == 0


async def test_unconvertible_requests_are_anthropic_400s_before_any_slot(r: Rig) -> None:
    for body, code in (
        ({"model": "m", "max_tokens": 4}, "KV_ANTHROPIC_MISSING_FIELD"),
        ({**MESSAGE, "messages": [{"role": "robot", "content": "x"}]}, "KV_ANTHROPIC_INVALID_FIELD"),
        (b"not json", "KV_BAD_REQUEST"),  # the body gate's, in Anthropic's shape
        (b"[1, 2]", "KV_ANTHROPIC_INVALID_FIELD"),
    ):
        resp = await post(r, body)
        assert resp.status_code == 400, body
        error = resp.json()
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert error["error"]["code"] == code, (body, error)
    assert r.origin.requests == [] and r.h.coordinator.status()["stats"]["acquires"] == 0


async def test_llama_server_errors_come_back_in_anthropics_shape(r: Rig) -> None:
    for stream in (False, True):
        body = {**MESSAGE, "stream": stream, "messages": [{"role": "user", "content": "fail"}]}
        resp = await post(r, body)
        assert resp.status_code == 400 and resp.headers["content-type"] == "application/json"
        assert resp.json() == {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": "the prompt is too long"},
        }
    assert r.h.coordinator.status()["leases"] == 0


@pytest.mark.parametrize("path", ["/", "/api/hello", "/%61pi/hello", "/api%2Fhello"])
async def test_claude_codes_probes_are_answered_locally_without_a_token(r: Rig, path: str) -> None:
    """`HEAD /` (2.1.197) and `HEAD /api/hello` (2.1.332), spelled however llama-server would decode them:
    404 and no body as llama-server answers them, before the token check, reaching nothing upstream."""
    async with httpx.AsyncClient(base_url=r.url, timeout=10) as c:
        bare = await c.head(path)
        with_token = await c.head(path, headers=AUTH)
        wrong = await c.head(path, headers={"authorization": "Bearer wrong"})
        other = await c.head("/v1/messages")
        get = await c.get(path, headers=AUTH)
        near = await c.head("/api/hello/", headers=AUTH)
    for probe in (bare, with_token, wrong):
        assert probe.status_code == 404 and probe.content == b""
        assert probe.headers["content-length"] == "0"
    assert other.status_code == 401  # only the probes are exempt
    assert get.status_code == 403 and near.status_code == 403  # GET, or another path: not forwarded
    assert r.origin.requests == []
    registry = r.h.coordinator.metrics.registry
    refused = registry.get_sample_value(
        "kvsidecar_proxy_request_total", {"kind": "refused", "result": "KV_UNAUTHORIZED"}
    )
    assert refused == 1  # the HEAD /v1/messages; never a probe


async def test_the_token_is_accepted_as_x_api_key_or_bearer(r: Rig) -> None:
    bearer = {"authorization": f"Bearer {TOKEN}"}
    key = {"x-api-key": TOKEN}
    for auth in (bearer, key, {**bearer, **key}):
        resp = await post(r, MESSAGE, auth=auth)
        assert resp.status_code == 200, (auth, resp.text)
        sent = r.origin.requests[-1]
        assert "x-api-key" not in sent.headers and "authorization" not in sent.headers
    for auth in (
        {"x-api-key": "wrong"},
        {"x-api-key": f"Bearer {TOKEN}"},
        {**bearer, "x-api-key": "wrong"},
        {"authorization": "Bearer wrong", **key},
        {},
    ):
        resp = await post(r, MESSAGE, auth=auth)
        assert resp.status_code == 401, auth
    # passthrough routes take it too, and never forward it (llama-server reads X-Api-Key as its own key)
    async with httpx.AsyncClient(base_url=r.url, timeout=10) as c:
        models = await c.get("/v1/models", headers=key)
        counted = await c.post("/v1/messages/count_tokens", json=MESSAGE, headers=key)
    assert models.status_code == 200 and counted.status_code == 200
    assert r.origin.requests[-1].target == "/v1/messages/count_tokens"
    assert "x-api-key" not in r.origin.requests[-1].headers
