"""Proxy mode: llama-server's own HTTP API on a second listener, with session-pinned KV persistence.

Only an allowlist of llama-server's routes is forwarded (`kvsidecar.backend.llama_http.ROUTES`: all of
kvsidecar's knowledge of llama-server's routes, slot pinning and API key lives there), matched on the path
as llama-server's HTTP library (cpp-httplib) will see it: percent escapes decoded (`%XX` and `%uXXXX`),
compared literally and case-sensitively, and forwarded under its canonical spelling, so what llama-server
routes is exactly what was checked. Slot management (`/slots...`), settings (`POST /props`,
`POST /lora-adapters`), the router's model management, stream replay, tools and anything unknown get 403
`KV_PROXY_FORBIDDEN`:
kvsidecar is the only client of slot actions.

Every forwarded route that runs on a slot goes through the coordinator, so nothing the proxy forwards
can change a slot kvsidecar believes it knows:

- with a session id (the `X-Session-Id` header by default, or a body field such as `user` /
  `prompt_cache_key`): acquire the session, set `id_slot` and `cache_prompt: true`, forward, stream the
  answer back chunk by chunk, release with the engine's own `timings.prompt_n` / `timings.cache_n`;
- without one: an auxiliary lease (the reserved aux slot, or a slot whose owner is saved first), with
  `id_slot` set to it whatever the client asked for.

`/v1/messages` (Anthropic Messages: Claude Code) is converted (`kvsidecar.proxy_anthropic`): llama-server's
own route drops `id_slot`, so the proxy builds the very chat completion llama-server would (token for token
the same prompt), pins it and sends it to `/v1/chat/completions`, and turns the answer back into an
Anthropic message or event stream (`kvsidecar.proxy_forward`). It does so on every pool size, one slot
included, so a session's KV is the same whatever `--parallel` is. A request that cannot be converted is an
Anthropic-shaped 400 before any slot is acquired. `/v1/messages/count_tokens` runs on no slot and passes
through. `HEAD /` (Claude Code's first request, with no credentials) is answered here, 404 with no body as
llama-server answers it, and reaches nothing. The proxy's token is accepted as `Authorization: Bearer
<token>` or `X-Api-Key: <token>` (a request with both must carry it in both); neither is forwarded.

Routes where llama-server ignores `id_slot` (embeddings, rerank, transcriptions, ...)
are forwarded only to a llama-server with a single slot, which the lease then holds. Requests for more
than one completion (`n`, `n_cmpl`) are refused: llama-server would run the others on other slots.

A session's KV is named by its id and, with `proxy.identity: session+model` (the default), the request's
`model` string; with `proxy.identity: session` by the id alone, so a client that varies `model` keeps one
session. Either way a snapshot is restored only into the runtime it was saved under (its fingerprint:
model file, KV layout, build, ...): the model that runs is llama-server's, whatever the string says.

A client that disconnects (or is cut by the listener's limits, `kvsidecar.listener`) aborts the upstream
request and the lease. Pure ASGI, so nothing is buffered on the way back. The hop itself (headers,
streaming, the lease's end) is `kvsidecar.proxy_forward`; what the proxy says on its own (OpenAI-shaped
errors, `X-KV-*` headers) is `kvsidecar.proxy_answers`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.types import Message, Receive, Scope, Send

from kvsidecar.backend.llama_http import (
    CONVERTED_TARGET,
    PUBLIC_PATHS,
    RouteKind,
    check_one_completion,
    classify,
    json_object,
    pin,
    read_api_key,
)
from kvsidecar.config import Config
from kvsidecar.coordinator.caller import Caller
from kvsidecar.coordinator.core import Coordinator
from kvsidecar.coordinator.state import AcquireResult, Outcome
from kvsidecar.errors import (
    BackendUnavailable,
    BadRequest,
    ConfigError,
    InvariantViolation,
    KvError,
    PayloadTooLarge,
    ProxyForbidden,
)
from kvsidecar.http.listener import Limits, ListenerState, bearer_credential
from kvsidecar.http.router import HOP_HEADER, ClientGone, hop_count, read_body, refuse, watch_disconnect
from kvsidecar.logs import event
from kvsidecar.proxy.answers import (
    PROMPT_DIVERGED,
    SIGNAL_AUX_DIVERGED,
    SIGNAL_NONE,
    error_answer,
    kv_headers,
    openai_error,
)
from kvsidecar.proxy.anthropic import INVALID_FIELD, ConversionError, chat_request_bytes
from kvsidecar.proxy.client_content import SIGNAL as CONTENT_SIGNAL
from kvsidecar.proxy.client_content import Normalized, divergence_index, extends, normalize
from kvsidecar.proxy.client_ids import CONFIGURED, SIG_SESSION_HEADER, asgi_headers, recognize
from kvsidecar.proxy.conversations import ConversationTable, credential_of
from kvsidecar.proxy.forward import (
    PEER_HEADER,
    Convert,
    Forwarder,
    Outbound,
    Release,
    hop_by_hop,
    lifespan,
)
from kvsidecar.proxy.upstream import Upstream, UpstreamError, UpstreamTimeout
from kvsidecar.store.naming import short_id, validate_session_id

if TYPE_CHECKING:
    from kvsidecar.fleet.routing import FleetRouter

log = logging.getLogger("kvsidecar.proxy")
AUX_PURPOSE = "proxy"
DIVERGENCES_KEPT = 32  # low-reuse turns status shows (the latest)
ANY_MODEL = "default"  # the model label of a session when the `model` string is not part of its identity


@dataclass(frozen=True, kw_only=True)
class _Call:
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


class _Sent:
    """`send`, remembering whether an answer has started (an unexpected error can still be answered)."""

    __slots__ = ("send", "started")

    def __init__(self, send: Send) -> None:
        self.send, self.started = send, False

    async def __call__(self, message: Message) -> None:
        self.started = True
        await self.send(message)


_GONE = object()  # a peer proxy that stopped being live before it answered
_HOP = HOP_HEADER.lower().encode()
# On every answer of a proxy to a request forwarded by another host (fleet mode): the answering host's id.
# The forwarding host passes on only an answer that names the host it sent the request to: one from
# anything else (a llama-server, another service that a host record named) never reaches the client.


def _as_host(send: Send, host_id: str) -> Send:
    async def marked(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != PEER_HEADER]
            message = {**message, "headers": [*headers, (PEER_HEADER, host_id.encode())]}
        await send(message)

    return marked


def _no_fleet() -> FleetRouter | None:
    return None


class Proxy:
    def __init__(
        self,
        coordinator: Coordinator,
        config: Config,
        *,
        token: str | None,
        check_host: bool,
    ) -> None:
        self.coordinator = coordinator
        self.cfg = config.proxy
        self.provider = config.proxy_provider()
        server = config.servers[self.cfg.server]
        self.expected = f"Bearer {token}".encode() if token else None
        self.check_host = check_host
        self.llama_auth = None
        if server.api_key_file is not None:
            if self.expected is None:  # config validation says so too; never run without it
                raise ConfigError(
                    f"api.token_file: required with servers.{self.cfg.server}.api_key_file and the proxy on"
                )
            key = read_api_key(Path(server.api_key_file), setting=f"servers.{self.cfg.server}.api_key_file")
            self.llama_auth = f"Bearer {key}".encode()
        self.upstream = Upstream(
            server.base_url,
            connect_timeout_s=server.connect_timeout_s,
            read_timeout_s=self.cfg.upstream_timeout_s,
            on_connect=coordinator.metrics.proxy_connect.inc,
        )
        self.forwarder = Forwarder(self.upstream, self._busy)
        self.requests = coordinator.metrics.proxy_request
        self.session_header = self.cfg.session_header.lower().encode()
        self.model_in_identity = self.cfg.identity == "session+model"
        self.listener = ListenerState(
            "proxy",
            Limits.of(self.cfg),
            shape=openai_error,
            credential=bearer_credential(self.expected, api_key_header=True),
        )
        # fleet mode: the router once it runs (set by the daemon), and a forwarder per peer proxy
        self.fleet: Callable[[], FleetRouter | None] = _no_fleet
        self._peers: dict[str, Forwarder] = {}
        self.conversations = ConversationTable()  # issue 28: digests only, per credential, bounded
        self.divergences: list[dict[str, Any]] = []  # the latest low-reuse turns, for status (short ids)
        coordinator.proxy_view = self.view

    async def aclose(self) -> None:
        for forwarder in self._peers.values():
            await forwarder.upstream.aclose()
        await self.upstream.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        router = self.fleet()
        if router is not None and any(k == _HOP for k, _ in scope.get("headers", ())):
            send = _as_host(send, router.host_id)  # a peer's forward: say which kvsidecar answers it
        sent = _Sent(send)
        try:
            await self._handle(scope, receive, sent)
        except Exception:
            log.exception("kv.proxy.unexpected_error")
            if sent.started:
                raise  # the listener cuts the connection: a broken answer never looks complete
            bug = InvariantViolation("unexpected error in the proxy; see the daemon log", hint="A bug.")
            await self._refuse(bug, scope, receive, send)

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw_path = scope.get("raw_path") or scope["path"].encode("utf-8")
        route = classify(scope["method"], raw_path)
        probe = scope["method"] == "HEAD" and raw_path == b"/"  # Claude Code's first request, no token
        public = probe or (route is not None and route[0] in PUBLIC_PATHS)
        headers = dict(scope.get("headers", []))
        refusal = refuse(
            scope,
            headers,
            expected=self.expected,
            check_host=self.check_host,
            exempt=public,
            api_key_header=True,
        )
        if refusal is None and probe:  # llama-server's answer (404, no body); nothing upstream is asked
            await send({"type": "http.response.start", "status": 404, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        if refusal is None and route is None:
            shown = scope["path"][:80]
            refusal = ProxyForbidden(f"the proxy does not forward {scope['method']} {shown!r}")
        if refusal is not None:
            await self._refuse(refusal, scope, receive, send)
            return
        assert route is not None
        try:
            body = await read_body(receive, self.cfg.max_body_bytes)
        except ClientGone:
            return
        if body is None:
            too_big = PayloadTooLarge(f"request body is over {self.cfg.max_body_bytes} bytes")
            await self._refuse(too_big, scope, receive, send)
            return
        path, kind = route
        if kind is RouteKind.INFO:
            out = self._outbound(scope, path, body, authenticated=not public, pinned=False)
            await self._forward(scope, out, receive, send, kind="passthrough")
            return
        try:
            call = self._read_call(scope, headers, path, kind, body)
        except KvError as exc:
            await self._refuse(exc, scope, receive, send)
            return
        except ConversionError as exc:  # an Anthropic request that cannot be converted: Anthropic's 400
            self.requests.labels("refused", exc.code).inc()
            await self._anthropic_answer(send, exc.status, exc.body())
            return
        await self._on_slot(scope, receive, send, call)

    @staticmethod
    async def _anthropic_answer(send: Send, status: int, body: bytes) -> None:
        headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": body, "more_body": False})

    async def _refuse(self, exc: KvError, scope: Scope, receive: Receive, send: Send) -> None:
        self.requests.labels("refused", exc.code).inc()
        await error_answer(exc)(scope, receive, send)

    def _read_call(
        self, scope: Scope, headers: dict[bytes, bytes], path: str, kind: RouteKind, body: bytes
    ) -> _Call:
        """The session id and the body of a slot-running request: the configured header, else the configured
        body field (both checked strictly: a bad one is a 400), else a client's built-in id
        (`kvsidecar.client_ids`, in its documented order); the auxiliary markers; the normalized messages."""
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
        return _Call(
            path=path,
            route=kind,
            session=session,
            data=data,
            body=body,
            signal=signal,
            markers=rec.markers,
            norm=normalize(path, data) if data is not None else None,
            credential=credential_of(headers),
        )

    def _resolve(self, call: _Call) -> _Call:
        """Issue 28: which conversation a request continues, or that it runs beside it (auxiliary)."""
        if call.markers:  # a title request: never a turn of the conversation, whatever id it carries
            return replace(call, session=None, signal=min(call.markers))
        if call.session is None:
            if not self.cfg.content_identity or call.norm is None:
                return replace(call, signal=SIGNAL_NONE)
            sid, continued = self.conversations.identify(call.credential, call.norm)
            return replace(call, session=sid, signal=CONTENT_SIGNAL, new=not continued)
        entry = self.conversations.get(call.credential, call.session)
        if entry is None:
            return replace(call, new=True)
        if call.norm is None or extends(call.norm, entry.known) is not None:
            return call
        index = divergence_index(call.norm, entry.known)
        if index is None:
            return call
        dropped_tools = entry.tools and not (call.norm.roles and call.norm.roles[0] == "tools")
        if dropped_tools or 2 * len(call.norm.digests) < len(entry.known.digests):
            # a side request under the conversation's id (a title, a summary): its KV stays the session's
            return replace(call, session=None, signal=SIGNAL_AUX_DIVERGED)
        if index >= len(entry.known.digests) - 1:
            # its last message changed: grown in place (a prompt that is extended within one message) or
            # rewritten, digests cannot say which; llama-server's reuse says it after the answer
            return call
        return replace(call, diverged=index)

    def _model_label(self, call: _Call) -> str:
        """The model part of a session's identity (a label: the runtime's fingerprint guards restores)."""
        if not self.model_in_identity or call.session is None or call.data is None:
            return ANY_MODEL
        model = call.data.get("model")
        return model if isinstance(model, str) and model else ANY_MODEL

    def _check_unpinned(self, call: _Call) -> None:
        """A route that ignores id_slot is safe only where llama-server has no other slot to pick."""
        if call.route is not RouteKind.UNPINNED:
            return
        caps = self.coordinator.servers[self.cfg.server].caps
        if caps is None:
            raise BackendUnavailable(f"llama-server at {self.upstream.base_url} has not answered a probe yet")
        if caps.total_slots != 1:
            raise ProxyForbidden(
                f"{call.path} runs on a slot llama-server picks itself (it ignores id_slot); with "
                f"{caps.total_slots} slots it could overwrite a session's slot, so the proxy forwards it "
                "only to a llama-server with one slot (--parallel 1)"
            )

    def _kv_headers(self, call: _Call, lease: AcquireResult) -> list[tuple[bytes, bytes]] | None:
        signal = (b"x-kv-signal", (call.signal or SIGNAL_NONE).encode())
        if call.session is None:
            return [signal]  # an auxiliary request is no session's: nothing else to say about one
        out = kv_headers(lease, restore_enabled=self.coordinator.config.restore.enabled)
        out.append(signal)
        if call.diverged is not None:  # its messages stopped extending the session's last request
            if not any(k == b"x-kv-reason" for k, _ in out):
                out.append((b"x-kv-reason", PROMPT_DIVERGED.encode()))
            out.append((b"x-kv-diverged-message", str(call.diverged).encode()))
        router = self.fleet()
        if router is not None:  # fleet mode: which host served it
            out.append((b"x-kv-host", router.host_id.encode()))
        return out

    def _donor(self, call: _Call) -> str | None:
        """Issue 28: the conversation of the same credential and model whose KV a new session may start
        from (the most leading messages in common); the coordinator uses it only for a cold start."""
        if call.session is None or not call.new or call.norm is None:
            return None
        if not self.coordinator.config.restore.share_prefix:
            return None
        found = self.conversations.donor(
            call.credential, call.norm, model=self._model_label(call), exclude=call.session
        )
        return found[0] if found is not None else None

    def _after_turn(self, call: _Call, lease: AcquireResult, release: Release) -> None:
        """A successful turn: its request is the conversation's latest now; a turn that reused far fewer
        tokens than its session's KV held, or whose messages diverged, is recorded (item 5)."""
        assert call.session is not None
        if call.norm is not None:
            self.conversations.record(call.credential, call.session, self._model_label(call), call.norm)
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

    async def _on_slot(self, scope: Scope, receive: Receive, send: Send, call: _Call) -> None:
        """Acquire (the session, or an auxiliary lease), pin, forward, release."""
        call = self._resolve(call)  # before the fleet hand-off: fleet routing goes by the session
        kind = "managed" if call.session is not None else "auxiliary"
        self.coordinator.metrics.proxy_session_signal.labels(call.signal or SIGNAL_NONE, kind).inc()
        router = self.fleet()
        if router is not None and await self._to_peer(router, scope, receive, send, call):
            return  # fleet mode: another host's proxy served it
        if self.provider is None or not self.coordinator.config.enabled:  # no slot of it is managed
            why = "unmanaged provider" if self.provider is None else "disabled"
            bypass = AcquireResult(outcome=Outcome.BYPASS, reason=why)
            out = self._outbound(scope, call.path, call.body, authenticated=True, pinned=False)
            extra = self._kv_headers(call, bypass)
            await self._forward(scope, out, receive, send, kind="passthrough", extra=extra)
            return
        # a client that hangs up while its acquire waits for a slot gets no lease (issue 26 C)
        caller = Caller()
        watch = asyncio.ensure_future(watch_disconnect(receive, caller))
        try:
            self._check_unpinned(call)
            lease = await self.coordinator.acquire(
                call.session,
                provider=self.provider,
                model=self._model_label(call),
                purpose=None if call.session is not None else AUX_PURPOSE,
                caller=caller,
                scope=call.credential,
                prefix_from=self._donor(call),
            )
        except KvError as exc:
            await self._refuse(exc, scope, receive, send)
            return
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)
        extra = self._kv_headers(call, lease)
        if lease.lease_id is None or lease.slot_id is None:  # bypass (disabled, shutting down)
            out = self._outbound(scope, call.path, call.body, authenticated=True, pinned=False)
            await self._forward(scope, out, receive, send, kind="passthrough", extra=extra)
            return
        release = Release(self.coordinator, lease.lease_id)
        status, timings = "aborted", None
        try:
            body, pinned = call.body, call.route is not RouteKind.UNPINNED and call.data is not None
            convert: Convert | None = None
            cache_prompt = call.session is not None
            if call.route is RouteKind.CONVERTED and call.data is not None:
                # an auxiliary request keeps llama-server's default (cache_prompt on), as pin() leaves it
                body = chat_request_bytes(
                    call.data, slot_id=lease.slot_id, cache_prompt=True if cache_prompt else None
                )
                convert = "stream" if call.data.get("stream") is True else "json"
            elif pinned:
                assert call.data is not None
                body = pin(call.body, call.data, lease.slot_id, cache_prompt=cache_prompt)
            out = self._outbound(scope, call.path, body, authenticated=True, pinned=pinned, converted=convert)
            status, timings = await self._forward(
                scope,
                out,
                receive,
                send,
                kind=kind,
                extra=extra,
                release=release,
                slot_id=lease.slot_id,
                convert=convert,
            )
        finally:
            await release(status, timings)  # a no-op when the pump already released at the answer's end
        if status == "ok" and call.session is not None:
            self._after_turn(call, lease, release)

    async def _to_peer(
        self, router: FleetRouter, scope: Scope, receive: Receive, send: Send, call: _Call
    ) -> bool:
        """Fleet mode: a session that belongs on another host goes to that host's proxy, whole (the client's
        headers, token and session id; the body as it came), and its answer streams back. False: served
        here (it belongs here, or the other host could not be reached: then the session is taken over)."""
        if call.session is None or self.provider is None:
            return False
        hop = hop_count(dict(scope.get("headers", [])))
        key, server = self.coordinator.session_key(call.session, self.provider, self._model_label(call), None)
        if key is None or server is None:
            return False
        target = await router.proxy_target(key, server, hop)
        if target is None:
            return False
        host_id, url = target
        out_headers = self._peer_headers(scope, call, hop)
        path = call.path
        if scope.get("query_string"):
            path += "?" + scope["query_string"].decode("latin-1")
        out = Outbound(method=scope["method"], path=path, body=call.body, headers=out_headers)
        failed: list[UpstreamError] = []

        def unreachable(exc: UpstreamError) -> bool:
            if isinstance(exc, UpstreamTimeout):
                return False  # it is working on it, silently: answered as any silent upstream
            failed.append(exc)
            return True

        started: list[bool] = []

        async def tracked(message: Message) -> None:
            if message["type"] == "http.response.start":
                started.append(True)
            await send(message)

        forwarding = asyncio.ensure_future(
            self._peer(url).forward(
                scope, out, receive, tracked, no_answer=unreachable, peer_host=host_id.encode()
            )
        )
        result = await self._until_gone(forwarding, router, host_id, started)
        if result is _GONE:  # the peer dropped out of the fleet before answering (stopped, partitioned)
            failed.append(UpstreamError(f"host {host_id} is no longer live"))
        if failed:
            await router.proxy_unreachable(key, host_id, failed[0])
            return False
        self.requests.labels("fleet", result or "aborted").inc()
        return True

    def _peer_headers(self, scope: Scope, call: _Call, hop: int) -> list[tuple[bytes, bytes]]:
        """The client's headers for another host's proxy; a content-derived id is named in the session
        header, since the peer's conversation table may not know the conversation (issue 28)."""
        drop = hop_by_hop(scope["headers"]) | {HOP_HEADER.lower().encode()}
        named = call.signal == CONTENT_SIGNAL and call.session is not None
        if named:
            drop.add(self.session_header)
        out = [(k, v) for k, v in scope["headers"] if k not in drop]
        out.append((HOP_HEADER.lower().encode(), str(hop + 1).encode()))
        if named and call.session is not None:
            out.append((self.session_header, call.session.encode()))
        return out

    @staticmethod
    async def _until_gone(
        forwarding: asyncio.Future[tuple[str | None, Any]],
        router: FleetRouter,
        host_id: str,
        started: list[bool],
    ) -> str | object | None:
        """The forward's result, or _GONE when the peer stopped being live before its answer began (the
        forward is then cancelled, and the request is served here). Once the answer has begun streaming it
        runs to its end (the peer's and the client's own limits end it)."""
        try:
            while True:
                done, _ = await asyncio.wait({forwarding}, timeout=router.agent.settings.heartbeat_s)
                if done:
                    return forwarding.result()[0]
                if not started and not router.is_live(host_id):
                    return _GONE
        finally:
            if not forwarding.done():
                forwarding.cancel()
                await asyncio.gather(forwarding, return_exceptions=True)

    def _peer(self, url: str) -> Forwarder:
        """The forwarder to another host's proxy (one per URL, its connections kept)."""
        forwarder = self._peers.get(url)
        if forwarder is None:
            server = self.coordinator.config.servers[self.cfg.server]
            upstream = Upstream(
                url,
                connect_timeout_s=server.connect_timeout_s,
                read_timeout_s=self.cfg.upstream_timeout_s,
            )
            forwarder = self._peers[url] = Forwarder(upstream, partial(self._peer_working, url), peer=True)
        return forwarder

    async def _peer_working(self, url: str, _slot: int | None) -> bool:
        """Asked after `proxy.upstream_timeout_s` of silence from another host's proxy: it is working on
        the request while that host is live (its own limits end a request); a host that dropped out of the
        fleet (stopped, partitioned) is not, and the request ends as for any silent upstream (504)."""
        router = self.fleet()
        if router is None:
            return False
        host_id = router.host_of_proxy(url)
        return host_id is not None and router.is_live(host_id)

    def _outbound(
        self,
        scope: Scope,
        path: str,
        body: bytes,
        *,
        authenticated: bool,
        pinned: bool,
        converted: Convert | None = None,
    ) -> Outbound:
        """The request as llama-server gets it: the canonical path; no hop-by-hop headers, session header
        or our token (in either form: llama-server takes `X-Api-Key` as its own key); llama-server's key
        only for a client that proved it holds ours. `converted`: an Anthropic request sent as a chat
        completion (no query string, no `anthropic-*` headers)."""
        drop = hop_by_hop(scope["headers"]) | {self.session_header}
        if self.expected is not None or self.llama_auth is not None:
            drop |= {b"authorization", b"x-api-key"}
        if pinned:  # the body is plain JSON now, whatever the client said it was
            drop |= {b"content-type", b"content-encoding"}
        headers = [
            (k, v)
            for k, v in scope["headers"]
            if k not in drop and not (converted is not None and k.startswith(b"anthropic-"))
        ]
        if pinned:
            headers.append((b"content-type", b"application/json"))
        if self.llama_auth is not None and authenticated and self.expected is not None:
            headers.append((b"authorization", self.llama_auth))
        target = path if converted is None else CONVERTED_TARGET
        if scope.get("query_string") and converted is None:  # `?beta=true` means nothing to llama-server
            target += "?" + scope["query_string"].decode("latin-1")
        return Outbound(method=scope["method"], path=target, body=body, headers=headers)

    async def _forward(
        self,
        scope: Scope,
        out: Outbound,
        receive: Receive,
        send: Send,
        *,
        kind: str,
        extra: list[tuple[bytes, bytes]] | None = None,
        release: Release | None = None,
        slot_id: int | None = None,
        convert: Convert | None = None,
    ) -> tuple[str, dict[str, Any] | None]:
        """Forward, count; returns the lease's release status (ok / error / aborted) and the timings."""
        result, timings = await self.forwarder.forward(
            scope, out, receive, send, extra=extra, release=release, slot_id=slot_id, convert=convert
        )
        self.requests.labels(kind, result or "aborted").inc()
        if result is None:
            return "aborted", None
        return ("ok" if result == "ok" else "error"), timings

    async def _busy(self, slot_id: int | None) -> bool:
        """Is llama-server processing on `slot_id` (any slot: None)? Asked after a silence."""
        slots = await self.coordinator.servers[self.cfg.server].backend.inspect_slots()
        return any(s.is_processing for s in slots if slot_id is None or s.id == slot_id)
