"""Which tokens a prompt becomes in llama-server, known before the request runs.

A snapshot's file holds the tokens of the slot it saved (`kvsidecar.store.state_format`). This module says
which tokens the next request will put in the slot, so that a planner can tell whether the request extends a
snapshot exactly (all a hybrid recurrent model can reuse), within one token of its end, or shares a prefix
with it, and how long. It asks llama-server itself (`PromptTokenizer`), so the tokens are those its routes
compute (build 11434, tools/server), not an estimate:

- A completion prompt (`/completion`, `/completions`, `/v1/completions`; `completion_tokens`) as
  `tokenize_input_prompts` reads it: a text, or texts and ids mixed, goes to `/tokenize` with `add_special`
  and `parse_special` (the same `tokenize_mixed` call: only a first text gets the BOS); a list of ids is the
  prompt as it is; `{"prompt_string": ...}` is its text or mixed list. An array of several prompts, media
  (`multimodal_data`), a form llama-server refuses, or an id outside the vocabulary: unknown.
- A chat body (`/v1/chat/completions`, and what the Anthropic and Responses routes convert to;
  `chat_tokens`): its prompt text from `/apply-template`, which runs the very `oaicompat_chat_params_parse`
  the chat routes run on the same body (template, tools, `parallel_tool_calls`, `response_format`,
  `reasoning_format`, `chat_template_kwargs`, `enable_thinking`, the assistant prefill), then `/tokenize` as
  above, which is what `handle_completions_impl` does with that text. Media parts are unknown (llama-server
  replaces them with a marker and chunks them), and so is any chat prompt on a server with a multimodal
  projector, which tokenizes through mtmd instead; so is a render that holds U+FFFD where the body held
  none (llama-server writes invalid UTF-8 in its answer that way, so the text would not be the same).
- The hook API's `prompt` (`hint_tokens`): a text or ids as a completion prompt, an object as a chat body.

`/tokenize` and `/apply-template` run on llama-server's HTTP threads, beside the slot loop (they queue no
task); on a sleeping server they wait for it to wake, as the request itself would.

Anything this cannot prove is `UnknownTokens` with a `reason` from `REASONS`: a planner decides as if it
knew nothing of the prompt. Nothing here raises. `shared_prefix` compares a snapshot's tokens with a
prompt's.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvsidecar.backend.base import PromptTokenizer
from kvsidecar.errors import BadRequest, KvError

# Why a prompt's tokens are unknown (a stable vocabulary: logs and status may carry it).
MULTIMODAL = "multimodal"  # images, audio or video: tokenized into media chunks
MULTIMODAL_SERVER = "multimodal_server"  # a projector loaded: OpenAI routes tokenize through mtmd
SEVERAL_PROMPTS = "several_prompts"  # an array of prompts: several completions
INVALID = "invalid_prompt"  # a form llama-server refuses, or ids outside the vocabulary
REFUSED = "refused"  # llama-server refused to render or tokenize it (HTTP 4xx)
BACKEND = "backend_error"  # the call failed: unreachable, timed out, an answer that does not check
LOSSY = "lossy_render"  # the rendered text came back with replaced bytes
NOT_CONVERTIBLE = "not_convertible"  # a Responses or Anthropic body its conversion refuses
INFILL = "infill"  # /infill's prompt needs what llama-server's API does not tell
NO_PROMPT = "no_prompt"  # a route that runs no prompt on a slot
REASONS = frozenset(
    {
        MULTIMODAL,
        MULTIMODAL_SERVER,
        SEVERAL_PROMPTS,
        INVALID,
        REFUSED,
        BACKEND,
        LOSSY,
        NOT_CONVERTIBLE,
        INFILL,
        NO_PROMPT,
    }
)
MEDIA_PARTS = frozenset({"image_url", "input_audio", "input_video", "video_url"})  # llama-server's
_REPLACEMENT = "\ufffd"


@dataclass(frozen=True, kw_only=True)
class KnownTokens:
    """The exact tokens the request puts in its slot (before anything is generated)."""

    tokens: tuple[int, ...]
    cost_ms: float  # wall time spent finding them (the calls to llama-server included)


@dataclass(frozen=True, kw_only=True)
class UnknownTokens:
    """No token knowledge: `reason` is one of `REASONS`, `detail` a short text for logs (never a prompt)."""

    reason: str
    detail: str
    cost_ms: float = 0.0


PromptTokens = KnownTokens | UnknownTokens


@dataclass(frozen=True)
class _Ids:
    ids: tuple[int, ...]


@dataclass(frozen=True)
class _Text:
    content: str | tuple[str | int, ...]


def _is_id(value: Any) -> bool:
    return type(value) is int  # JSON true/false are not numbers to llama-server


def _mixed(values: list[Any]) -> _Text | UnknownTokens:
    if all(isinstance(v, str) or _is_id(v) for v in values):
        return _Text(tuple(values))
    return UnknownTokens(reason=INVALID, detail="a prompt array holds something other than texts and ids")


def _subprompt(prompt: Any) -> _Ids | _Text | UnknownTokens:
    """`tokenize_input_subprompt`: one prompt."""
    if isinstance(prompt, str):
        return _Text(prompt)
    if isinstance(prompt, list):
        if any(isinstance(v, str) for v in prompt) and any(_is_id(v) for v in prompt):
            return _mixed(prompt)
        if all(_is_id(v) for v in prompt):
            return _Ids(tuple(prompt))
    elif isinstance(prompt, dict) and "prompt_string" in prompt:
        if "multimodal_data" in prompt:
            return UnknownTokens(reason=MULTIMODAL, detail="multimodal_data")
        inner = prompt["prompt_string"]
        if isinstance(inner, str):
            return _Text(inner)
        if isinstance(inner, list):
            return _mixed(inner)
    return UnknownTokens(reason=INVALID, detail="not a prompt llama-server reads")


def _completion_input(prompt: Any) -> _Ids | _Text | UnknownTokens:
    """`tokenize_input_prompts`: an array without ids is several prompts (one of them is that one)."""
    if isinstance(prompt, list) and not any(_is_id(v) for v in prompt):
        if len(prompt) != 1:
            reason = SEVERAL_PROMPTS if prompt else INVALID
            return UnknownTokens(reason=reason, detail=f"an array of {len(prompt)} prompts")
        prompt = prompt[0]
    return _subprompt(prompt)


def _failed(exc: KvError) -> UnknownTokens:
    reason = REFUSED if isinstance(exc, BadRequest) else BACKEND
    return UnknownTokens(reason=reason, detail=f"{exc.code}: {exc.message}"[:300])


def _ms(started: float) -> float:
    return (time.perf_counter() - started) * 1000.0


async def _out_of_vocab(tok: PromptTokenizer, ids: list[int]) -> UnknownTokens | None:
    n_vocab = (await tok.tokenizer_info()).n_vocab
    if all(0 <= t < n_vocab for t in ids):
        return None
    return UnknownTokens(reason=INVALID, detail=f"an id outside the vocabulary (n_vocab {n_vocab})")


async def _tokens(tok: PromptTokenizer, found: _Ids | _Text) -> PromptTokens:
    if isinstance(found, _Ids):
        if not found.ids:
            return UnknownTokens(reason=INVALID, detail="an empty prompt runs nothing")
        return await _out_of_vocab(tok, list(found.ids)) or KnownTokens(tokens=found.ids, cost_ms=0.0)
    content = found.content if isinstance(found.content, str) else list(found.content)
    ids = [v for v in content if isinstance(v, int)] if isinstance(content, list) else []
    refused = await _out_of_vocab(tok, ids) if ids else None  # llama-server would cut them to 32 bits
    if refused is not None:
        return refused
    tokens = await tok.tokenize(content, add_special=True, parse_special=True)
    return KnownTokens(tokens=tuple(tokens), cost_ms=0.0)


def _timed(result: PromptTokens, started: float) -> PromptTokens:
    if isinstance(result, KnownTokens):
        return KnownTokens(tokens=result.tokens, cost_ms=_ms(started))
    return UnknownTokens(reason=result.reason, detail=result.detail, cost_ms=_ms(started))


async def completion_tokens(tok: PromptTokenizer, prompt: Any, *, oai: bool = False) -> PromptTokens:
    """The tokens of a completion route's `prompt` (see the module docstring). `oai`: `/v1/completions`,
    which a server with a multimodal projector tokenizes through mtmd, a text only (unknown then)."""
    started = time.perf_counter()
    found = _completion_input(prompt)
    if isinstance(found, UnknownTokens):
        return _timed(found, started)
    try:
        if oai and (await tok.tokenizer_info()).multimodal:
            return _timed(UnknownTokens(reason=MULTIMODAL_SERVER, detail="/v1/completions"), started)
        return _timed(await _tokens(tok, found), started)
    except KvError as exc:
        return _timed(_failed(exc), started)


def has_media(chat: Mapping[str, Any]) -> bool:
    """Whether a chat body holds a media part llama-server would load (`oaicompat_content_load_media`)."""
    messages = chat.get("messages")
    for msg in messages if isinstance(messages, list) else ():
        content = msg.get("content") if isinstance(msg, dict) else None
        for part in content if isinstance(content, list) else ():
            if isinstance(part, dict) and part.get("type") in MEDIA_PARTS:
                return True
    return False


def _wire(chat: Mapping[str, Any]) -> bytes | UnknownTokens:
    try:
        return json.dumps(chat, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    except (UnicodeEncodeError, ValueError, TypeError, RecursionError):
        return UnknownTokens(reason=INVALID, detail="a body JSON cannot carry (a lone surrogate, NaN)")


def _holds_replacement(body: bytes) -> bool:
    return _REPLACEMENT.encode() in body or b"\\ufffd" in body.lower()


async def chat_tokens(
    tok: PromptTokenizer, chat: Mapping[str, Any], *, body: bytes | None = None
) -> PromptTokens:
    """The tokens of a chat-completions body `chat` (see the module docstring). `body`: the same body as
    the bytes the server will parse, when the caller has them (else `chat` is encoded)."""
    started = time.perf_counter()
    if has_media(chat):
        return _timed(UnknownTokens(reason=MULTIMODAL, detail="a media part in messages"), started)
    wire = body if body is not None else _wire(chat)
    if isinstance(wire, UnknownTokens):
        return _timed(wire, started)
    try:
        if (await tok.tokenizer_info()).multimodal:
            return _timed(UnknownTokens(reason=MULTIMODAL_SERVER, detail="a chat route"), started)
        prompt = await tok.apply_template(wire)
        if _REPLACEMENT in prompt and not _holds_replacement(wire):
            return _timed(UnknownTokens(reason=LOSSY, detail="U+FFFD in the render only"), started)
        tokens = await tok.tokenize(prompt, add_special=True, parse_special=True)
    except KvError as exc:
        return _timed(_failed(exc), started)
    return KnownTokens(tokens=tuple(tokens), cost_ms=_ms(started))


async def hint_tokens(tok: PromptTokenizer, prompt: str | list[int] | Mapping[str, Any]) -> PromptTokens:
    """The tokens of a harness' next prompt (the hook API's acquire `prompt`): a text or a list of ids as
    `/completion` reads its `prompt`, an object as a chat-completions body."""
    if isinstance(prompt, Mapping):
        return await chat_tokens(tok, prompt)
    return await completion_tokens(tok, prompt)


def shared_prefix(saved: Sequence[int], prompt: Sequence[int]) -> int:
    """How many leading tokens two token lists share: a snapshot's (its state file) and a prompt's. The
    prompt extends the snapshot exactly when this is `len(saved)`; llama-server reuses at most this many."""
    n = min(len(saved), len(prompt))
    block = 512
    start = 0
    while start < n and list(saved[start : start + block]) == list(prompt[start : start + block]):
        start += block
    end = min(start + block, n)
    while start < end and saved[start] == prompt[start]:
        start += 1
    return min(start, n)
