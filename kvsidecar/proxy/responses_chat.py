"""OpenAI Responses -> the chat-completions body llama-server builds from it, so that a Responses request's
prompt (and so its tokens, `kvsidecar.proxy.prompt_tokens`) is known before it runs.

The proxy forwards `/v1/responses` to llama-server as it came (pinned): llama-server converts it itself
(`server_chat_convert_responses_to_chatcmpl`, tools/server/server-chat.cpp, build 11434) and renders the
result like any chat completion. This module builds the same chat body, rule for rule, for knowing the prompt
only; nothing here is sent in place of the client's request. Codex CLI uses this route (`store: false`, the
whole history every time).

What llama-server does, and so what this does:

- The chat body is the Responses body with `input` and `instructions` taken out and `messages` put in; every
  other field stays (so `tool_choice`, `parallel_tool_calls`, `chat_template_kwargs` reach the render).
  `max_output_tokens` becomes `max_tokens`, `reasoning.effort` becomes `reasoning_effort`.
- `instructions` (a string; any other value counts as "") is a first `system` message. A string `input` is
  one `user` message. A `previous_response_id` is refused (llama-server keeps no responses).
- Each item of an array `input`, in order, a string `content` first turned into one `input_text` part:
  - a `user`, `system` or `developer` message with parts: `input_text` -> a text part, `input_image` -> an
    `image_url` part; its `type` and `status` dropped, every other field kept;
  - an `assistant` item of type `message`: `output_text`/`input_text` -> text parts, `refusal` -> a
    refusal part; appended to the previous message when that is an assistant's, else a new message;
  - `function_call` -> a tool call (`call_id` its id) of the previous assistant message, else of a new one;
  - `function_call_output` -> a `tool` message (string output, or `input_text`/`input_image` parts);
  - `reasoning` (with a `summary` array) -> the first content part's text as `reasoning_content` of the
    previous assistant message, else of a new one with empty content;
  - anything else is refused.
- `tools`: only `type: "function"` tools are kept, as `{"type": "function", "function": <the tool without
  its type, with strict: true unless given>}`; the list is dropped when none is left.

Where llama-server answers 400, `NotConvertible` is raised with its message. Input is hostile: every field
is type-checked before use, nothing recurses into client data, and the client's objects are never mutated.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_USER_ROLES = frozenset({"user", "system", "developer"})


class NotConvertible(ValueError):
    """A Responses body llama-server refuses to convert (HTTP 400 there): the message is llama-server's."""


def _string(obj: Any, key: str) -> bool:
    return isinstance(obj, Mapping) and isinstance(obj.get(key), str)


def _array(obj: Any, key: str) -> bool:
    return isinstance(obj, Mapping) and isinstance(obj.get(key), list)


def _str_value(obj: Any, key: str) -> str:
    """`json_value(obj, key, std::string())`: the string, or "" when absent, null or of another type."""
    value = obj.get(key) if isinstance(obj, Mapping) else None
    return value if isinstance(value, str) else ""


def _input_parts(parts: list[Any]) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for part in parts:
        kind = _str_value(part, "type")
        if kind == "input_text":
            if "text" not in part:
                raise NotConvertible("'Input text' requires 'text'")
            out.append({"text": part["text"], "type": "text"})
        elif kind == "input_image":
            if "image_url" not in part:
                raise NotConvertible("'image_url' is required")
            out.append({"image_url": {"url": part["image_url"]}, "type": "image_url"})
        elif kind == "input_file":
            raise NotConvertible("'input_file' is not supported by llamacpp at this moment")
        else:
            raise NotConvertible("'type' must be one of 'input_text', 'input_image', or 'input_file'")
    return out


def _output_parts(item: dict[str, Any]) -> list[dict[str, Any]]:
    content = item.get("content")
    if isinstance(content, str):
        return [{"text": content, "type": "text"}]
    out: list[dict[str, Any]] = []
    for part in content if isinstance(content, list) else ():
        kind = _str_value(part, "type")
        if kind in ("output_text", "input_text"):
            if not _string(part, "text"):
                raise NotConvertible("'Output text' requires 'text'")
            out.append({"text": part["text"], "type": "text"})
        elif kind == "refusal":
            if not _string(part, "refusal"):
                raise NotConvertible("'Refusal' requires 'refusal'")
            out.append({"refusal": part["refusal"], "type": "refusal"})
        else:
            raise NotConvertible("'type' must be one of 'output_text' or 'refusal'")
    return out


def _tool_output(item: dict[str, Any]) -> dict[str, Any]:
    output = item["output"]
    if isinstance(output, list):
        parts = []
        for part in output:
            if not isinstance(part, dict) or "type" not in part:
                raise NotConvertible("Output of tool call missing 'type' field")
            if part["type"] not in ("input_text", "input_image"):
                raise NotConvertible("Output of tool call should be 'Input text' or 'Input image'")
            part = dict(part)
            if part["type"] == "input_text":
                part["type"] = "text"
            else:
                if "image_url" not in part:
                    raise NotConvertible("'image_url' is required")
                part["type"] = "image_url"
                part["image_url"] = {"url": part["image_url"]}
            parts.append(part)
        output = parts
    return {"content": output, "role": "tool", "tool_call_id": item["call_id"]}


def _reasoning_text(item: dict[str, Any]) -> Any:
    content = item.get("content")
    if not isinstance(content, list):
        raise NotConvertible("item['content'] is not an array")
    if not content:
        raise NotConvertible("item['content'] is empty")
    if not _string(content[0], "text"):
        raise NotConvertible("item['content']['text'] is not a string")
    return content[0]["text"]


def _typed(item: dict[str, Any], kind: str) -> bool:
    return _string(item, "type") and item["type"] == kind


def _is_function_call(item: dict[str, Any]) -> bool:
    names = ("arguments", "call_id", "name")
    return all(_string(item, k) for k in names) and _typed(item, "function_call")


def _is_function_output(item: dict[str, Any]) -> bool:
    has_output = _string(item, "output") or _array(item, "output")
    return _string(item, "call_id") and has_output and _typed(item, "function_call_output")


def _add_item(raw: Any, messages: list[dict[str, Any]]) -> None:
    """One item of an array `input`, as llama-server's loop takes it (the branches in its order)."""
    if not isinstance(raw, Mapping):
        raise NotConvertible("Cannot determine type of 'item'")
    item = dict(raw)
    prev = messages[-1] if messages and messages[-1].get("role") == "assistant" else None
    if _string(item, "content"):
        item["content"] = [{"text": item["content"], "type": "input_text"}]
    role = item.get("role") if _string(item, "role") else None
    if _array(item, "content") and role in _USER_ROLES:
        item.pop("type", None)
        item.pop("status", None)
        item["content"] = _input_parts(item["content"])
        messages.append(item)
    elif role == "assistant" and _typed(item, "message"):
        parts = _output_parts(item)
        if prev is not None:
            content = prev.get("content")
            prev["content"] = [*content, *parts] if isinstance(content, list) else parts
        else:
            item.pop("status", None)
            item.pop("type", None)
            item["content"] = parts
            messages.append(item)
    elif _is_function_call(item):
        call = {
            "function": {"arguments": item["arguments"], "name": item["name"]},
            "id": item["call_id"],
            "type": "function",
        }
        if prev is not None:  # a new list: the previous item's own may be the client's
            calls = prev.get("tool_calls")
            prev["tool_calls"] = [*calls, call] if isinstance(calls, list) else [call]
        else:
            messages.append({"role": "assistant", "tool_calls": [call]})
    elif _is_function_output(item):
        messages.append(_tool_output(item))
    elif _array(item, "summary") and _typed(item, "reasoning"):
        text = _reasoning_text(item)
        if prev is not None:
            prev["reasoning_content"] = text
        else:
            messages.append({"role": "assistant", "content": [], "reasoning_content": text})
    else:
        raise NotConvertible("Cannot determine type of 'item'")


def _tools(value: Any) -> list[dict[str, Any]]:
    if not isinstance(value, list):
        raise NotConvertible("'tools' must be an array of objects")
    out = []
    for tool in value:
        if _str_value(tool, "type") != "function":
            continue  # llama-server skips other tool types (web search, namespaces), with a warning
        function = {k: v for k, v in tool.items() if k != "type"}
        function.setdefault("strict", True)
        out.append({"type": "function", "function": function})
    return out


def responses_to_chat(body: Mapping[str, Any]) -> dict[str, Any]:
    """The chat-completions body llama-server converts the Responses `body` to (see the module docstring);
    raises `NotConvertible` where llama-server answers 400."""
    if not isinstance(body, Mapping):
        raise NotConvertible("the body is not a JSON object")
    if "input" not in body:
        raise NotConvertible("'input' is required")
    if _str_value(body, "previous_response_id"):
        raise NotConvertible("llama.cpp does not support 'previous_response_id'.")
    chat = {k: v for k, v in body.items() if k not in ("input", "instructions")}
    messages: list[dict[str, Any]] = []
    if "instructions" in body:
        messages.append({"role": "system", "content": _str_value(body, "instructions")})
    value = body["input"]
    if isinstance(value, str):
        messages.append({"role": "user", "content": value})
    elif isinstance(value, list):
        for raw in value:
            _add_item(raw, messages)
    else:
        raise NotConvertible("'input' must be a string or array of objects")
    chat["messages"] = messages
    _top_level(body, chat)
    return chat


def _top_level(body: Mapping[str, Any], chat: dict[str, Any]) -> None:
    """`tools`, `max_output_tokens` and `reasoning` into their chat-completions forms."""
    if "tools" in body:
        tools = _tools(body["tools"])
        del chat["tools"]
        if tools:
            chat["tools"] = tools
    if "max_output_tokens" in body:
        del chat["max_output_tokens"]
        chat["max_tokens"] = body["max_output_tokens"]
    if "reasoning" in body:
        reasoning = body["reasoning"]
        if isinstance(reasoning, dict) and "effort" in reasoning:
            chat["reasoning_effort"] = reasoning["effort"]
        del chat["reasoning"]
