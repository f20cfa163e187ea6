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

A client that disconnects (or is cut by the listener's limits, `kvsidecar.listener`) aborts the upstream
request and the lease. Pure ASGI, so nothing is buffered on the way back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from starlette.types import Receive, Scope, Send

from kvsidecar.backend.llama_http import (
    PUBLIC_PATHS,
    SLOT_HEADERS,
    RouteKind,
    check_one_completion,
    classify,
    find_timings,
    json_object,
    pin,
    prompt_ms,
    read_api_key,
    token_counts,
)
from kvsidecar.config import Config
from kvsidecar.coordinator.core import AcquireResult, Coordinator
from kvsidecar.errors import (
    BackendUnavailable,
    BadRequest,
    ConfigError,
    KvError,
    PayloadTooLarge,
    ProxyForbidden,
)
from kvsidecar.listener import Limits, ListenerState
from kvsidecar.logs import event
from kvsidecar.router import ClientGone, error_response, read_body, refuse
from kvsidecar.store.naming import validate_session_id
from kvsidecar.upstream import Response, Upstream, UpstreamError

log = logging.getLogger("kvsidecar.proxy")
T = TypeVar("T")


HOP_BY_HOP = (
    frozenset(
        {
            b"connection",
            b"keep-alive",
            b"proxy-authenticate",
            b"proxy-authorization",
            b"te",
            b"trailers",
            b"transfer-encoding",
            b"upgrade",
            b"host",
            b"content-length",
            b"expect",
        }
    )
    | SLOT_HEADERS
)  # what would change llama-server's use of the slot behind the lease's back
RENEW_EVERY_S = 10.0
_TAIL_BYTES = 256 * 1024
AUX_PURPOSE = "proxy"


def _final_event(chunk: bytes, tail: _Tail) -> bool:
    """llama-server's last event of a stream carries its `timings`: the answer is complete then, even if
    the end of the HTTP message arrives later (a client that has read it may hang up at once)."""
    return b'"timings"' in chunk and tail.timings() is not None


class _Tail:
    """The end of a response, enough to find the engine's final `timings` object."""

    def __init__(self) -> None:
        self.buf = bytearray()
        self.parsed: tuple[dict[str, Any] | None] | None = None

    def feed(self, chunk: bytes) -> None:
        self.buf += chunk
        self.parsed = None
        if len(self.buf) > 2 * _TAIL_BYTES:
            del self.buf[: len(self.buf) - _TAIL_BYTES]

    def timings(self) -> dict[str, Any] | None:
        if self.parsed is None:
            self.parsed = (find_timings(self.buf.decode("utf-8", errors="replace")),)
        return self.parsed[0]


@dataclass(frozen=True, kw_only=True)
class _Call:
    """One request to a slot-running route, read and checked."""

    path: str
    route: RouteKind
    session: str | None
    data: dict[str, Any] | None  # the body as a JSON object, when it is one (always for PINNED)
    body: bytes


@dataclass(frozen=True, kw_only=True)
class _Outbound:
    """What goes to llama-server."""

    path: str
    body: bytes
    headers: list[tuple[bytes, bytes]]


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
        self.requests = coordinator.metrics.proxy_request
        self.session_header = self.cfg.session_header.lower().encode()
        self.listener = ListenerState("proxy", Limits.of(self.cfg))

    async def aclose(self) -> None:
        await self.upstream.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
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
            await self._forward(scope, out, receive, send)
            return
        try:
            call = self._read_call(headers, path, kind, body)
        except KvError as exc:
            await self._refuse(exc, scope, receive, send)
            return
        await self._on_slot(scope, receive, send, call)

    async def _refuse(self, exc: KvError, scope: Scope, receive: Receive, send: Send) -> None:
        self.requests.labels("refused", exc.code).inc()
        await error_response(exc)(scope, receive, send)

    def _read_call(self, headers: dict[bytes, bytes], path: str, kind: RouteKind, body: bytes) -> _Call:
        """The session id (header, else body field) and the body of a slot-running request."""
        raw = headers.get(self.session_header)
        session = raw.decode("latin-1") if raw is not None else None
        wanted = kind is RouteKind.PINNED or session is not None or bool(self.cfg.session_field)
        data = json_object(body) if wanted else None  # a session's model label comes from it too
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

    async def _on_slot(self, scope: Scope, receive: Receive, send: Send, call: _Call) -> None:
        """Acquire (the session, or an auxiliary lease), pin, forward, release."""
        if self.provider is None or not self.coordinator.config.enabled:  # no slot of it is managed
            out = self._outbound(scope, call.path, call.body, authenticated=True, pinned=False)
            await self._forward(scope, out, receive, send)
            return
        model = call.data.get("model") if call.data is not None else None
        try:
            self._check_unpinned(call)
            lease = await self.coordinator.acquire(
                call.session,
                provider=self.provider,
                model=model if isinstance(model, str) and model and call.session else "default",
                purpose=None if call.session is not None else AUX_PURPOSE,
            )
        except KvError as exc:
            await self._refuse(exc, scope, receive, send)
            return
        if lease.lease_id is None or lease.slot_id is None:  # bypass (disabled, shutting down)
            out = self._outbound(scope, call.path, call.body, authenticated=True, pinned=False)
            await self._forward(scope, out, receive, send)
            return
        release = _Release(self.coordinator, lease.lease_id)
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
                extra=_kv_headers(lease) if call.session is not None else None,
                release=release,
                slot_id=lease.slot_id,
            )
        finally:
            await release(status, timings)  # a no-op when the pump already released at the answer's end

    def _outbound(
        self, scope: Scope, path: str, body: bytes, *, authenticated: bool, pinned: bool
    ) -> _Outbound:
        """The request as llama-server gets it: the canonical path; no hop-by-hop headers, session header
        or our token; llama-server's key only for a client that proved it holds ours."""
        drop = _hop_by_hop(scope["headers"]) | {self.session_header}
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
        return _Outbound(path=target, body=body, headers=headers)

    async def _forward(
        self,
        scope: Scope,
        out: _Outbound,
        receive: Receive,
        send: Send,
        *,
        kind: str = "passthrough",
        extra: list[tuple[bytes, bytes]] | None = None,
        release: _Release | None = None,
        slot_id: int | None = None,
    ) -> tuple[str, dict[str, Any] | None]:
        """Stream one request to llama-server and its answer back. Returns (release status, timings): ok /
        error (llama-server's answer was an HTTP error, or it failed or never answered) / aborted."""

        async def busy() -> bool:
            """Asked after `proxy.upstream_timeout_s` of silence: is llama-server still working on it?"""
            slots = await self.coordinator.servers[self.cfg.server].backend.inspect_slots()
            return any(s.is_processing for s in slots if slot_id is None or s.id == slot_id)

        async def exchange() -> tuple[str, dict[str, Any] | None]:
            try:
                response = await self.upstream.request(
                    scope["method"], out.path, out.headers, out.body, still_working=busy
                )
            except UpstreamError as exc:
                err = BackendUnavailable(f"llama-server at {self.upstream.base_url} did not answer: {exc}")
                await error_response(err)(scope, receive, send)
                return "unavailable", None
            tail = _Tail()
            try:
                # Content-Length is kept: the body goes through byte for byte, so the client sees
                # llama-server's own framing and a cut-short answer stays detectably short.
                out_drop = _hop_by_hop(response.headers) - {b"content-length"}
                out_headers = [(k, v) for k, v in response.headers if k not in out_drop]
                await send(
                    {
                        "type": "http.response.start",
                        "status": response.status_code,
                        "headers": out_headers + (extra or []),
                    }
                )
                if not await self._pump(response, send, tail, release):
                    return "error", None
            finally:
                await response.aclose()  # closes the connection unless the answer ended cleanly
            return ("ok" if response.status_code < 400 else "error"), tail.timings()

        # The client may leave at any point, also while llama-server is still prefilling and has sent
        # nothing: closing the upstream connection then is what stops llama-server's work on it.
        outcome = await _race_disconnect(exchange(), receive)
        result, timings = outcome if outcome is not None else ("aborted", None)
        self.requests.labels(kind, result).inc()
        if outcome is None:
            event(log, logging.INFO, "kv.proxy.client_disconnected", path=out.path.partition("?")[0])
        return ("error" if result == "unavailable" else result), timings

    async def _pump(self, response: Response, send: Send, tail: _Tail, release: _Release | None) -> bool:
        """Forward the body; False when llama-server failed mid-answer (the client connection is then closed
        without a proper end, so a truncated answer never looks complete).

        The lease ends as soon as llama-server's answer is complete, before its last bytes go to the client:
        a client that has the whole answer can count on the slot being free for its next request.
        """
        status = "ok" if response.status_code < 400 else "error"
        try:
            async for chunk in response.stream():
                tail.feed(chunk)
                if release is not None and (response.finished or _final_event(chunk, tail)):
                    await release(status, tail.timings())
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except UpstreamError as exc:
            event(log, logging.WARNING, "kv.proxy.upstream_failed", error=str(exc))
            return False
        if release is not None:
            await release(status, tail.timings())
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return True


class _Release:
    """Keeps one proxied lease alive while its request is in flight (a 100K-token prefill can outlast the
    lease TTL before llama-server sends a byte), then ends it, once, with the engine's own prompt/cache
    counts when there are any."""

    def __init__(self, coordinator: Coordinator, lease_id: str) -> None:
        self.coordinator, self.lease_id, self.done = coordinator, lease_id, False
        self.every = min(RENEW_EVERY_S, coordinator.config.api.lease_ttl_s / 3)
        self.timer = asyncio.get_running_loop().call_later(self.every, self._renew)

    def _renew(self) -> None:
        self.coordinator.renew(self.lease_id)
        self.timer = asyncio.get_running_loop().call_later(self.every, self._renew)

    async def __call__(self, status: str, timings: dict[str, Any] | None) -> None:
        if self.done:
            return
        self.done = True
        self.timer.cancel()
        prompt_n, cache_n = token_counts(timings)
        with contextlib.suppress(KvError):
            await self.coordinator.release(
                self.lease_id,
                status=status,  # type: ignore[arg-type]
                prompt_tokens=prompt_n,
                cached_tokens=cache_n,
                prompt_ms=prompt_ms(timings),
            )


def _hop_by_hop(headers: list[tuple[bytes, bytes]] | Any) -> set[bytes]:
    """The fixed hop-by-hop set plus every header named by the message's own Connection header (RFC 9110)."""
    names = set(HOP_BY_HOP)
    for k, v in headers:
        if k == b"connection":
            names.update(t.strip().lower() for t in v.split(b",") if t.strip())
    return names


def _kv_headers(lease: AcquireResult) -> list[tuple[bytes, bytes]]:
    out = [(b"x-kv-outcome", lease.outcome.value.encode())]
    if lease.restored_tokens is not None:
        out.append((b"x-kv-restored-tokens", str(lease.restored_tokens).encode()))
    if lease.restore_ms is not None:
        out.append((b"x-kv-restore-ms", f"{lease.restore_ms:.1f}".encode()))
    return out


async def _race_disconnect(work: Awaitable[T], receive: Receive) -> T | None:
    """Run `work` until it ends (its result) or the client goes away first (None; `work` is cancelled)."""

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    work_task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({work_task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if work_task in done:
            return work_task.result()
        return None
    finally:
        for t in (work_task, watch):
            t.cancel()
        await asyncio.gather(work_task, watch, return_exceptions=True)


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
