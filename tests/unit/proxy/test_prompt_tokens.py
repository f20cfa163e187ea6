"""kvsidecar.proxy.prompt_tokens: each slot-running route to the prompt llama-server renders from it, with
the fake engine's tokenizer (the real one: tests/integration/test_prompt_tokens_real.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvsidecar.backend.fake import FakeKvBackend
from kvsidecar.backend.fake_prompts import fake_render, fake_tokenize, fake_tokens
from kvsidecar.backend.llama_http import ROUTES, RouteKind
from kvsidecar.backend.prompts import (
    INFILL,
    MULTIMODAL,
    NO_PROMPT,
    NOT_CONVERTIBLE,
    SEVERAL_PROMPTS,
    KnownTokens,
    PromptTokens,
    UnknownTokens,
)
from kvsidecar.proxy import prompt_tokens
from kvsidecar.proxy.anthropic import messages_to_chat
from kvsidecar.proxy.prompt_tokens import request_tokens, request_tokens_of
from kvsidecar.proxy.responses_chat import responses_to_chat
from kvsidecar.proxy.sessions import SlotCall

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}


@pytest.fixture
def fake(tmp_path: Path) -> FakeKvBackend:
    return FakeKvBackend(tmp_path)


def rendered(chat: Any) -> tuple[int, ...]:
    return tuple(fake_tokenize(fake_render(chat), add_special=True, parse_special=True))


def known(result: PromptTokens) -> tuple[int, ...]:
    assert isinstance(result, KnownTokens), result
    assert result.cost_ms >= 0
    return result.tokens


def unknown(result: PromptTokens) -> str:
    assert isinstance(result, UnknownTokens), result
    return result.reason


@pytest.mark.parametrize("path", ["/completion", "/completions", "/v1/completions"])
async def test_completion_routes_tokenize_the_prompt(fake: FakeKvBackend, path: str) -> None:
    tokens = known(await request_tokens(fake, path, {"prompt": "a b", "n_predict": 3}))
    assert tokens == (1, *fake_tokens("a b", add_special=False, parse_special=True))
    assert fake.prompt_calls.count("tokenize") == 1
    assert unknown(await request_tokens(fake, path, {"prompt": ["a", "b"]})) == SEVERAL_PROMPTS
    assert unknown(await request_tokens(fake, path, {"messages": []})) == NO_PROMPT


@pytest.mark.parametrize("path", ["/chat/completions", "/v1/chat/completions"])
async def test_chat_routes_render_the_clients_own_bytes(fake: FakeKvBackend, path: str) -> None:
    assert known(await request_tokens(fake, path, CHAT)) == rendered(CHAT)
    raw = json.dumps({"messages": [{"role": "user", "content": "as sent"}]}).encode()
    assert known(await request_tokens(fake, path, CHAT, body=raw)) == rendered(raw)
    assert fake.prompt_calls.count("apply-template") == 2 and fake.prompt_calls.count("tokenize") == 2


async def test_anthropic_messages_render_the_chat_body_the_proxy_sends(fake: FakeKvBackend) -> None:
    body = {
        "model": "m",
        "max_tokens": 5,
        "system": [{"type": "text", "text": "sys"}],
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
    }
    raw = b'{"messages":[{"role":"user","content":"not these bytes"}]}'
    assert known(await request_tokens(fake, "/v1/messages", body, body=raw)) == rendered(
        messages_to_chat(body)
    )
    image = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA"}}
    with_image = {**body, "messages": [{"role": "user", "content": [image]}]}
    assert unknown(await request_tokens(fake, "/v1/messages", with_image)) == MULTIMODAL
    assert unknown(await request_tokens(fake, "/v1/messages", {"model": "m"})) == NOT_CONVERTIBLE


@pytest.mark.parametrize("path", ["/responses", "/v1/responses"])
async def test_responses_render_the_converted_chat_body(fake: FakeKvBackend, path: str) -> None:
    body = {"model": "m", "instructions": "sys", "input": [{"role": "user", "content": "hi"}]}
    assert known(await request_tokens(fake, path, body)) == rendered(responses_to_chat(body))
    image = {"role": "user", "content": [{"type": "input_image", "image_url": "data:x"}]}
    assert unknown(await request_tokens(fake, path, {"input": [image]})) == MULTIMODAL
    refused = await request_tokens(fake, path, {"input": "x", "previous_response_id": "r"})
    assert unknown(refused) == NOT_CONVERTIBLE and "previous_response_id" in refused.detail  # type: ignore[union-attr]


async def test_infill_and_other_routes_are_unknown_with_no_call(fake: FakeKvBackend) -> None:
    infill = {"input_prefix": "def f(", "input_suffix": ")", "prompt": ""}
    assert unknown(await request_tokens(fake, "/infill", infill)) == INFILL
    assert unknown(await request_tokens(fake, "/v1/embeddings", {"input": "x"})) == NO_PROMPT
    assert unknown(await request_tokens(fake, "/v1/chat/completions", None)) == NO_PROMPT
    assert fake.prompt_calls == []


def test_every_slot_running_route_is_mapped() -> None:
    """Each route the proxy pins or converts has its rule here: a new one cannot be forgotten."""
    mapped = (
        prompt_tokens.COMPLETION_ROUTES
        | prompt_tokens.OAI_COMPLETION_ROUTES
        | prompt_tokens.CHAT_ROUTES
        | prompt_tokens.RESPONSES_ROUTES
        | {prompt_tokens.MESSAGES_ROUTE, prompt_tokens.INFILL_ROUTE}
    )
    running = {path for path, (_, kind) in ROUTES.items() if kind in (RouteKind.PINNED, RouteKind.CONVERTED)}
    assert mapped == running


async def test_a_slot_call_is_read_by_its_path_data_and_bytes(fake: FakeKvBackend) -> None:
    raw = json.dumps(CHAT).encode()
    call = SlotCall(path="/v1/chat/completions", route=RouteKind.PINNED, session="s", data=CHAT, body=raw)
    assert known(await request_tokens_of(fake, call)) == rendered(raw)
