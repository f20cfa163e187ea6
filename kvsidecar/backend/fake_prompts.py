"""The fake engine's tokenizer and chat template (`FakeKvBackend.tokenize`, `apply_template`): unit tests.

Deterministic stand-ins with the real ones' shape (llama-server's `tokenize_mixed` and its chat render): one
id per whitespace-separated word (ids 3 and up), `<s>`/`</s>` read as specials only with `parse_special`, the
BOS only with `add_special` and only before the first text of a mixed list of texts and ids; a chat body
renders as one `<|role|> text` line per message after its tools, then the generation prompt. What the real
server refuses with HTTP 400 (a non-list `messages`, an id beyond the vocabulary) is refused as `BadRequest`.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

import xxhash

from kvsidecar.errors import BadRequest

FAKE_VOCAB = 32000
FAKE_SPECIALS = {"<s>": 1, "</s>": 2}  # the BOS and EOS of the fake vocabulary


def fake_tokens(text: str, *, add_special: bool, parse_special: bool) -> list[int]:
    """The fake tokenizer: one id per whitespace-separated word (ids 3 and up), specials when parsed."""
    out = [FAKE_SPECIALS["<s>"]] if add_special else []
    for word in text.split():
        special = FAKE_SPECIALS.get(word) if parse_special else None
        out.append(
            special if special is not None else 3 + xxhash.xxh32_intdigest(word.encode()) % (FAKE_VOCAB - 3)
        )
    return out


def fake_tokenize(content: str | Sequence[str | int], *, add_special: bool, parse_special: bool) -> list[int]:
    """As `tokenize_mixed`: texts tokenized, ids kept, the BOS only before a first text."""
    parts = [content] if isinstance(content, str) else list(content)
    out: list[int] = []
    for i, part in enumerate(parts):
        if isinstance(part, str):
            out += fake_tokens(part, add_special=add_special and i == 0, parse_special=parse_special)
        elif type(part) is int and 0 <= part < FAKE_VOCAB:
            out.append(part)
        else:
            raise BadRequest("tokenize: HTTP 400 a token id out of the vocabulary")
    return out


def fake_render(chat_body: bytes | Mapping[str, Any]) -> str:
    """The fake chat template: the tools, `<|role|> text` per message, then the generation prompt."""
    try:
        body = json.loads(chat_body) if isinstance(chat_body, bytes) else chat_body
    except ValueError:
        body = None
    if not isinstance(body, Mapping):
        raise BadRequest("apply-template: HTTP 400 the body is not a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
        raise BadRequest("apply-template: HTTP 400 Expected 'messages' to be an array")
    lines = []
    if body.get("tools"):
        lines.append("<|tools|> " + json.dumps(body["tools"], sort_keys=True))
    for msg in messages:
        content = msg.get("content")
        if isinstance(content, list):
            content = "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
        lines.append(f"<|{msg.get('role')}|> {content or ''}")
    if body.get("add_generation_prompt", True) is not False:
        lines.append("<|assistant|>")
    return "\n".join(lines)
