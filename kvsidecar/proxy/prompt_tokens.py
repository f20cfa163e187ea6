"""Which prompt a proxied request renders to, token for token, before it runs: `request_tokens`.

Each slot-running route of llama-server turns its body into a prompt its own way (build 11434,
tools/server/server-context.cpp); this module maps a route to that way and asks llama-server for the tokens
through `kvsidecar.backend.prompts`:

- `/completion`, `/completions`, `/v1/completions`: the body's `prompt` (a text, ids, texts and ids
  mixed, `{"prompt_string": ...}`); one call, `/tokenize` (none for ids).
- `/chat/completions`, `/v1/chat/completions`: the body as it is; `/apply-template`, then `/tokenize`.
- `/v1/messages`: the chat completion the proxy sends in its place (`kvsidecar.proxy.anthropic`); the same.
- `/responses`, `/v1/responses`: the chat body llama-server converts it to
  (`kvsidecar.proxy.responses_chat`); the same.
- `/infill`: unknown (`INFILL`). `format_prompt_infill` cuts and frames the texts with the model's FIM
  token ids, `n_batch`, the server's default `n_predict` and `--spm-infill`, none of which llama-server's
  API tells.

Multimodal parts, several prompts in one request and bodies llama-server would refuse are unknown with their
reason (`kvsidecar.backend.prompts.REASONS`). The result's `cost_ms` is the whole: conversion and calls.
Nothing here changes the request, or raises: the proxy forwards what the client sent either way.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Protocol

from kvsidecar.backend.base import PromptTokenizer
from kvsidecar.backend.prompts import (
    INFILL,
    NO_PROMPT,
    NOT_CONVERTIBLE,
    KnownTokens,
    PromptTokens,
    UnknownTokens,
    chat_tokens,
    completion_tokens,
)
from kvsidecar.proxy.anthropic import messages_to_chat
from kvsidecar.proxy.anthropic_errors import ConversionError, dumps
from kvsidecar.proxy.responses_chat import NotConvertible, responses_to_chat

COMPLETION_ROUTES = frozenset({"/completion", "/completions"})  # llama-server's own completion
OAI_COMPLETION_ROUTES = frozenset({"/v1/completions"})
CHAT_ROUTES = frozenset({"/chat/completions", "/v1/chat/completions"})
RESPONSES_ROUTES = frozenset({"/responses", "/v1/responses"})
MESSAGES_ROUTE = "/v1/messages"
INFILL_ROUTE = "/infill"


class RequestLike(Protocol):
    """What `request_tokens_of` reads of a request (`kvsidecar.proxy.sessions.SlotCall` is one)."""

    @property
    def path(self) -> str: ...

    @property
    def data(self) -> dict[str, Any] | None: ...

    @property
    def body(self) -> bytes: ...


def _unknown(reason: str, detail: str, started: float) -> UnknownTokens:
    return UnknownTokens(reason=reason, detail=detail, cost_ms=(time.perf_counter() - started) * 1000.0)


def _with_conversion(result: PromptTokens, started: float) -> PromptTokens:
    """The result, its cost counted from `started` (the conversion before the calls included)."""
    cost_ms = (time.perf_counter() - started) * 1000.0
    if isinstance(result, UnknownTokens):
        return UnknownTokens(reason=result.reason, detail=result.detail, cost_ms=cost_ms)
    return KnownTokens(tokens=result.tokens, cost_ms=cost_ms)


async def request_tokens(
    tok: PromptTokenizer, path: str, data: Mapping[str, Any] | None, *, body: bytes | None = None
) -> PromptTokens:
    """The tokens the request to `path` (canonical, as `kvsidecar.backend.llama_http.classify` gives it)
    with the JSON object `data` puts in its slot, or why they are unknown. `body`: the raw bytes `data`
    was parsed from, sent to `/apply-template` as they are for a chat route (the exact text llama-server
    parses); optional."""
    started = time.perf_counter()
    if path == INFILL_ROUTE:
        return _unknown(INFILL, "the FIM framing depends on settings llama-server does not tell", started)
    if data is None:
        return _unknown(NO_PROMPT, "no JSON object body", started)
    if path in COMPLETION_ROUTES or path in OAI_COMPLETION_ROUTES:
        if "prompt" not in data:
            return _unknown(NO_PROMPT, "no prompt in the body", started)
        return await completion_tokens(tok, data["prompt"], oai=path in OAI_COMPLETION_ROUTES)
    if path in CHAT_ROUTES:
        return await chat_tokens(tok, data, body=body)
    if path == MESSAGES_ROUTE:
        try:  # the body the proxy sends (`chat_request_bytes`): what llama-server renders
            chat = messages_to_chat(data)
            wire = dumps(chat)
        except ConversionError as exc:
            return _unknown(NOT_CONVERTIBLE, f"{exc.code}: {exc.message}"[:300], started)
        return _with_conversion(await chat_tokens(tok, chat, body=wire), started)
    if path in RESPONSES_ROUTES:
        try:
            chat = responses_to_chat(data)
        except NotConvertible as exc:
            return _unknown(NOT_CONVERTIBLE, str(exc)[:300], started)
        return _with_conversion(await chat_tokens(tok, chat), started)
    return _unknown(NO_PROMPT, "a route that runs no prompt on a slot", started)


async def request_tokens_of(tok: PromptTokenizer, call: RequestLike) -> PromptTokens:
    """`request_tokens` of a request read by the proxy (a `SlotCall`: its path, parsed body and bytes)."""
    return await request_tokens(tok, call.path, call.data, body=call.body)
