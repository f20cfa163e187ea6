"""Proxy mode: llama-server's own HTTP API on a second listener, with session-pinned KV persistence.

Requests to the inference routes that carry a session id (the `X-Session-Id` header by default, or a body
field such as `user` / `prompt_cache_key`) go through the coordinator: acquire, inject `id_slot` and
`cache_prompt: true`, forward, stream the answer back chunk by chunk, release with the engine's own
`timings.prompt_n` / `timings.cache_n` (so restore verification works with no help from the client).
Everything else passes through untouched. A client that disconnects aborts the upstream request and the
lease. Pure ASGI, so nothing is buffered on the way back.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import Awaitable
from pathlib import Path
from typing import Any, TypeVar

from starlette.types import Receive, Scope, Send

from kvsidecar.api import error_response, read_body, refuse
from kvsidecar.config import Config
from kvsidecar.coordinator.core import AcquireResult, Coordinator
from kvsidecar.errors import BackendUnavailable, BadRequest, KvError, PayloadTooLarge
from kvsidecar.logs import event
from kvsidecar.store.naming import validate_session_id
from kvsidecar.upstream import Response, Upstream, UpstreamError

log = logging.getLogger("kvsidecar.proxy")
T = TypeVar("T")

INFERENCE_PATHS = frozenset(
    {
        "/completion",
        "/completions",
        "/v1/completions",
        "/chat/completions",
        "/v1/chat/completions",
        "/infill",
        "/v1/responses",
        "/v1/messages",
    }
)
HOP_BY_HOP = frozenset(
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
RENEW_EVERY_S = 10.0
_OBJECT_START = re.compile(rb"[ \t\r\n]*\{")  # JSON whitespace, then an object in UTF-8
_TAIL_BYTES = 256 * 1024


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
            self.parsed = (self._parse(),)
        return self.parsed[0]

    def _parse(self) -> dict[str, Any] | None:
        text = self.buf.decode("utf-8", errors="replace")
        with contextlib.suppress(ValueError):
            whole = json.loads(text)
            if isinstance(whole, dict) and isinstance(whole.get("timings"), dict):
                return dict(whole["timings"])
        for line in reversed(text.splitlines()):
            if '"timings"' in line:
                with contextlib.suppress(ValueError):
                    data = json.loads(line.removeprefix("data:").strip())
                    if isinstance(data, dict) and isinstance(data.get("timings"), dict):
                        return dict(data["timings"])
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
            self.llama_auth = f"Bearer {Path(server.api_key_file).read_text().strip()}".encode()
        self.upstream = Upstream(
            server.base_url,
            connect_timeout_s=server.connect_timeout_s,
            read_timeout_s=self.cfg.upstream_timeout_s,
            on_connect=coordinator.metrics.proxy_connect.inc,
        )
        self.requests = coordinator.metrics.proxy_request
        self.session_header = self.cfg.session_header.lower().encode()

    async def aclose(self) -> None:
        await self.upstream.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await _lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        headers = dict(scope.get("headers", []))
        refusal = refuse(scope, headers, expected=self.expected, check_host=self.check_host)
        if refusal is not None:
            await self._refuse(refusal, scope, receive, send)
            return
        body = await read_body(receive, self.cfg.max_body_bytes)
        if body is None:
            too_big = PayloadTooLarge(f"request body is over {self.cfg.max_body_bytes} bytes")
            await self._refuse(too_big, scope, receive, send)
            return
        try:
            session, data = self._session(scope, headers, body)
        except KvError as exc:
            await self._refuse(exc, scope, receive, send)
            return
        if session is None or data is None or self.provider is None:
            await self._forward(scope, body, receive, send)
            return
        await self._managed(scope, receive, send, session, data, body)

    async def _refuse(self, exc: KvError, scope: Scope, receive: Receive, send: Send) -> None:
        self.requests.labels("refused", exc.code).inc()
        await error_response(exc)(scope, receive, send)

    def _session(
        self, scope: Scope, headers: dict[bytes, bytes], body: bytes
    ) -> tuple[str | None, dict[str, Any] | None]:
        """(session id, parsed body) for a managed request; (None, None) for a pass-through one."""
        if scope["method"] != "POST" or scope["path"] not in INFERENCE_PATHS:
            return None, None
        raw = headers.get(self.session_header)
        session = raw.decode("latin-1") if raw is not None else None
        if session is None and not self.cfg.session_field:
            return None, None  # pass-through: the body is not even parsed
        try:
            data = json.loads(body) if body else None
        except ValueError:
            data = None
        if session is None and self.cfg.session_field and isinstance(data, dict):
            field = data.get(self.cfg.session_field)
            session = field if isinstance(field, str) and field else None
        if session is None:
            return None, None
        if not isinstance(data, dict):
            raise BadRequest("a managed request needs a JSON object body")
        return validate_session_id(session), data

    async def _managed(
        self, scope: Scope, receive: Receive, send: Send, session: str, data: dict[str, Any], body: bytes
    ) -> None:
        model = data.get("model") if isinstance(data.get("model"), str) and data.get("model") else "default"
        assert self.provider is not None
        try:
            lease = await self.coordinator.acquire(session, provider=self.provider, model=str(model))
        except KvError as exc:
            await self._refuse(exc, scope, receive, send)
            return
        if lease.lease_id is None or lease.slot_id is None:  # bypass / disabled
            await self._forward(scope, body, receive, send)
            return
        release = _Release(self.coordinator, lease.lease_id)
        status, timings = "aborted", None
        try:
            pinned = _pin(body, data, lease.slot_id)
            status, timings = await self._forward(
                scope, pinned, receive, send, extra=_kv_headers(lease), release=release, slot_id=lease.slot_id
            )
        finally:
            await release(status, timings)  # a no-op when the pump already released at the answer's end

    async def _forward(
        self,
        scope: Scope,
        body: bytes,
        receive: Receive,
        send: Send,
        *,
        extra: list[tuple[bytes, bytes]] | None = None,
        release: _Release | None = None,
        slot_id: int | None = None,
    ) -> tuple[str, dict[str, Any] | None]:
        """Stream one request to llama-server and its answer back. Returns (release status, timings): ok /
        error (llama-server's answer was an HTTP error, or it failed or never answered) / aborted."""
        drop = _hop_by_hop(scope["headers"]) | {self.session_header}
        if self.expected is not None or self.llama_auth is not None:
            drop.add(b"authorization")
        headers = [(k, v) for k, v in scope["headers"] if k not in drop]
        if self.llama_auth is not None:
            headers.append((b"authorization", self.llama_auth))
        target = scope["raw_path"].decode("latin-1") if scope.get("raw_path") else scope["path"]
        if scope.get("query_string"):
            target += "?" + scope["query_string"].decode("latin-1")

        async def busy() -> bool:
            """Asked after `proxy.upstream_timeout_s` of silence: is llama-server still working on it?"""
            slots = await self.coordinator.servers[self.cfg.server].backend.inspect_slots()
            return any(s.is_processing for s in slots if slot_id is None or s.id == slot_id)

        async def exchange() -> tuple[str, dict[str, Any] | None]:
            try:
                response = await self.upstream.request(
                    scope["method"], target, headers, body, still_working=busy
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
        self.requests.labels("passthrough" if release is None else "managed", result).inc()
        if outcome is None:
            event(log, logging.INFO, "kv.proxy.client_disconnected", path=scope["path"])
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
                if release is not None and response.finished:
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
        prompt_n = timings.get("prompt_n") if timings else None
        cache_n = timings.get("cache_n") if timings else None
        with contextlib.suppress(KvError):
            await self.coordinator.release(
                self.lease_id,
                status=status,  # type: ignore[arg-type]
                prompt_tokens=prompt_n if isinstance(prompt_n, int) else None,
                cached_tokens=cache_n if isinstance(cache_n, int) else None,
            )


def _hop_by_hop(headers: list[tuple[bytes, bytes]] | Any) -> set[bytes]:
    """The fixed hop-by-hop set plus every header named by the message's own Connection header (RFC 9110)."""
    names = set(HOP_BY_HOP)
    for k, v in headers:
        if k == b"connection":
            names.update(t.strip().lower() for t in v.split(b",") if t.strip())
    return names


def _pin(body: bytes, data: dict[str, Any], slot_id: int) -> bytes:
    """The request body with `id_slot` and `cache_prompt: true` set.

    Agent prompts run to hundreds of kilobytes and re-encoding them costs milliseconds, so when the object
    has neither key the two members are spliced in before its closing brace; otherwise it is re-encoded.
    """
    text = body.rstrip()
    untouched = data and "id_slot" not in data and "cache_prompt" not in data
    if untouched and _OBJECT_START.match(text) and text.endswith(b"}"):
        return text[:-1] + b',"id_slot":%d,"cache_prompt":true}' % slot_id
    return json.dumps({**data, "id_slot": slot_id, "cache_prompt": True}).encode()


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
