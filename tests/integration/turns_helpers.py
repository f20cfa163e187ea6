"""Agent-client gestures over the proxy's chat routes, for the tests and the benchmark of a conversation's
turns (tests/integration/test_proxy_turns_real.py, bench/bench_turns.py): a client that names no session and
sends each turn with the assistant's replies verbatim, streamed and read to its last event, then sends the
next one at once; or that hangs up after a few tokens and re-prompts with the partial answer.

Two wire forms of one conversation: OpenAI chat completions (`chat`: `data: [DONE]` ends the stream,
llama-server's `timings` carry the counts) and Anthropic Messages (`messages`: the data of `message_stop`
ends it, `usage` carries the counts)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, Literal

import httpx

Api = Literal["chat", "messages"]
PATHS: dict[Api, str] = {"chat": "/v1/chat/completions", "messages": "/v1/messages"}
SYSTEM = "You are a coding agent. Answer tersely."


@dataclass
class Conversation:
    """One agent conversation: its messages so far, in either wire form (the system prompt kept apart)."""

    api: Api
    messages: list[dict[str, Any]] = field(default_factory=list)
    system: str = SYSTEM
    max_tokens: int = 8

    def body(self, *, stream: bool, max_tokens: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {
            "model": "tiny",
            "max_tokens": max_tokens or self.max_tokens,
            "temperature": 0,
            "stream": stream,
        }
        if self.api == "chat":
            body["messages"] = [{"role": "system", "content": self.system}, *self.messages]
        else:
            body["system"] = self.system
            body["messages"] = list(self.messages)
        return body

    def add(self, role: str, text: str) -> None:
        self.messages.append({"role": role, "content": text})


@dataclass(frozen=True)
class Answer:
    status: int
    headers: dict[str, str]
    text: str
    computed: int | None  # prompt tokens llama-server computed
    reused: int | None  # prompt tokens it reused from the slot's KV

    @property
    def prompt(self) -> int | None:
        return None if self.computed is None or self.reused is None else self.computed + self.reused

    @property
    def ratio(self) -> float:
        """The share of the prompt reused (0 when unknown)."""
        return (self.reused or 0) / self.prompt if self.prompt else 0.0

    @property
    def outcome(self) -> str | None:
        return self.headers.get("x-kv-outcome")


class _Reader:
    """An event stream, event by event: the text so far, the counts, and whether its last event came."""

    def __init__(self, api: Api) -> None:
        self.api, self.text, self.ended, self.pending = api, "", False, ""
        self.computed: int | None = None
        self.reused: int | None = None
        self.content_events = 0

    def line(self, line: str) -> None:
        if line.startswith("event:"):
            self.pending = line[6:].strip()
            return
        if not line.startswith("data:"):
            return
        data = line[5:].strip()
        if data == "[DONE]":
            self.ended = True
            return
        event = json.loads(data)
        if self.api == "chat":
            self._chat(event)
        else:
            self._messages(event)

    def _chat(self, event: dict[str, Any]) -> None:
        for choice in event.get("choices") or []:
            piece = (choice.get("delta") or {}).get("content")
            if piece:
                self.text += piece
                self.content_events += 1
        timings = event.get("timings")
        if isinstance(timings, dict):
            self.computed, self.reused = int(timings["prompt_n"]), int(timings["cache_n"])

    def _messages(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        if kind == "content_block_delta" and event["delta"].get("type") == "text_delta":
            self.text += event["delta"]["text"]
            self.content_events += 1
        elif kind == "message_delta":
            usage = event.get("usage") or {}
            self.computed = int(usage.get("input_tokens", 0))
            self.reused = int(usage.get("cache_read_input_tokens", 0))
        elif kind == "message_stop":
            self.ended = True


def _headers(resp: httpx.Response) -> dict[str, str]:
    return {k.lower(): v for k, v in resp.headers.items()}


async def streamed_turn(client: httpx.AsyncClient, convo: Conversation) -> Answer:
    """One turn, streamed and read up to its last event (`[DONE]`, `message_stop`): then the caller sends
    its next turn at once, the answer's HTTP message possibly not yet ended."""
    reader = _Reader(convo.api)
    async with client.stream("POST", PATHS[convo.api], json=convo.body(stream=True)) as resp:
        if resp.status_code != 200:
            await resp.aread()
            return Answer(resp.status_code, _headers(resp), resp.text, None, None)
        async for line in resp.aiter_lines():
            reader.line(line)
            if reader.ended:
                break
        headers = _headers(resp)
    assert reader.ended, "the stream ended without its last event"
    return Answer(200, headers, reader.text, reader.computed, reader.reused)


async def aborted_turn(
    client: httpx.AsyncClient, convo: Conversation, *, events: int = 3, max_tokens: int = 512
) -> Answer:
    """One turn, streamed; the client hangs up after `events` pieces of text (the answer so far)."""
    reader = _Reader(convo.api)
    body = convo.body(stream=True, max_tokens=max_tokens)
    async with client.stream("POST", PATHS[convo.api], json=body) as resp:
        assert resp.status_code == 200, await resp.aread()
        async for line in resp.aiter_lines():
            reader.line(line)
            if reader.content_events >= events or reader.ended:
                break
        headers = _headers(resp)
    assert not reader.ended, "the answer ended before the client could abort it: raise max_tokens"
    return Answer(200, headers, reader.text, None, None)


async def whole_turn(client: httpx.AsyncClient, convo: Conversation) -> Answer:
    """One turn, not streamed."""
    resp = await client.post(PATHS[convo.api], json=convo.body(stream=False))
    if resp.status_code != 200:
        return Answer(resp.status_code, _headers(resp), resp.text, None, None)
    data = resp.json()
    if convo.api == "chat":
        text = data["choices"][0]["message"].get("content") or ""
        timings = data["timings"]
        return Answer(200, _headers(resp), text, int(timings["prompt_n"]), int(timings["cache_n"]))
    text = "".join(b.get("text", "") for b in data["content"] if b.get("type") == "text")
    usage = data["usage"]
    return Answer(
        200, _headers(resp), text, int(usage["input_tokens"]), int(usage.get("cache_read_input_tokens", 0))
    )
