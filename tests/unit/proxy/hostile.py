"""Hostile request bodies for the proxy's readers: any JSON value at any field of a chat, Messages or
Responses body (hypothesis strategies), and a fixed table of type confusions for an exhaustive sweep.

The bodies start from the recorded agent-client requests (tests/fixtures/clients) and from hand-written ones
that hold every part type the readers look at (images, tool results, reasoning, function calls); a mutation
replaces the value at one path, or adds a field under any object, with any JSON value.
"""

from __future__ import annotations

import copy
import functools
import math
from collections.abc import Iterator
from typing import Any

from hypothesis import strategies as st

from tests.unit.client_fixtures import posts

Path = tuple[str | int, ...]

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
RESPONSES = "/v1/responses"

IMAGE = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}}
HAND_WRITTEN: list[tuple[str, dict[str, Any]]] = [
    (
        CHAT,
        {
            "model": "m",
            "messages": [
                {"role": "system", "content": "be brief"},
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "hi"},
                        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
                        {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}},
                    ],
                },
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
                    ],
                },
                {"role": "tool", "tool_call_id": "c1", "content": "done"},
            ],
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
            "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}},
            "stream": True,
            "n": 1,
            "user": "u",
            "prompt_cache_key": "k",
        },
    ),
    (
        MESSAGES,
        {
            "model": "m",
            "max_tokens": 16,
            "system": [{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}],
            "messages": [
                {"role": "user", "content": [{"type": "text", "text": "hi"}, IMAGE]},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hmm"},
                        {"type": "tool_use", "id": "t1", "name": "f", "input": {"a": 1}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [{"type": "text", "text": "ok"}, IMAGE],
                        }
                    ],
                },
            ],
            "tools": [{"name": "f", "description": "d", "input_schema": {"type": "object"}}],
            "tool_choice": {"type": "auto"},
            "stop_sequences": ["x"],
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 4,
            "thinking": {"type": "enabled", "budget_tokens": 100},
            "metadata": {"user_id": '{"session_id": "s1"}'},
            "output_config": {"format": {"type": "json_schema", "schema": {"properties": {"title": {}}}}},
            "chat_template_kwargs": {"a": 1},
            "stream": False,
        },
    ),
    (
        RESPONSES,
        {
            "model": "m",
            "instructions": "be brief",
            "input": [
                {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
                {
                    "role": "user",
                    "content": [{"type": "input_image", "image_url": "data:image/png;base64,AAAA"}],
                },
                {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
                {
                    "type": "function_call_output",
                    "call_id": "c1",
                    "output": [{"type": "input_image", "image_url": "x"}],
                },
                {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}]},
                {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]},
            ],
            "tools": [{"type": "function", "name": "f", "parameters": {"type": "object"}}],
            "client_metadata": {
                "session_id": "s1",
                "x-codex-turn-metadata": '{"thread_source": "thread_title"}',
            },
            "prompt_cache_key": "k",
            "stream": True,
        },
    ),
]


@functools.cache
def _recorded() -> tuple[tuple[str, Any], ...]:
    return tuple((r.path, r.body) for r in posts() if isinstance(r.body, dict))


def corpus(*, distinct: bool = False) -> list[tuple[str, Any]]:
    """(route, body) of every recorded client request with a body, and the hand-written ones; `distinct`:
    one recording per client and route (the others have the same fields), for an exhaustive sweep."""
    recorded = list(_recorded())
    if distinct:
        seen: dict[tuple[str, frozenset[str]], tuple[str, Any]] = {}
        for route, body in recorded:
            seen.setdefault((route, frozenset(body)), (route, body))
        recorded = list(seen.values())
    return recorded + [(route, body) for route, body in HAND_WRITTEN]


def paths(value: Any, at: Path = ()) -> Iterator[Path]:
    """Every path into `value`, the root included (containers before their members)."""
    yield at
    if isinstance(value, dict):
        for key, sub in value.items():
            yield from paths(sub, (*at, key))
    elif isinstance(value, list):
        for index, sub in enumerate(value):
            yield from paths(sub, (*at, index))


_STRUCTURAL = frozenset(
    {"type", "role", "content", "text", "source", "input", "messages", "system", "tools", "output"}
)


@functools.cache
def _paths(index: int) -> list[Path]:
    return list(paths(corpus()[index][1]))


def get(value: Any, path: Path) -> Any:
    for step in path:
        value = value[step]
    return value


def replaced(body: Any, path: Path, new: Any) -> Any:
    """A copy of `body` with the value at `path` replaced by `new` (the root: `new` itself)."""
    if not path:
        return new
    out = copy.deepcopy(body)
    get(out, path[:-1])[path[-1]] = new
    return out


# Any JSON value (and what Python's parser also gives: huge integers, lone surrogates), nested a little.
_TEXT = st.text(alphabet=st.characters(codec=None, exclude_categories=()), max_size=12)
_SCALARS = (
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=2**63 - 2, max_value=2**70)
    | st.just(10**400)
    | st.floats(allow_nan=False, allow_infinity=False)
    | _TEXT
    | st.sampled_from(["text", "image", "image_url", "input_image", "tool_use", "tool_result", "message", ""])
)
JSON = st.recursive(
    _SCALARS,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.dictionaries(_TEXT | st.sampled_from(["type", "text"]), inner, max_size=4)
    ),
    max_leaves=12,
)


@st.composite
def mutated(draw: st.DrawFn, routes: tuple[str, ...] | None = None) -> tuple[str, Any]:
    """(route, body): a corpus body with one path replaced by any JSON value, or a field added anywhere."""
    candidates = [i for i, (r, _) in enumerate(corpus()) if routes is None or r in routes]
    index = draw(st.sampled_from(candidates))
    route, body = corpus()[index]
    if draw(st.booleans()):
        every = _paths(index)
        keyed = [p for p in every if p and p[-1] in _STRUCTURAL]  # where the readers branch: drawn as often
        structural = bool(keyed) and draw(st.booleans())
        path = draw(st.sampled_from(keyed if structural else every))
        return route, replaced(body, path, draw(JSON))
    where = draw(st.sampled_from([p for p in _paths(index) if isinstance(get(body, p), dict)]))
    key = draw(
        st.sampled_from(["type", "text", "content", "role", "source", "input", "tools", "system"]) | _TEXT
    )
    out = copy.deepcopy(body)
    get(out, where)[key] = draw(JSON)
    return route, out


# The fixed sweep: each of these at every path of every corpus body.
CONFUSIONS: list[Any] = [
    None,
    True,
    0,
    -1,
    2**64,
    10**400,
    1.5,
    -math.pi,
    "",
    "x",
    "\ud800",
    [],
    {},
    ["text"],
    {"a": 1},
    [{"type": ["text"], "text": "s"}],
    {"type": {"a": 1}, "text": "s"},
    [[[[[[[[[[]]]]]]]]]],
]
