"""Anthropic Messages <-> llama-server chat completions, so that `/v1/messages` can be pinned to a slot.

llama-server serves `/v1/messages` by converting the request to a chat completion
(`server_chat_convert_anthropic_to_oai`, tools/server/server-chat.cpp) and dropping every other field,
`id_slot` among them: on `--parallel N > 1` it picks the slot itself. The proxy instead converts the
request here, exactly as llama-server would, sends it to `/v1/chat/completions` with `id_slot` (and
`cache_prompt`) set, and converts the answer back (`kvsidecar.proxy.anthropic_answer`; streams:
`kvsidecar.proxy.anthropic_stream`). The errors of both directions are `kvsidecar.proxy.anthropic_errors`.

The key property: `messages_to_chat(body)` is the chat request llama-server itself would build from `body`,
so the prompt it renders, and the KV it computes, are token for token those of its own `/v1/messages`.
What that means, field by field (llama-server's behaviour, mirrored):

- `system` (a string or text blocks, concatenated with no separator) is the first message; a
  `x-anthropic-billing-header` block has its 5-character `cch=` stamp rewritten to `fffff`.
- `messages[]` with string or null content pass through (with `name`, `tool_call_id`,
  `reasoning_content`), `role: "system"` included. Block content: `text` and `image` (base64 -> a data URL,
  `url` kept) become content parts, `thinking` becomes `reasoning_content`, `tool_use` becomes
  `tool_calls` (arguments: the input as compact JSON), each `tool_result` a `role: "tool"` message after
  the message (text-only content collapses to one string; `is_error` is not passed on), any other block
  type (`redacted_thinking`, `document`, server tools, ...) is dropped. An assistant message without
  content, or one that converts to nothing, is dropped.
- `tools[]` -> functions (`input_schema` -> `parameters`, `{}` when absent); `tool_choice` auto -> `"auto"`,
  any/tool -> `"required"`, none -> unset; `stop_sequences` -> `stop`; `max_tokens` (default 4096);
  `temperature`, `top_p`, `top_k`, `stream`, `chat_template_kwargs` copied; `thinking` enabled ->
  `thinking_budget_tokens` (default 10000), adaptive/disabled -> nothing; `metadata.user_id` ->
  `__metadata_user_id` (unused by llama-server).
- Every other field is ignored, as llama-server ignores it: `cache_control`, `context_management`,
  `output_config.effort`, `service_tier`, `container`, `mcp_servers`, the query string (`?beta=true`), and
  llama-server's own knobs (`id_slot`, `grammar`, `n_probs`, ...): a client cannot reach them through
  `/v1/messages`, and cannot through the proxy either.

One addition, which changes nothing in the prompt: a stream asks for `stream_options.include_usage` (the
token counts of the answer's `message_delta`). `output_config.format` (json_schema, Claude Code's title
request) becomes `response_format` only when asked (`structured_output=True`): llama-server's own route
drops it, and on build 11434 with `--jinja` templates whose generation prompt the model's vocabulary does
not hold as one token, any `response_format` fails with 400 "Failed to initialize samplers" (seen with the
generated test model and Qwen3-Coder.jinja), so turning it on by default could fail a request that
llama-server's `/v1/messages` serves.

Every field is hostile input. Types are checked where llama-server would reject them or an Anthropic API
would (a wrong type never silently becomes a default), nesting and counts are bounded, and the only
exception is `ConversionError`, with a stable code and the JSON path of the field, that the proxy answers
as an Anthropic-shaped 400 (`ConversionError.body()`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from kvsidecar.proxy.anthropic_errors import (
    INVALID_FIELD,
    INVALID_TEXT,
    MAX_INT,
    MISSING_FIELD,
    TOO_LARGE,
    ConversionError,
    dumps,
)

MAX_DEPTH = 64  # JSON nesting in tool inputs, schemas, template kwargs (llama-server's parser recurses)
MAX_ITEMS = 100_000  # messages, blocks per message, tools, stop sequences
DEFAULT_MAX_TOKENS = 4096
DEFAULT_THINKING_BUDGET = 10000
ROLES = frozenset({"user", "assistant", "system"})
BILLING_PREFIX = b"x-anthropic-billing-header:"


# -- checks -----------------------------------------------------------------------------------------------
def _bad(path: str, what: str) -> ConversionError:
    return ConversionError(INVALID_FIELD, f"{path}: {what}", param=path)


def _str(value: Any, path: str, *, default: str | None = None) -> str:
    if value is None and default is not None:
        return default
    if not isinstance(value, str):
        raise _bad(path, "expected a string")
    return value


def _list(value: Any, path: str) -> list[Any]:
    if not isinstance(value, list):
        raise _bad(path, "expected an array")
    if len(value) > MAX_ITEMS:
        raise ConversionError(TOO_LARGE, f"{path}: more than {MAX_ITEMS} items", param=path)
    return value


def _obj(value: Any, path: str) -> Mapping[str, Any]:
    if not isinstance(value, dict):
        raise _bad(path, "expected an object")
    return value


def _int(value: Any, path: str, *, low: int, high: int = MAX_INT) -> int:
    if type(value) is not int or not low <= value <= high:
        raise _bad(path, f"expected an integer in [{low}, {high}]")
    return value


def _number(value: Any, path: str) -> float | int:
    # an integer is compared as one: math.isfinite() cannot take one beyond a double (10**400)
    finite = type(value) is int or (type(value) is float and math.isfinite(value))
    if not finite or abs(value) > MAX_INT:
        raise _bad(path, "expected a finite number")
    return value  # type: ignore[no-any-return]


def _scalar(item: Any, path: str) -> None:
    if type(item) is float and not math.isfinite(item):
        raise ConversionError(INVALID_TEXT, f"{path}: a number JSON cannot carry", param=path)
    if type(item) is int and not -(2**63) <= item <= 2**64 - 1:
        raise ConversionError(INVALID_TEXT, f"{path}: an integer beyond 64 bits", param=path)
    if item is not None and not isinstance(item, str | bool | int | float):
        raise _bad(path, "not a JSON value")


def _json_value(value: Any, path: str) -> Any:
    """Any JSON value, checked iteratively: depth, item counts, finite numbers, 64-bit integers."""
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        if depth > MAX_DEPTH:
            raise ConversionError(TOO_LARGE, f"{path}: nested deeper than {MAX_DEPTH}", param=path)
        if isinstance(item, dict | list):
            if len(item) > MAX_ITEMS:
                raise ConversionError(TOO_LARGE, f"{path}: more than {MAX_ITEMS} items", param=path)
            if isinstance(item, dict) and not all(isinstance(k, str) for k in item):
                raise _bad(path, "object keys must be strings")
            stack.extend((sub, depth + 1) for sub in (item.values() if isinstance(item, dict) else item))
        else:
            _scalar(item, path)
    return value


# -- the request ---------------------------------------------------------------------------------------------
def normalize_billing_header(text: str) -> str:
    """llama-server's rewrite of Claude Code's `cch=` stamp (5 bytes followed by `;`) to `fffff`, done on
    the UTF-8 bytes as llama-server does."""
    if not text.startswith(BILLING_PREFIX.decode()):
        return text
    raw = text.encode("utf-8", errors="surrogatepass")
    at = raw.find(b"cch=", len(BILLING_PREFIX))
    if at < 0:
        return text
    start = at + 4
    if start + 5 < len(raw) and raw[start + 5 : start + 6] == b";":
        raw = raw[:start] + b"fffff" + raw[start + 5 :]
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:  # the stamp cut a character in two: llama-server's bytes are broken
            raise ConversionError(
                INVALID_TEXT, "system: a cch= stamp that is not ASCII", param="system"
            ) from exc
    return text


def _system(value: Any) -> dict[str, Any] | None:
    if value is None:
        return None
    if isinstance(value, str):
        return {"role": "system", "content": normalize_billing_header(value)}
    text = ""
    for i, block in enumerate(_list(value, "system")):
        path = f"system[{i}]"
        block = _obj(block, path)
        if block.get("type") == "text":
            text += normalize_billing_header(_str(block.get("text"), f"{path}.text", default=""))
    return {"role": "system", "content": text}


def _image_url(source: Any, path: str) -> str | None:
    """The URL of an image source (a data URL for base64), None for a source type llama-server drops."""
    source = _obj(source if source is not None else {}, path)
    kind = source.get("type")
    if kind == "base64":
        media = _str(source.get("media_type"), f"{path}.media_type", default="image/jpeg")
        return f"data:{media};base64," + _str(source.get("data"), f"{path}.data", default="")
    if kind == "url":
        return _str(source.get("url"), f"{path}.url", default="")
    return None


def _tool_result(block: Mapping[str, Any], path: str) -> dict[str, Any]:
    tool_id = _str(block.get("tool_use_id"), f"{path}.tool_use_id", default="")
    content = block.get("content")
    if isinstance(content, str):
        return {"role": "tool", "tool_call_id": tool_id, "content": content}
    if not isinstance(content, list):  # absent, null, anything else: llama-server sends ""
        return {"role": "tool", "tool_call_id": tool_id, "content": ""}
    text, images = "", False
    parts: list[dict[str, Any]] = []
    for i, part in enumerate(_list(content, f"{path}.content")):
        where = f"{path}.content[{i}]"
        part = _obj(part, where)
        if part.get("type") == "text":
            piece = _str(part.get("text"), f"{where}.text", default="")
            text += piece
            parts.append({"type": "text", "text": piece})
        elif part.get("type") == "image":
            images = True  # even for a source it drops: llama-server then sends the parts
            url = _image_url(part.get("source"), f"{where}.source")
            if url is not None:
                parts.append({"type": "image_url", "image_url": {"url": url}})
    return {"role": "tool", "tool_call_id": tool_id, "content": parts if images else text}


def _tool_call(block: Mapping[str, Any], path: str) -> dict[str, Any]:
    arguments = block.get("input")
    arguments = {} if arguments is None else _json_value(_obj(arguments, f"{path}.input"), f"{path}.input")
    return {
        "id": _str(block.get("id"), f"{path}.id", default=""),
        "type": "function",
        "function": {
            "name": _str(block.get("name"), f"{path}.name", default=""),
            "arguments": dumps(arguments).decode("utf-8"),
        },
    }


def _blocks(role: str, content: list[Any], path: str) -> list[dict[str, Any]]:
    """One message's content blocks -> the message (if any is left) and then its tool results."""
    parts: list[dict[str, Any]] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    reasoning = ""
    for i, block in enumerate(_list(content, path)):
        where = f"{path}[{i}]"
        block = _obj(block, where)
        kind = block.get("type")
        if kind == "text":
            parts.append({"type": "text", "text": _str(block.get("text"), f"{where}.text")})
        elif kind == "thinking":
            reasoning += _str(block.get("thinking"), f"{where}.thinking", default="")
        elif kind == "image":
            url = _image_url(block.get("source"), f"{where}.source")
            if url is not None:
                parts.append({"type": "image_url", "image_url": {"url": url}})
        elif kind == "tool_use":
            calls.append(_tool_call(block, where))
        elif kind == "tool_result":
            results.append(_tool_result(block, where))
        elif kind is not None and not isinstance(kind, str):
            raise _bad(f"{where}.type", "expected a string")
        # any other type is dropped, as llama-server drops it
    out: list[dict[str, Any]] = []
    if parts or calls or reasoning:
        msg: dict[str, Any] = {"role": role, "content": parts if parts else ""}
        if calls:
            msg["tool_calls"] = calls
        if reasoning:
            msg["reasoning_content"] = reasoning
        out.append(msg)
    return out + results


_PASSED = ("name", "tool_call_id", "reasoning_content")  # what llama-server's parser reads from a message


def _message(value: Any, path: str) -> list[dict[str, Any]]:
    msg = _obj(value, path)
    role = msg.get("role")
    if not isinstance(role, str) or role not in ROLES:
        raise _bad(f"{path}.role", f"expected one of {sorted(ROLES)}")
    if "tool_calls" in msg:
        raise _bad(f"{path}.tool_calls", "not an Anthropic field (use tool_use blocks)")
    if "content" not in msg:
        if role == "assistant":
            return []  # llama-server skips it
        raise ConversionError(MISSING_FIELD, f"{path}.content: required", param=f"{path}.content")
    content = msg["content"]
    if isinstance(content, list):
        return _blocks(role, content, f"{path}.content")
    if content is not None and not isinstance(content, str):
        raise _bad(f"{path}.content", "expected a string or an array of blocks")
    out: dict[str, Any] = {"role": role, "content": content}
    for key in _PASSED:
        if key in msg and msg[key] is not None:
            out[key] = _str(msg[key], f"{path}.{key}")
    return [out]


def _tools(value: Any) -> list[dict[str, Any]]:
    out = []
    for i, tool in enumerate(_list(value, "tools")):
        path = f"tools[{i}]"
        tool = _obj(tool, path)
        schema = tool.get("input_schema")
        schema = {} if schema is None else _json_value(_obj(schema, f"{path}.input_schema"), path)
        function = {
            "name": _str(tool.get("name"), f"{path}.name", default=""),
            "description": _str(tool.get("description"), f"{path}.description", default=""),
            "parameters": schema,
        }
        out.append({"type": "function", "function": function})
    return out


def _tool_choice(value: Any) -> str | None:
    kind = _obj(value, "tool_choice").get("type")
    if kind == "auto":
        return "auto"
    if kind in ("any", "tool"):
        return "required"  # llama-server cannot force one named tool: any tool
    return None


def _stop(value: Any) -> list[str]:
    return [_str(s, f"stop_sequences[{i}]") for i, s in enumerate(_list(value, "stop_sequences"))]


def _sampling(body: Mapping[str, Any], out: dict[str, Any]) -> None:
    if "max_tokens" in body:
        limit = body["max_tokens"]
        out["max_tokens"] = None if limit is None else _int(limit, "max_tokens", low=-1, high=2**31 - 1)
    else:
        out["max_tokens"] = DEFAULT_MAX_TOKENS
    for key in ("temperature", "top_p"):
        if key in body:
            out[key] = None if body[key] is None else _number(body[key], key)
    if "top_k" in body:
        out["top_k"] = None if body["top_k"] is None else _int(body["top_k"], "top_k", low=-1, high=2**31 - 1)
    if "stream" in body:
        stream = body["stream"]
        if stream is not None and type(stream) is not bool:
            raise _bad("stream", "expected a boolean")
        out["stream"] = stream
    if "chat_template_kwargs" in body and body["chat_template_kwargs"] is not None:
        kwargs = _obj(body["chat_template_kwargs"], "chat_template_kwargs")
        out["chat_template_kwargs"] = _json_value(kwargs, "chat_template_kwargs")


def _extras(body: Mapping[str, Any], out: dict[str, Any]) -> None:
    thinking = body.get("thinking")
    if thinking is not None and _obj(thinking, "thinking").get("type") == "enabled":
        budget = thinking.get("budget_tokens")
        out["thinking_budget_tokens"] = (
            DEFAULT_THINKING_BUDGET if budget is None else _int(budget, "thinking.budget_tokens", low=-1)
        )
    metadata = body.get("metadata")
    if metadata is not None:
        user = _obj(metadata, "metadata").get("user_id")
        if isinstance(user, str) and user:
            out["__metadata_user_id"] = user


def _response_format(body: Mapping[str, Any]) -> dict[str, Any] | None:
    config = body.get("output_config")
    if config is None:
        return None
    form = _obj(config, "output_config").get("format")
    if form is None:
        return None
    form = _obj(form, "output_config.format")
    if form.get("type") != "json_schema":
        raise _bad("output_config.format.type", 'expected "json_schema"')
    schema = _json_value(
        _obj(form.get("schema"), "output_config.format.schema"), "output_config.format.schema"
    )
    return {"type": "json_schema", "json_schema": {"schema": schema}}


def _messages(body: Mapping[str, Any]) -> list[dict[str, Any]]:
    messages = []
    system = _system(body.get("system"))
    if system is not None:
        messages.append(system)
    if "messages" not in body:
        raise ConversionError(MISSING_FIELD, "messages: required", param="messages")
    for i, msg in enumerate(_list(body["messages"], "messages")):
        messages.extend(_message(msg, f"messages[{i}]"))
    return messages


def messages_to_chat(
    body: Any,
    *,
    slot_id: int | None = None,
    cache_prompt: bool | None = None,
    structured_output: bool = False,
) -> dict[str, Any]:
    """The chat-completions request llama-server builds from the Anthropic request `body` (see the module
    docstring), plus `id_slot`/`cache_prompt` when given, and `response_format` from `output_config.format`
    with `structured_output` (always checked). Raises only `ConversionError`."""
    body = _obj(body, "body")
    out: dict[str, Any] = {}
    if isinstance(body.get("model"), str):
        out["model"] = body["model"]  # llama-server answers with its own model name either way
    out["messages"] = _messages(body)
    if body.get("tools") is not None:
        out["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        choice = _tool_choice(body["tool_choice"])
        if choice is not None:
            out["tool_choice"] = choice
    if body.get("stop_sequences") is not None:
        out["stop"] = _stop(body["stop_sequences"])
    _sampling(body, out)
    _extras(body, out)
    response_format = _response_format(body)
    if structured_output and response_format is not None:
        out["response_format"] = response_format
    if out.get("stream") is True:
        out["stream_options"] = {"include_usage": True}
    if slot_id is not None:
        out["id_slot"] = _int(slot_id, "id_slot", low=0, high=2**31 - 1)
    if cache_prompt is not None:
        out["cache_prompt"] = bool(cache_prompt)
    return out


def chat_request_bytes(body: Any, **kw: Any) -> bytes:
    """`messages_to_chat` encoded for the wire (raises `ConversionError` on text JSON cannot carry)."""
    return dumps(messages_to_chat(body, **kw))
