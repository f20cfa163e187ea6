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
import socket
import time
from collections.abc import Awaitable
from pathlib import Path
from typing import Any

import httpx
from starlette.types import Receive, Scope, Send

from kvsidecar.api import error_response, read_body, refuse
from kvsidecar.config import Config
from kvsidecar.coordinator.core import AcquireResult, Coordinator
from kvsidecar.errors import BackendUnavailable, BadRequest, KvError, PayloadTooLarge
from kvsidecar.logs import event
from kvsidecar.store.naming import validate_session_id

log = logging.getLogger("kvsidecar.proxy")

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
    }
)
RENEW_EVERY_S = 10.0
_TAIL_BYTES = 256 * 1024


class _Tail:
    """The end of a response, enough to find the engine's final `timings` object."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def feed(self, chunk: bytes) -> None:
        self.buf += chunk
        if len(self.buf) > 2 * _TAIL_BYTES:
            del self.buf[: len(self.buf) - _TAIL_BYTES]

    def timings(self) -> dict[str, Any] | None:
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
        transport: httpx.AsyncBaseTransport | None = None,
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
        if transport is None:
            transport = httpx.AsyncHTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
        self.upstream = httpx.AsyncClient(
            base_url=server.base_url,
            transport=transport,
            timeout=httpx.Timeout(self.cfg.upstream_timeout_s, connect=server.connect_timeout_s),
        )
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
            await error_response(refusal)(scope, receive, send)
            return
        body = await read_body(receive, self.cfg.max_body_bytes)
        if body is None:
            too_big = PayloadTooLarge(f"request body is over {self.cfg.max_body_bytes} bytes")
            await error_response(too_big)(scope, receive, send)
            return
        try:
            session, data = self._session(scope, headers, body)
        except KvError as exc:
            await error_response(exc)(scope, receive, send)
            return
        if session is None or data is None or self.provider is None:
            await self._forward(scope, body, receive, send)
            return
        await self._managed(scope, receive, send, session, data)

    def _session(
        self, scope: Scope, headers: dict[bytes, bytes], body: bytes
    ) -> tuple[str | None, dict[str, Any] | None]:
        """(session id, parsed body) for a managed request; (None, None) for a pass-through one."""
        if scope["method"] != "POST" or scope["path"] not in INFERENCE_PATHS:
            return None, None
        raw = headers.get(self.session_header)
        session = raw.decode("latin-1") if raw is not None else None
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
        self, scope: Scope, receive: Receive, send: Send, session: str, data: dict[str, Any]
    ) -> None:
        model = data.get("model") if isinstance(data.get("model"), str) and data.get("model") else "default"
        assert self.provider is not None
        try:
            lease = await self.coordinator.acquire(session, provider=self.provider, model=str(model))
        except KvError as exc:
            await error_response(exc)(scope, receive, send)
            return
        if lease.lease_id is None:  # bypass / disabled
            await self._forward(scope, json.dumps(data).encode(), receive, send)
            return
        data["id_slot"], data["cache_prompt"] = lease.slot_id, True
        status, timings = "aborted", None
        try:
            status, timings = await self._forward(
                scope,
                json.dumps(data).encode(),
                receive,
                send,
                extra=_kv_headers(lease),
                lease_id=lease.lease_id,
            )
        finally:
            prompt_n = timings.get("prompt_n") if timings else None
            cache_n = timings.get("cache_n") if timings else None
            with contextlib.suppress(KvError):
                await self.coordinator.release(
                    lease.lease_id,
                    status=status,  # type: ignore[arg-type]
                    prompt_tokens=prompt_n if isinstance(prompt_n, int) else None,
                    cached_tokens=cache_n if isinstance(cache_n, int) else None,
                )

    async def _forward(
        self,
        scope: Scope,
        body: bytes,
        receive: Receive,
        send: Send,
        *,
        extra: list[tuple[bytes, bytes]] | None = None,
        lease_id: str | None = None,
    ) -> tuple[str, dict[str, Any] | None]:
        """Stream one request to llama-server and its answer back. Returns (release status, timings)."""
        headers = [(k, v) for k, v in scope["headers"] if k not in HOP_BY_HOP and k != self.session_header]
        if self.expected is not None or self.llama_auth is not None:
            headers = [(k, v) for k, v in headers if k != b"authorization"]
        if self.llama_auth is not None:
            headers.append((b"authorization", self.llama_auth))
        url = scope["path"] + (
            f"?{scope['query_string'].decode('latin-1')}" if scope.get("query_string") else ""
        )
        request = self.upstream.build_request(scope["method"], url, headers=headers, content=body)
        try:
            try:
                response = await self.upstream.send(request, stream=True)
            except httpx.RemoteProtocolError:
                # llama-server closes a kept-alive connection after a streamed answer; a request sent on it
                # gets no response at all, so it was never processed: send it once more on a new connection.
                response = await self.upstream.send(request, stream=True)
        except httpx.HTTPError as exc:
            err = BackendUnavailable(
                f"llama-server at {self.upstream.base_url} did not answer ({type(exc).__name__})"
            )
            await error_response(err)(scope, receive, send)
            return "error", None
        tail = _Tail()
        try:
            out_headers = [(k.lower(), v) for k, v in response.headers.raw if k.lower() not in HOP_BY_HOP]
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": out_headers + (extra or []),
                }
            )
            completed = await _race_disconnect(self._pump(response, send, tail, lease_id), receive)
        finally:
            await response.aclose()
        if not completed:
            event(log, logging.INFO, "kv.proxy.client_disconnected", path=scope["path"])
            return "aborted", None
        return ("ok" if response.status_code < 400 else "error"), tail.timings()

    async def _pump(self, response: httpx.Response, send: Send, tail: _Tail, lease_id: str | None) -> None:
        renewed = time.monotonic()
        async for chunk in response.aiter_raw():
            tail.feed(chunk)
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
            if lease_id is not None and time.monotonic() - renewed > RENEW_EVERY_S:
                self.coordinator.renew(lease_id)  # a long generation must not outlive its lease
                renewed = time.monotonic()
        await send({"type": "http.response.body", "body": b"", "more_body": False})


def _kv_headers(lease: AcquireResult) -> list[tuple[bytes, bytes]]:
    out = [(b"x-kv-outcome", lease.outcome.value.encode())]
    if lease.restored_tokens is not None:
        out.append((b"x-kv-restored-tokens", str(lease.restored_tokens).encode()))
    if lease.restore_ms is not None:
        out.append((b"x-kv-restore-ms", f"{lease.restore_ms:.1f}".encode()))
    return out


async def _race_disconnect(pump: Awaitable[None], receive: Receive) -> bool:
    """Run the response pump until it ends (True) or the client goes away first (False)."""

    async def disconnected() -> None:
        while (await receive())["type"] != "http.disconnect":
            pass

    pump_task = asyncio.ensure_future(pump)
    watch = asyncio.ensure_future(disconnected())
    try:
        done, _ = await asyncio.wait({pump_task, watch}, return_when=asyncio.FIRST_COMPLETED)
        if pump_task in done:
            pump_task.result()
            return True
        pump_task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pump_task
        return False
    finally:
        for t in (pump_task, watch):
            t.cancel()
        await asyncio.gather(pump_task, watch, return_exceptions=True)


async def _lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
