"""A streamed chat completion (OpenAI SSE) turned into an Anthropic Messages stream, incrementally.

`StreamTransducer.feed(bytes) -> bytes` takes llama-server's `/v1/chat/completions` stream as it arrives,
cut anywhere, and returns the Anthropic events complete so far; `close()` ends it. Only the event being
read is held (bounded by `MAX_EVENT_BYTES`), never the answer.

Events, as llama-server's own `/v1/messages` stream sends them: `message_start` (at the first chunk; its
usage is not known yet, so `input_tokens` 0), then content blocks in order, one open at a time: `thinking`
(`thinking_delta`, closed by an empty `signature_delta` as llama-server does), `text` (`text_delta`),
`tool_use` (`input_json_delta`, one block per tool call index); `message_delta` with `stop_reason` and the
whole usage (`input_tokens`, `cache_read_input_tokens`, `output_tokens`, from the usage chunk that
`stream_options.include_usage` asks for, else `timings`); `message_stop`. llama-server's keep-alive comment
becomes a `ping` event once the message has started (a comment before).

An upstream error event, or a stream that does not parse, becomes one Anthropic `error` event and ends the
stream (`failed` is set, and no `message_stop` follows: the client never takes a cut answer for a whole
one). A stream that ends before its finish chunk gets the same from `close()`. Nothing here raises.
"""

from __future__ import annotations

import json
from typing import Any

from kvsidecar.proxy.anthropic_answer import stop_reason, usage
from kvsidecar.proxy.anthropic_errors import ERROR_TYPES

MAX_EVENT_BYTES = 8 << 20  # one SSE event of llama-server's stream: a chunk of a few tokens, or an error
MAX_BLOCKS = 4096  # content blocks of one answer


def sse(event: str, data: dict[str, Any]) -> bytes:
    body = json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode("utf-8", errors="replace")
    return b"event: " + event.encode() + b"\ndata: " + body + b"\n\n"


class StreamTransducer:
    """One answer's stream. Single owner: the request that forwards it."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.started = False  # message_start sent
        self.done = False  # message_stop or error sent: everything after is dropped
        self.failed = False  # ended by an error event
        self.open: tuple[str, Any] | None = (
            None  # the open block: ("text" | "thinking", None) | ("tool", index)
        )
        self.index = -1  # the open (or last) block's Anthropic index
        self.tools: dict[int, int] = {}  # tool call index -> its block's index
        self.finish: str | None = None  # finish_reason, once seen
        self.usage: dict[str, Any] | None = None
        self.timings: dict[str, Any] | None = None  # llama-server's last `timings` (prompt_n, cache_n, ...)
        self.id, self.model = "", ""

    # -- bytes in, bytes out ---------------------------------------------------------------------------
    def feed(self, chunk: bytes) -> bytes:
        if self.done:
            return b""
        self.buf += chunk
        out = bytearray()
        while not self.done:
            end, size = self._boundary()
            if end < 0:
                if len(self.buf) > MAX_EVENT_BYTES:
                    self.buf.clear()
                    out += self._fail("an event of llama-server's stream is over the size bound")
                break
            raw = bytes(self.buf[:end])
            del self.buf[: end + size]
            out += self._event(raw)
        return bytes(out)

    def close(self) -> bytes:
        """The end of the upstream stream: the message's end if its finish chunk came, else an error."""
        if self.done:
            return b""
        out = self.feed(b"\n\n") if self.buf.strip() else b""
        if self.done:
            return out
        if self.finish is not None:
            return out + self._end()
        return out + self._fail("llama-server's stream ended before the answer did")

    def _boundary(self) -> tuple[int, int]:
        """Where the first complete event ends (at a blank line, LF or CRLF), and the separator's size."""
        lf, crlf = self.buf.find(b"\n\n"), self.buf.find(b"\r\n\r\n")
        if crlf >= 0 and (lf < 0 or crlf < lf):
            return crlf, 4
        return lf, 2

    def _event(self, raw: bytes) -> bytes:
        lines = raw.replace(b"\r\n", b"\n").split(b"\n")
        data = [ln[5:].lstrip(b" ") for ln in lines if ln.startswith(b"data:")]
        if not data:
            if any(ln.startswith(b":") for ln in lines):  # llama-server's keep-alive
                return sse("ping", {"type": "ping"}) if self.started else b":\n\n"
            return b""
        payload = b"\n".join(data)
        if payload.strip() == b"[DONE]":
            return (
                self._end() if self.finish is not None else self._fail("the stream ended without an answer")
            )
        try:
            chunk = json.loads(payload)
        except (ValueError, RecursionError):
            return self._fail("llama-server sent an event that is not JSON")
        if not isinstance(chunk, dict):
            return self._fail("llama-server sent an event that is not an object")
        if "error" in chunk:
            return self._upstream_error(chunk["error"])
        return self._chunk(chunk)

    # -- one chunk ----------------------------------------------------------------------------------------
    def _chunk(self, chunk: dict[str, Any]) -> bytes:
        out = bytearray()
        if not self.started:
            out += self._start(chunk)
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        if isinstance(chunk.get("timings"), dict):
            self.timings = chunk["timings"]
        choices = chunk.get("choices")
        choice = choices[0] if isinstance(choices, list) and choices else None
        if isinstance(choice, dict):
            delta = choice.get("delta")
            if isinstance(delta, dict):
                out += self._delta(delta)
            if isinstance(choice.get("finish_reason"), str):
                self.finish = choice["finish_reason"]
                out += self._close_block()
        if self.finish is not None and self.usage is not None:
            out += self._end()  # the usage chunk is the last one: no need to wait for [DONE]
        return bytes(out)

    def _start(self, chunk: dict[str, Any]) -> bytes:
        self.started = True
        if isinstance(chunk.get("id"), str):
            self.id = chunk["id"]
        if isinstance(chunk.get("model"), str):
            self.model = chunk["model"]
        message: dict[str, Any] = {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "content": [],
            "model": self.model,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"cache_read_input_tokens": 0, "input_tokens": 0, "output_tokens": 0},
        }
        return sse("message_start", {"type": "message_start", "message": message})

    def _delta(self, delta: dict[str, Any]) -> bytes:
        out = bytearray()
        reasoning = delta.get("reasoning_content")
        if isinstance(reasoning, str) and reasoning:
            out += self._text_like("thinking", reasoning)
        text = delta.get("content")
        if isinstance(text, str) and text:
            out += self._text_like("text", text)
        calls = delta.get("tool_calls")
        for call in calls if isinstance(calls, list) else []:
            if isinstance(call, dict):
                out += self._tool(call)
        return bytes(out)

    def _text_like(self, kind: str, text: str) -> bytes:
        out = b""
        if self.open != (kind, None):
            out = self._close_block()
            block = {"type": kind, kind: ""}
            out += self._open_block((kind, None), block)
            if self.done:
                return out
        key = "thinking_delta" if kind == "thinking" else "text_delta"
        delta = {"type": key, kind: text}
        return out + sse(
            "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}
        )

    def _tool(self, call: dict[str, Any]) -> bytes:
        at = call.get("index", 0)
        if type(at) is not int or not 0 <= at < MAX_BLOCKS:
            return self._fail("llama-server sent a tool call with a bad index")
        out = b""
        function: dict[str, Any] = call["function"] if isinstance(call.get("function"), dict) else {}
        if at not in self.tools:
            out = self._close_block()
            name, call_id = function.get("name"), call.get("id")
            block = {
                "type": "tool_use",
                "id": call_id if isinstance(call_id, str) else "",
                "name": name if isinstance(name, str) else "",
                "input": {},
            }
            out += self._open_block(("tool", at), block)
            if self.done:
                return out
            self.tools[at] = self.index
        arguments = function.get("arguments")
        if isinstance(arguments, str) and arguments:
            delta = {"type": "input_json_delta", "partial_json": arguments}
            event = {"type": "content_block_delta", "index": self.tools[at], "delta": delta}
            out += sse("content_block_delta", event)
        return out

    # -- blocks and the end ----------------------------------------------------------------------------
    def _open_block(self, which: tuple[str, Any], block: dict[str, Any]) -> bytes:
        if self.index + 1 >= MAX_BLOCKS:
            return self._fail("llama-server's answer has too many content blocks")
        self.index += 1
        self.open = which
        return sse(
            "content_block_start",
            {"type": "content_block_start", "index": self.index, "content_block": block},
        )

    def _close_block(self) -> bytes:
        if self.open is None:
            return b""
        out = b""
        if self.open[0] == "thinking":  # Anthropic's clients expect a signature before a thinking block ends
            delta = {"type": "signature_delta", "signature": ""}
            out = sse(
                "content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta}
            )
        self.open = None
        return out + sse("content_block_stop", {"type": "content_block_stop", "index": self.index})

    def _end(self) -> bytes:
        if self.done:
            return b""
        out = self._close_block()
        self.done = True
        delta = {"stop_reason": stop_reason(self.finish), "stop_sequence": None}
        out += sse(
            "message_delta",
            {"type": "message_delta", "delta": delta, "usage": usage(self.usage, self.timings)},
        )
        return out + sse("message_stop", {"type": "message_stop"})

    def _upstream_error(self, error: Any) -> bytes:
        message, status = "llama-server failed while answering", 500
        if isinstance(error, dict):
            if isinstance(error.get("message"), str):
                message = error["message"][:4000]
            if type(error.get("code")) is int:
                status = error["code"]
        return self._fail(message, status=status)

    def _fail(self, message: str, *, status: int = 502) -> bytes:
        self.done = self.failed = True
        self.buf.clear()
        error = {"type": ERROR_TYPES.get(status, "api_error"), "message": message}
        return sse("error", {"type": "error", "error": error})
