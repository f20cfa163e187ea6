"""The proxy as OpenAI-ecosystem clients see it (issue 17): `X-KV-Reason` on answers whose session is not
warm, a session identity without the `model` string, OpenAI-shaped errors (checked with the openai SDK),
and one of each response header. In front of a scripted origin that runs the fake backend's engine, so
sessions really go resident, saved and restored. The real-llama-server suite:
tests/integration/test_proxy_openai_real.py."""

from __future__ import annotations

import ast
import asyncio
import json
import re
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import openai
import pytest

from kvsidecar.backend.fake import FakeKvBackend
from kvsidecar.coordinator.savepoints import PointTaken
from kvsidecar.coordinator.state import AcquireResult, Outcome
from kvsidecar.fingerprint import reasons as fingerprint
from kvsidecar.proxy import client_content, client_ids
from kvsidecar.proxy.answers import CLIENTS, OTHER, REASONS, client_of, reason_token, with_point
from tests.unit.client_fixtures import Recorded, load, posts
from tests.unit.origin import Origin, OriginConn, Request, keep_alive_origin
from tests.unit.proxy.test_app import TOKEN, Rig, rig
from tests.unit.rawhttp import open_socket, read_until_closed

Answer = tuple[int, bytes, tuple[tuple[str, str], ...]]


def engine(headers: tuple[tuple[str, str], ...] = ()) -> tuple[Origin, list[FakeKvBackend]]:
    """An origin that runs each pinned request on the fake backend's slot (so the slot really holds the
    prompt, is saved with it and restored from it) and answers with the engine's timings."""
    fake: list[FakeKvBackend] = []

    async def answer(request: Request) -> Answer:
        data = request.json()
        prompt = [ord(c) for c in data.get("prompt", "")]
        prompt_n, cache_n = fake[0].infer(data["id_slot"], prompt)
        body = {"content": "ok", "timings": {"prompt_n": prompt_n, "cache_n": cache_n}}
        return 200, json.dumps(body).encode(), (("content-type", "application/json"), *headers)

    return keep_alive_origin(answer), fake


async def with_engine(tmp_path: Path, **kw: Any) -> AsyncIterator[Rig]:
    origin, fake = engine()
    async for each in rig(tmp_path, origin, **kw):
        fake.append(each.h.fake)
        yield each


async def turn(r: Rig, session: str, prompt: str, model: str | None = None) -> dict[str, str]:
    body: dict[str, Any] = {"prompt": prompt}
    if model is not None:
        body["model"] = model
    async with r.client() as c:
        resp = await c.post("/completion", json=body, headers={"X-Session-Id": session})
    assert resp.status_code == 200, resp.text
    return dict(resp.headers)


# X-KV-Reason -------------------------------------------------------------------------------------------


async def test_answers_of_a_session_that_is_not_warm_say_why(tmp_path: Path) -> None:
    async for r in with_engine(tmp_path):
        first = await turn(r, "A", "a" * 40)
        assert first["x-kv-outcome"] == "cold" and first["x-kv-reason"] == "NO_SNAPSHOT"
        again = await turn(r, "A", "a" * 50)
        assert again["x-kv-outcome"] == "resident" and "x-kv-reason" not in again
        await turn(r, "B", "b" * 40)  # A is saved to make room
        back = await turn(r, "A", "a" * 60)
        assert back["x-kv-outcome"] == "restored" and "x-kv-reason" not in back
        await turn(r, "B", "b" * 50)
        r.h.fake.fail_next_restore()
        failed = await turn(r, "A", "a" * 70)
        assert failed["x-kv-outcome"] == "cold_fallback" and failed["x-kv-reason"] == "KV_RESTORE_FAILED"


async def test_a_session_the_proxy_does_not_manage_is_told_so(tmp_path: Path) -> None:
    async for r in with_engine(tmp_path, enabled=False):
        async with r.client() as c:
            resp = await c.post(
                "/completion", json={"prompt": "x", "id_slot": 0}, headers={"X-Session-Id": "A"}
            )
            aux = await c.post("/completion", json={"prompt": "x", "id_slot": 0})
        assert resp.headers["x-kv-outcome"] == "bypass" and resp.headers["x-kv-reason"] == "DISABLED"
        assert "x-kv-outcome" not in aux.headers  # no session: nothing to say about one


def test_the_reason_is_a_token_of_our_own_never_the_text_behind_it() -> None:
    def token(reason: str | None, outcome: Outcome = Outcome.COLD_FALLBACK) -> str | None:
        return reason_token(AcquireResult(outcome=outcome, reason=reason))

    assert token("previous generation (SNAPSHOT_CORRUPT)", Outcome.RESTORED) == "PREVIOUS_GENERATION"
    assert token("previous generation (x\r\nSet-Cookie: a=b)", Outcome.RESTORED) == "PREVIOUS_GENERATION"
    assert token("MODEL_FINGERPRINT_CHANGED") == "MODEL_FINGERPRINT_CHANGED"
    assert token("SNAPSHOT_FILE_UNSAFE") == "SNAPSHOT_FILE_UNSAFE"
    for hostile in ("NOT_OURS", "../../etc/passwd", "A" * 5000, "x\r\ny", "circuit open!"):
        assert token(hostile) == OTHER
    assert token(None, Outcome.RESIDENT) is None and token(None, Outcome.COLD) == "NO_SNAPSHOT"
    assert reason_token(AcquireResult(outcome=Outcome.COLD), restore_enabled=False) == "RESTORE_DISABLED"
    assert all(re.fullmatch(r"[A-Z][A-Z0-9_]{0,63}", r) for r in REASONS)
    assert set(fingerprint.REASON_PRIORITY) <= REASONS


def coordinator_reasons() -> set[str]:
    """Every reason text the coordinator writes into an acquire's answer (its source, read by ast)."""
    found: set[str] = set()
    for path in Path("kvsidecar/coordinator").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            values: list[ast.expr] = []
            if isinstance(node, ast.Assign) and any("reason" in ast.unparse(t) for t in node.targets):
                values.append(node.value)
            if isinstance(node, ast.Call) and ast.unparse(node.func) == "AcquireResult":
                values += [k.value for k in node.keywords if k.arg == "reason"]
            for value in values:
                found |= _texts(value)
    return found


def _texts(node: ast.AST) -> set[str]:
    """The string constants of an expression; of an f-string, its fixed beginning."""
    if isinstance(node, ast.JoinedStr):
        first = node.values[0] if node.values else None
        return {str(first.value)} if isinstance(first, ast.Constant) else set()
    if isinstance(node, ast.Constant):
        return {node.value} if isinstance(node.value, str) else set()
    return set().union(*(_texts(child) for child in ast.iter_child_nodes(node)))


def test_every_reason_the_coordinator_gives_has_its_own_token() -> None:
    reasons = coordinator_reasons() - {"auxiliary"}  # an auxiliary answer carries no X-KV-* headers
    assert {"circuit open", "server restarted during restore", "disabled"} <= reasons  # the scan works
    for reason in reasons:
        assert token_of(reason) != OTHER, reason


def token_of(reason: str) -> str | None:
    return reason_token(AcquireResult(outcome=Outcome.COLD_FALLBACK, reason=reason))


# session identity --------------------------------------------------------------------------------------


async def test_session_identity_keeps_one_session_whatever_model_string(tmp_path: Path) -> None:
    async for r in with_engine(tmp_path, proxy={"identity": "session"}):
        assert (await turn(r, "A", "a" * 40, model="gpt-4o"))["x-kv-outcome"] == "cold"
        assert (await turn(r, "A", "a" * 50, model="qwen"))["x-kv-outcome"] == "resident"
        assert (await turn(r, "A", "a" * 60))["x-kv-outcome"] == "resident"
        await turn(r, "B", "b" * 40, model="other")
        assert (await turn(r, "A", "a" * 70, model="claude"))["x-kv-outcome"] == "restored"


async def test_default_identity_is_session_and_model(tmp_path: Path) -> None:
    async for r in with_engine(tmp_path):
        assert (await turn(r, "A", "a" * 40, model="gpt-4o"))["x-kv-outcome"] == "cold"
        assert (await turn(r, "A", "a" * 50, model="gpt-4o"))["x-kv-outcome"] == "resident"
        split = await turn(r, "A", "a" * 60, model="qwen")  # another identity: its own (cold) session
        assert split["x-kv-outcome"] == "cold" and split["x-kv-reason"] == "NO_SNAPSHOT"


async def test_session_identity_never_restores_into_another_runtime(tmp_path: Path) -> None:
    async for r in with_engine(tmp_path, proxy={"identity": "session"}):
        await turn(r, "A", "a" * 40, model="m")
        await turn(r, "B", "b" * 40, model="m")  # A saved under the first runtime
        r.h.fake.restart(model_path="/models/another.gguf")
        r.h.fake.calls.clear()
        back = await turn(r, "A", "a" * 50, model="m")
        assert back["x-kv-outcome"] == "cold_fallback"
        assert back["x-kv-reason"] in set(fingerprint.REASON_PRIORITY) | {"FINGERPRINT_CHANGED"}
        assert not [c for c in r.h.fake.calls if c[0] == "restore"]


# OpenAI-shaped errors ----------------------------------------------------------------------------------


async def sdk(r: Rig, call: Callable[[openai.AsyncOpenAI], Awaitable[Any]], key: str = TOKEN) -> Any:
    """One call with the openai SDK through the proxy (no retries: each error is seen as it is)."""
    async with openai.AsyncOpenAI(base_url=f"{r.url}/v1", api_key=key, max_retries=0) as client:
        return await call(client)


def create(content: str = "hi", **headers: str) -> Callable[[openai.AsyncOpenAI], Awaitable[Any]]:
    """A chat completion with these extra headers."""
    messages = [{"role": "user", "content": content}]
    return lambda c: c.chat.completions.create(**chat(messages=messages), extra_headers=headers)


def chat(**kw: Any) -> dict[str, Any]:
    return {"model": "m", "messages": [{"role": "user", "content": "hi"}], **kw}


async def raises(
    call: Awaitable[Any], kind: type[openai.APIStatusError], status: int, code: str
) -> openai.APIStatusError:
    with pytest.raises(kind) as caught:
        await call
    err = caught.value
    assert err.status_code == status and err.code == code, (err.status_code, err.body)
    assert isinstance(err.body, dict) and {"message", "type", "code"} <= set(err.body)
    assert err.type and err.message
    return err


async def test_the_proxys_own_errors_are_openai_errors_with_our_code(tmp_path: Path) -> None:
    async for r in with_engine(tmp_path, proxy={"max_body_bytes": 2000}):
        forbidden = await raises(
            sdk(r, lambda c: c.models.retrieve("x")), openai.PermissionDeniedError, 403, "KV_PROXY_FORBIDDEN"
        )
        assert forbidden.type == "permission_error"
        wrong_key = sdk(r, lambda c: c.models.list(), key="wrong")
        await raises(wrong_key, openai.AuthenticationError, 401, "KV_UNAUTHORIZED")
        two = sdk(r, lambda c: c.chat.completions.create(**chat(n=2)))
        bad = await raises(two, openai.BadRequestError, 400, "KV_BAD_REQUEST")
        assert bad.type == "invalid_request_error"
        bad_id = sdk(r, create(**{"X-Session-Id": "../x"}))
        await raises(bad_id, openai.BadRequestError, 400, "KV_INVALID_SESSION_ID")
        too_big = sdk(r, create(content="x" * 3000, **{"X-Session-Id": "A"}))
        await raises(too_big, openai.APIStatusError, 413, "KV_PAYLOAD_TOO_LARGE")
        assert r.origin.requests == []


async def test_no_capacity_is_a_503_to_retry(tmp_path: Path) -> None:
    async for r in with_engine(tmp_path, server={"slot_wait_s": 0.05}):
        held = await r.h.coordinator.acquire("X", provider="local", model="m")
        busy = sdk(r, create(**{"X-Session-Id": "A"}))
        err = await raises(busy, openai.InternalServerError, 503, "KV_SLOT_BUSY")
        assert err.response.headers["retry-after"] == "1" and err.type == "unavailable_error"
        assert held.lease_id is not None
        await r.h.coordinator.release(held.lease_id, status="aborted")


async def hang_up(conn: OriginConn) -> None:
    await conn.read_request()
    conn.close()  # took the request, never answered


async def silent(conn: OriginConn) -> None:
    await conn.read_request()
    await conn.read_request()  # waits for the proxy to give up


@pytest.mark.parametrize(
    ("handler", "status", "code"),
    [(hang_up, 502, "KV_BACKEND_UNAVAILABLE"), (silent, 504, "KV_OPERATION_TIMEOUT")],
)
async def test_llama_server_down_or_silent(
    tmp_path: Path, handler: Callable[[OriginConn], Awaitable[None]], status: int, code: str
) -> None:
    async for r in rig(tmp_path, Origin(handler), proxy={"upstream_timeout_s": 0.3}):
        err = await raises(sdk(r, create(**{"X-Session-Id": "A"})), openai.InternalServerError, status, code)
        assert err.type == ("server_error" if status == 502 else "timeout_error")
        assert r.h.coordinator.status()["leases"] == 0  # ended before the client heard of it


async def test_an_unexpected_error_is_still_an_openai_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: Any, **__: Any) -> bytes:
        raise RuntimeError("a bug")

    monkeypatch.setattr("kvsidecar.proxy.outbound.pin", broken)
    async for r in with_engine(tmp_path):
        bug = sdk(r, create(**{"X-Session-Id": "A"}))
        await raises(bug, openai.InternalServerError, 500, "KV_INVARIANT")
        assert r.h.coordinator.status()["leases"] == 0


async def test_the_listeners_own_refusals_are_openai_errors_too(tmp_path: Path) -> None:
    """Answers the connection limits write before any app runs: a half-sent head, no free connection."""
    arrived, done = asyncio.Event(), asyncio.Event()

    async def held(conn: OriginConn) -> None:
        await conn.read_request()
        arrived.set()
        await done.wait()

    limits = {"max_connections": 1, "header_timeout_s": 0.3}
    async for r in rig(tmp_path, Origin(held), proxy=limits):
        s = open_socket(r.url)
        try:
            s.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
            answer = await read_until_closed(s, within_s=10)
        finally:
            s.close()
        assert answer is not None and answer.startswith(b"HTTP/1.1 408 ")
        error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
        assert error["code"] == "KV_REQUEST_TIMEOUT" and error["type"] == "timeout_error"
        first = asyncio.ensure_future(sdk(r, create(**{"X-Session-Id": "A"})))
        await asyncio.wait_for(arrived.wait(), 10)  # the only connection is busy with a request
        newcomer = open_socket(r.url)  # refused at once, before it could send a byte
        try:
            answer = await read_until_closed(newcomer, within_s=10)
        finally:
            newcomer.close()
        assert answer is not None and answer.startswith(b"HTTP/1.1 503 ")
        error = json.loads(answer.partition(b"\r\n\r\n")[2])["error"]
        assert error["code"] == "KV_TOO_MANY_CONNECTIONS" and error["type"] == "unavailable_error"
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        done.set()


async def test_llama_servers_own_errors_pass_through_unchanged(tmp_path: Path) -> None:
    own = b'{"error":{"code":400,"message":"the request exceeds the available context size","type":"exceed_context_size_error"}}'

    async def refuse(_: Request) -> Answer:
        return 400, own, (("content-type", "application/json; charset=utf-8"),)

    async for r in rig(tmp_path, keep_alive_origin(refuse)):
        async with r.client() as c:
            resp = await c.post("/v1/chat/completions", json=chat(), headers={"X-Session-Id": "A"})
        assert resp.status_code == 400 and resp.content == own
        assert resp.headers["content-type"] == "application/json; charset=utf-8"
        with pytest.raises(openai.BadRequestError) as caught:
            await sdk(r, create(**{"X-Session-Id": "A"}))
        assert caught.value.type == "exceed_context_size_error" and caught.value.code == "400"


# one of each header ------------------------------------------------------------------------------------


async def raw_head(url: str, request: bytes) -> tuple[int, list[tuple[str, str]], bytes]:
    """Status, every header line as sent (duplicates kept), and the rest of the answer."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, rest = data.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    pairs = [line.split(":", 1) for line in lines[1:]]
    return int(lines[0].split()[1]), [(k.strip().lower(), v.strip()) for k, v in pairs], rest


def request(method: str, path: str, body: bytes = b"", **headers: str) -> bytes:
    lines = [
        f"{method} {path} HTTP/1.1",
        "host: 127.0.0.1",
        "connection: close",
        f"content-length: {len(body)}",
    ]
    lines += [f"authorization: Bearer {TOKEN}", *(f"{k.replace('_', '-')}: {v}" for k, v in headers.items())]
    return "\r\n".join(lines).encode() + b"\r\n\r\n" + body


def counts(headers: list[tuple[str, str]]) -> dict[str, int]:
    out: dict[str, int] = {}
    for name, _ in headers:
        out[name] = out.get(name, 0) + 1
    return out


LLAMA_HEADERS = (
    ("server", "llama.cpp"),
    ("date", "Thu, 01 Jan 1970 00:00:00 GMT"),
    ("keep-alive", "timeout=5, max=100"),
    ("connection", "keep-alive"),
    ("x-kv-outcome", "forged"),
    ("x-kv-reason", "FORGED"),
    ("access-control-allow-origin", "*"),
)


async def test_every_answer_has_one_of_each_header(tmp_path: Path) -> None:
    origin, fake = engine(LLAMA_HEADERS)
    async for r in rig(tmp_path, origin):
        fake.append(r.h.fake)
        body = b'{"prompt": "hello"}'
        answers = [
            await raw_head(r.url, request("POST", "/completion", body, x_session_id="A")),
            await raw_head(r.url, request("POST", "/completion", body)),  # auxiliary
            await raw_head(r.url, request("POST", "/slots/0?action=erase", body)),  # the proxy's own error
        ]
        for status, headers, _ in answers:
            seen = counts(headers)
            assert all(n == 1 for n in seen.values()), (status, headers)
            assert seen.get("server") == 1 and seen.get("date") == 1, headers
            assert "keep-alive" not in seen and dict(headers)["connection"] == "close"
            assert ("content-length" in seen) != ("transfer-encoding" in seen)
        (_, managed, _), (_, aux, _), (status, _, _) = answers
        assert dict(managed)["x-kv-outcome"] == "cold" and dict(managed)["x-kv-reason"] == "NO_SNAPSHOT"
        assert "x-kv-outcome" not in dict(aux) and status == 403
        assert dict(managed)["access-control-allow-origin"] == "*"  # end-to-end headers pass


async def test_a_chunked_answer_is_reframed_once(tmp_path: Path) -> None:
    async def handler(conn: OriginConn) -> None:
        await conn.read_request()
        await conn.send(
            b"HTTP/1.1 200 OK\r\nserver: llama.cpp\r\ntransfer-encoding: chunked\r\nconnection: keep-alive\r\n"
            b"trailer: x-t\r\n\r\n6\r\ndata: \r\n0\r\n\r\n"
        )
        await conn.read_request()

    async for r in rig(tmp_path, Origin(handler)):
        status, headers, rest = await raw_head(r.url, request("POST", "/completion", b"{}", x_session_id="A"))
        seen = counts(headers)
        assert status == 200 and all(n == 1 for n in seen.values()), headers
        assert dict(headers)["transfer-encoding"] == "chunked" and "content-length" not in seen
        assert "trailer" not in seen and dict(headers)["server"] != "llama.cpp"
        assert rest.startswith(b"6\r\ndata: \r\n")


async def test_duplicate_session_headers_are_refused(tmp_path: Path) -> None:
    async for r in with_engine(tmp_path):
        raw = request("POST", "/completion", b'{"prompt": "x"}', x_session_id="A")
        raw = raw.replace(b"x-session-id: A\r\n", b"x-session-id: A\r\nx-session-id: B\r\n")
        status, _, rest = await raw_head(r.url, raw)
        assert status == 400 and json.loads(rest)["error"]["code"] == "KV_BAD_REQUEST"
        assert r.origin.requests == []


# -- which client --------------------------------------------------------------------------------------
def _raw(rec: Recorded, *drop: str) -> list[tuple[bytes, bytes]]:
    return [(k.lower().encode(), v.encode()) for k, v in rec.headers if k.lower() not in drop]


def _named(rec: Recorded, *drop: str) -> tuple[str | None, str]:
    """What the proxy would say named the recorded request, and which client it says sent it."""
    found = client_ids.recognize(rec.path, client_ids.asgi_headers(_raw(rec, *drop)), rec.body)
    signal = min(found.markers) if found.markers else found.signal
    if signal is None:
        signal = client_content.SIGNAL  # no id: the content names it
    return signal, client_of(signal, _raw(rec, *drop), rec.body)


@pytest.mark.parametrize("rec", posts(), ids=lambda r: f"{r.client}/{r.name}")
def test_every_recorded_request_names_its_own_client(rec: Recorded) -> None:
    expected = {"claude": "claude-code", "codex": "codex", "opencode": "opencode", "aider": "aider"}
    signal, client = _named(rec)
    assert client == expected[rec.client], signal
    assert client in CLIENTS


def test_a_signal_any_client_may_send_names_no_client_without_the_clients_own_mark() -> None:
    opencode, aider = load("opencode", "run_turn1"), load("aider", "ui_turn1")
    # your own harness sends X-Session-Id (the proxy's default header) without opencode's affinity header
    assert _named(opencode, "x-session-affinity") == (client_ids.SIG_SESSION_HEADER, "unknown")
    twice = [*_raw(opencode), (b"x-session-affinity", b"other")]
    assert client_of(client_ids.SIG_SESSION_HEADER, twice, opencode.body) == "unknown"
    # an id-less request whose system prompt is not aider's
    other = {**aider.body, "messages": [{"role": "system", "content": "You are helpful."}]}
    assert client_of(client_content.SIGNAL, [], other) == "unknown"
    for hostile in ({"messages": "x"}, {"messages": [1]}, {"messages": [{"role": "system", "content": [1]}]}):
        assert client_of(client_content.SIGNAL, [], hostile) == "unknown"
    assert client_of(None, [], None) == client_of("none", [], None) == "unknown"
    assert client_of(client_ids.SIG_PROMPT_CACHE_KEY, [], None) == "unknown"


def test_a_prompt_point_is_told_in_the_answers_headers() -> None:
    """What a prompt point did is in the answer (its prefill is not in the request's own timings)."""
    base = [(b"x-kv-outcome", b"cold")]
    assert with_point(base, None) == base
    saved = PointTaken(tokens=1494, computed=170, saved=True, prefill_ms=21.64, save_ms=13.05)
    assert with_point(base, saved) == [
        *base,
        (b"x-kv-prompt-point-tokens", b"1494"),
        (b"x-kv-prompt-point-computed", b"170"),
        (b"x-kv-prompt-point-ms", b"21.6;13.1"),
        (b"x-kv-prompt-point", b"saved"),
    ]
    failed = PointTaken(
        tokens=9, computed=None, saved=False, prefill_ms=1.0, save_ms=0.0, error="KV_BACKEND_UNAVAILABLE"
    )
    got = dict(with_point(None, failed) or [])
    assert got[b"x-kv-prompt-point"] == b"KV_BACKEND_UNAVAILABLE" and b"x-kv-prompt-point-computed" not in got
