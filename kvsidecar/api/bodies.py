"""The hook API's request models: the JSON bodies and query strings its routes validate (400
`KV_BAD_REQUEST` naming the first offending field, `kvsidecar.http.router`).

A leaf of the API: the fleet router (`kvsidecar.fleet.routing`) checks the releases other hosts queued for
this one with the release route's own `ReleaseBody`, and imports it from here, not from the routes.

An acquire may carry the harness' next prompt (`prompt`: a text, token ids, or a chat-completions body),
checked here and turned into llama-server's tokens by `acquire_prompt_tokens`: what the start plan reads.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Discriminator, Field, StrictInt, StrictStr, Tag

from kvsidecar.backend.base import PromptTokenizer
from kvsidecar.backend.prompts import PromptTokens, hint_tokens
from kvsidecar.coordinator.core import EventType, ReleaseStatus

_Label = Annotated[str, Field(min_length=1, max_length=256)]
# The bounds of an acquire's `prompt` (the body cap, `api.max_body_bytes`, binds first unless raised).
MAX_PROMPT_CHARS = 16 * 2**20
MAX_PROMPT_IDS = 4 * 2**20
MAX_PROMPT_MESSAGES = 100_000


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class ChatPrompt(BaseModel):
    """A chat-completions body, as the harness will send it to llama-server: `messages` and whatever else
    shapes the render (`tools`, `tool_choice`, `parallel_tool_calls`, `chat_template_kwargs`,
    `reasoning_effort`, `add_generation_prompt`, `response_format`, ...), kept as sent."""

    model_config = ConfigDict(extra="allow")
    messages: Annotated[list[dict[str, Any]], Field(min_length=1, max_length=MAX_PROMPT_MESSAGES)]


_PromptText = Annotated[StrictStr, Field(min_length=1, max_length=MAX_PROMPT_CHARS)]
_PromptIds = Annotated[
    list[Annotated[StrictInt, Field(ge=0, lt=2**31)]], Field(min_length=1, max_length=MAX_PROMPT_IDS)
]


def _prompt_form(value: Any) -> str | None:
    """Which form a `prompt` is, by its JSON type (so an error names the form that was meant)."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, list):
        return "ids"
    if isinstance(value, dict | ChatPrompt):
        return "chat"
    return None


_Prompt = Annotated[
    Annotated[_PromptText, Tag("text")]
    | Annotated[_PromptIds, Tag("ids")]
    | Annotated[ChatPrompt, Tag("chat")],
    Discriminator(
        _prompt_form,
        custom_error_type="prompt_form",
        custom_error_message="a text, a list of token ids, or a chat body (an object with messages)",
    ),
]


class AcquireBody(_Body):
    provider: _Label
    model: _Label
    purpose: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    seq: Annotated[int, Field(ge=0)] | None = None
    # Issue 28: a cold start may begin from this session's newest snapshot (same provider, model and
    # credential scope: the operator's, as its manifest recorded it); the id is checked as a session id
    # (400 KV_INVALID_SESSION_ID), never used as a path
    prefix_from: (
        Annotated[
            str,
            Field(
                min_length=1,
                max_length=256,
                description="a session (same provider and model, of the operator's scope as its manifest "
                "recorded it: a proxy client's session of that id is another session) whose newest "
                "snapshot a cold start of this one may begin from; checked as a session id "
                "(400 KV_INVALID_SESSION_ID)",
            ),
        ]
        | None
    ) = None
    prompt: (
        Annotated[
            _Prompt,
            Field(
                description="the prompt of the model call this lease is for: a text or token ids (read as "
                "llama-server's /completion reads `prompt`), or a chat-completions body (an object with "
                "`messages`); optional, checked, turned into llama-server's tokens before the call",
            ),
        ]
        | None
    ) = None

    def prompt_value(self) -> str | list[int] | dict[str, Any] | None:
        """The prompt as plain JSON values: a text, ids, or the chat body (its fields as sent)."""
        if isinstance(self.prompt, ChatPrompt):
            return self.prompt.model_dump()
        return self.prompt


async def acquire_prompt_tokens(body: AcquireBody, tok: PromptTokenizer) -> PromptTokens | None:
    """The tokens llama-server will compute for the acquire's `prompt` (None when it sent none)."""
    value = body.prompt_value()
    return None if value is None else await hint_tokens(tok, value)


class ReleaseBody(_Body):
    status: ReleaseStatus
    prompt_tokens: Annotated[int, Field(ge=0)] | None = None
    cached_tokens: Annotated[int, Field(ge=0)] | None = None
    # llama-server's timings.prompt_ms for the computed tokens: teaches the cost model the prefill speed
    prompt_ms: Annotated[float, Field(ge=0, lt=1e9)] | None = None


class EventBody(_Body):
    type: EventType
    seq: Annotated[int, Field(ge=0)] | None = None


class DoctorQuery(_Body):
    deep: bool = Field(False, description="also run a save/erase/restore round trip on a held slot")


class GcQuery(_Body):
    dry_run: bool = Field(False, description="plan only: delete nothing")


class CheckpointQuery(_Body):
    server: Annotated[str, Field(min_length=1, max_length=256)] | None = Field(
        None, description="the server whose dirty slots to save (default: every server)"
    )
    wait: bool = Field(False, description="answer once every save has committed (else once they started)")
    timeout_s: Annotated[float, Field(gt=0, le=86400)] | None = Field(
        None, description="with wait: how long to wait (default: checkpoint.shutdown_timeout_s)"
    )
