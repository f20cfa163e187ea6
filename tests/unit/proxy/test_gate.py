"""The one body gate (kvsidecar.proxy.gate) in front of every route that reaches llama-server: bodies it cannot
read or that are over llama-server's limits, and media a text-only model cannot take, are 4xx in the route's
own shape before any slot is acquired, and nothing of them reaches llama-server; any JSON at any field of a
chat, Messages or Responses body gets a 2xx or a 4xx, never a 500. With the fake backend and a scripted
origin; against a real llama-server: tests/integration/test_proxy_body_gate_real.py."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsidecar.backend.base import BackendCapabilities
from kvsidecar.backend.llama_body import MAX_DEPTH, check_fields, read_json
from kvsidecar.backend.llama_http import ANTHROPIC_ROUTES, ROUTES
from kvsidecar.errors import BadRequest, BodyLimit, ModalityUnsupported
from kvsidecar.proxy import sessions as proxy_sessions
from kvsidecar.proxy.gate import ANY_MEDIA, AUDIO, VIDEO, VISION, admit, media, modalities
from tests.unit.origin import keep_alive_origin
from tests.unit.proxy.hostile import CHAT, IMAGE, MESSAGES, RESPONSES, mutated
from tests.unit.proxy.test_app import AUTH, Rig, rig
from tests.unit.proxy.test_app_messages import llama

DEEP = b"[" * 80_000 + b"]" * 80_000  # what killed llama-server 11434 (SIGSEGV) through the proxy
TEXT_ONLY = {"vision": False, "video": False, "audio": False}
PNG = "data:image/png;base64,AAAA"


@pytest.fixture
async def r(tmp_path: Path) -> AsyncIterator[Rig]:
    async for each in rig(tmp_path, keep_alive_origin(llama), proxy={"content_identity": True}):
        yield each


def with_modalities(r: Rig, said: dict[str, Any] | None) -> None:
    """The server's `/props` as if it said `modalities: said` (None: says nothing of them)."""
    server = r.h.coordinator.servers["local"]
    assert server.caps is not None
    props = {k: v for k, v in server.caps.props.items() if k != "modalities"}
    caps = dataclasses.replace(server.caps, props=props if said is None else {**props, "modalities": said})
    server.identity.probed(caps, server.process)  # a probe's answer, told to the one writer of it


def shape_of(path: str, resp: httpx.Response) -> str:
    """The error's code, checked to be in the route's shape (Anthropic's on its routes, OpenAI's elsewhere)."""
    data = resp.json()
    if path in ANTHROPIC_ROUTES:
        assert data["type"] == "error" and set(data["error"]) >= {"type", "message", "code"}, data
    else:
        assert set(data["error"]) >= {"message", "type", "code", "param", "hint"}, data
    return str(data["error"]["code"])


async def send(r: Rig, method: str, path: str, body: bytes, **headers: str) -> httpx.Response:
    async with r.client() as c:
        return await c.request(
            method, path, content=body, headers={"content-type": "application/json", **headers}
        )


# -- what is refused, on every route ----------------------------------------------------------------------
async def test_a_body_nested_too_deep_reaches_llama_server_on_no_route(r: Rig) -> None:
    """The body that killed llama-server, to every route the proxy forwards (GET ones with a body too)."""
    for path, (methods, _) in ROUTES.items():
        for method in sorted(methods - {"HEAD"}):
            resp = await send(r, method, path, DEEP)
            assert resp.status_code == 400, (method, path, resp.text)
            assert shape_of(path, resp) == "KV_BODY_LIMIT", (method, path)
    assert r.origin.requests == []
    assert r.h.coordinator.status()["stats"]["acquires"] == 0


async def test_llama_servers_own_fields_and_hostile_grammars_are_refused(r: Rig) -> None:
    cyclic = {
        "parsers": [{"type": "rule", "name": "a", "child": 1, "trigger": False}, {"type": "ref", "name": "a"}]
    }
    refs = {f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in range(2_000)}
    for path, body, code in (
        (
            "/completion",
            {"prompt": "x", "chat_parser": json.dumps({**cyclic, "rules": {"a": 0}, "root": 0})},
            "KV_BAD_REQUEST",
        ),
        ("/completion", {"prompt": "x", "grammar_triggers": [{"type": 7, "value": "x"}]}, "KV_BAD_REQUEST"),
        (
            "/completion",
            {"prompt": "x", "grammar": "root ::= " + "(" * 20_000 + '"a"' + ")" * 20_000},
            "KV_BODY_LIMIT",
        ),
        (
            "/v1/chat/completions",
            {"messages": [], "grammar": "root ::= " + "(" * 200 + ")" * 200},
            "KV_BODY_LIMIT",
        ),
        (
            "/completion",
            {"prompt": "x", "json_schema": {"$ref": "#/$defs/a0", "$defs": refs}},
            "KV_BODY_LIMIT",
        ),
        (
            "/apply-template",
            {"messages": [], "tools": [{"type": "function", "function": {"parameters": {"$defs": refs}}}]},
            "KV_BODY_LIMIT",
        ),
    ):
        resp = await send(r, "POST", path, json.dumps(body).encode())
        assert resp.status_code == 400 and shape_of(path, resp) == code, (path, resp.text)
    assert r.origin.requests == []


async def test_what_is_not_json_is_refused_before_it_is_forwarded(r: Rig) -> None:
    for path in (
        "/tokenize",
        "/apply-template",
        "/v1/messages/count_tokens",
        "/v1/embeddings",
        "/v1/messages",
    ):
        for body in (b"", b"not json", b"[NaN]", b'{"a": 1e400}', b"\xef\xbb\xbf{}", b'{"a": "\xff"}'):
            resp = await send(r, "POST", path, body)
            assert resp.status_code in (400, 403), (path, body, resp.text)
            assert shape_of(path, resp) in ("KV_BAD_REQUEST", "KV_PROXY_FORBIDDEN"), (path, body)
    assert r.origin.requests == []


async def test_refusals_on_anthropic_routes_are_in_anthropics_shape(r: Rig) -> None:
    image = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [IMAGE]}]}
    with_modalities(r, TEXT_ONLY)
    async with httpx.AsyncClient(base_url=r.url, timeout=10) as c:
        for path in sorted(ANTHROPIC_ROUTES):
            cases = [
                (await c.post(path, json=image, headers=AUTH), 400, "KV_MODALITY_UNSUPPORTED"),
                (await c.post(path, json=image, headers={"x-api-key": "wrong"}), 401, "KV_UNAUTHORIZED"),
                (await c.post(path, content=DEEP, headers=AUTH), 400, "KV_BODY_LIMIT"),
            ]
            for resp, status, code in cases:
                assert resp.status_code == status and shape_of(path, resp) == code, (path, resp.text)
        two = [("x-session-id", "a"), ("x-session-id", "b"), *AUTH.items()]
        resp = await c.post(
            "/v1/messages", json={**image, "messages": [{"role": "user", "content": "x"}]}, headers=two
        )
        assert resp.status_code == 400 and shape_of("/v1/messages", resp) == "KV_BAD_REQUEST"
    assert r.origin.requests == []


async def test_a_reader_that_fails_is_a_400_in_the_routes_shape_not_a_500(
    r: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_: Any, **__: Any) -> Any:
        raise TypeError("a reader's bug")

    monkeypatch.setattr(proxy_sessions, "normalize", broken)
    for path, body in (
        (CHAT, {"messages": [{"role": "user", "content": "x"}]}),
        (MESSAGES, {"model": "m", "messages": []}),
    ):
        resp = await send(r, "POST", path, json.dumps(body).encode())
        assert resp.status_code == 400 and shape_of(path, resp) == "KV_BAD_REQUEST", resp.text
    assert r.origin.requests == [] and r.h.coordinator.status()["stats"]["acquires"] == 0


# -- media for a model that cannot take them ------------------------------------------------------------------
IMAGE_BODIES: list[tuple[str, dict[str, Any]]] = [
    (CHAT, {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG}}]}]}),
    (
        "/v1/chat/completions/input_tokens",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG}}]}]},
    ),
    (
        "/apply-template",
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG}}]}]},
    ),
    (RESPONSES, {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": PNG}]}]}),
    (
        "/v1/responses/input_tokens",
        {
            "input": [
                {
                    "type": "function_call_output",
                    "call_id": "c",
                    "output": [{"type": "input_image", "image_url": PNG}],
                }
            ]
        },
    ),
    (MESSAGES, {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": [IMAGE]}]}),
    (
        "/v1/messages/count_tokens",
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": [IMAGE]}]}
            ],
        },
    ),
    ("/completion", {"prompt": {"prompt_string": "x", "multimodal_data": ["AAAA"]}}),
]


async def test_media_for_a_text_only_model_is_a_4xx_that_says_why(r: Rig) -> None:
    with_modalities(r, TEXT_ONLY)
    for path, body in IMAGE_BODIES:
        resp = await send(r, "POST", path, json.dumps(body).encode(), x_session_id="s1")
        assert resp.status_code == 400, (path, resp.text)
        assert shape_of(path, resp) == "KV_MODALITY_UNSUPPORTED"
        message = resp.json()["error"]["message"]
        assert "input" in message and "text only" in message and "--mmproj" in message, message
    assert r.origin.requests == [] and r.h.coordinator.status()["stats"]["acquires"] == 0


async def test_media_pass_when_the_model_takes_them_or_the_server_does_not_say(r: Rig) -> None:
    for said in ({"vision": True, "audio": False, "video": False}, None):
        with_modalities(r, said)
        for path, body in IMAGE_BODIES:
            resp = await send(r, "POST", path, json.dumps(body).encode())
            assert resp.status_code == 200, (said, path, resp.text)
    assert len(r.origin.requests) == 2 * len(IMAGE_BODIES)


def test_media_are_read_where_llama_server_loads_them() -> None:
    part = {"type": "input_audio", "input_audio": {"data": "AAAA"}}
    video = {"type": "video_url", "video_url": {"url": "x"}}
    assert media(CHAT, {"messages": [{"role": "user", "content": [part, video]}]}) == {AUDIO, VIDEO}
    assert media(CHAT, {"messages": [{"role": "user", "content": "image_url"}]}) == set()
    assert media(CHAT, {"messages": [{"role": "user", "content": [{"type": ["image_url"]}]}]}) == set()
    assert (
        media(
            MESSAGES,
            {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "file"}}]}]},
        )
        == set()
    )
    assert media("/v1/embeddings", {"input": [{"content": [{"type": "image_url"}]}]}) == {VISION}
    assert media("/infill", {"prompt": "x", "input_extra": [{"text": "x"}]}) == set()
    assert media("/rerank", {"documents": [{"prompt_string": "x", "multimodal_data": ["A"]}]}) == {ANY_MEDIA}
    assert media("/tokenize", {"content": [{"type": "image_url"}]}) == set()  # tokenize reads no media
    assert modalities(None) is None and modalities({"modalities": "x"}) is None
    assert modalities({"modalities": {"vision": True, "audio": 1}}) == frozenset({VISION})


def test_the_gate_reads_a_transcriptions_form_and_needs_audio() -> None:
    def caps(props: dict[str, Any]) -> BackendCapabilities:
        return BackendCapabilities(
            kind="llama.cpp",
            alive=True,
            slots_endpoint=True,
            total_slots=1,
            n_ctx=None,
            model_path=None,
            build_info=None,
            props=props,
        )

    form = [(b"content-type", b"multipart/form-data; boundary=x")]
    with pytest.raises(ModalityUnsupported, match="audio"):
        admit("POST", "/v1/audio/transcriptions", form, b"--x--", caps({"modalities": TEXT_ONLY}))
    audio = {**TEXT_ONLY, "audio": True}
    assert admit("POST", "/v1/audio/transcriptions", form, b"--x--", caps({"modalities": audio})) is None
    with pytest.raises(BadRequest):  # a form anywhere else, or two content types: read as the JSON it is not
        admit("POST", "/v1/embeddings", form, b"--x--", None)
    with pytest.raises(BadRequest):
        admit(
            "POST",
            "/v1/audio/transcriptions",
            [*form, (b"content-type", b"application/json")],
            b"--x--",
            None,
        )
    assert admit("GET", "/props", [], b"", None) is None
    with pytest.raises(BodyLimit):
        admit("GET", "/props", [], b"[" * (MAX_DEPTH + 1), None)


# -- any JSON at any field: 2xx or 4xx, and only what the proxy could read reaches llama-server -------------
POSTED = sorted(p for p, (methods, _) in ROUTES.items() if "POST" in methods)
ID_HEADERS = ["x-session-id", "x-claude-code-session-id", "session-id", "thread-id", "x-codex-turn-metadata"]
HEADER_VALUE = st.binary(max_size=40).map(lambda b: bytes(c for c in b if c >= 0x20 and c != 0x7F).strip())


async def test_any_json_at_any_field_is_answered_2xx_or_4xx(r: Rig) -> None:
    """Mutated chat, Messages and Responses bodies, to their own route or any route that takes a body, with any
    value of the session headers the proxy reads: never a 5xx, and only what the gate admits reaches llama-server."""
    cases: list[tuple[str, Any, dict[str, bytes]]] = []

    @settings(max_examples=400, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(
        mutated(),
        st.none() | st.sampled_from(POSTED),
        st.dictionaries(st.sampled_from(ID_HEADERS), HEADER_VALUE, max_size=2),
    )
    def collect(case: tuple[str, Any], route: str | None, headers: dict[str, bytes]) -> None:
        cases.append((route or case[0], case[1], headers))

    collect()
    async with r.client() as c:
        for path, body, headers in cases:
            sent = {b"content-type": b"application/json", **{k.encode(): v for k, v in headers.items()}}
            resp = await c.post(path, content=json.dumps(body).encode(), headers=sent)
            assert resp.status_code < 500, (path, body, headers, resp.text)
    for upstream in r.origin.requests:  # nothing the proxy could not read went on
        check_fields(read_json(upstream.body))
    assert r.h.coordinator.status()["leases"] == 0
