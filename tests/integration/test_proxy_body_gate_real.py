"""The proxy's body gate (kvsidecar.proxy.gate) in front of a real llama-server 11434 with the tiny model (no
multimodal projector): a body that kills llama-server when sent to it directly is a 4xx from the proxy on
every route, and llama-server is still the same live process afterwards; an image for this text-only model is
a 4xx that says why (llama-server itself answers 500), on the chat, Messages and Responses routes.
The limits' measurements: bench/bench_body_limits.py; the unit suite: tests/unit/proxy/test_gate.py."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsidecar.backend.llama_http import ANTHROPIC_ROUTES, ROUTES, RouteKind
from kvsidecar.testing.llama import LlamaServer
from tests.conftest import StartServer
from tests.integration.test_proxy_real import TOKEN, Setup, proxy_daemon

AUTH = {"Authorization": f"Bearer {TOKEN}", "content-type": "application/json"}
DEEP = b"[" * 80_000 + b"]" * 80_000  # 50,000 is still answered; 80,000 killed llama-server (SIGSEGV)
MESSAGE = b'[{"role":"user","content":"hi"}]'
CHAT_ROUTES = ("/apply-template", "/chat/completions", "/v1/chat/completions")
PNG = "data:image/png;base64,iVBORw0KGgoAAAANSUhEUgAAAAEAAAABCAIAAACQd1PeAAAADElEQVR4nGP4z8AAAAMBAQDJ/pLvAAAAAElFTkSuQmCC"


def deep_body(path: str) -> bytes:
    """80,000 levels of arrays where the route's handler reads them (a tool's schema, the template's kwargs)."""
    if path in ANTHROPIC_ROUTES:
        tool = b'{"name":"f","input_schema":{"type":"object","properties":{"a":' + DEEP + b"}}}"
        return b'{"model":"m","max_tokens":1,"messages":' + MESSAGE + b',"tools":[' + tool + b"]}"
    if path.startswith(CHAT_ROUTES) or "/chat/" in path:
        return b'{"messages":' + MESSAGE + b',"max_tokens":1,"chat_template_kwargs":{"a":' + DEEP + b"}}"
    if "responses" in path:
        return b'{"input":"hi","max_output_tokens":1,"x":' + DEEP + b"}"
    return (
        b'{"prompt":"x","content":"x","input":"x","query":"x","documents":["x"],"n_predict":1,"x":'
        + DEEP
        + b"}"
    )


@pytest.fixture
def setup(start_llama: StartServer, tmp_path: Path) -> Iterator[Setup]:
    llama = start_llama(ctx_size=4096)  # one slot: the routes that ignore id_slot are forwarded too
    daemon = proxy_daemon(llama, tmp_path)
    try:
        yield Setup(llama=llama, proxy=daemon.proxy_url, daemon=daemon)
    finally:
        daemon.stop()


def same_live_process(llama: LlamaServer, pid: int) -> None:
    assert llama.alive and llama.pid == pid, "llama-server died"
    assert httpx.get(f"{llama.base_url}/health", timeout=10).status_code == 200


def error_code(path: str, resp: httpx.Response) -> str:
    data = resp.json()
    if path in ANTHROPIC_ROUTES:  # Anthropic's shape on its routes, OpenAI's elsewhere
        assert data["type"] == "error", data
    else:
        assert "hint" in data["error"], data
    return str(data["error"]["code"])


CYCLIC_PARSER = {
    "parsers": [{"type": "rule", "name": "a", "child": 1, "trigger": False}, {"type": "ref", "name": "a"}],
    "rules": {"a": 0},
    "root": 0,
}


def ref_chain(n: int) -> dict[str, Any]:
    defs: dict[str, Any] = {f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in range(n)}
    defs[f"a{n}"] = {"type": "string"}
    return {"$ref": "#/$defs/a0", "$defs": defs}


LAZY = {"grammar": 'root ::= "a"', "grammar_lazy": True}
# Bodies that kill llama-server 11434 when sent to it directly, and the proxy's refusal of each. Beyond JSON's
# own nesting: a grammar's groups, a schema's chain of `$ref`s, llama-server's own `chat_parser` (a graph with a
# cycle: SIGSEGV) and `grammar_triggers` (an unknown type: abort).
KILLERS: list[tuple[str, bytes, str]] = [
    ("/apply-template", deep_body("/apply-template"), "KV_BODY_LIMIT"),
    ("/v1/chat/completions/input_tokens", deep_body("/v1/chat/completions/input_tokens"), "KV_BODY_LIMIT"),
    ("/v1/messages/count_tokens", deep_body("/v1/messages/count_tokens"), "KV_BODY_LIMIT"),
    (
        "/completion",
        json.dumps(
            {"prompt": "x", "n_predict": 1, "grammar": "root ::= " + "(" * 40_000 + '"a"' + ")" * 40_000}
        ).encode(),
        "KV_BODY_LIMIT",
    ),
    (
        "/completion",
        json.dumps({"prompt": "x", "n_predict": 1, "json_schema": ref_chain(12_000)}).encode(),
        "KV_BODY_LIMIT",
    ),
    (
        "/completion",
        json.dumps(
            {"prompt": "x", "n_predict": 2, "chat_format": 1, "chat_parser": json.dumps(CYCLIC_PARSER)}
        ).encode(),
        "KV_BAD_REQUEST",
    ),
    (
        "/completion",
        json.dumps(
            {"prompt": "x", "n_predict": 2, **LAZY, "grammar_triggers": [{"type": 7, "value": "x"}]}
        ).encode(),
        "KV_BAD_REQUEST",
    ),
]
KILLER_IDS = [
    "apply-template",
    "chat-input-tokens",
    "count-tokens",
    "grammar-groups",
    "ref-chain",
    "chat-parser",
    "trigger-type",
]


@pytest.mark.parametrize(("path", "body", "code"), KILLERS, ids=KILLER_IDS)
def test_each_body_kills_llama_server_when_sent_to_it_directly(
    start_llama: StartServer, path: str, body: bytes, code: str
) -> None:
    """What the proxy keeps from llama-server: sent straight to it, each of these ends the process."""
    llama = start_llama(ctx_size=4096)
    with contextlib.suppress(httpx.HTTPError):  # it dies while answering
        httpx.post(f"{llama.base_url}{path}", content=body, headers=AUTH, timeout=120)
    assert llama.proc is not None and llama.proc.wait(timeout=30) != 0


def test_each_killing_body_is_refused_by_the_proxy_and_llama_server_lives(setup: Setup) -> None:
    pid = setup.llama.pid
    for path, body, code in KILLERS:
        resp = httpx.post(f"{setup.proxy}{path}", content=body, headers=AUTH, timeout=120)
        assert resp.status_code == 400 and error_code(path, resp) == code, (path, resp.text[:300])
        same_live_process(setup.llama, pid)


def test_a_body_too_deep_is_refused_on_every_route_and_llama_server_lives(setup: Setup) -> None:
    pid = setup.llama.pid
    tried = 0
    with httpx.Client(base_url=setup.proxy, headers=AUTH, timeout=120) as c:
        for path, (methods, _) in ROUTES.items():
            for method in sorted(methods - {"HEAD"}):
                body = DEEP if method == "GET" else deep_body(path)
                resp = c.request(method, path, content=body)
                assert resp.status_code == 400, (method, path, resp.text[:300])
                assert error_code(path, resp) == "KV_BODY_LIMIT", (method, path)
                same_live_process(setup.llama, pid)
                tried += 1
        assert tried == sum(len(m - {"HEAD"}) for m, _ in ROUTES.values())
        assert {k for _, k in ROUTES.values()} == set(RouteKind)  # info, pinned, converted, unpinned
        ok = c.post("/completion", json={"prompt": "hello", "n_predict": 2}, headers={"X-Session-Id": "s1"})
        assert ok.status_code == 200, ok.text  # and it still serves
    same_live_process(setup.llama, pid)


IMAGE_REQUESTS: list[tuple[str, dict[str, Any]]] = [
    (
        "/v1/chat/completions",
        {
            "max_tokens": 2,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {"type": "image_url", "image_url": {"url": PNG}},
                    ],
                }
            ],
        },
    ),
    (
        "/v1/responses",
        {
            "max_output_tokens": 2,
            "input": [
                {
                    "role": "user",
                    "content": [
                        {"type": "input_text", "text": "what is this?"},
                        {"type": "input_image", "image_url": PNG},
                    ],
                }
            ],
        },
    ),
    (
        "/v1/messages",
        {
            "model": "m",
            "max_tokens": 2,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "what is this?"},
                        {
                            "type": "image",
                            "source": {
                                "type": "base64",
                                "media_type": "image/png",
                                "data": PNG.split(",")[1],
                            },
                        },
                    ],
                }
            ],
        },
    ),
    (
        "/v1/messages/count_tokens",
        {
            "model": "m",
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "url", "url": "https://example.invalid/x.png"}}
                    ],
                }
            ],
        },
    ),
    (
        "/v1/chat/completions/input_tokens",
        {
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}],
                }
            ]
        },
    ),
]


def test_an_image_for_a_text_only_model_is_a_4xx_that_says_why(setup: Setup) -> None:
    props = httpx.get(f"{setup.llama.base_url}/props", timeout=10).json()
    assert props["modalities"] == {"vision": False, "video": False, "audio": False}  # the tiny model
    direct = httpx.post(f"{setup.llama.base_url}/v1/chat/completions", json=IMAGE_REQUESTS[0][1], timeout=120)
    assert direct.status_code == 500 and "image input is not supported" in direct.text  # llama-server's own
    pid = setup.llama.pid
    for session in (None, "s1"):
        for path, body in IMAGE_REQUESTS:
            headers = AUTH | ({"X-Session-Id": session} if session else {})
            resp = httpx.post(f"{setup.proxy}{path}", json=body, headers=headers, timeout=120)
            assert resp.status_code == 400, (path, resp.status_code, resp.text[:300])
            assert error_code(path, resp) == "KV_MODALITY_UNSUPPORTED", path
            message = resp.json()["error"]["message"]
            assert "input" in message and "text only" in message and "--mmproj" in message, message
    same_live_process(setup.llama, pid)
    status = httpx.get(f"{setup.daemon.url}/v1/status", headers=setup.daemon.auth, timeout=10).json()
    assert status["stats"]["acquires"] == 0  # refused before any slot was prepared
