"""Reading Anthropic Messages answers in tests: SSE events, the message a stream builds (as Anthropic's SDK
accumulates it), and a structural check of a message against the Messages API's shapes."""

from __future__ import annotations

import json
from typing import Any

STOP_REASONS = {"end_turn", "max_tokens", "stop_sequence", "tool_use", "pause_turn", "refusal"}
BLOCK_KEYS = {
    "text": {"type", "text"},
    "thinking": {"type", "thinking", "signature"},
    "tool_use": {"type", "id", "name", "input"},
}


def parse_sse(raw: bytes) -> list[tuple[str | None, Any]]:
    """(event name, parsed data) of each event; comments are skipped, as SSE clients skip them."""
    out: list[tuple[str | None, Any]] = []
    for block in raw.decode("utf-8").replace("\r\n", "\n").split("\n\n"):
        if not block.strip():
            continue
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith("event:"):
                name = line[6:].strip()
            elif line.startswith("data:"):
                data.append(line[5:].lstrip(" "))
        if data:
            parsed = json.loads("\n".join(data))
            assert name is None or parsed.get("type") == name, (name, parsed)
            out.append((name, parsed))
    return out


def accumulate(events: list[tuple[str | None, Any]]) -> dict[str, Any]:
    """The message an Anthropic stream describes; asserts the event grammar on the way (message_start
    first, blocks opened in index order, deltas only to open blocks of their kind, message_stop last)."""
    assert events and events[0][0] == "message_start", events[:1]
    message = dict(events[0][1]["message"])
    message["content"] = []
    message["usage"] = dict(message["usage"])
    open_blocks: set[int] = set()
    partial: dict[int, str] = {}
    ended = False
    for name, data in events[1:]:
        assert not ended, f"{name} after message_stop"
        if name == "ping":
            continue
        if name == "content_block_start":
            assert data["index"] == len(message["content"]), data
            message["content"].append(dict(data["content_block"]))
            open_blocks.add(data["index"])
        elif name == "content_block_delta":
            _apply(message["content"], open_blocks, partial, data)
        elif name == "content_block_stop":
            index = data["index"]
            assert index in open_blocks, data
            open_blocks.discard(index)
            if index in partial:
                message["content"][index]["input"] = json.loads(partial.pop(index))
        elif name == "message_delta":
            message.update(data["delta"])
            message["usage"].update(data["usage"])
        elif name == "message_stop":
            ended = True
        else:
            raise AssertionError(f"unexpected event {name}: {data}")
    assert ended, "no message_stop"
    assert not open_blocks, f"blocks never stopped: {open_blocks}"
    return message


def _apply(content: list[dict[str, Any]], open_blocks: set[int], partial: dict[int, str], data: Any) -> None:
    index, delta = data["index"], data["delta"]
    assert index in open_blocks, data
    block = content[index]
    kinds = {
        "text_delta": ("text", "text"),
        "thinking_delta": ("thinking", "thinking"),
        "signature_delta": ("thinking", "signature"),
        "input_json_delta": ("tool_use", "partial_json"),
    }
    kind, key = kinds[delta["type"]]
    assert block["type"] == kind, (block, delta)
    if key == "partial_json":
        partial[index] = partial.get(index, "") + delta[key]
    elif key == "signature":
        block["signature"] = delta[key]
    else:
        block[key] = block.get(key, "") + delta[key]


def check_message(message: Any) -> None:
    """A valid Anthropic Messages answer (the fields Anthropic's SDK types require)."""
    assert isinstance(message, dict)
    assert message["type"] == "message" and message["role"] == "assistant"
    assert isinstance(message["id"], str) and isinstance(message["model"], str)
    assert message["stop_reason"] in STOP_REASONS, message["stop_reason"]
    assert message["stop_sequence"] is None or isinstance(message["stop_sequence"], str)
    usage = message["usage"]
    for key in ("input_tokens", "output_tokens"):
        assert type(usage[key]) is int and usage[key] >= 0, usage
    assert type(usage.get("cache_read_input_tokens", 0)) is int
    for block in message["content"]:
        keys = BLOCK_KEYS[block["type"]]
        assert keys <= set(block), block
        if block["type"] == "tool_use":
            assert isinstance(block["input"], dict)
        else:
            assert isinstance(block[block["type"]], str)
