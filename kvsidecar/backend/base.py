"""The backend interface (spec §12). The coordinator talks to a KV engine only through this.

Core code never builds a `/slots` URL: a backend turns these calls into its engine's API and converts every
transport failure into a `kvsidecar.errors.BackendError` subclass.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol


@dataclass(frozen=True, kw_only=True)
class BackendCapabilities:
    kind: str
    alive: bool
    slots_endpoint: bool
    total_slots: int
    n_ctx: int | None
    model_path: str | None
    build_info: str | None
    # A value the server makes anew at each process start (llama-server: /props `media_marker`), so a
    # client that cannot see the process can still tell one start from the next. None when not exposed.
    instance_id: str | None = None
    props: dict[str, Any] = field(default_factory=dict)
    # In sleep mode (llama-server `--sleep-idle-seconds`, /props `is_sleeping`): the model and every slot's
    # KV are freed, and the next request that needs them loads the model again from its path.
    sleeping: bool = False
    # Where the serving process listens when that is not the configured address (a router's model: its
    # child on 127.0.0.1); the local process is found there. None: the configured address.
    process_url: str | None = None


@dataclass(frozen=True, kw_only=True)
class InstanceState:
    """What a cheap look at the server says about its instance: the per-start nonce, and sleep mode."""

    nonce: str | None
    sleeping: bool


@dataclass(frozen=True, kw_only=True)
class BackendSlot:
    id: int
    n_ctx: int | None
    is_processing: bool
    n_tokens: int | None = None  # tokens cached in the slot, when the build reports it
    # a task (a completion, an embedding, ...) ever ran on it (llama-server: /slots shows `id_task`); a
    # backend that cannot tell says True
    used: bool = True


@dataclass(frozen=True, kw_only=True)
class SaveResult:
    slot_id: int
    filename: str
    tokens: int
    bytes_written: int
    server_ms: float | None
    measured_ms: float


@dataclass(frozen=True, kw_only=True)
class RestoreResult:
    slot_id: int
    filename: str
    tokens: int
    bytes_read: int
    server_ms: float | None
    measured_ms: float


@dataclass(frozen=True, kw_only=True)
class EraseResult:
    slot_id: int
    tokens: int
    measured_ms: float


@dataclass(frozen=True, kw_only=True)
class PromptResult:
    slot_id: int
    computed: int  # prompt tokens the engine computed (llama-server: timings.prompt_n)
    reused: int  # prompt tokens it took from the slot's cache (timings.cache_n)


@dataclass(frozen=True, kw_only=True)
class TokenizerInfo:
    """What a prompt's tokens are checked against: the vocabulary's size, and whether the server holds a
    multimodal projector (llama-server then tokenizes the prompts of its OpenAI routes with mtmd)."""

    n_vocab: int
    multimodal: bool


class PromptTokenizer(Protocol):
    """llama-server's own template and tokenizer, asked before a request runs (`kvsidecar.backend.prompts`).
    Every method raises only `KvError`s: `BadRequest` when the server refuses what it was given (HTTP 4xx),
    a `BackendError` for everything else."""

    async def tokenize(
        self, content: str | Sequence[str | int], *, add_special: bool, parse_special: bool
    ) -> list[int]:
        """`content` (a text, or texts and token ids mixed) as the server tokenizes it; every id checked to
        be in the vocabulary."""
        ...

    async def apply_template(self, chat_body: bytes | Mapping[str, Any]) -> str:
        """The prompt text the server renders from a chat-completions body (its chat template, tools,
        reasoning settings): exactly what its chat route then tokenizes."""
        ...

    async def tokenizer_info(self) -> TokenizerInfo: ...


class KvBackend(PromptTokenizer, Protocol):
    """What the coordinator needs from an engine. Every method raises only `BackendError` subclasses."""

    kind: str

    async def probe(self) -> BackendCapabilities: ...

    async def inspect_slots(self) -> list[BackendSlot]: ...

    async def save_slot(self, slot_id: int, filename: str) -> SaveResult: ...

    async def restore_slot(self, slot_id: int, filename: str) -> RestoreResult: ...

    async def erase_slot(self, slot_id: int) -> EraseResult: ...

    async def instance_id(self) -> str | None:
        """The per-process nonce the server reports now (see BackendCapabilities.instance_id)."""
        ...

    async def instance_state(self) -> InstanceState:
        """The nonce and the sleep state now, from a call that does not wake a sleeping server."""
        ...

    async def wake(self) -> None:
        """Wake a sleeping server (it loads its model again); returns once it is awake."""
        ...

    async def prefill(self, slot_id: int, prompt: str | list[int]) -> int:
        """Compute `prompt` into the slot's KV cache without generating; returns the tokens cached."""
        ...

    async def run_prompt(self, slot_id: int, prompt: str | list[int], *, n_predict: int = 0) -> PromptResult:
        """Run `prompt` on the slot, reusing what its cache holds; how much was computed and reused.
        With `n_predict` 0 or 1 the slot then holds exactly the prompt's tokens (see `LlamaCppBackend`)."""
        ...

    async def aclose(self) -> None: ...
