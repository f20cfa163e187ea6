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

Routes where llama-server ignores `id_slot` (`/v1/messages`, embeddings, rerank, transcriptions, ...)
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
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.types import Message, Receive, Scope, Send

from kvsidecar.backend.llama_http import (
    PUBLIC_PATHS,
    RouteKind,
    check_one_completion,
    classify,
    json_object,
    pin,
    read_api_key,
)
from kvsidecar.config import Config
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
from kvsidecar.listener import Limits, ListenerState
from kvsidecar.proxy_answers import error_answer, kv_headers, openai_error
from kvsidecar.proxy_forward import Forwarder, Outbound, Release, hop_by_hop, lifespan
from kvsidecar.router import HOP_HEADER, ClientGone, hop_count, read_body, refuse
from kvsidecar.store.naming import validate_session_id
from kvsidecar.upstream import Upstream, UpstreamError, UpstreamTimeout

if TYPE_CHECKING:
    from kvsidecar.fleet.routing import FleetRouter

log = logging.getLogger("kvsidecar.proxy")
AUX_PURPOSE = "proxy"
ANY_MODEL = "default"  # the model label of a session when the `model` string is not part of its identity


@dataclass(frozen=True, kw_only=True)
class _Call:
    """One request to a slot-running route, read and checked."""

    path: str
    route: RouteKind
    session: str | None
    data: dict[str, Any] | None  # the body as a JSON object, when it is one (always for PINNED)
    body: bytes


class _Sent:
    """`send`, remembering whether an answer has started (an unexpected error can still be answered)."""

    __slots__ = ("send", "started")

    def __init__(self, send: Send) -> None:
        self.send, self.started = send, False

    async def __call__(self, message: Message) -> None:
        self.started = True
        await self.send(message)


_GONE = object()  # a peer proxy that stopped being live before it answered


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
        self.listener = ListenerState("proxy", Limits.of(self.cfg), shape=openai_error)
        # fleet mode: the router once it runs (set by the daemon), and a forwarder per peer proxy
        self.fleet: Callable[[], FleetRouter | None] = _no_fleet
        self._peers: dict[str, Forwarder] = {}

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
        route = classify(scope["method"], scope.get("raw_path") or scope["path"].encode("utf-8"))
        public = route is not None and route[0] in PUBLIC_PATHS
        headers = dict(scope.get("headers", []))
        refusal = refuse(scope, headers, expected=self.expected, check_host=self.check_host, exempt=public)
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
        await self._on_slot(scope, receive, send, call)

    async def _refuse(self, exc: KvError, scope: Scope, receive: Receive, send: Send) -> None:
        self.requests.labels("refused", exc.code).inc()
        await error_answer(exc)(scope, receive, send)

    def _read_call(
        self, scope: Scope, headers: dict[bytes, bytes], path: str, kind: RouteKind, body: bytes
    ) -> _Call:
        """The session id (header, else body field) and the body of a slot-running request."""
        raw = headers.get(self.session_header)
        if raw is not None and sum(k == self.session_header for k, _ in scope["headers"]) > 1:
            raise BadRequest(f"more than one {self.cfg.session_header} header")
        session = raw.decode("latin-1") if raw is not None else None
        wanted = (
            kind is RouteKind.PINNED
            or bool(self.cfg.session_field)
            or (session is not None and self.model_in_identity)  # the model label comes from it
        )
        data = json_object(body) if wanted else None
        if kind is RouteKind.PINNED:
            if data is None:
                raise BadRequest(f"{path} needs a JSON object body (the proxy pins it to a slot)")
            check_one_completion(data)
        if session is None and self.cfg.session_field and data is not None:
            field = data.get(self.cfg.session_field)
            session = field if isinstance(field, str) and field else None
        if session is not None:
            validate_session_id(session)
        return _Call(path=path, route=kind, session=session, data=data, body=body)

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
        if call.session is None:
            return None  # an auxiliary request is no session's: nothing to say about one
        out = kv_headers(lease, restore_enabled=self.coordinator.config.restore.enabled)
        router = self.fleet()
        if router is not None:  # fleet mode: which host served it
            out.append((b"x-kv-host", router.host_id.encode()))
        return out

    async def _on_slot(self, scope: Scope, receive: Receive, send: Send, call: _Call) -> None:
        """Acquire (the session, or an auxiliary lease), pin, forward, release."""
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
        try:
            self._check_unpinned(call)
            lease = await self.coordinator.acquire(
                call.session,
                provider=self.provider,
                model=self._model_label(call),
                purpose=None if call.session is not None else AUX_PURPOSE,
            )
        except KvError as exc:
            await self._refuse(exc, scope, receive, send)
            return
        extra = self._kv_headers(call, lease)
        if lease.lease_id is None or lease.slot_id is None:  # bypass (disabled, shutting down)
            out = self._outbound(scope, call.path, call.body, authenticated=True, pinned=False)
            await self._forward(scope, out, receive, send, kind="passthrough", extra=extra)
            return
        release = Release(self.coordinator, lease.lease_id)
        status, timings = "aborted", None
        try:
            body, pinned = call.body, call.route is RouteKind.PINNED and call.data is not None
            if pinned:
                assert call.data is not None
                body = pin(call.body, call.data, lease.slot_id, cache_prompt=call.session is not None)
            out = self._outbound(scope, call.path, body, authenticated=True, pinned=pinned)
            status, timings = await self._forward(
                scope,
                out,
                receive,
                send,
                kind="managed" if call.session is not None else "auxiliary",
                extra=extra,
                release=release,
                slot_id=lease.slot_id,
            )
        finally:
            await release(status, timings)  # a no-op when the pump already released at the answer's end

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
        drop = hop_by_hop(scope["headers"]) | {HOP_HEADER.lower().encode()}
        out_headers = [(k, v) for k, v in scope["headers"] if k not in drop]
        out_headers.append((HOP_HEADER.lower().encode(), str(hop + 1).encode()))
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
            self._peer(url).forward(scope, out, receive, tracked, no_answer=unreachable)
        )
        result = await self._until_gone(forwarding, router, host_id, started)
        if result is _GONE:  # the peer dropped out of the fleet before answering (stopped, partitioned)
            failed.append(UpstreamError(f"host {host_id} is no longer live"))
        if failed:
            await router.proxy_unreachable(key, host_id, failed[0])
            return False
        self.requests.labels("fleet", result or "aborted").inc()
        return True

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
        self, scope: Scope, path: str, body: bytes, *, authenticated: bool, pinned: bool
    ) -> Outbound:
        """The request as llama-server gets it: the canonical path; no hop-by-hop headers, session header
        or our token; llama-server's key only for a client that proved it holds ours."""
        drop = hop_by_hop(scope["headers"]) | {self.session_header}
        if self.expected is not None or self.llama_auth is not None:
            drop.add(b"authorization")
        if pinned:  # the body is plain JSON now, whatever the client said it was
            drop |= {b"content-type", b"content-encoding"}
        headers = [(k, v) for k, v in scope["headers"] if k not in drop]
        if pinned:
            headers.append((b"content-type", b"application/json"))
        if self.llama_auth is not None and authenticated and self.expected is not None:
            headers.append((b"authorization", self.llama_auth))
        target = path
        if scope.get("query_string"):
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
    ) -> tuple[str, dict[str, Any] | None]:
        """Forward, count; returns the lease's release status (ok / error / aborted) and the timings."""
        result, timings = await self.forwarder.forward(
            scope, out, receive, send, extra=extra, release=release, slot_id=slot_id
        )
        self.requests.labels(kind, result or "aborted").inc()
        if result is None:
            return "aborted", None
        return ("ok" if result == "ok" else "error"), timings

    async def _busy(self, slot_id: int | None) -> bool:
        """Is llama-server processing on `slot_id` (any slot: None)? Asked after a silence."""
        slots = await self.coordinator.servers[self.cfg.server].backend.inspect_slots()
        return any(s.is_processing for s in slots if slot_id is None or s.id == slot_id)
