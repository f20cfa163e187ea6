"""The proxy's hop: one request to llama-server, its answer streamed back unbuffered, the lease kept alive
while it runs and ended as soon as llama-server's answer is complete.

Headers (RFC 9110 §7.6.1): hop-by-hop headers (`Connection`, `Keep-Alive`, `TE`, `Transfer-Encoding`,
`Upgrade`, ..., and every header a message's own `Connection` names) stop here in both directions; the
listener (uvicorn) frames the answer itself. llama-server's `Content-Length` is kept (the body passes byte
for byte). Its `Server` and `Date` are dropped, as a reverse proxy does (nginx's default): the listener
sends its own, exactly one of each, on every answer whether llama-server or the proxy made it. Its
`X-KV-*` headers are dropped too: only the proxy says what happened to the session.

A converted answer (`convert`: an Anthropic Messages request the proxy sent as a pinned chat completion,
`kvsidecar.proxy.anthropic`) is turned back into Anthropic's shape on the way: a stream event by event
(`StreamTransducer`, still unbuffered; llama-server's raw chunks still feed `Tail`, whose timings end the
lease), a JSON answer whole (buffered up to `MAX_CONVERTED_BYTES`, its `Content-Length` recomputed), an
error answer as an Anthropic error. The converted answer's own framing replaces llama-server's
`Content-Length`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar

from starlette.types import Receive, Scope, Send

from kvsidecar.backend.llama_http import SLOT_HEADERS, find_timings, prompt_ms, token_counts
from kvsidecar.coordinator.core import Coordinator
from kvsidecar.errors import BackendUnavailable, KvError, OperationTimeout
from kvsidecar.logs import event
from kvsidecar.proxy.answers import error_answer
from kvsidecar.proxy.anthropic_answer import chat_answer_to_message_bytes
from kvsidecar.proxy.anthropic_errors import ConversionError, anthropic_error, error_to_anthropic
from kvsidecar.proxy.anthropic_stream import StreamTransducer
from kvsidecar.proxy.upstream import Response, Upstream, UpstreamError, UpstreamTimeout

log = logging.getLogger("kvsidecar.proxy")
T = TypeVar("T")

HOP_BY_HOP = (
    frozenset(
        {
            b"connection",
            b"keep-alive",
            b"proxy-authenticate",
            b"proxy-authorization",
            b"proxy-connection",
            b"te",
            b"trailer",
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
# Never taken from llama-server's answer (see the module docstring).
ANSWER_DROP = frozenset({b"server", b"date"})
PEER_HEADER = (
    b"x-kv-fleet-host"  # a peer proxy's answer names its host (fleet mode): checked, never passed on
)
RENEW_EVERY_S = 10.0
_TAIL_BYTES = 256 * 1024
MAX_CONVERTED_BYTES = 64 << 20  # a non-streamed (or error) answer converted to Anthropic's shape, whole
Convert = Literal["stream", "json"]


def hop_by_hop(headers: Iterable[tuple[bytes, bytes]]) -> set[bytes]:
    """The fixed hop-by-hop set plus every header named by the message's own Connection header (RFC 9110)."""
    names = set(HOP_BY_HOP)
    for k, v in headers:
        if k == b"connection":
            names.update(t.strip().lower() for t in v.split(b",") if t.strip())
    return names


def answer_headers(headers: list[tuple[bytes, bytes]], *, peer: bool = False) -> list[tuple[bytes, bytes]]:
    """llama-server's answer headers as the client gets them (before the proxy's own X-KV-*). `peer`: the
    answer of another host's kvsidecar proxy (fleet mode), whose X-KV-* headers are the session's."""
    drop = (hop_by_hop(headers) - {b"content-length"}) | ANSWER_DROP | {PEER_HEADER}
    return [(k, v) for k, v in headers if k not in drop and (peer or not k.startswith(b"x-kv-"))]


@dataclass(frozen=True, kw_only=True)
class Outbound:
    """What goes to llama-server."""

    method: str
    path: str  # with the query string
    body: bytes
    headers: list[tuple[bytes, bytes]]


class Tail:
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

    def final_event(self, chunk: bytes) -> bool:
        """llama-server's last event of a stream carries its `timings`: the answer is complete then, even if
        the end of the HTTP message arrives later (a client that has read it may hang up at once)."""
        return b'"timings"' in chunk and self.timings() is not None


class Release:
    """Keeps one proxied lease alive while its request is in flight (a 100K-token prefill can outlast the
    lease TTL before llama-server sends a byte), then ends it, once, with the engine's own prompt/cache
    counts when there are any. `held`: for a session's turn, what the slot holds after its client left
    mid-answer (`kvsidecar.proxy.sessions.slot_held`); the lease is kept until then, and the session keeps
    that KV as its own."""

    def __init__(
        self,
        coordinator: Coordinator,
        lease_id: str,
        *,
        held: Callable[[], Awaitable[int | None]] | None = None,
    ) -> None:
        self.coordinator, self.lease_id, self.done = coordinator, lease_id, False
        self.held = held
        self.status: str | None = None  # what the lease was released with
        self.result: dict[str, Any] | None = None  # the coordinator's answer to the release
        self.counts: tuple[int | None, int | None] = (None, None)  # the engine's prompt_n, cache_n
        coordinator.renew(lease_id)  # held here, by this request: active from the start, not a claim
        self.every = min(RENEW_EVERY_S, coordinator.config.api.lease_ttl_s / 3)
        self.timer = asyncio.get_running_loop().call_later(self.every, self._renew)

    def _renew(self) -> None:
        self.coordinator.renew(self.lease_id)
        self.timer = asyncio.get_running_loop().call_later(self.every, self._renew)

    async def __call__(self, status: str, timings: dict[str, Any] | None) -> None:
        if self.done:
            return
        self.done, self.status = True, status
        try:
            held = await self.held() if status == "aborted" and self.held is not None else None
        finally:
            self.timer.cancel()
        prompt_n, cache_n = token_counts(timings)
        self.counts = (prompt_n, cache_n)
        with contextlib.suppress(KvError):
            self.result = await self.coordinator.release(
                self.lease_id,
                status=status,  # type: ignore[arg-type]
                prompt_tokens=prompt_n,
                cached_tokens=cache_n,
                prompt_ms=prompt_ms(timings),
                held_tokens=held,
            )


class Forwarder:
    """Sends requests to one llama-server and streams the answers back."""

    def __init__(
        self,
        upstream: Upstream,
        still_working: Callable[[int | None], Awaitable[bool]],
        *,
        peer: bool = False,
    ) -> None:
        self.upstream = upstream
        self.still_working = still_working  # is llama-server still at work on slot N (None: any)?
        self.peer = peer  # the upstream is another host's kvsidecar proxy (fleet mode), not llama-server

    async def forward(
        self,
        scope: Scope,
        out: Outbound,
        receive: Receive,
        send: Send,
        *,
        extra: list[tuple[bytes, bytes]] | None = None,
        release: Release | None = None,
        slot_id: int | None = None,
        no_answer: Callable[[UpstreamError], bool] | None = None,
        peer_host: bytes | None = None,
        convert: Convert | None = None,
    ) -> tuple[str | None, dict[str, Any] | None]:
        """Stream one request to llama-server and its answer back. Returns (result, timings), result: ok /
        error (llama-server's answer was an HTTP error, or it failed mid-answer) / unavailable / timeout
        (no answer: the proxy answered with an error) / None (the client left first). `no_answer`: asked
        when the upstream gave no answer; True means the caller answers the client itself ("unanswered").
        `peer_host` (fleet mode, another host's proxy): an answer whose `X-KV-Fleet-Host` does not name that
        host is not a kvsidecar's answer: never passed on, it counts as no answer at all. `convert`: the
        answer of a converted Anthropic request (see the module docstring); a stream that ended in an
        error event is an error."""

        async def busy() -> bool:
            """Asked after `proxy.upstream_timeout_s` of silence: is llama-server still working on it?"""
            return await self.still_working(slot_id)

        async def exchange() -> tuple[str, dict[str, Any] | None]:
            try:
                response = await self.upstream.request(
                    out.method, out.path, out.headers, out.body, still_working=busy
                )
            except UpstreamError as exc:
                if release is not None:  # ended before the client hears of it, as after an answer
                    await release("error", None)
                if no_answer is not None and no_answer(exc):
                    return "unanswered", None
                return await self._no_answer(exc, scope, receive, send), None
            forged = await self._not_from(response, peer_host) if peer_host is not None else None
            if forged is not None:
                if no_answer is not None and no_answer(forged):
                    return "unanswered", None
                return await self._no_answer(forged, scope, receive, send), None
            try:
                if convert is not None:
                    return await self._converted(response, send, Tail(), release, extra, convert)
                return await self._relay(response, send, release, extra)
            finally:
                await response.aclose()  # closes the connection unless the answer ended cleanly

        # The client may leave at any point, also while llama-server is still prefilling and has sent
        # nothing: closing the upstream connection then is what stops llama-server's work on it.
        outcome = await race_disconnect(exchange(), receive)
        if outcome is None:
            event(log, logging.INFO, "kv.proxy.client_disconnected", path=out.path.partition("?")[0])
            return None, None
        return outcome

    async def _not_from(self, response: Response, peer_host: bytes) -> UpstreamError | None:
        """An answer whose `X-KV-Fleet-Host` does not name `peer_host` is not that kvsidecar's: closed
        unread, it counts as no answer at all (the error says why)."""
        said = [v for k, v in response.headers if k.lower() == PEER_HEADER]
        if said == [peer_host]:
            return None
        await response.aclose()
        event(log, logging.WARNING, "kv.proxy.peer_not_kvsidecar", url=self.upstream.base_url)
        return UpstreamError(
            f"{self.upstream.base_url} did not answer as kvsidecar host {peer_host.decode()}"
        )

    async def _relay(
        self,
        response: Response,
        send: Send,
        release: Release | None,
        extra: list[tuple[bytes, bytes]] | None,
    ) -> tuple[str, dict[str, Any] | None]:
        """llama-server's answer passed on as it is, byte for byte: (result, timings) as `forward` returns
        them."""
        tail = Tail()
        await send(
            {
                "type": "http.response.start",
                "status": response.status_code,
                "headers": answer_headers(response.headers, peer=self.peer) + (extra or []),
            }
        )
        if not await self._pump(response, send, tail, release):
            return "error", None
        return ("ok" if response.status_code < 400 else "error"), tail.timings()

    async def _no_answer(self, exc: UpstreamError, scope: Scope, receive: Receive, send: Send) -> str:
        """llama-server gave no answer: say so (502, or 504 after `proxy.upstream_timeout_s` of silence)."""
        err: KvError
        if isinstance(exc, UpstreamTimeout):
            err = OperationTimeout(
                f"llama-server at {self.upstream.base_url} did not answer: {exc}",
                hint="Raise proxy.upstream_timeout_s, or check llama-server's log.",
            )
        else:
            err = BackendUnavailable(f"llama-server at {self.upstream.base_url} did not answer: {exc}")
        await error_answer(err)(scope, receive, send)
        return "timeout" if isinstance(exc, UpstreamTimeout) else "unavailable"

    async def _converted(
        self,
        response: Response,
        send: Send,
        tail: Tail,
        release: Release | None,
        extra: list[tuple[bytes, bytes]] | None,
        convert: Convert,
    ) -> tuple[str, dict[str, Any] | None]:
        """A converted answer: (result, timings) as `forward` returns them."""
        headers = [(k, v) for k, v in answer_headers(response.headers) if k != b"content-length"]
        headers += extra or []
        if response.status_code < 400 and convert == "stream":
            return await self._converted_stream(response, send, tail, release, headers)
        return await self._converted_whole(response, send, tail, release, headers)

    async def _converted_stream(
        self,
        response: Response,
        send: Send,
        tail: Tail,
        release: Release | None,
        headers: list[tuple[bytes, bytes]],
    ) -> tuple[str, dict[str, Any] | None]:
        """A chat completion stream as an Anthropic event stream, event by event."""
        status = response.status_code
        transducer = StreamTransducer()
        await send({"type": "http.response.start", "status": status, "headers": headers})

        async def pass_on(raw: bytes, out: bytes, final: bool) -> None:
            tail.feed(raw)
            if release is not None and (final or tail.final_event(raw)):
                await release("error" if transducer.failed else "ok", tail.timings())
            if out:
                await send({"type": "http.response.body", "body": out, "more_body": True})

        try:
            async for chunk in response.stream():
                await pass_on(chunk, transducer.feed(chunk), response.finished)
        except UpstreamError as exc:
            event(log, logging.WARNING, "kv.proxy.upstream_failed", error=str(exc))
            return "error", None  # cut, as a raw stream is: the client never takes it for whole
        await pass_on(b"", transducer.close(), True)
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return ("error" if transducer.failed else "ok"), tail.timings()

    async def _converted_whole(
        self,
        response: Response,
        send: Send,
        tail: Tail,
        release: Release | None,
        headers: list[tuple[bytes, bytes]],
    ) -> tuple[str, dict[str, Any] | None]:
        """A whole chat completion (or error) answer as an Anthropic message (or error), buffered."""
        status = response.status_code
        body, result = bytearray(), "ok" if status < 400 else "error"
        try:
            async for chunk in response.stream():
                tail.feed(chunk)
                body += chunk
                if len(body) > MAX_CONVERTED_BYTES:
                    break
        except UpstreamError as exc:
            event(log, logging.WARNING, "kv.proxy.upstream_failed", error=str(exc))
            status, result = 502, "error"
            out = anthropic_error(502, f"llama-server failed while answering: {exc}")
        else:
            if len(body) > MAX_CONVERTED_BYTES:
                status, result = 502, "error"
                out = anthropic_error(502, f"llama-server's answer is over {MAX_CONVERTED_BYTES} bytes")
            elif status >= 400:
                out = error_to_anthropic(status, bytes(body))
            else:
                try:
                    out = chat_answer_to_message_bytes(bytes(body))
                except ConversionError as exc:
                    status, result, out = exc.status, "error", exc.body()
        timings = tail.timings()
        if release is not None:
            await release(result, timings)
        if status >= 400:  # an answer of ours now, whatever llama-server said it was
            headers = [(k, v) for k, v in headers if k != b"content-type"]
            headers.append((b"content-type", b"application/json"))
        headers.append((b"content-length", str(len(out)).encode()))
        await send({"type": "http.response.start", "status": status, "headers": headers})
        await send({"type": "http.response.body", "body": out, "more_body": False})
        return result, timings

    async def _pump(self, response: Response, send: Send, tail: Tail, release: Release | None) -> bool:
        """Forward the body; False when llama-server failed mid-answer (the client connection is then closed
        without a proper end, so a truncated answer never looks complete).

        The lease ends as soon as llama-server's answer is complete, before its last bytes go to the client:
        a client that has the whole answer can count on the slot being free for its next request.
        """
        status = "ok" if response.status_code < 400 else "error"
        try:
            async for chunk in response.stream():
                tail.feed(chunk)
                if release is not None and (response.finished or tail.final_event(chunk)):
                    await release(status, tail.timings())
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
        except UpstreamError as exc:
            event(log, logging.WARNING, "kv.proxy.upstream_failed", error=str(exc))
            return False
        if release is not None:
            await release(status, tail.timings())
        await send({"type": "http.response.body", "body": b"", "more_body": False})
        return True


async def race_disconnect(work: Awaitable[T], receive: Receive) -> T | None:
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


async def lifespan(receive: Receive, send: Send) -> None:
    while True:
        message = await receive()
        if message["type"] == "lifespan.startup":
            await send({"type": "lifespan.startup.complete"})
        elif message["type"] == "lifespan.shutdown":
            await send({"type": "lifespan.shutdown.complete"})
            return
