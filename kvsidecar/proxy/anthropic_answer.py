"""A llama-server chat completion as the Anthropic message its `/v1/messages` answers (the non-streamed
answer; a stream is `kvsidecar.proxy.anthropic_stream`, which shares `stop_reason` and `usage`).
"""

from __future__ import annotations

import json
from typing import Any

from kvsidecar.proxy.anthropic_errors import MAX_INT, UPSTREAM_INVALID, ConversionError, dumps

STOP_REASONS = {"stop": "end_turn", "tool_calls": "tool_use", "length": "max_tokens"}


def stop_reason(finish_reason: Any) -> str:
    """llama-server's mapping: a stop word or EOS -> end_turn (tool_use with tool calls), else max_tokens."""
    return STOP_REASONS.get(finish_reason, "end_turn") if isinstance(finish_reason, str) else "end_turn"


def usage(chat_usage: Any, timings: Any) -> dict[str, int]:
    """Anthropic usage from the chat answer's `usage` (else its `timings`): `input_tokens` are the prompt
    tokens computed, `cache_read_input_tokens` those reused from the slot, as llama-server reports them."""
    prompt = cached = output = 0
    if isinstance(chat_usage, dict):
        prompt = _count(chat_usage.get("prompt_tokens"))
        output = _count(chat_usage.get("completion_tokens"))
        details = chat_usage.get("prompt_tokens_details")
        cached = _count(details.get("cached_tokens")) if isinstance(details, dict) else 0
    elif isinstance(timings, dict):
        cached = _count(timings.get("cache_n"))
        prompt = cached + _count(timings.get("prompt_n"))
        output = _count(timings.get("predicted_n"))
    cached = min(cached, prompt)
    return {"cache_read_input_tokens": cached, "input_tokens": prompt - cached, "output_tokens": output}


def _count(value: Any) -> int:
    return value if type(value) is int and 0 <= value <= MAX_INT else 0


def tool_input(arguments: Any) -> Any:
    """A tool call's arguments as the `input` object (llama-server: `{}` when they do not parse)."""
    if isinstance(arguments, dict):
        return arguments
    if not isinstance(arguments, str):
        return {}
    try:
        parsed = json.loads(arguments)
    except (ValueError, RecursionError):
        return {}
    return parsed


def chat_to_message(answer: Any) -> dict[str, Any]:
    """A (non-streamed) chat completion -> the Anthropic message llama-server's `/v1/messages` answers."""
    if not isinstance(answer, dict) or not isinstance(answer.get("choices"), list) or not answer["choices"]:
        raise ConversionError(UPSTREAM_INVALID, "llama-server's answer has no choices", status=502)
    choice = answer["choices"][0]
    message = choice.get("message") if isinstance(choice, dict) else None
    if not isinstance(message, dict):
        raise ConversionError(UPSTREAM_INVALID, "llama-server's answer has no message", status=502)
    content: list[dict[str, Any]] = []
    reasoning = message.get("reasoning_content")
    if isinstance(reasoning, str) and reasoning:
        content.append({"type": "thinking", "thinking": reasoning, "signature": ""})
    text = message.get("content")
    if isinstance(text, str) and text:
        content.append({"type": "text", "text": text})
    calls = message.get("tool_calls")
    for call in calls if isinstance(calls, list) else []:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict):
            continue
        content.append(
            {
                "type": "tool_use",
                "id": call.get("id") if isinstance(call.get("id"), str) else "",
                "name": function.get("name") if isinstance(function.get("name"), str) else "",
                "input": tool_input(function.get("arguments")),
            }
        )
    answer_id, model = answer.get("id"), answer.get("model")
    return {
        "id": answer_id if isinstance(answer_id, str) else "",
        "type": "message",
        "role": "assistant",
        "content": content,
        "model": model if isinstance(model, str) else "",
        "stop_reason": stop_reason(choice.get("finish_reason")),
        "stop_sequence": None,  # llama-server's chat answer does not say which stop sequence matched
        "usage": usage(answer.get("usage"), answer.get("timings")),
    }


def chat_answer_to_message_bytes(raw: bytes) -> bytes:
    """`chat_to_message` from and to bytes (the proxy's non-streamed answer)."""
    try:
        answer = json.loads(raw)
    except (ValueError, RecursionError) as exc:
        raise ConversionError(UPSTREAM_INVALID, "llama-server's answer is not JSON", status=502) from exc
    return dumps(chat_to_message(answer))
