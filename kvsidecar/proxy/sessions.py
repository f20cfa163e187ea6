"""Which session a proxied request belongs to (issue 28, docs/CLIENTS.md), and what its turns did.

A slot-running request is read once into a `SlotCall`: the session id from the configured header, else the
configured body field (both checked strictly: a bad one is a 400), else a client's built-in id
(`kvsidecar.proxy.client_ids`); its auxiliary markers; its normalized messages and credential scope. Then
`resolve` says which conversation it continues (`kvsidecar.proxy.conversations`: digests only, per
credential, bounded), names one by content when the client sent no id, or runs it beside the session as
auxiliary. What the operator configured (`configured`) wins over title markers, which demote a client's
own id only where the request does not continue the conversation known under it. A raw completion's
prompt under an id is one element (`prompt_of`): it grows in place, or is another prompt run beside.

The table learns a turn at its dispatch (`begin`), before the client can see the end of its answer, and
settles it when the turn ends (`end`); a turn the client aborted keeps what its slot holds once llama-server
stopped it (`slot_held`: the lease is released with it, and the session keeps that KV, unsaved). A turn
that reused far fewer tokens than its session's KV held, or whose messages diverged, is recorded for status.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from starlette.types import Scope

from kvsidecar.backend.base import BackendSlot
from kvsidecar.backend.llama_http import RouteKind, check_one_completion, json_object
from kvsidecar.config import ProxyConfig
from kvsidecar.coordinator.core import Coordinator
from kvsidecar.coordinator.server import ServerRuntime
from kvsidecar.coordinator.state import AcquireResult
from kvsidecar.errors import BackendUnavailable, BadRequest, KvError
from kvsidecar.logs import event
from kvsidecar.proxy.answers import PROMPT_DIVERGED, SIGNAL_AUX_DIVERGED, SIGNAL_NONE
from kvsidecar.proxy.anthropic import chat_request_bytes
from kvsidecar.proxy.anthropic_errors import INVALID_FIELD, ConversionError
from kvsidecar.proxy.client_content import SIGNAL as CONTENT_SIGNAL
from kvsidecar.proxy.client_content import Normalized, divergence_index, normalize
from kvsidecar.proxy.client_ids import CONFIGURED, SIG_SESSION_HEADER, asgi_headers, recognize
from kvsidecar.proxy.conversations import (
    ConversationTable,
    credential_of,
    element_digest,
    from_elsewhere,
)
from kvsidecar.proxy.forward import Release
from kvsidecar.store.naming import short_id, validate_session_id

log = logging.getLogger("kvsidecar.proxy")
ABORT_SETTLE_S = 30.0  # how long a slot may take to stop after its client left (`slot_held`)
ABORT_POLL_S = 0.05
DIVERGENCES_KEPT = 32  # low-reuse turns status shows (the latest)
ANY_MODEL = "default"  # the model label of a session when the `model` string is not part of its identity
PROMPT_API = "prompt"  # a raw completion's prompt as one element (`prompt_of`): no content identity
_PROMPT_ROUTES = frozenset({"/completion", "/completions", "/v1/completions"})


def prompt_of(path: str, data: dict[str, Any]) -> Normalized | None:
    """A raw completion's `prompt` (one string, or one list of token ids) as a single element, so that a
    request under a session's id can be told to grow its prompt in place (the old prompt its prefix) or
    to be another prompt (`from_elsewhere`). Nothing else (several prompts, multimodal parts)."""
    prompt = data.get("prompt") if path in _PROMPT_ROUTES else None
    if isinstance(prompt, str):
        text = "text:" + prompt
    elif isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        text = "tokens:" + "".join(f"{t}," for t in prompt)
    else:
        return None
    element = text.encode("utf-8", "surrogatepass")
    return Normalized(
        api=PROMPT_API, elements=(element,), digests=(element_digest(element),), roles=("prompt",)
    )


async def slot_held(
    inspect: Callable[[], Awaitable[list[BackendSlot]]], slot_id: int, *, timeout_s: float = ABORT_SETTLE_S
) -> int | None:
    """The tokens a slot holds once llama-server has stopped the task of a client that left: it notices the
    closed connection (at its next write, or within a second while it prefills), stops, and keeps the
    prompt processed so far and the tokens generated (`n_prompt_tokens` of `GET /slots`). None when the
    slot did not stop within `timeout_s`, or llama-server cannot say."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        try:
            slots = await inspect()
        except KvError:
            return None
        slot = next((s for s in slots if s.id == slot_id), None)
        if slot is None:
            return None
        if not slot.is_processing:
            return slot.n_tokens
        if asyncio.get_running_loop().time() >= deadline:
            return None
        await asyncio.sleep(ABORT_POLL_S)


@dataclass(frozen=True, kw_only=True)
class SlotCall:
    """One request to a slot-running route, read and checked."""

    path: str
    route: RouteKind
    session: str | None
    data: dict[str, Any] | None  # the body as a JSON object, when it is one (always for PINNED)
    body: bytes
    # issue 28 (docs/CLIENTS.md): what named the session (a fixed signal name, never client text), the
    # auxiliary markers, the normalized messages, the credential scope (a digest)
    signal: str | None = None
    markers: frozenset[str] = frozenset()
    norm: Normalized | None = None
    credential: str = ""
    new: bool = False  # a session the conversation table has not seen: it may start from a donor's KV
    diverged: int | None = None  # the message index where it stopped extending its session's last request


class ProxySessions:
    """The proxy's sessions: the conversation table and the latest low-reuse turns."""

    def __init__(self, coordinator: Coordinator, cfg: ProxyConfig) -> None:
        self.coordinator = coordinator
        self.cfg = cfg
        self.session_header = cfg.session_header.lower().encode()
        self.model_in_identity = cfg.identity == "session+model"
        self.conversations = ConversationTable()  # issue 28: digests only, per credential, bounded
        self.divergences: list[dict[str, Any]] = []  # the latest low-reuse turns, for status (short ids)

    def read(
        self, scope: Scope, headers: dict[bytes, bytes], path: str, kind: RouteKind, body: bytes
    ) -> SlotCall:
        """The session id and the body of a slot-running request: the configured header, else the configured
        body field (both checked strictly: a bad one is a 400), else a client's built-in id
        (`kvsidecar.proxy.client_ids`, in its documented order); the auxiliary markers; the normalized
        messages."""
        raw = headers.get(self.session_header)
        if raw is not None and sum(k == self.session_header for k, _ in scope["headers"]) > 1:
            raise BadRequest(f"more than one {self.cfg.session_header} header")
        session = raw.decode("latin-1") if raw is not None else None
        signal = None
        if session is not None:
            signal = SIG_SESSION_HEADER if self.session_header == b"x-session-id" else CONFIGURED
        data = json_object(body)
        if kind is RouteKind.PINNED:
            if data is None:
                raise BadRequest(f"{path} needs a JSON object body (the proxy pins it to a slot)")
            check_one_completion(data)
        if kind is RouteKind.CONVERTED:
            if data is None:
                raise ConversionError(INVALID_FIELD, "body: a JSON object", param="body")
            chat_request_bytes(data)  # raises ConversionError: refused before any slot is acquired
        if session is None and self.cfg.session_field and data is not None:
            field = data.get(self.cfg.session_field)
            session = field if isinstance(field, str) and field else None
            signal = CONFIGURED if session is not None else None
        if session is not None:
            validate_session_id(session)
        rec = recognize(path, asgi_headers(scope["headers"]), data)  # never raises
        if session is None and rec.session_id is not None:
            try:
                validate_session_id(rec.session_id)
                session, signal = rec.session_id, rec.signal
            except KvError:  # a client's id we cannot use: as if it sent none
                pass
        return SlotCall(
            path=path,
            route=kind,
            session=session,
            data=data,
            body=body,
            signal=signal,
            markers=rec.markers,
            norm=(normalize(path, data) or prompt_of(path, data)) if data is not None else None,
            credential=credential_of(headers),
        )

    def resolve(self, call: SlotCall) -> SlotCall:
        """Issue 28: which conversation a request continues, or that it runs beside it (auxiliary).

        The operator's id (`configured`: the configured header or body field) is never demoted by a title
        marker, a guess from content; a client's built-in id is, unless the request continues the
        conversation known under it."""
        markers = call.markers if call.signal != CONFIGURED else frozenset()
        if call.session is None:
            if markers:  # a title request: never a turn of a conversation
                return replace(call, signal=min(markers))
            if not self.cfg.content_identity or call.norm is None or call.norm.api == PROMPT_API:
                return replace(call, signal=SIGNAL_NONE)
            sid, continued = self.conversations.identify(call.credential, call.norm)
            return replace(call, session=sid, signal=CONTENT_SIGNAL, new=not continued)
        return self._named(call, markers)

    def _named(self, call: SlotCall, markers: frozenset[str]) -> SlotCall:
        """A request that names its session: a turn of it, or a request beside it under its id."""
        assert call.session is not None
        entry, norm = self.conversations.get(call.credential, call.session), call.norm
        if norm is None:
            if markers:
                return replace(call, session=None, signal=min(markers))
            return call if entry is not None else replace(call, new=True)
        if entry is not None and entry.continued_by(norm):
            return call  # a turn of the conversation, whatever it looks like
        if self.conversations.promoted(call.credential, call.session, norm):
            # it extends the request that last ran beside the conversation: the conversation went there
            index = divergence_index(norm, entry.known) if entry is not None else None
            return replace(call, new=entry is None, diverged=index)
        if markers:
            return self._beside(call, min(markers))
        if entry is None:
            return replace(call, new=True)
        known = entry.known
        dropped_tools = entry.tools and not (norm.roles and norm.roles[0] == "tools")
        if (
            dropped_tools
            or 2 * len(norm.digests) < len(known.digests)
            or from_elsewhere(norm, known, entry.shape)
        ):
            # a side request under the conversation's id (a title, a summary), or another conversation's
            # first message: it runs beside the conversation, whose KV stays the session's
            return self._beside(call, SIGNAL_AUX_DIVERGED)
        index = divergence_index(norm, known)
        if index is None or index >= len(known.digests) - 1:
            # its last message changed: grown in place or rewritten; llama-server's reuse says which
            return call
        return replace(call, diverged=index)

    def _beside(self, call: SlotCall, signal: str) -> SlotCall:
        """Run `call` as auxiliary, beside the conversation it named; remembered, in case the conversation
        itself moved there (`ConversationTable.promoted`)."""
        assert call.session is not None and call.norm is not None
        self.conversations.aside(call.credential, call.session, call.norm)
        return replace(call, session=None, signal=signal)

    def model_label(self, call: SlotCall) -> str:
        """The model part of a session's identity (a label: the runtime's fingerprint guards restores)."""
        if not self.model_in_identity or call.session is None or call.data is None:
            return ANY_MODEL
        model = call.data.get("model")
        return model if isinstance(model, str) and model else ANY_MODEL

    def donor(self, call: SlotCall) -> str | None:
        """Issue 28: the conversation of the same credential and model whose KV a new session may start
        from (the most leading messages in common); the coordinator uses it only for a cold start."""
        if call.session is None or not call.new or call.norm is None:
            return None
        if not self.coordinator.config.restore.share_prefix:
            return None
        found = self.conversations.donor(
            call.credential, call.norm, model=self.model_label(call), exclude=call.session
        )
        return found[0] if found is not None else None

    def held(
        self, call: SlotCall, slot_id: int, server: str | None = None
    ) -> Callable[[], Awaitable[int | None]] | None:
        """For a session's turn: what its slot holds if the client leaves mid-answer (`slot_held`), on the
        server of its lease (a router's model: the one the call runs on)."""
        if call.session is None:
            return None
        srv = self.coordinator.servers.get(server or self.cfg.server)
        return partial(slot_held, srv.backend.inspect_slots, slot_id) if srv is not None else None

    def serving(self, provider: str | None, model: str | None) -> ServerRuntime | None:
        """The runtime a call naming `model` runs on (a router's model, by the body's `model`), else
        proxy.server's; None: proxy.server is a router's entry that discovers its models (no runtime of its
        own) and `model` names none of them."""
        routed = self.coordinator.route(provider, model) if provider is not None else None
        return routed or self.coordinator.servers.get(self.cfg.server)

    async def n_vocab(self, provider: str | None, data: Any) -> int:
        """The vocabulary a body's token ids are looked up in: the model it names (a router's), else
        proxy.server's."""
        model = data.get("model") if isinstance(data, dict) else None
        srv = self.serving(provider, model if isinstance(model, str) and model else None)
        if srv is None:
            raise BackendUnavailable("the body names no model kvsidecar manages: its vocabulary is unknown")
        return (await srv.backend.tokenizer_info()).n_vocab

    def runs_on(self, call: SlotCall) -> str | None:
        """The model the call runs on as a router reads it (the body's `model`), None when it names none."""
        model = call.data.get("model") if call.data is not None else None
        return model if isinstance(model, str) and model else None

    def begin(self, call: SlotCall) -> int | None:
        """Its lease is granted and it is about to be sent: a session's turn is the conversation's latest
        request from now on, before the client can see the end of its answer (a client may send its next
        turn the instant it reads it). Returns the turn's serial (None: no turn of a conversation)."""
        if call.session is None or call.norm is None:
            return None
        return self.conversations.begin(call.credential, call.session, self.model_label(call), call.norm)

    def end(
        self, call: SlotCall, turn: int | None, status: str, lease: AcquireResult, release: Release
    ) -> None:
        """The turn is over (`ok`, `error` or `aborted`: see `ConversationTable.end`); a successful turn
        that reused far fewer tokens than its session's KV held, or whose messages diverged, is recorded
        (item 5)."""
        if call.session is None:
            return
        if turn is not None:
            self.conversations.end(call.credential, call.session, turn, status)
        if status == "ok":
            self._divergence(call, lease, release)

    def _divergence(self, call: SlotCall, lease: AcquireResult, release: Release) -> None:
        assert call.session is not None
        prompt_n, cache_n = release.counts
        held = (release.result or {}).get("held_tokens")
        low = (
            isinstance(held, int)
            and held > 0
            and prompt_n is not None
            and cache_n is not None
            and cache_n < self.coordinator.config.restore.min_reuse_ratio * min(held, prompt_n + cache_n)
        )
        if not low and call.diverged is None:
            return
        record = {
            "session": short_id(call.session),
            "signal": call.signal,
            "outcome": lease.outcome.value,
            "reason": PROMPT_DIVERGED,
            "message_index": call.diverged,
            "token_offset": cache_n if low else None,  # llama-server reused exactly this common prefix
            "held_tokens": held,
            "prompt_tokens": None if prompt_n is None or cache_n is None else prompt_n + cache_n,
        }
        self.divergences = [*self.divergences[-(DIVERGENCES_KEPT - 1) :], record]
        when = "reuse" if low else "request"
        self.coordinator.metrics.prompt_diverged.labels(call.signal or SIGNAL_NONE, when).inc()
        event(log, logging.INFO, "kv.proxy.prompt_diverged", when=when, **record)

    def view(self) -> dict[str, Any]:
        """The proxy's part of status: the conversation table's size and the latest divergences."""
        return {
            "content_identity": self.cfg.content_identity,
            "conversations": len(self.conversations),
            "divergences": list(self.divergences),
        }
