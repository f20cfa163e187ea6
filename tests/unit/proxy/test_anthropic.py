"""Anthropic Messages -> llama-server chat completions and back (kvsidecar.proxy_anthropic, _stream).

The request side is held to llama-server's own conversion (`server_chat_convert_anthropic_to_oai`,
tools/server/server-chat.cpp at build 11434); the real-server equality is
tests/integration/test_proxy_anthropic_real.py."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from kvsidecar.proxy.anthropic import (
    MAX_DEPTH,
    chat_request_bytes,
    messages_to_chat,
    normalize_billing_header,
)
from kvsidecar.proxy.anthropic_answer import chat_answer_to_message_bytes, chat_to_message
from kvsidecar.proxy.anthropic_errors import (
    CODES,
    INVALID_FIELD,
    INVALID_TEXT,
    MISSING_FIELD,
    TOO_LARGE,
    UPSTREAM_INVALID,
    ConversionError,
    error_to_anthropic,
)
from kvsidecar.proxy.anthropic_stream import MAX_EVENT_BYTES, StreamTransducer
from tests.anthropic_helpers import accumulate, check_message, parse_sse
from tests.unit.client_fixtures import load
from tests.unit.proxy import hostile

CLAUDE = [
    "p_turn1",
    "p_turn2_continue",
    "p_conv2_turn1",
    "tools_turn1",
    "tools_turn1_tool_result",
    "tools_turn2_continue",
    "ui_turn1",
    "ui_title",
    "ui_turn2",
]
ANTHROPIC_ONLY = {"system", "stop_sequences", "thinking", "metadata", "output_config", "context_management"}


def convert(body: dict[str, Any], **kw: Any) -> dict[str, Any]:
    return messages_to_chat({"messages": [], **body}, **kw)


# -- every recorded Claude Code request ----------------------------------------------------------------
@pytest.mark.parametrize("name", CLAUDE)
def test_every_recorded_claude_request_converts(name: str) -> None:
    recorded = load("claude", name)
    body = recorded.body
    out = messages_to_chat(body, slot_id=1, cache_prompt=True)
    assert not ANTHROPIC_ONLY & set(out)
    assert out["id_slot"] == 1 and out["cache_prompt"] is True
    assert out["max_tokens"] == body["max_tokens"] and out["stream"] is True
    assert out["stream_options"] == {"include_usage": True}
    # the system blocks joined, with no separator, as the first message
    system = "".join(b["text"] for b in body["system"])
    assert out["messages"][0] == {"role": "system", "content": system}
    assert [t["function"]["name"] for t in out["tools"]] == [t["name"] for t in body["tools"]]
    assert all(
        t["function"]["parameters"] == s["input_schema"]
        for t, s in zip(out["tools"], body["tools"], strict=True)
    )
    # no cache_control survives anywhere, and the whole request is wire JSON
    wire = chat_request_bytes(body, slot_id=1)
    assert b"cache_control" not in wire and json.loads(wire)["id_slot"] == 1
    assert out["__metadata_user_id"] == body["metadata"]["user_id"]


def test_claude_tool_round_trip_shape() -> None:
    out = messages_to_chat(load("claude", "tools_turn2_continue").body)
    roles = [m["role"] for m in out["messages"]]
    assert roles == ["system", "user", "system", "assistant", "tool", "assistant", "user"]
    call = out["messages"][3]
    assert call["content"] == ""
    assert call["tool_calls"] == [
        {
            "id": "toolu_000002",
            "type": "function",
            "function": {"name": "Read", "arguments": '{"file_path":"/tmp/clients/env/claude/work/calc.py"}'},
        }
    ]
    tool = out["messages"][4]
    assert tool == {"role": "tool", "tool_call_id": "toolu_000002", "content": tool["content"]}
    assert tool["content"].startswith("1\tdef add")
    # role: "system" inside messages passes through, string content and all
    assert out["messages"][2]["role"] == "system" and isinstance(out["messages"][2]["content"], str)


def test_claude_title_request_asks_for_json_when_told_to() -> None:
    body = load("claude", "ui_title").body
    out = messages_to_chat(body, structured_output=True)
    schema = body["output_config"]["format"]["schema"]
    assert out["response_format"] == {"type": "json_schema", "json_schema": {"schema": schema}}
    assert out["tools"] == []
    assert "response_format" not in messages_to_chat(body)  # llama-server's own route drops it too


# -- golden shapes ----------------------------------------------------------------------------------------
def test_system_string_and_blocks_and_billing_stamp() -> None:
    assert convert({"system": "be brief"})["messages"] == [{"role": "system", "content": "be brief"}]
    blocks = [
        {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.1.e51; cch=a5145;"},
        {"type": "image", "source": {"type": "url", "url": "http://x"}},  # not text: skipped
        {"type": "text", "text": "You are", "cache_control": {"type": "ephemeral"}},
        {"type": "text", "text": " Claude."},
    ]
    system = convert({"system": blocks})["messages"][0]
    assert system == {
        "role": "system",
        "content": "x-anthropic-billing-header: cc_version=2.1.1.e51; cch=fffff;You are Claude.",
    }
    assert convert({"system": []})["messages"] == [{"role": "system", "content": ""}]
    assert convert({"system": None})["messages"] == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("x-anthropic-billing-header: cch=abcde; rest", "x-anthropic-billing-header: cch=fffff; rest"),
        ("x-anthropic-billing-header: cch=abcd;", "x-anthropic-billing-header: cch=abcd;"),  # not 5 + ;
        ("x-anthropic-billing-header: cch=abcde;", "x-anthropic-billing-header: cch=fffff;"),  # ; is last
        ("x-anthropic-billing-header: cch=abcde", "x-anthropic-billing-header: cch=abcde"),  # no ;
        (
            "prefix x-anthropic-billing-header: cch=abcde; r",
            "prefix x-anthropic-billing-header: cch=abcde; r",
        ),
        (
            "x-anthropic-billing-header: cc_version=1; no stamp",
            "x-anthropic-billing-header: cc_version=1; no stamp",
        ),
    ],
)
def test_billing_stamp_rewritten_as_llama_server_does(text: str, expected: str) -> None:
    assert normalize_billing_header(text) == expected


def test_text_blocks_keep_only_type_and_text() -> None:
    msg = {
        "role": "user",
        "content": [
            {"type": "text", "text": "a", "cache_control": {"type": "ephemeral"}, "citations": None},
            {"type": "text", "text": "b"},
        ],
    }
    assert convert({"messages": [msg]})["messages"] == [
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}
    ]


def test_string_content_messages_pass_through_with_the_fields_llama_server_reads() -> None:
    msgs = [
        {"role": "user", "content": "hi", "name": "bob", "unknown": 1},
        {"role": "assistant", "content": "ok", "reasoning_content": "thought"},
        {"role": "assistant", "content": None},
        {"role": "system", "content": "mid-conversation"},
    ]
    assert convert({"messages": msgs})["messages"] == [
        {"role": "user", "content": "hi", "name": "bob"},
        {"role": "assistant", "content": "ok", "reasoning_content": "thought"},
        {"role": "assistant", "content": None},
        {"role": "system", "content": "mid-conversation"},
    ]


def test_assistant_without_content_is_dropped_and_others_refused() -> None:
    assert convert({"messages": [{"role": "assistant"}]})["messages"] == []
    with pytest.raises(ConversionError) as err:
        convert({"messages": [{"role": "user"}]})
    assert err.value.code == MISSING_FIELD and err.value.param == "messages[0].content"


def test_blocks_that_convert_to_nothing_drop_the_message() -> None:
    msgs = [
        {"role": "user", "content": []},
        {"role": "assistant", "content": [{"type": "redacted_thinking", "data": "x"}, {"type": "document"}]},
    ]
    assert convert({"messages": msgs})["messages"] == []


def test_thinking_blocks_become_reasoning_content() -> None:
    msg = {
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "step 1. ", "signature": "sig"},
            {"type": "thinking", "thinking": "step 2."},
            {"type": "text", "text": "answer"},
        ],
    }
    assert convert({"messages": [msg]})["messages"] == [
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "answer"}],
            "reasoning_content": "step 1. step 2.",
        }
    ]
    only = {"role": "assistant", "content": [{"type": "thinking", "thinking": "t"}]}
    assert convert({"messages": [only]})["messages"] == [
        {"role": "assistant", "content": "", "reasoning_content": "t"}
    ]


def test_images_base64_url_and_unknown_sources() -> None:
    msg = {
        "role": "user",
        "content": [
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AAAA"}},
            {"type": "image", "source": {"type": "base64", "data": "BBBB"}},
            {"type": "image", "source": {"type": "url", "url": "https://example.com/a.png"}},
            {"type": "image", "source": {"type": "file", "file_id": "f"}},
            {"type": "text", "text": "what is it?"},
        ],
    }
    assert convert({"messages": [msg]})["messages"][0]["content"] == [
        {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}},
        {"type": "image_url", "image_url": {"url": "data:image/jpeg;base64,BBBB"}},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
        {"type": "text", "text": "what is it?"},
    ]


def test_tool_use_and_tool_results_every_content_form() -> None:
    msgs = [
        {
            "role": "assistant",
            "content": [
                {"type": "text", "text": "calling"},
                {"type": "tool_use", "id": "t1", "name": "f", "input": {"b": [1, 2.5, "é"], "a": None}},
                {"type": "tool_use", "id": "t2", "name": "g"},
            ],
        },
        {
            "role": "user",
            "content": [
                {"type": "tool_result", "tool_use_id": "t1", "content": "plain", "is_error": True},
                {
                    "type": "tool_result",
                    "tool_use_id": "t2",
                    "content": [
                        {"type": "text", "text": "a"},
                        {"type": "other"},
                        {"type": "text", "text": "b"},
                    ],
                },
                {
                    "type": "tool_result",
                    "tool_use_id": "t3",
                    "content": [
                        {"type": "text", "text": "see"},
                        {
                            "type": "image",
                            "source": {"type": "base64", "media_type": "image/gif", "data": "R0"},
                        },
                    ],
                },
                {"type": "tool_result", "tool_use_id": "t4"},
                {"type": "text", "text": "and then"},
            ],
        },
    ]
    out = convert({"messages": msgs})["messages"]
    assert out == [
        {
            "role": "assistant",
            "content": [{"type": "text", "text": "calling"}],
            "tool_calls": [
                {
                    "id": "t1",
                    "type": "function",
                    "function": {"name": "f", "arguments": '{"b":[1,2.5,"é"],"a":null}'},
                },
                {"id": "t2", "type": "function", "function": {"name": "g", "arguments": "{}"}},
            ],
        },
        # the message's own content first, its tool results after it (llama-server's order); is_error is
        # not passed on by llama-server either
        {"role": "user", "content": [{"type": "text", "text": "and then"}]},
        {"role": "tool", "tool_call_id": "t1", "content": "plain"},
        {"role": "tool", "tool_call_id": "t2", "content": "ab"},
        {
            "role": "tool",
            "tool_call_id": "t3",
            "content": [
                {"type": "text", "text": "see"},
                {"type": "image_url", "image_url": {"url": "data:image/gif;base64,R0"}},
            ],
        },
        {"role": "tool", "tool_call_id": "t4", "content": ""},
    ]


def test_tools_tool_choice_and_sampling() -> None:
    body = {
        "tools": [
            {"name": "f", "description": "does f", "input_schema": {"type": "object"}, "cache_control": {}},
            {"name": "web_search", "type": "web_search_20250305"},
        ],
        "tool_choice": {"type": "any", "disable_parallel_tool_use": True},
        "stop_sequences": ["END", "STOP"],
        "temperature": 0.2,
        "top_p": 0.9,
        "top_k": 40,
        "stream": False,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    out = convert(body)
    assert out["tools"] == [
        {
            "type": "function",
            "function": {"name": "f", "description": "does f", "parameters": {"type": "object"}},
        },
        {"type": "function", "function": {"name": "web_search", "description": "", "parameters": {}}},
    ]
    assert out["tool_choice"] == "required"
    assert out["stop"] == ["END", "STOP"]
    assert (out["temperature"], out["top_p"], out["top_k"], out["stream"]) == (0.2, 0.9, 40, False)
    assert out["chat_template_kwargs"] == {"enable_thinking": False}
    assert out["max_tokens"] == 4096  # llama-server's default when absent
    assert "stream_options" not in out
    assert convert({"tool_choice": {"type": "auto"}})["tool_choice"] == "auto"
    assert convert({"tool_choice": {"type": "tool", "name": "f"}})["tool_choice"] == "required"
    assert "tool_choice" not in convert({"tool_choice": {"type": "none"}})


def test_thinking_param_and_metadata() -> None:
    assert convert({"thinking": {"type": "enabled", "budget_tokens": 2048}})["thinking_budget_tokens"] == 2048
    assert convert({"thinking": {"type": "enabled"}})["thinking_budget_tokens"] == 10000
    assert "thinking_budget_tokens" not in convert({"thinking": {"type": "adaptive"}})
    assert "thinking_budget_tokens" not in convert({"thinking": {"type": "disabled"}})
    assert "__metadata_user_id" not in convert({"metadata": {"user_id": ""}})
    assert "__metadata_user_id" not in convert({"metadata": {}})


def test_ignored_fields_never_reach_llama_server() -> None:
    """What llama-server's conversion drops (its own knobs among them) is dropped here too."""
    body = {
        "id_slot": 0,
        "cache_prompt": False,
        "grammar": "root ::= x",
        "n_probs": 5,
        "n": 3,
        "context_management": {"edits": []},
        "service_tier": "auto",
        "output_config": {"effort": "high"},
        "cache_control": {"type": "ephemeral"},
        "container": "c",
        "mcp_servers": [],
        "something_new": {"x": 1},
    }
    out = convert(body, slot_id=1)
    assert set(out) == {"messages", "max_tokens", "id_slot"}
    assert out["id_slot"] == 1


# -- hostile input: one exception, stable codes -----------------------------------------------------------
BAD: list[tuple[Any, str]] = [
    ("not an object", INVALID_FIELD),
    ({}, MISSING_FIELD),
    ({"messages": "hi"}, INVALID_FIELD),
    ({"messages": [1]}, INVALID_FIELD),
    ({"messages": [{"role": "tool", "content": "x"}]}, INVALID_FIELD),
    ({"messages": [{"role": ["user"], "content": "x"}]}, INVALID_FIELD),
    ({"messages": [{"role": "user", "content": 5}]}, INVALID_FIELD),
    ({"messages": [{"role": "user", "content": {"type": "text"}}]}, INVALID_FIELD),
    ({"messages": [{"role": "user", "content": ["x"]}]}, INVALID_FIELD),
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, INVALID_FIELD),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": 1}]}]}, INVALID_FIELD),
    ({"messages": [{"role": "user", "content": [{"type": 7}]}]}, INVALID_FIELD),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]}, INVALID_FIELD),
    ({"messages": [{"role": "user", "content": "x", "name": 3}]}, INVALID_FIELD),
    ({"messages": [{"role": "assistant", "content": [{"type": "tool_use", "input": "x"}]}]}, INVALID_FIELD),
    (
        {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "input": {}, "id": 1}]}]},
        INVALID_FIELD,
    ),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": "u"}]}]}, INVALID_FIELD),
    (
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {"type": "url", "url": 1}}]}]},
        INVALID_FIELD,
    ),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "content": [3]}]}]}, INVALID_FIELD),
    ({"messages": [], "system": 5}, INVALID_FIELD),
    ({"messages": [], "system": [{"type": "text", "text": None}, "x"]}, INVALID_FIELD),
    ({"messages": [], "tools": {}}, INVALID_FIELD),
    ({"messages": [], "tools": [{"name": "f", "input_schema": "object"}]}, INVALID_FIELD),
    ({"messages": [], "tools": [{"name": 1}]}, INVALID_FIELD),
    ({"messages": [], "tool_choice": "auto"}, INVALID_FIELD),
    ({"messages": [], "stop_sequences": "END"}, INVALID_FIELD),
    ({"messages": [], "stop_sequences": [1]}, INVALID_FIELD),
    ({"messages": [], "max_tokens": "10"}, INVALID_FIELD),
    ({"messages": [], "max_tokens": True}, INVALID_FIELD),
    ({"messages": [], "max_tokens": 2**40}, INVALID_FIELD),
    ({"messages": [], "temperature": "hot"}, INVALID_FIELD),
    ({"messages": [], "temperature": float("nan")}, INVALID_FIELD),
    ({"messages": [], "top_k": 1.5}, INVALID_FIELD),
    ({"messages": [], "stream": "yes"}, INVALID_FIELD),
    ({"messages": [], "thinking": "enabled"}, INVALID_FIELD),
    ({"messages": [], "thinking": {"type": "enabled", "budget_tokens": "lots"}}, INVALID_FIELD),
    ({"messages": [], "metadata": "u"}, INVALID_FIELD),
    ({"messages": [], "chat_template_kwargs": []}, INVALID_FIELD),
    ({"messages": [], "output_config": {"format": {"type": "regex"}}}, INVALID_FIELD),
    ({"messages": [], "output_config": {"format": {"type": "json_schema"}}}, INVALID_FIELD),
    ({"messages": [], "output_config": []}, INVALID_FIELD),
]


def _deep(depth: int) -> Any:
    value: Any = {}
    for _ in range(depth):
        value = {"a": value}
    return value


BAD += [
    (
        {
            "messages": [
                {"role": "assistant", "content": [{"type": "tool_use", "input": _deep(MAX_DEPTH + 2)}]}
            ]
        },
        TOO_LARGE,
    ),
    ({"messages": [], "tools": [{"name": "f", "input_schema": _deep(10_000)}]}, TOO_LARGE),
    (
        {
            "messages": [
                {"role": "assistant", "content": [{"type": "tool_use", "input": {"x": float("inf")}}]}
            ]
        },
        INVALID_TEXT,
    ),
    (
        {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "input": {"x": 2**70}}]}]},
        INVALID_TEXT,
    ),
    ({"messages": [{"role": "user", "content": "\ud800"}]}, INVALID_TEXT),  # only on the wire
]


@pytest.mark.parametrize(("body", "code"), BAD)
def test_hostile_requests_get_one_error_with_a_stable_code(body: Any, code: str) -> None:
    with pytest.raises(ConversionError) as err:
        chat_request_bytes(body, structured_output=True)
    assert err.value.code == code
    assert err.value.status == 400
    shaped = json.loads(err.value.body())
    assert shaped["type"] == "error" and shaped["error"]["type"] == "invalid_request_error"
    assert shaped["error"]["code"] == code


def _mutations(value: Any, rng: random.Random) -> Any:
    """`value` with one node (at a random path) replaced by a value of a random type."""
    junk: list[Any] = [None, 0, -1, 2**65, 1.5, True, "", "x", [], [None], {}, {"type": "text"}, {"type": 3}]
    node, path = value, []
    while isinstance(node, dict | list) and node and rng.random() < 0.8:
        key = rng.choice(list(node)) if isinstance(node, dict) else rng.randrange(len(node))
        path.append(key)
        node = node[key]
    if not path:
        return rng.choice(junk)
    parent = value
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = rng.choice(junk)
    return value


@pytest.mark.parametrize("name", ["tools_turn2_continue", "ui_title"])
def test_mutated_recordings_convert_or_raise_conversion_error_only(name: str) -> None:
    body = load("claude", name).body
    rng = random.Random(28)
    codes = set()
    for _ in range(1500):
        mutated = _mutations(copy.deepcopy(body), rng)
        try:
            json.loads(chat_request_bytes(mutated, slot_id=0, structured_output=True))
        except ConversionError as exc:
            codes.add(exc.code)
    assert codes and codes <= CODES


# -- the non-streamed answer ------------------------------------------------------------------------------
def chat_answer(**message: Any) -> dict[str, Any]:
    return {
        "choices": [{"finish_reason": message.pop("finish", "stop"), "index": 0, "message": message}],
        "created": 1,
        "model": "m.gguf",
        "object": "chat.completion",
        "usage": {
            "completion_tokens": 7,
            "prompt_tokens": 100,
            "total_tokens": 107,
            "prompt_tokens_details": {"cached_tokens": 60},
        },
        "id": "chatcmpl-1",
        "timings": {"cache_n": 60, "prompt_n": 40, "predicted_n": 7},
    }


def test_answer_with_thinking_text_and_tool_calls() -> None:
    answer = chat_answer(
        role="assistant",
        content="Let me look.",
        reasoning_content="I should read it.",
        tool_calls=[
            {
                "type": "function",
                "id": "call_1",
                "function": {"name": "Read", "arguments": '{"file_path":"a.py"}'},
            },
            {"type": "function", "id": "call_2", "function": {"name": "Bad", "arguments": "{not json"}},
        ],
        finish="tool_calls",
    )
    message = chat_to_message(answer)
    assert message == {
        "id": "chatcmpl-1",
        "type": "message",
        "role": "assistant",
        "content": [
            {"type": "thinking", "thinking": "I should read it.", "signature": ""},
            {"type": "text", "text": "Let me look."},
            {"type": "tool_use", "id": "call_1", "name": "Read", "input": {"file_path": "a.py"}},
            {"type": "tool_use", "id": "call_2", "name": "Bad", "input": {}},
        ],
        "model": "m.gguf",
        "stop_reason": "tool_use",
        "stop_sequence": None,
        "usage": {"cache_read_input_tokens": 60, "input_tokens": 40, "output_tokens": 7},
    }
    check_message(message)


@pytest.mark.parametrize(
    ("finish", "reason"),
    [("stop", "end_turn"), ("length", "max_tokens"), ("tool_calls", "tool_use"), (None, "end_turn")],
)
def test_answer_stop_reasons(finish: Any, reason: str) -> None:
    message = chat_to_message(chat_answer(role="assistant", content="", finish=finish))
    assert message["stop_reason"] == reason and message["content"] == []
    check_message(message)


def test_answer_usage_from_timings_when_usage_is_missing() -> None:
    answer = chat_answer(role="assistant", content="x")
    del answer["usage"]
    assert chat_to_message(answer)["usage"] == {
        "cache_read_input_tokens": 60,
        "input_tokens": 40,
        "output_tokens": 7,
    }


@pytest.mark.parametrize(
    "raw", [b"", b"[]", b'{"choices": []}', b'{"choices": [1]}', b'{"choices": [{}]}', b"[" * 100_000]
)
def test_malformed_answers_are_upstream_errors(raw: bytes) -> None:
    with pytest.raises(ConversionError) as err:
        chat_answer_to_message_bytes(raw)
    assert err.value.code == UPSTREAM_INVALID and err.value.status == 502


def test_llama_server_error_in_anthropic_shape() -> None:
    raw = b'{"error":{"code":400,"message":"the request exceeds the available context size","type":"exceed_context_size_error"}}'
    assert json.loads(error_to_anthropic(400, raw)) == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": "the request exceeds the available context size",
        },
    }
    assert json.loads(error_to_anthropic(503, b"<html>"))["error"] == {
        "type": "overloaded_error",
        "message": "llama-server answered 503",
    }


# -- the stream ------------------------------------------------------------------------------------------
def chunk(delta: dict[str, Any] | None = None, *, finish: str | None = None, **extra: Any) -> bytes:
    data: dict[str, Any] = {
        "choices": [{"finish_reason": finish, "index": 0, "delta": delta if delta is not None else {}}],
        "created": 1,
        "id": "chatcmpl-s",
        "model": "m.gguf",
        "system_fingerprint": "b1",
        "object": "chat.completion.chunk",
        **extra,
    }
    return b"data: " + json.dumps(data, ensure_ascii=False).encode() + b"\n\n"


USAGE = {
    "completion_tokens": 9,
    "prompt_tokens": 50,
    "total_tokens": 59,
    "prompt_tokens_details": {"cached_tokens": 49},
}
TIMINGS = {"cache_n": 49, "prompt_n": 1, "predicted_n": 9, "prompt_ms": 1.0}


def usage_chunk() -> bytes:
    data = {
        "choices": [],
        "created": 1,
        "id": "chatcmpl-s",
        "model": "m.gguf",
        "object": "chat.completion.chunk",
        "usage": USAGE,
        "timings": TIMINGS,
    }
    return b"data: " + json.dumps(data).encode() + b"\n\n"


# As llama-server writes it (server_chat_msg_diff_to_json_oaicompat): a role chunk, reasoning, text, a tool
# call whose id and name come first and whose arguments come in pieces, a second tool call, the finish
# chunk, the usage chunk with timings, [DONE]; with a keep-alive comment in the middle.
STREAM = b"".join(
    [
        chunk({"role": "assistant", "content": None}),
        chunk({"reasoning_content": "Think"}),
        chunk({"reasoning_content": "ing é."}),
        b":\n\n",
        chunk({"content": "Reading "}),
        chunk({"content": "it."}),
        chunk(
            {"tool_calls": [{"index": 0, "id": "call_A", "type": "function", "function": {"name": "Read"}}]}
        ),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": '{"file_pa'}}]}),
        chunk({"tool_calls": [{"index": 0, "function": {"arguments": 'th":"a.py"}'}}]}),
        chunk(
            {
                "tool_calls": [
                    {
                        "index": 1,
                        "id": "call_B",
                        "type": "function",
                        "function": {"name": "Grep", "arguments": '{"q":1}'},
                    }
                ]
            }
        ),
        chunk(finish="tool_calls"),
        usage_chunk(),
        b"data: [DONE]\n\n",
    ]
)

EXPECTED = {
    "id": "chatcmpl-s",
    "type": "message",
    "role": "assistant",
    "content": [
        {"type": "thinking", "thinking": "Thinking é.", "signature": ""},
        {"type": "text", "text": "Reading it."},
        {"type": "tool_use", "id": "call_A", "name": "Read", "input": {"file_path": "a.py"}},
        {"type": "tool_use", "id": "call_B", "name": "Grep", "input": {"q": 1}},
    ],
    "model": "m.gguf",
    "stop_reason": "tool_use",
    "stop_sequence": None,
    "usage": {"cache_read_input_tokens": 49, "input_tokens": 1, "output_tokens": 9},
}


def run(pieces: list[bytes]) -> tuple[bytes, StreamTransducer]:
    t = StreamTransducer()
    out = b"".join(t.feed(p) for p in pieces) + t.close()
    return out, t


def test_stream_whole() -> None:
    out, t = run([STREAM])
    events = parse_sse(out)
    message = accumulate(events)
    assert message == EXPECTED
    check_message(message)
    assert not t.failed and t.timings == TIMINGS
    names = [n for n, _ in events]
    assert names[0] == "message_start" and names[-2:] == ["message_delta", "message_stop"]
    assert "ping" in names  # the keep-alive, once the message started
    assert out.count(b"event: message_stop") == 1


def test_stream_byte_by_byte_and_at_random_cuts_gives_the_same_events() -> None:
    whole, _ = run([STREAM])
    one_by_one, _ = run([STREAM[i : i + 1] for i in range(len(STREAM))])
    assert one_by_one == whole
    rng = random.Random(7)
    for _ in range(50):
        cuts = sorted(rng.sample(range(1, len(STREAM)), 12))
        pieces = [STREAM[a:b] for a, b in zip([0, *cuts], [*cuts, len(STREAM)], strict=True)]
        assert run(pieces)[0] == whole


def test_stream_is_incremental() -> None:
    """Each event comes out as soon as it is complete: nothing waits for the end of the answer."""
    t = StreamTransducer()
    first = chunk({"role": "assistant", "content": None}) + chunk({"content": "Hel"})
    out = t.feed(first[:-1])  # the second event not complete yet
    assert [n for n, _ in parse_sse(out)] == ["message_start"]
    out = t.feed(first[-1:])
    assert parse_sse(out) == [
        (
            "content_block_start",
            {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}},
        ),
        (
            "content_block_delta",
            {"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": "Hel"}},
        ),
    ]
    # a multi-byte character cut between two reads is not broken
    piece = chunk({"content": "é!"})
    cut = piece.index("é".encode()) + 1
    assert t.feed(piece[:cut]) == b""
    assert parse_sse(t.feed(piece[cut:]))[0][1]["delta"]["text"] == "é!"


def test_stream_without_usage_chunk_ends_at_done_with_timings() -> None:
    stream = chunk({"content": "hi"}) + chunk(finish="length", timings=TIMINGS) + b"data: [DONE]\n\n"
    message = accumulate(parse_sse(run([stream])[0]))
    assert message["stop_reason"] == "max_tokens"
    assert message["usage"] == {"cache_read_input_tokens": 49, "input_tokens": 1, "output_tokens": 9}


def test_stream_crlf_events_and_a_finish_without_done() -> None:
    stream = (chunk({"content": "hi"}) + chunk(finish="stop")).replace(b"\n\n", b"\r\n\r\n")
    out, t = run([stream])  # the stream ends without [DONE] or usage: close() ends the message
    message = accumulate(parse_sse(out))
    assert message["content"] == [{"type": "text", "text": "hi"}] and message["stop_reason"] == "end_turn"
    assert not t.failed


@pytest.mark.parametrize(
    "stream",
    [
        chunk({"content": "hi"}),  # cut before the finish chunk
        chunk({"content": "hi"}) + b"data: [DONE]\n\n",  # [DONE] with no finish
        chunk({"content": "hi"}) + b'data: {"error":{"code":500,"message":"boom","type":"server_error"}}\n\n',
        chunk({"content": "hi"}) + b"data: {not json\n\n",
        chunk({"content": "hi"}) + b"data: [1]\n\n",
        chunk({"tool_calls": [{"index": -1, "id": "x", "function": {"name": "f"}}]}),
        chunk({"content": "hi"}) + b"data: " + b"[" * 100_000 + b"\n\n",
    ],
)
def test_stream_failures_end_with_one_error_event_and_no_message_stop(stream: bytes) -> None:
    out, t = run([stream])
    events = parse_sse(out)
    assert t.failed
    assert events[-1][0] == "error" and events[-1][1]["type"] == "error"
    assert not any(n == "message_stop" for n, _ in events)
    assert t.feed(chunk({"content": "more"})) == b"" and t.close() == b""


def test_stream_upstream_error_keeps_its_message() -> None:
    err = b'data: {"error":{"code":400,"message":"context too long","type":"exceed_context_size_error"}}\n\n'
    events = parse_sse(run([err])[0])
    assert events == [
        (
            "error",
            {"type": "error", "error": {"type": "invalid_request_error", "message": "context too long"}},
        )
    ]


def test_stream_oversized_event_is_refused_without_holding_it() -> None:
    t = StreamTransducer()
    out = b""
    piece = b"data: " + b"x" * (1 << 20)
    for _ in range(MAX_EVENT_BYTES // len(piece) + 2):
        out += t.feed(piece)
    assert t.failed and len(t.buf) == 0
    assert parse_sse(out)[-1][0] == "error"


def test_stream_keepalive_before_the_message_stays_a_comment() -> None:
    t = StreamTransducer()
    assert t.feed(b":\n\n") == b":\n\n"
    assert parse_sse(t.feed(b":\n\n")) == []


# -- hostile bodies: the conversion raises ConversionError only -----------------------------------------------
def _converts_or_refuses(body: Any) -> None:
    try:
        chat_request_bytes(body, slot_id=0, cache_prompt=True, structured_output=True)
    except ConversionError as exc:
        assert exc.code in CODES and exc.status == 400


def test_any_type_confusion_at_any_field_converts_or_is_a_conversion_error() -> None:
    """Every path of every recorded and hand-written Messages body, replaced by each type confusion (an
    integer beyond a double as `temperature` raised OverflowError: a 500)."""
    for route, body in hostile.corpus(distinct=True):
        if route != hostile.MESSAGES:
            continue
        for path in hostile.paths(body):
            for value in hostile.CONFUSIONS:
                _converts_or_refuses(hostile.replaced(body, path, value))


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(hostile.mutated(routes=(hostile.MESSAGES,)))
def test_any_json_at_any_field_converts_or_is_a_conversion_error(case: tuple[str, Any]) -> None:
    _converts_or_refuses(case[1])
