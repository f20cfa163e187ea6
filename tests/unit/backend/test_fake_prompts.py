"""The fake engine's tokenizer and chat template keep the real ones' shape (kvsidecar.backend.fake_prompts)."""

from __future__ import annotations

import pytest

from kvsidecar.backend.fake_prompts import FAKE_VOCAB, fake_render, fake_tokenize, fake_tokens
from kvsidecar.errors import BadRequest


def test_words_specials_and_the_bos() -> None:
    plain = fake_tokens("a <s> b", add_special=False, parse_special=False)
    assert len(plain) == 3 and 1 not in plain and all(3 <= t < FAKE_VOCAB for t in plain)
    assert fake_tokens("a <s> b", add_special=True, parse_special=True) == [1, plain[0], 1, plain[2]]
    assert fake_tokens("a b", add_special=False, parse_special=True) == [plain[0], plain[2]]  # deterministic


def test_mixed_lists_as_tokenize_mixed() -> None:
    a = fake_tokens("a", add_special=False, parse_special=True)
    assert fake_tokenize(["a", 7, "a"], add_special=True, parse_special=True) == [1, *a, 7, *a]
    assert fake_tokenize([7, "a"], add_special=True, parse_special=True) == [7, *a]
    with pytest.raises(BadRequest):
        fake_tokenize([FAKE_VOCAB], add_special=True, parse_special=True)


def test_the_render() -> None:
    body = {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}], "tools": [{"x": 1}]}
    assert fake_render(body) == '<|tools|> [{"x": 1}]\n<|user|> hi\n<|assistant|>'
    assert fake_render({**body, "add_generation_prompt": False}).endswith("<|user|> hi")
    for bad in (b"not json", b"[]", {"messages": 1}, {"messages": [1]}):
        with pytest.raises(BadRequest):
            fake_render(bad)
