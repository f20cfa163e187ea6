"""Issue 28 through the proxy: the recorded agent-client requests (tests/fixtures/clients) against a
scripted origin that runs the fake backend's engine (a slot really holds the rendered prompt, is saved and
restored with it): which signal names each session (`X-KV-Signal`), title requests as auxiliary, the
content identity, PROMPT_DIVERGED, the prefix donor (`prefix_from`) and the no-erase cold start. The real
llama-server suite: tests/integration/test_agent_clients_real.py."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import zlib
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsidecar.api.routes import create_app
from kvsidecar.backend.fake import FakeKvBackend
from kvsidecar.backend.fake_prompts import fake_render, fake_tokens
from kvsidecar.backend.llama_http import find_timings
from kvsidecar.coordinator.state import Outcome
from kvsidecar.errors import BadRequest, InvalidSessionId
from kvsidecar.proxy.answers import REASONS, SIGNAL_VALUES
from kvsidecar.proxy.client_content import normalize
from kvsidecar.proxy.conversations import ConversationTable, credential_of
from tests.unit.client_fixtures import Recorded, load
from tests.unit.coordinator_helpers import conversation, start_harness
from tests.unit.origin import Origin, OriginConn, Request, keep_alive_origin
from tests.unit.proxy.test_app import AUTH, TOKEN, Rig, rig

_DROP = {"authorization", "x-api-key", "host", "content-length", "accept-encoding", "connection"}


def render(data: dict[str, Any]) -> list[int]:
    """A prompt as tokens: a chat body as the fake engine's own template and tokenizer make it (what the
    proxy's start plan computes before it runs: backend/fake_prompts.py); anything else the tools, then
    each message / item as canonical JSON (an extension of the messages is an extension of the tokens, as
    with a real chat template)."""
    if isinstance(data.get("messages"), list) and "system" not in data:
        with contextlib.suppress(BadRequest):
            return fake_tokens(fake_render(data), add_special=True, parse_special=True)
    parts = [data.get("tools") or [], data.get("system") or data.get("instructions") or ""]
    items = data.get("messages") or data.get("input") or []
    text = "".join(json.dumps(p, sort_keys=True) for p in [*parts, *items])
    return [zlib.crc32(text[i : i + 32].encode()) for i in range(0, len(text), 32)]  # 32 chars a token


async def with_engine(tmp_path: Path, **kw: Any) -> AsyncIterator[tuple[Rig, FakeKvBackend]]:
    fake: list[FakeKvBackend] = []

    async def answer(request: Request) -> tuple[int, bytes, tuple[tuple[str, str], ...]]:
        data = request.json()
        prompt_n, cache_n = fake[0].infer(data.get("id_slot", 0), render(data))
        body = {
            "content": "ok",
            # a chat completion's shape too: the proxy converts Claude Code's requests to one (issue 28)
            "choices": [{"message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
            "timings": {"prompt_n": prompt_n, "cache_n": cache_n},
        }
        return 200, json.dumps(body).encode(), (("content-type", "application/json"),)

    async for each in rig(tmp_path, keep_alive_origin(answer), **kw):
        fake.append(each.h.fake)
        yield each, each.h.fake


async def replay(r: Rig, client: str, name: str, *, key: str = TOKEN, **changes: Any) -> httpx.Response:
    rec: Recorded = load(client, name)
    headers = {k: v for k, v in rec.headers if k.lower() not in _DROP}
    headers |= {"authorization": f"Bearer {key}", "content-type": "application/json"}
    body = {**rec.body, "stream": False, **changes}
    async with httpx.AsyncClient(base_url=r.url, timeout=10) as c:
        resp = await c.post(rec.path, content=json.dumps(body).encode(), headers=headers)
    assert resp.status_code == 200, resp.text
    return resp


def kv(resp: httpx.Response) -> tuple[str | None, str | None, str | None]:
    h = resp.headers
    return h.get("x-kv-signal"), h.get("x-kv-outcome"), h.get("x-kv-reason")


@pytest.fixture
async def r(tmp_path: Path) -> AsyncIterator[tuple[Rig, FakeKvBackend]]:
    async for each in with_engine(tmp_path, proxy={"identity": "session"}):
        yield each


def origin_prompt(r: Rig) -> dict[str, Any]:
    return r.origin.requests[-1].json()  # type: ignore[no-any-return]


async def test_each_client_is_recognized_by_its_own_signal(r: tuple[Rig, FakeKvBackend]) -> None:
    rig_, _ = r
    assert kv(await replay(rig_, "codex", "exec_turn1"))[:2] == ("header:session-id", "cold")
    assert kv(await replay(rig_, "codex", "exec_turn2_resume"))[:2] == ("header:session-id", "resident")
    assert kv(await replay(rig_, "opencode", "run_turn1"))[:2] == ("header:x-session-id", "cold")
    assert kv(await replay(rig_, "aider", "ui_turn1"))[:2] == ("content", "cold")
    assert kv(await replay(rig_, "aider", "ui_turn2"))[:2] == ("content", "resident")  # continued
    counted = rig_.h.coordinator.metrics.registry.get_sample_value(
        "kvsidecar_proxy_session_signal_total", {"signal": "content", "kind": "managed"}
    )
    assert counted == 2


async def test_title_requests_run_beside_the_conversation(r: tuple[Rig, FakeKvBackend]) -> None:
    """Codex's title has a new id, opencode's the conversation's: both auxiliary, the conversation stays
    resident (the title ran on its slot only after the conversation was saved) and restores whole."""
    rig_, fake = r
    await replay(rig_, "codex", "ui_turn1")
    title = await replay(rig_, "codex", "ui_title")
    assert kv(title) == ("title:codex", None, None)
    assert "cache_prompt" not in origin_prompt(rig_)  # auxiliary: llama-server's own default
    stats = rig_.h.coordinator.status()["stats"]
    assert stats["saves"] == 1  # the conversation was saved before the title ran on its slot
    turn2 = await replay(rig_, "codex", "ui_turn2")
    assert kv(turn2)[:2] == ("header:session-id", "restored")
    opencode_title = await replay(rig_, "opencode", "run_title")
    assert kv(opencode_title) == ("title:opencode", None, None)
    assert rig_.h.coordinator.status()["stats"]["acquires"] == 4
    assert fake.slot_tokens(0) == render(origin_prompt(rig_))


async def test_a_side_request_under_the_sessions_id_does_not_replace_its_kv(
    r: tuple[Rig, FakeKvBackend],
) -> None:
    """Claude Code's UI title carries the conversation's id: with its markers removed it is still told
    apart by content (no tools where the conversation has them): auxiliary, never the session's turn."""
    rig_, _ = r
    await replay(rig_, "claude", "ui_turn1")
    side = await replay(rig_, "claude", "ui_title", output_config=None)
    assert kv(side) == ("aux:not-extending", None, None)
    assert kv(await replay(rig_, "claude", "ui_turn2"))[:2] == ("header:x-claude-code-session-id", "restored")


async def test_a_turn_that_does_not_extend_its_session_says_where(r: tuple[Rig, FakeKvBackend]) -> None:
    rig_, _ = r
    await replay(rig_, "opencode", "run_turn1")
    turn = dict(load("opencode", "run_turn2_continue").body)
    tools = [{"type": "function", "function": {"name": "other", "parameters": {}}}, *turn["tools"][1:]]
    changed = await replay(rig_, "opencode", "run_turn2_continue", tools=tools)  # a changed tool list
    assert kv(changed) == ("header:x-session-id", "resident", "PROMPT_DIVERGED")
    assert changed.headers["x-kv-diverged-message"] == "0"  # element 0 is the tools, 1 the system prompt
    view = rig_.h.coordinator.status()["proxy"]
    [record] = view["divergences"]
    assert record["reason"] == "PROMPT_DIVERGED" and record["message_index"] == 0
    assert record["token_offset"] is not None and record["token_offset"] < record["held_tokens"]
    assert len(record["session"]) == 8  # a short id, never the client's
    registry = rig_.h.coordinator.metrics.registry
    labels = {"signal": "header:x-session-id", "when": "reuse"}
    assert registry.get_sample_value("kvsidecar_proxy_prompt_diverged_total", labels) == 1
    assert "PROMPT_DIVERGED" in REASONS and "aux:not-extending" in SIGNAL_VALUES


async def test_a_second_conversation_starts_from_the_firsts_kv(r: tuple[Rig, FakeKvBackend]) -> None:
    """opencode's second conversation (its title request ran in between, so the slot no longer holds the
    first one): it starts from the first conversation's snapshot (`prefix_from`), which stays untouched."""
    rig_, _ = r
    await replay(rig_, "opencode", "run_turn1")
    await replay(rig_, "opencode", "run_conv2_title")  # auxiliary: saves conv 1, runs on the slot
    first, second = load("opencode", "run_turn1"), load("opencode", "run_conv2_turn1")
    assert first.header_map["x-session-id"] != second.header_map["x-session-id"]  # two conversations
    resp = await replay(rig_, "opencode", "run_conv2_turn1")
    assert kv(resp)[:2] == ("header:x-session-id", "cold")
    shared = int(resp.headers["x-kv-shared-tokens"])
    assert shared > 0.9 * len(render(second.body))
    status = rig_.h.coordinator.status()["stats"]
    assert status["prefix_donor_restores"] == 1 and status["shared_prefix_tokens"] >= shared - 1


async def test_another_credential_never_shares_a_prefix(r: tuple[Rig, FakeKvBackend]) -> None:
    """Without a proxy token of its own the client's key is the scope; here two keys of the proxy's own
    token cannot differ, so the check is on the coordinator: a scoped cold start after another scope's
    turn erases its slot, and a `prefix_from` names a session of its own scope only (another scope's id is
    another session). Once two scopes ran, llama-server's RAM cache (assumed on: no process is seen) may
    hold either's KV, so the slot a request of either runs on is empty unless it holds that request's own
    session's KV, known to be extended (coordinator/scope.py)."""
    rig_, fake = r
    c = rig_.h.coordinator
    first = await c.acquire("A", provider="local", model="m", scope="k1")
    assert first.lease_id is not None
    fake.infer(0, [1, 2, 3, 4])
    await c.release(first.lease_id, status="ok", prompt_tokens=4, cached_tokens=0)
    other = await c.acquire("B", provider="local", model="m", scope="k2", prefix_from="A")
    assert "erase" in other.actions and other.shared_tokens is None
    assert fake.slot_tokens(0) == []
    fake.infer(0, [5, 6, 7])
    await c.release(other.lease_id or "", status="ok", prompt_tokens=3, cached_tokens=0)
    same = await c.acquire("C", provider="local", model="m", scope="k2")
    assert "erase" in same.actions and fake.slot_tokens(0) == []  # B's KV, but the RAM cache is shared now
    await c.release(same.lease_id or "", status="aborted")


async def test_prefix_from_is_checked_as_a_session_id(r: tuple[Rig, FakeKvBackend]) -> None:
    rig_, _ = r
    with pytest.raises(InvalidSessionId):
        await rig_.h.coordinator.acquire("A", provider="local", model="m", prefix_from="../etc/x")


async def test_share_prefix_off_erases_every_cold_start(tmp_path: Path) -> None:
    async for rig_, fake in with_engine(tmp_path, restore={"share_prefix": False}):
        c = rig_.h.coordinator
        for session in ("A", "B"):
            lease = await c.acquire(session, provider="local", model="m")
            assert "erase" in lease.actions and lease.outcome is Outcome.COLD
            fake.infer(0, [1, 2, 3])
            await c.release(lease.lease_id or "", status="ok", prompt_tokens=3, cached_tokens=0)


async def test_content_identity_off_runs_idless_requests_as_auxiliary(tmp_path: Path) -> None:
    async for rig_, _ in with_engine(tmp_path, proxy={"content_identity": False}):
        assert kv(await replay(rig_, "aider", "ui_turn1")) == ("none", None, None)
        assert rig_.h.coordinator.status()["proxy"]["conversations"] == 0


def test_prompt_counts_come_from_usage_where_llama_server_sends_no_timings() -> None:
    """`/v1/messages` (either way) and a non-streamed `/v1/responses` carry `usage`, not `timings`."""
    anthropic = {"type": "message", "usage": {"input_tokens": 7, "cache_read_input_tokens": 93}}
    assert find_timings(json.dumps(anthropic)) == {"prompt_n": 7, "cache_n": 93}
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 5, "cache_read_input_tokens": 9}}}
    stream = f"event: message_start\ndata: {json.dumps(start)}\n\nevent: message_stop\ndata: {{}}\n\n"
    assert find_timings(stream) == {"prompt_n": 5, "cache_n": 9}
    responses = {"usage": {"input_tokens": 100, "input_tokens_details": {"cached_tokens": 60}}}
    assert find_timings(json.dumps(responses)) == {"prompt_n": 40, "cache_n": 60}
    for hostile in ({"usage": {"input_tokens": "7", "cache_read_input_tokens": 1}}, {"usage": [1]}):
        assert find_timings(json.dumps(hostile)) is None


def test_the_conversation_table_is_per_credential_and_bounded() -> None:
    table = ConversationTable(max_credentials=2, per_credential=3)
    first = normalize("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    longer = normalize(
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
    )
    assert first is not None and longer is not None
    sid, continued = table.identify("k1", first)
    assert not continued and sid.startswith("c:")
    table.record("k1", sid, "m", first)
    assert table.identify("k1", longer) == (sid, True)
    other, continued = table.identify("k2", longer)  # another credential never continues it
    assert not continued and other != sid
    assert table.donor("k2", longer, model="m", exclude="x") is None
    assert table.donor("k1", longer, model="m", exclude="x") == (sid, 1)
    for n in range(5):
        table.record("k1", f"s{n}", "m", first)
    table.record("k2", "t", "m", first)
    table.record("k3", "u", "m", first)
    assert len(table) == 2 and table.get("k1", "s4") is None  # k1, least recently used, was dropped
    assert credential_of({b"authorization": b"Bearer a"}) != credential_of({b"x-api-key": b"Bearer a"})
    assert credential_of({}) == "anon"


def test_a_request_is_known_to_extend_its_session_only_when_it_carries_its_last_request_exactly() -> None:
    """What the scope gate may rely on (coordinator/scope.py): every element of the session's last request,
    the last one too, then more; never a cut or rewritten last message, a route without messages, a new
    session or a divergence."""
    table = ConversationTable()

    def chat(*texts: str) -> Any:
        msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(texts)]
        return normalize("/v1/chat/completions", {"messages": msgs})

    table.record("k1", "s", "m", chat("hi\n\nreminder"))
    known = table.known_extension
    assert known("k1", "s", chat("hi\n\nreminder", "yo", "more"), new=False, diverged=None)
    assert known("k1", "s", chat("hi\n\nreminder"), new=False, diverged=None)  # a retry
    assert not known("k1", "s", chat("hi", "yo", "more"), new=False, diverged=None)  # cut at a paragraph
    assert not known("k1", "s", chat("something else"), new=False, diverged=None)  # rewritten in place
    assert not known("k1", "s", None, new=False, diverged=None)  # /completion, /infill: no messages
    assert not known("k2", "s", chat("hi\n\nreminder", "yo"), new=False, diverged=None)  # another scope
    assert not known("k1", "s", chat("hi\n\nreminder", "yo"), new=True, diverged=None)
    assert not known("k1", "s", chat("hi\n\nreminder", "yo"), new=False, diverged=0)
    assert not known("k1", None, chat("hi\n\nreminder", "yo"), new=False, diverged=None)


async def test_hook_api_prefix_from_restores_the_donors_snapshot_untouched(tmp_path: Path) -> None:
    """The acquire hint for harnesses that know a session's parent: a cold start on an empty slot begins
    from the donor's newest snapshot; the donor's manifest and files stay as they were; a hostile hint is
    a 400 with a stable code."""
    # a pool: B gets an empty slot, A stays resident in its own
    h = await start_harness(tmp_path, total_slots=3, servers={"local": {"mode": "managed-slots"}})
    try:
        await h.turn("A")
        assert (await h.coordinator.session_event("A", "flush"))["saved"] == 1
        donor_key = h.coordinator.sessions.known("A")[0].key
        before = h.coordinator.store.get(donor_key)
        app = create_app(h.coordinator, token=TOKEN)
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=app),
            base_url="http://127.0.0.1:8377",
            headers={"Authorization": f"Bearer {TOKEN}"},
        ) as c:
            bad = await c.post(
                "/v1/sessions/B/acquire", json={"provider": "local", "model": "m", "prefix_from": "../A"}
            )
            assert bad.status_code == 400 and bad.json()["error"]["code"] == "KV_INVALID_SESSION_ID"
            r = await c.post(
                "/v1/sessions/B/acquire", json={"provider": "local", "model": "m", "prefix_from": "A"}
            )
            body = r.json()
            slot = body["slot_id"]
            assert body["outcome"] == "cold" and slot != 0, body
            assert body["shared_tokens"] == len(conversation("A", 1)), body
            assert h.fake.slot_tokens(slot) == conversation("A", 1)
            prompt_n, cache_n = h.fake.infer(slot, [*conversation("A", 1)[:50], 7, 7, 7])
            out = await c.post(
                f"/v1/leases/{body['lease_id']}/release",
                json={"status": "ok", "prompt_tokens": prompt_n, "cached_tokens": cache_n},
            )
            assert out.json()["shared_tokens"] == 50
        assert h.coordinator.store.get(donor_key) == before  # read, never written
        assert h.coordinator.telemetry.stats()["prefix_donor_restores"] == 1
    finally:
        await h.coordinator.aclose()


# A conversation's next turn is always recognized --------------------------------------------------------
def _chunk(event: bytes) -> bytes:
    return f"{len(event):x}\r\n".encode() + event + b"\r\n"


def _sse(data: dict[str, Any] | str) -> bytes:
    return b"data: " + (data if isinstance(data, str) else json.dumps(data)).encode() + b"\n\n"


def held_end_origin(fake: list[FakeKvBackend], later: asyncio.Event) -> Origin:
    """llama-server as the fake engine, streaming chat completions: the answer's last event ([DONE]) goes
    out at once, the end of the HTTP message only once a later request has come in (bounded), the widest
    gap a real stream has between the end a client reads and the end the proxy sees."""

    async def handler(conn: OriginConn) -> None:
        while True:
            request = origin.recording(await conn.read_request())
            if request is None:
                return
            if len(origin.requests) > 1:
                later.set()
            data = request.json()
            prompt_n, cache_n = fake[0].infer(data.get("id_slot", 0), render(data))
            timings = {"prompt_n": prompt_n, "cache_n": cache_n}
            if not data.get("stream"):
                body = {"choices": [{"message": {"role": "assistant", "content": "ok"}}], "timings": timings}
                await conn.respond(json.dumps(body).encode(), headers=(("content-type", "application/json"),))
                continue
            head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            delta = {"choices": [{"index": 0, "delta": {"role": "assistant", "content": "ok"}}]}
            stop = {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
            final = {"choices": [], "timings": timings}
            await conn.send(head + b"".join(_chunk(_sse(e)) for e in (delta, stop, final, "[DONE]")))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(later.wait(), 5)  # the end of the message, once the next turn is in
            await conn.send(b"0\r\n\r\n")

    origin = Origin(handler)
    return origin


CHAT_TURN = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "a" * 300}]}
MESSAGES_TURN = {
    "model": "m",
    "max_tokens": 4,
    "system": "You are terse.",
    "messages": [{"role": "user", "content": "b" * 300}],
}


async def read_to_the_end(resp: httpx.Response) -> None:
    """An SSE stream read up to its last event: `data: [DONE]`, or the data of Anthropic's message_stop."""
    stop = False
    async for line in resp.aiter_lines():
        if line == "data: [DONE]" or (stop and line.startswith("data:")):
            return
        stop = stop or line == "event: message_stop"
    raise AssertionError("the stream ended without its last event")


@pytest.mark.parametrize(
    ("path", "first"), [("/v1/chat/completions", CHAT_TURN), ("/v1/messages", MESSAGES_TURN)]
)
async def test_a_turn_sent_the_instant_the_stream_ends_continues_its_conversation(
    tmp_path: Path, path: str, first: dict[str, Any]
) -> None:
    """A client with no session id that sends its next turn as soon as it has read the answer's last
    event: the conversation table knows the turn by then, so the next one is the same conversation,
    resident (never a new conversation started cold or from a donor)."""
    fake: list[FakeKvBackend] = []
    later = asyncio.Event()
    async for r in rig(tmp_path, held_end_origin(fake, later)):
        fake.append(r.h.fake)
        headers = {**AUTH, "anthropic-version": "2023-06-01"}
        async with httpx.AsyncClient(base_url=r.url, headers=headers, timeout=10) as c:
            async with c.stream("POST", path, json={**first, "stream": True}) as resp:
                assert resp.headers["x-kv-signal"] == "content", resp.headers
                await read_to_the_end(resp)
                messages = [*first["messages"], {"role": "assistant", "content": "ok"}]
                messages.append({"role": "user", "content": "next"})
                second = await c.post(path, json={**first, "messages": messages})
            assert second.status_code == 200, second.text
            assert kv(second)[:2] == ("content", "resident"), second.headers
            assert r.h.coordinator.status()["proxy"]["conversations"] == 1


def generating_origin(fake: list[FakeKvBackend], gone: asyncio.Event) -> Origin:
    """llama-server as the fake engine: a streamed answer generates (a token appended to the slot per
    event) until its client hangs up; then the slot stops, keeping the prompt and the tokens so far."""

    async def handler(conn: OriginConn) -> None:
        while True:
            request = origin.recording(await conn.read_request())
            if request is None:
                return
            data = request.json()
            slot_id = data.get("id_slot", 0)
            prompt_n, cache_n = fake[0].infer(slot_id, render(data))
            timings = {"prompt_n": prompt_n, "cache_n": cache_n}
            if not data.get("stream"):
                body = {"choices": [{"message": {"role": "assistant", "content": "ok"}}], "timings": timings}
                await conn.respond(json.dumps(body).encode(), headers=(("content-type", "application/json"),))
                continue
            slot = fake[0].slots[slot_id]
            slot.is_processing = True
            head = b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
            delta = {"choices": [{"index": 0, "delta": {"content": "Sure"}}]}
            try:
                await conn.send(head)
                for n in itertools.count():
                    slot.tokens.append(100_000 + n)
                    await conn.send(_chunk(_sse(delta)))
                    await asyncio.sleep(0.005)  # a token's time: generates until the client is gone
            except ConnectionError:
                slot.is_processing = False
                gone.set()
                return

    origin = Origin(handler)
    return origin


async def abort_after_two_events(c: httpx.AsyncClient, body: dict[str, Any]) -> httpx.Headers:
    async with c.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
        events = 0
        async for line in resp.aiter_lines():
            events += line.startswith("data:")
            if events == 2:
                break
        return resp.headers  # leaving the block hangs up mid-answer


REPROMPT = [
    *CHAT_TURN["messages"],  # type: ignore[misc]
    {"role": "assistant", "content": "SureSure"},
    {"role": "user", "content": "No: do it the other way."},
]


@pytest.mark.parametrize("evicted", [False, True], ids=["resident", "evicted"])
async def test_a_turn_the_client_aborts_is_kept_and_its_reprompt_continues_it(
    tmp_path: Path, evicted: bool
) -> None:
    """Stop and redirect: the client hangs up after a few tokens and re-prompts with the partial answer and a
    new instruction. The aborted turn is the session's (what the slot holds once llama-server stopped, as
    unsaved KV: an eviction saves it), and the re-prompt continues it with the slot's prompt reused."""
    fake: list[FakeKvBackend] = []
    gone = asyncio.Event()
    async for r in rig(tmp_path, generating_origin(fake, gone)):
        fake.append(r.h.fake)
        async with httpx.AsyncClient(base_url=r.url, headers=AUTH, timeout=10) as c:
            first = await abort_after_two_events(c, CHAT_TURN)
            assert first["x-kv-signal"] == "content" and first["x-kv-outcome"] == "cold"
            await asyncio.wait_for(gone.wait(), 5)
            assert await r.leases_after_release() == 0
            [rt] = r.h.coordinator.sessions.by_key.values()
            held = len(fake[0].slot_tokens(0))
            assert held > len(render(CHAT_TURN)) and rt.dirty and rt.context_tokens == held
            if evicted:  # another conversation takes the only slot: the aborted turn's KV is saved first
                other = {**CHAT_TURN, "messages": [{"role": "user", "content": "z" * 200}]}
                assert (await c.post("/v1/chat/completions", json=other)).status_code == 200
                assert r.h.coordinator.status()["stats"]["saves"] == 1
            again = await c.post("/v1/chat/completions", json={**CHAT_TURN, "messages": REPROMPT})
        assert kv(again)[:2] == ("content", "restored" if evicted else "resident"), again.headers
        assert again.json()["timings"]["cache_n"] >= len(render(CHAT_TURN)) - 1
        assert r.h.coordinator.status()["proxy"]["conversations"] == 1 + evicted


TITLE_SYSTEM = "You are a title generator. You write titles of at most 50 characters."


def chat_body(system: str, *users: str, **extra: Any) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}]
    for n, text in enumerate(users):
        if n:
            messages.append({"role": "assistant", "content": "ok"})
        messages.append({"role": "user", "content": text})
    return {"model": "m", "max_tokens": 4, "messages": messages, **extra}


async def post_chat(r: Rig, body: dict[str, Any], **headers: str) -> httpx.Response:
    async with httpx.AsyncClient(base_url=r.url, headers=AUTH, timeout=10) as c:
        resp = await c.post("/v1/chat/completions", json=body, headers=headers)
    assert resp.status_code == 200, resp.text
    return resp


@pytest.mark.parametrize(
    ("proxy", "named"),
    [
        ({"session_header": "X-Conversation"}, {"headers": {"X-Conversation": "conv-1"}}),
        ({"session_field": "user"}, {"body": {"user": "conv-1"}}),
    ],
    ids=["header", "body-field"],
)
async def test_the_operators_session_id_wins_over_title_markers(
    tmp_path: Path, proxy: dict[str, Any], named: dict[str, Any]
) -> None:
    """A conversation whose system prompt starts like opencode's title generator, named by the operator's
    configured header or body field: every turn is the session's (saved, restored), never auxiliary."""
    async for r, _ in with_engine(tmp_path, proxy=proxy):
        extra, headers = named.get("body", {}), named.get("headers", {})
        turn1 = await post_chat(r, chat_body(TITLE_SYSTEM, "u1", **extra), **headers)
        assert kv(turn1)[:2] == ("configured", "cold")
        turn2 = await post_chat(r, chat_body(TITLE_SYSTEM, "u1", "u2", **extra), **headers)
        assert kv(turn2)[:2] == ("configured", "resident")
        await post_chat(
            r, chat_body("Another conversation.", "v1", user="conv-2"), **{"X-Conversation": "conv-2"}
        )
        assert r.h.coordinator.status()["stats"]["saves"] == 1  # the title-like conversation was saved
        turn3 = await post_chat(r, chat_body(TITLE_SYSTEM, "u1", "u2", "u3", **extra), **headers)
        assert kv(turn3)[:2] == ("configured", "restored")


async def test_a_client_id_conversation_that_looks_like_a_title_is_a_session_from_its_second_turn(
    r: tuple[Rig, FakeKvBackend],
) -> None:
    """Under a client's built-in id (here `X-Session-Id`, also opencode's), a first request that looks like a
    title runs beside; the next one that extends it shows it was the conversation, a session from then on."""
    rig_, _ = r
    first = await post_chat(rig_, chat_body(TITLE_SYSTEM, "u1"), **{"X-Session-Id": "s1"})
    assert kv(first) == ("title:opencode", None, None)
    second = await post_chat(rig_, chat_body(TITLE_SYSTEM, "u1", "u2"), **{"X-Session-Id": "s1"})
    assert kv(second)[:2] == ("header:x-session-id", "cold")
    third = await post_chat(rig_, chat_body(TITLE_SYSTEM, "u1", "u2", "u3"), **{"X-Session-Id": "s1"})
    assert kv(third)[:2] == ("header:x-session-id", "resident")
    # a real title request under its id still runs beside it (and is no continuation of it)
    again = await post_chat(rig_, chat_body(TITLE_SYSTEM, "summarize u1 u2 u3"), **{"X-Session-Id": "s1"})
    assert kv(again) == ("title:opencode", None, None)


async def test_a_request_diverging_at_message_zero_runs_beside_the_conversation(
    r: tuple[Rig, FakeKvBackend],
) -> None:
    """A title request the recognizer misses (lower-case, under the conversation's id, as long as the
    conversation): it runs beside the conversation, whose KV survives; if the client then continues that
    request, the conversation moved there (its first message changed for good)."""
    rig_, fake = r
    sid = {"X-Session-Id": "conv"}
    await post_chat(rig_, chat_body("You are a coding agent.", "fix the bug"), **sid)
    held = fake.slot_tokens(0)
    title = chat_body("you are a title generator. write a title.", "fix the bug")
    side = await post_chat(rig_, title, **sid)
    assert kv(side) == ("aux:not-extending", None, None)
    turn2 = await post_chat(rig_, chat_body("You are a coding agent.", "fix the bug", "and test it"), **sid)
    assert kv(turn2)[:2] == ("header:x-session-id", "restored")  # saved before the title ran on its slot
    assert turn2.json()["timings"]["cache_n"] >= len(held) - 1
    # the client sends one again and continues it: the conversation itself is there now
    assert kv(await post_chat(rig_, title, **sid)) == ("aux:not-extending", None, None)
    moved = await post_chat(
        rig_, chat_body("you are a title generator. write a title.", "fix the bug", "x"), **sid
    )
    assert kv(moved)[:3] == ("header:x-session-id", "restored", "PROMPT_DIVERGED")
    assert moved.headers["x-kv-diverged-message"] == "0"


async def test_a_prompt_that_grows_in_its_only_message_is_told_from_another_prompt(
    r: tuple[Rig, FakeKvBackend],
) -> None:
    """Raw `/completion` (one element: the prompt) and a one-message chat: a prompt that grows in place is the
    session's next turn (resident); another prompt under the same id runs beside it, and the session's KV
    survives it."""
    rig_, fake = r
    sid = {"X-Session-Id": "raw"}

    async def complete(prompt: Any) -> httpx.Response:
        async with httpx.AsyncClient(base_url=rig_.url, headers=AUTH, timeout=10) as c:
            resp = await c.post("/completion", json={"prompt": prompt, "n_predict": 2}, headers=sid)
        assert resp.status_code == 200, resp.text
        return resp

    assert kv(await complete("Once upon a time"))[:2] == ("header:x-session-id", "cold")
    assert kv(await complete("Once upon a time, there was"))[:2] == ("header:x-session-id", "resident")
    assert kv(await complete("Write a title for this story."))[:2] == ("aux:not-extending", None)
    grown = await complete("Once upon a time, there was a king")
    assert kv(grown)[:2] == ("header:x-session-id", "restored")
    assert kv(await complete([1, 2, 3]))[:2] == ("aux:not-extending", None)  # token ids: another prompt
    one = {"X-Session-Id": "one"}
    chat = {"model": "m", "messages": [{"role": "user", "content": "Tell me a story."}]}
    assert kv(await post_chat(rig_, chat, **one))[:2] == ("header:x-session-id", "cold")
    chat["messages"] = [{"role": "user", "content": "Tell me a story. About a king."}]
    assert kv(await post_chat(rig_, chat, **one))[:2] == ("header:x-session-id", "resident")
    chat["messages"] = [{"role": "user", "content": "Give this conversation a title."}]
    assert kv(await post_chat(rig_, chat, **one))[:2] == ("aux:not-extending", None)
    assert fake.violations == []


async def test_a_turn_whose_system_prompt_changed_is_still_the_conversations(
    r: tuple[Rig, FakeKvBackend],
) -> None:
    """A date in the system prompt moved on: the request carries the whole conversation after it and a new
    turn, so it is the session's turn (reported where it diverged), not a request beside it."""
    rig_, _ = r
    sid = {"X-Session-Id": "dated"}
    await post_chat(rig_, chat_body("You code. Today is Monday.", "fix the bug"), **sid)
    turn = await post_chat(rig_, chat_body("You code. Today is Tuesday.", "fix the bug", "test it"), **sid)
    assert kv(turn) == ("header:x-session-id", "resident", "PROMPT_DIVERGED")
    assert turn.headers["x-kv-diverged-message"] == "0"
    title = await post_chat(
        rig_, chat_body("Write a title.", "fix the bug"), **sid
    )  # its first message, verbatim
    assert kv(title) == ("aux:not-extending", None, None)
