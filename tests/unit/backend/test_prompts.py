"""kvsidecar.backend.prompts: which tokens a prompt becomes, with the fake engine's tokenizer and template
(tests/integration/test_prompt_tokens_real.py proves the same against llama-server's saved slots)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from kvsidecar.backend import prompts
from kvsidecar.backend.base import TokenizerInfo
from kvsidecar.backend.fake import FakeKvBackend
from kvsidecar.backend.fake_prompts import fake_render, fake_tokenize, fake_tokens
from kvsidecar.backend.prompts import (
    BACKEND,
    INVALID,
    LOSSY,
    MULTIMODAL,
    MULTIMODAL_SERVER,
    REASONS,
    REFUSED,
    SEVERAL_PROMPTS,
    KnownTokens,
    PromptTokens,
    UnknownTokens,
    chat_tokens,
    completion_tokens,
    has_media,
    hint_tokens,
)
from kvsidecar.errors import BadRequest, KvError, OperationTimeout

CHAT = {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi there"}]}


@pytest.fixture
def fake(tmp_path: Path) -> FakeKvBackend:
    return FakeKvBackend(tmp_path)


def words(text: str) -> list[int]:
    return fake_tokens(text, add_special=False, parse_special=True)


def known(result: PromptTokens) -> tuple[int, ...]:
    assert isinstance(result, KnownTokens), result
    return result.tokens


def unknown(result: PromptTokens, reason: str) -> UnknownTokens:
    assert isinstance(result, UnknownTokens), result
    assert result.reason == reason and result.reason in REASONS, result
    return result


# -- completion prompts: tokenize_input_prompts' forms ----------------------------------------------------
async def test_a_text_is_tokenized_once_with_the_bos_and_specials(fake: FakeKvBackend) -> None:
    tokens = known(await completion_tokens(fake, "hello <s> world"))
    assert tokens == (1, *words("hello"), 1, *words("world"))  # add_special and parse_special both on
    assert fake.prompt_calls == ["tokenize"]


async def test_ids_are_the_prompt_as_they_are_with_no_tokenize(fake: FakeKvBackend) -> None:
    assert known(await completion_tokens(fake, [5, 17, 3])) == (5, 17, 3)
    assert "tokenize" not in fake.prompt_calls


@pytest.mark.parametrize(
    ("prompt", "expected"),
    [
        (["a", 5, "b"], [1, *words("a"), 5, *words("b")]),  # only the first text gets the BOS
        ([5, "a"], [5, *words("a")]),  # an id first: no BOS at all
        ({"prompt_string": "a b"}, [1, *words("a b")]),
        ({"prompt_string": [7, "a"]}, [7, *words("a")]),
        ({"prompt_string": ["a", "b"]}, [1, *words("a"), *words("b")]),  # one mixed list, not two prompts
        (["just one"], [1, *words("just one")]),  # an array of one prompt
        ([[9, 8]], [9, 8]),
        ([{"prompt_string": "x"}], [1, *words("x")]),
    ],
)
async def test_every_single_prompt_form(fake: FakeKvBackend, prompt: Any, expected: list[int]) -> None:
    assert list(known(await completion_tokens(fake, prompt))) == expected


@pytest.mark.parametrize(
    ("prompt", "reason"),
    [
        (["a", "b"], SEVERAL_PROMPTS),  # texts only: several completions
        ([[1], [2]], SEVERAL_PROMPTS),
        ([], INVALID),
        ([[]], INVALID),  # an empty prompt runs nothing
        ({"prompt_string": "x", "multimodal_data": ["aGk="]}, MULTIMODAL),
        ([1.5, 2], INVALID),  # not an integer to llama-server
        (["a", 1, 2.5], INVALID),
        ([True], INVALID),  # JSON true is not a number
        ([1, None], INVALID),
        ([32000], INVALID),  # beyond the vocabulary
        ([-1], INVALID),
        (["a", 2**40], INVALID),  # llama-server would wrap it to 32 bits
        (5, INVALID),
        (None, INVALID),
        ({"text": "x"}, INVALID),
        ({"prompt_string": {"x": 1}}, INVALID),
    ],
)
async def test_forms_that_are_not_one_known_prompt(fake: FakeKvBackend, prompt: Any, reason: str) -> None:
    unknown(await completion_tokens(fake, prompt), reason)
    assert "tokenize" not in fake.prompt_calls  # nothing is sent that llama-server would not run


async def test_oai_completions_on_a_multimodal_server_are_unknown(fake: FakeKvBackend) -> None:
    fake.multimodal = True
    unknown(await completion_tokens(fake, "hi", oai=True), MULTIMODAL_SERVER)
    assert known(await completion_tokens(fake, "hi")) == (1, *words("hi"))  # /completion: tokenize_mixed
    unknown(await completion_tokens(fake, [4, 5], oai=True), MULTIMODAL_SERVER)  # mtmd takes a text only


# -- chat bodies: the template's render, then the tokenizer -------------------------------------------------
async def test_a_chat_body_is_rendered_then_tokenized(fake: FakeKvBackend) -> None:
    tokens = known(await chat_tokens(fake, CHAT))
    assert list(tokens) == fake_tokenize(fake_render(CHAT), add_special=True, parse_special=True)
    assert fake.prompt_calls == ["tokenizer-info", "apply-template", "tokenize"]


async def test_the_callers_bytes_are_what_is_rendered(fake: FakeKvBackend) -> None:
    raw = b'{"messages":[{"role":"user","content":"from the bytes"}]}'
    tokens = known(await chat_tokens(fake, CHAT, body=raw))
    assert list(tokens) == fake_tokenize(fake_render(raw), add_special=True, parse_special=True)


@pytest.mark.parametrize("kind", sorted(prompts.MEDIA_PARTS))
async def test_media_parts_are_unknown_before_any_call(fake: FakeKvBackend, kind: str) -> None:
    chat = {"messages": [{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": kind}]}]}
    assert has_media(chat)
    unknown(await chat_tokens(fake, chat), MULTIMODAL)
    assert fake.prompt_calls == []


def test_has_media_reads_hostile_shapes_without_raising() -> None:
    for chat in ({}, {"messages": 3}, {"messages": [3, {"content": 4}, {"content": [5, {"type": 6}]}]}):
        assert not has_media(chat)


async def test_a_chat_on_a_multimodal_server_is_unknown(fake: FakeKvBackend) -> None:
    fake.multimodal = True
    unknown(await chat_tokens(fake, CHAT), MULTIMODAL_SERVER)
    assert "apply-template" not in fake.prompt_calls


async def test_a_body_the_server_refuses_is_unknown(fake: FakeKvBackend) -> None:
    result = unknown(await chat_tokens(fake, {"messages": "nope"}), REFUSED)
    assert "KV_BAD_REQUEST" in result.detail


async def test_a_body_json_cannot_carry_is_invalid(fake: FakeKvBackend) -> None:
    unknown(await chat_tokens(fake, {"messages": [{"role": "user", "content": "\ud800"}]}), INVALID)
    unknown(await chat_tokens(fake, {"messages": [], "x": float("nan")}), INVALID)
    assert fake.prompt_calls == []


async def test_an_unreachable_server_is_a_backend_error(fake: FakeKvBackend) -> None:
    fake.set_unavailable()
    assert "KV_BACKEND_UNAVAILABLE" in unknown(await chat_tokens(fake, CHAT), BACKEND).detail
    unknown(await completion_tokens(fake, "x"), BACKEND)
    unknown(await completion_tokens(fake, [1, 2]), BACKEND)  # the vocabulary could not be asked


class Scripted:
    """A tokenizer whose render and failures the test sets, on a clock the test advances."""

    def __init__(self, prompt: str = "rendered", *, fail: KvError | None = None) -> None:
        self.prompt, self.fail, self.now, self.sent = prompt, fail, 100.0, b""

    async def tokenizer_info(self) -> TokenizerInfo:
        return TokenizerInfo(n_vocab=100, multimodal=False)

    async def apply_template(self, chat_body: bytes | Mapping[str, Any]) -> str:
        self.now += 0.25  # the render takes 250 ms
        if self.fail is not None:
            raise self.fail
        assert isinstance(chat_body, bytes)
        self.sent = chat_body
        return self.prompt

    async def tokenize(
        self, content: str | Sequence[str | int], *, add_special: bool, parse_special: bool
    ) -> list[int]:
        self.now += 0.125
        return [1, 2, 3]


@pytest.fixture
def scripted(monkeypatch: pytest.MonkeyPatch) -> Scripted:
    tok = Scripted()
    monkeypatch.setattr("kvsidecar.backend.prompts.time.perf_counter", lambda: tok.now)
    return tok


async def test_the_cost_is_the_calls_wall_time(scripted: Scripted) -> None:
    result = await chat_tokens(scripted, CHAT)
    assert isinstance(result, KnownTokens) and result.cost_ms == pytest.approx(375.0)
    scripted.fail = OperationTimeout("apply-template: llama-server did not answer in time")
    failed = unknown(await chat_tokens(scripted, CHAT), BACKEND)
    assert failed.cost_ms == pytest.approx(250.0) and "KV_OPERATION_TIMEOUT" in failed.detail
    scripted.fail = BadRequest("apply-template: HTTP 400 Cannot have 2 or more assistant messages")
    assert "2 or more" in unknown(await chat_tokens(scripted, CHAT), REFUSED).detail


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b'{"messages":[]}', LOSSY),  # the replacement character came from the server's answer
        ('{"messages":["\ufffd"]}'.encode(), None),  # the body held one: the render may carry it
        (b'{"messages":["\\uFFFD"]}', None),  # the same, escaped
    ],
)
async def test_a_render_with_replaced_bytes_is_not_trusted(
    scripted: Scripted, body: bytes, reason: str | None
) -> None:
    scripted.prompt = "text \ufffd text"
    result = await chat_tokens(scripted, CHAT, body=body)
    if reason is None:
        assert known(result) == (1, 2, 3)
    else:
        unknown(result, reason)


async def test_a_chat_is_sent_as_compact_utf8(scripted: Scripted) -> None:
    await chat_tokens(scripted, {"messages": [{"role": "user", "content": "é 🙂"}]})
    assert scripted.sent == '{"messages":[{"role":"user","content":"é 🙂"}]}'.encode()


# -- the hook API's prompt ---------------------------------------------------------------------------------
async def test_a_hint_is_a_completion_prompt_or_a_chat_body(fake: FakeKvBackend) -> None:
    assert known(await hint_tokens(fake, "a b")) == (1, *words("a b"))
    assert known(await hint_tokens(fake, [3, 4])) == (3, 4)
    assert known(await hint_tokens(fake, CHAT)) == known(await chat_tokens(fake, CHAT))


@pytest.mark.parametrize(
    ("saved", "prompt", "shared"),
    [
        ((), (), 0),
        ((1, 2, 3), (1, 2, 3, 4), 3),  # an exact extension: all of the snapshot
        ((1, 2, 3), (1, 2, 3), 3),
        ((1, 2, 3), (1, 2), 2),
        ((1, 2, 3), (1, 9, 3), 1),
        ((5,), (6,), 0),
        (tuple(range(2000)), (*range(1500), -1, *range(1501, 2000)), 1500),  # past the first blocks
        (tuple(range(1024)), (*range(1024), 7), 1024),  # exactly two blocks, then longer
        (tuple(range(1025)), (*range(1024), 7), 1024),  # a difference right after a block
    ],
)
def test_shared_prefix(saved: tuple[int, ...], prompt: tuple[int, ...], shared: int) -> None:
    assert prompts.shared_prefix(saved, prompt) == shared == prompts.shared_prefix(prompt, saved)
    assert prompts.shared_prefix(list(saved), prompt) == shared  # any sequences
