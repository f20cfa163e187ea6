"""kvsidecar.proxy.responses_chat: the chat body llama-server converts a Responses request to, rule by rule
(`server_chat_convert_responses_to_chatcmpl`, build 11434). The same conversions against llama-server's own
token counts and saved slots: tests/integration/test_prompt_tokens_real.py."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from kvsidecar.proxy.responses_chat import NotConvertible, responses_to_chat
from tests.unit.client_fixtures import posts


def convert(**body: Any) -> dict[str, Any]:
    return responses_to_chat(body)


def messages(*items: Any) -> list[dict[str, Any]]:
    return list(convert(input=list(items))["messages"])


def text(t: str) -> dict[str, str]:
    return {"text": t, "type": "text"}


ASSISTANT = {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "ok"}]}
CALL = {"type": "function_call", "name": "ls", "arguments": "{}", "call_id": "c1"}
TOOL_CALL = {"function": {"arguments": "{}", "name": "ls"}, "id": "c1", "type": "function"}


def test_a_string_input_and_instructions() -> None:
    chat = convert(model="m", instructions="be brief", input="hi", stream=True)
    assert chat == {
        "model": "m",
        "stream": True,
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
    }


@pytest.mark.parametrize("value", [None, 5, ["x"], {"a": 1}])
def test_instructions_that_are_not_a_string_are_an_empty_system_message(value: Any) -> None:
    assert convert(instructions=value, input="x")["messages"][0] == {"role": "system", "content": ""}


@pytest.mark.parametrize(
    ("body", "said"),
    [
        ({}, "'input' is required"),
        ({"input": "x", "previous_response_id": "resp_1"}, "previous_response_id"),
        ({"input": 5}, "'input' must be a string or array of objects"),
        ({"input": None}, "'input' must be a string or array of objects"),
        ({"input": ["x"]}, "Cannot determine type of 'item'"),
        ({"input": [{"type": "function_call", "name": "x"}]}, "Cannot determine type of 'item'"),
        ({"input": [{"role": "assistant", "content": "x"}]}, "Cannot determine type of 'item'"),  # no type
        ({"input": "x", "tools": None}, "'tools' must be an array of objects"),
        ({"input": "x", "tools": {"type": "function"}}, "'tools' must be an array of objects"),
    ],
)
def test_what_llama_server_refuses_is_refused_with_its_message(body: dict[str, Any], said: str) -> None:
    with pytest.raises(NotConvertible, match=said.replace("(", r"\(")):
        responses_to_chat(body)


@pytest.mark.parametrize("value", ["", None, 7])
def test_a_previous_response_id_that_is_not_a_nonempty_string_is_ignored(value: Any) -> None:
    assert "previous_response_id" in convert(input="x", previous_response_id=value)


@pytest.mark.parametrize("role", ["user", "system", "developer"])
def test_an_input_message_keeps_its_fields_with_text_parts(role: str) -> None:
    item = {"type": "message", "id": "msg_1", "role": role, "status": "done", "content": "hello"}
    [msg] = messages(item)
    assert msg == {"id": "msg_1", "role": role, "content": [text("hello")]}
    assert list(msg) == ["id", "role", "content"]  # in place, as llama-server's object keeps its order


def test_input_parts() -> None:
    parts = [
        {"type": "input_text", "text": "a"},
        {"type": "input_image", "image_url": "data:image/png;base64,AA", "detail": "auto"},
    ]
    [msg] = messages({"role": "user", "content": parts})
    assert msg["content"] == [
        text("a"),
        {"image_url": {"url": "data:image/png;base64,AA"}, "type": "image_url"},
    ]


@pytest.mark.parametrize(
    ("part", "said"),
    [
        ({"type": "input_text"}, "'Input text' requires 'text'"),
        ({"type": "input_image"}, "'image_url' is required"),
        ({"type": "input_file", "file_id": "f"}, "'input_file' is not supported"),
        ({"type": "output_text", "text": "x"}, "'type' must be one of 'input_text'"),
        ({"text": "x"}, "'type' must be one of 'input_text'"),
        ("x", "'type' must be one of 'input_text'"),
    ],
)
def test_input_parts_llama_server_refuses(part: Any, said: str) -> None:
    with pytest.raises(NotConvertible, match=said):
        messages({"role": "user", "content": [part]})


def test_assistant_parts_and_merging() -> None:
    second = {
        "type": "message",
        "role": "assistant",
        "content": [{"type": "refusal", "refusal": "no"}, {"type": "input_text", "text": "b"}],
    }
    msgs = messages({"role": "user", "content": "q"}, ASSISTANT, second)
    assert msgs[1] == {
        "role": "assistant",
        "content": [text("ok"), {"refusal": "no", "type": "refusal"}, text("b")],
    }
    assert len(msgs) == 2


@pytest.mark.parametrize(
    ("part", "said"),
    [
        ({"type": "output_text", "text": 5}, "'Output text' requires 'text'"),
        ({"type": "refusal"}, "'Refusal' requires 'refusal'"),
        ({"type": "input_image", "image_url": "x"}, "'type' must be one of 'output_text' or 'refusal'"),
    ],
)
def test_assistant_parts_llama_server_refuses(part: Any, said: str) -> None:
    with pytest.raises(NotConvertible, match=said):
        messages({"type": "message", "role": "assistant", "content": [part]})


def test_an_assistant_message_without_content_has_none() -> None:
    assert messages({"type": "message", "role": "assistant", "status": "x"}) == [
        {"role": "assistant", "content": []}
    ]


def test_function_calls_join_the_assistant_message_before_them() -> None:
    second = {**CALL, "call_id": "c2", "name": "cat"}
    msgs = messages({"role": "user", "content": "q"}, ASSISTANT, CALL, second)
    assert msgs[1] == {
        "role": "assistant",
        "content": [text("ok")],
        "tool_calls": [TOOL_CALL, {**TOOL_CALL, "id": "c2", "function": {"arguments": "{}", "name": "cat"}}],
    }
    assert messages({"role": "user", "content": "q"}, CALL)[1] == {
        "role": "assistant",
        "tool_calls": [TOOL_CALL],
    }


def test_tool_outputs() -> None:
    out = {"type": "function_call_output", "call_id": "c1", "output": "done"}
    parts = [{"type": "input_text", "text": "a"}, {"type": "input_image", "image_url": "u"}]
    rich = {"type": "function_call_output", "call_id": "c1", "output": parts}
    msgs = messages(CALL, out, rich)
    assert msgs[1] == {"content": "done", "role": "tool", "tool_call_id": "c1"}
    assert msgs[2] == {
        "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "u"}}],
        "role": "tool",
        "tool_call_id": "c1",
    }


@pytest.mark.parametrize(
    ("part", "said"),
    [
        ({"text": "a"}, "missing 'type' field"),
        ("a", "missing 'type' field"),
        ({"type": "output_text", "text": "a"}, "should be 'Input text' or 'Input image'"),
        ({"type": 3}, "should be 'Input text' or 'Input image'"),
        ({"type": "input_image"}, "'image_url' is required"),
    ],
)
def test_tool_output_parts_llama_server_refuses(part: Any, said: str) -> None:
    with pytest.raises(NotConvertible, match=said):
        messages({"type": "function_call_output", "call_id": "c", "output": [part]})


def test_reasoning_becomes_reasoning_content() -> None:
    reasoning = {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "think"}]}
    assert messages(reasoning, ASSISTANT, CALL) == [
        {
            "role": "assistant",
            "content": [text("ok")],
            "reasoning_content": "think",
            "tool_calls": [TOOL_CALL],
        }
    ]
    assert messages({"role": "user", "content": "q"}, ASSISTANT, reasoning)[1]["reasoning_content"] == "think"
    # a string content is one input_text part first, as for every item
    as_string = {"type": "reasoning", "summary": [], "content": "plain"}
    assert messages(as_string) == [{"role": "assistant", "content": [], "reasoning_content": "plain"}]


@pytest.mark.parametrize(
    ("content", "said"),
    [
        (None, "is not an array"),
        ([], "is empty"),
        ([{"type": "x"}], "is not a string"),
    ],
)
def test_reasoning_llama_server_refuses(content: Any, said: str) -> None:
    item: dict[str, Any] = {"type": "reasoning", "summary": []}
    if content is not None:
        item["content"] = content
    with pytest.raises(NotConvertible, match=said):
        messages(item)


def test_tools_only_functions_with_strict_by_default() -> None:
    tools = [
        {"type": "function", "name": "a", "parameters": {"type": "object"}},
        {"type": "function", "name": "b", "strict": False},
        {"type": "web_search"},
        {"type": "namespace", "name": "n", "tools": []},
        "junk",
        {"name": "no type"},
    ]
    chat = convert(input="x", tools=tools)
    assert chat["tools"] == [
        {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}, "strict": True}},
        {"type": "function", "function": {"name": "b", "strict": False}},
    ]
    assert "tools" not in convert(input="x", tools=[{"type": "web_search"}])


def test_the_other_fields() -> None:
    chat = convert(
        input="x",
        max_output_tokens=7,
        reasoning={"effort": "low", "summary": "auto"},
        tool_choice="auto",
        parallel_tool_calls=True,
        store=False,
        include=["reasoning.encrypted_content"],
        chat_template_kwargs={"enable_thinking": False},
    )
    assert chat["max_tokens"] == 7 and "max_output_tokens" not in chat
    assert chat["reasoning_effort"] == "low" and "reasoning" not in chat
    assert {k: chat[k] for k in ("tool_choice", "parallel_tool_calls", "store", "chat_template_kwargs")} == {
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "store": False,
        "chat_template_kwargs": {"enable_thinking": False},
    }
    for reasoning in ({"summary": "auto"}, "high", None):
        assert not {"reasoning", "reasoning_effort"} & set(convert(input="x", reasoning=reasoning))


def test_the_clients_body_is_never_changed() -> None:
    own_calls = {**ASSISTANT, "tool_calls": [{"id": "mine"}]}
    body = {
        "input": [
            {"role": "user", "type": "message", "status": "s", "content": "q"},
            own_calls,
            CALL,
            {"type": "reasoning", "summary": [], "content": [{"text": "t"}]},
            {
                "type": "function_call_output",
                "call_id": "c1",
                "output": [{"type": "input_image", "image_url": "u"}],
            },
        ],
        "instructions": "s",
        "tools": [{"type": "function", "name": "a"}],
        "reasoning": {"effort": "high"},
        "max_output_tokens": 3,
    }
    before = copy.deepcopy(body)
    chat = responses_to_chat(body)
    assert body == before
    assert chat["messages"][2]["tool_calls"] == [{"id": "mine"}, TOOL_CALL]


@pytest.mark.parametrize("rec", [r for r in posts() if r.path.endswith("/responses")], ids=lambda r: r.name)
def test_every_recorded_codex_request_converts(rec: Any) -> None:
    chat = responses_to_chat(rec.body)
    assert chat["messages"] and {m["role"] for m in chat["messages"]} <= {
        "system",
        "developer",
        "user",
        "assistant",
        "tool",
    }
    assert all(t["type"] == "function" for t in chat.get("tools", []))
