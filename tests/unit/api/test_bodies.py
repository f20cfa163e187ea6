"""The hook API's request bodies: the acquire's optional `prompt` (a text, token ids or a chat body),
checked strictly and turned into tokens through the backend; bodies without it are unchanged."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError

from kvsidecar.api.bodies import MAX_PROMPT_IDS, AcquireBody, acquire_prompt_tokens
from kvsidecar.api.routes import create_app
from kvsidecar.backend.fake import FakeKvBackend
from kvsidecar.backend.fake_prompts import fake_render, fake_tokenize
from kvsidecar.backend.prompts import KnownTokens, chat_tokens
from kvsidecar.http.messages import validation_message
from tests.unit.coordinator_helpers import Harness

BASE = {"provider": "local", "model": "m"}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "tools": [{"type": "function"}], "x": {"y": [1]}}


def body(prompt: Any) -> AcquireBody:
    return AcquireBody.model_validate_json(json.dumps({**BASE, "prompt": prompt}))


def refusal(prompt: Any) -> str:
    with pytest.raises(ValidationError) as info:
        body(prompt)
    return validation_message(info.value.errors())


def test_the_three_forms_and_none() -> None:
    assert body("a b").prompt_value() == "a b"
    assert body([0, 5, 2**31 - 1]).prompt_value() == [0, 5, 2**31 - 1]
    assert body(CHAT).prompt_value() == CHAT  # every field kept as sent
    assert AcquireBody.model_validate_json(json.dumps(BASE)).prompt_value() is None
    assert body(None).prompt_value() is None


@pytest.mark.parametrize(
    ("prompt", "said"),
    [
        (5, "prompt: a text, a list of token ids, or a chat body"),
        (True, "prompt: a text, a list of token ids"),
        ("", "prompt.text: String should have at least 1 character"),
        ([], "prompt.ids: List should have at least 1 item"),
        (["1"], "prompt.ids.0: Input should be a valid integer"),  # strict: no "1" -> 1
        ([1.0], "prompt.ids.0: Input should be a valid integer"),
        ([True], "prompt.ids.0: Input should be a valid integer"),
        ([-1], "prompt.ids.0: Input should be greater than or equal to 0"),
        ([2**31], "prompt.ids.0: Input should be less than 2147483648"),
        ({"x": 1}, "prompt.chat.messages: Field required"),
        ({"messages": []}, "prompt.chat.messages: List should have at least 1 item"),
        ({"messages": "hi"}, "prompt.chat.messages: Input should be a valid array"),
        ({"messages": ["hi"]}, "prompt.chat.messages.0: Input should be an object"),
    ],
)
def test_a_bad_prompt_names_its_form(prompt: Any, said: str) -> None:
    assert refusal(prompt).startswith(said)


def test_the_ids_are_bounded() -> None:
    assert "at most" in refusal([1] * (MAX_PROMPT_IDS + 1))


def test_the_fleet_forwards_it_unchanged() -> None:
    """A routed acquire is re-sent as `model_dump(exclude_none=True)` and checked again on the peer."""
    for prompt in ("t", [1, 2], CHAT):
        sent = body(prompt).model_dump(exclude_none=True)
        assert AcquireBody.model_validate_json(json.dumps(sent)).prompt_value() == prompt


async def test_the_prompt_becomes_the_backends_tokens(tmp_path: Path) -> None:
    fake = FakeKvBackend(tmp_path)
    text = await acquire_prompt_tokens(body("a b"), fake)
    assert isinstance(text, KnownTokens) and list(text.tokens) == fake_tokenize(
        "a b", add_special=True, parse_special=True
    )
    ids = await acquire_prompt_tokens(body([3, 4]), fake)
    assert isinstance(ids, KnownTokens) and ids.tokens == (3, 4)
    chat = await acquire_prompt_tokens(body(CHAT), fake)
    assert isinstance(chat, KnownTokens) and list(chat.tokens) == fake_tokenize(
        fake_render(CHAT), add_special=True, parse_special=True
    )
    assert chat.tokens == (await chat_tokens(fake, CHAT)).tokens  # type: ignore[union-attr]
    assert await acquire_prompt_tokens(AcquireBody.model_validate(BASE), fake) is None


async def test_the_acquire_route_checks_it(h: Harness) -> None:
    app = create_app(h.coordinator, token="t" * 32, max_body_bytes=4096)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://127.0.0.1:8377",
        headers={"Authorization": "Bearer " + "t" * 32},
    ) as c:
        r = await c.post("/v1/sessions/A/acquire", json={**BASE, "prompt": [1, "x"]})
        assert r.status_code == 400 and r.json()["error"]["code"] == "KV_BAD_REQUEST"
        assert r.json()["error"]["message"].startswith("prompt.ids.1")
        assert len(h.coordinator.leases) == 0
        r = await c.post("/v1/sessions/A/acquire", json={**BASE, "prompt": CHAT})
        assert r.status_code == 200 and r.json()["outcome"] == "cold"
        r = await c.post("/v1/acquire", json={**BASE, "prompt": "title please"})
        assert r.status_code == 200
