"""A lean HTTP/1.1 client for the proxy's hop to llama-server.

The proxy's job is to add as little as possible to every model call. A general-purpose client (httpx over
httpcore over anyio, with h11 framing) cost about 2-3 ms per request on this hop, more than the whole
budget. This one is an `asyncio.Protocol` with the `httptools` (llhttp) response parser, which uvicorn
already brings: one write per request, body pieces handed over as they are parsed, kept-alive connections
reused, reading paused when the consumer (the downstream client) is slower than llama-server.

Scope is exactly what the proxy needs: one origin (`http://` or `https://`), requests with a complete body,
responses framed by Content-Length, chunked encoding or connection close. Every failure is an
`UpstreamError`; nothing else leaves this module.
"""

from __future__ import annotations

import asyncio
import collections
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, cast
from urllib.parse import urlsplit

import httptools

_HIGH_WATER = 512 * 1024  # pause reading llama-server when this much is waiting for the client
_ONE_WRITE_BYTES = 64 * 1024  # head and body go out in one write below this body size


class UpstreamError(Exception):
    """The upstream did not give a usable answer (connect failure, reset, timeout, malformed response)."""


class UpstreamTimeout(UpstreamError):
    """The upstream sent nothing for the read timeout, and was not known to be working on the request."""


class _NoResponse(UpstreamError):
    """The connection closed before a single response byte: the request was never answered."""


class _Conn(asyncio.Protocol):
    """One connection; carries one request at a time."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.reused = False
        self.news = 0  # bumped on every parser event: tells real news from a silence timer
        self.still_working: Callable[[], Awaitable[bool]] | None = None
        self._reset()

    def _reset(self) -> None:
        self.parser: Any = httptools.HttpResponseParser(self)
        self.active = False
        self.got_bytes = False
        self.head_only = False
        self.status = 0
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.informational = False
        self.stray = False
        self.complete = False
        self.keep_alive = False
        self.error: UpstreamError | None = None
        self.chunks: collections.deque[bytes] = collections.deque()
        self.buffered = 0
        self.paused = False
        self.waiter: asyncio.Future[None] | None = None

    # asyncio.Protocol
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses

    def data_received(self, data: bytes) -> None:
        if not self.active or self.complete:  # nothing is owed to us: the connection is out of step
            self._close()
            return
        self.got_bytes = True
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            self._fail(UpstreamError("llama-server switched protocols; the proxy does not forward upgrades"))
        except httptools.HttpParserError as exc:
            self._fail(UpstreamError(f"malformed response from llama-server: {exc}"))

    def eof_received(self) -> bool:
        if self.active and self.head_done and not self.complete and not self._framed():
            self.complete = True  # a body delimited by the connection's end
            self._wake()
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        if self.active and not self.complete:
            if not self.got_bytes:
                self._fail(_NoResponse("llama-server closed the connection without answering"))
            else:
                self._fail(UpstreamError("llama-server closed the connection in the middle of a response"))

    # httptools callbacks
    def on_message_begin(self) -> None:
        if self.complete:  # a second response to one request: ignore it, and drop the connection
            self.stray = True
            self._close()

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.stray:
            self.headers.append((name.lower(), value))

    def on_headers_complete(self) -> None:
        if self.stray:
            return
        status = self.parser.get_status_code()
        if 100 <= status < 200:  # informational (100 Continue, 103 Early Hints): the real answer follows
            self.headers.clear()
            self.informational = True
            return
        self.status = status
        self.head_done = True
        if self.head_only:
            self.complete = True
        self._wake()

    def on_body(self, body: bytes) -> None:
        if self.head_only or self.stray:
            return
        self.chunks.append(body)
        self.buffered += len(body)
        if self.buffered > _HIGH_WATER and not self.paused and self.transport is not None:
            self.transport.pause_reading()
            self.paused = True
        self._wake()

    def on_message_complete(self) -> None:
        if self.stray:
            return
        if self.informational:
            self.informational = False
            return
        self.keep_alive = self.parser.should_keep_alive()  # only valid until the parser resets
        self.complete = True
        self._wake()

    # helpers
    def _framed(self) -> bool:
        return any(n in (b"content-length", b"transfer-encoding") for n, _ in self.headers)

    def _wake(self) -> None:
        self.news += 1
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_result(None)

    def _fail(self, error: UpstreamError) -> None:
        if self.error is None:
            self.error = error
        self._close()
        self._wake()

    def _close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    async def wait(self, timeout: float) -> None:
        """Until the parser has news for the reader; raises the connection's error or a timeout.

        Silence for `timeout` is a timeout unless `still_working` (when set) says llama-server is busy with
        this request: a long prefill sends nothing until it is done, however long it takes.
        """
        if self.error is not None:
            raise self.error
        seen = self.news
        self.waiter = self.loop.create_future()
        timer = self.loop.call_later(timeout, self._timed_out, self.waiter)
        try:
            await self.waiter
        finally:
            timer.cancel()
            self.waiter = None
        if self.error is not None:
            raise self.error
        if self.news != seen:
            return
        # silence
        if self.still_working is not None:
            try:
                busy = await self.still_working()
            except Exception:  # cannot tell (llama-server unreachable...): treat as not working
                busy = False
            if busy or self.news != seen or self.error is not None:
                return  # the caller looks at the state and waits again
        error = UpstreamTimeout(f"llama-server sent nothing for {timeout:g} s")
        self._fail(error)
        raise error

    def _timed_out(self, waiter: asyncio.Future[None]) -> None:
        if waiter is self.waiter and not waiter.done():
            waiter.set_result(None)

    def take(self) -> bytes:
        data = self.chunks.popleft() if len(self.chunks) == 1 else b"".join(self.chunks)
        self.chunks.clear()
        self.buffered = 0
        if self.paused and self.transport is not None and not self.closed:
            self.transport.resume_reading()
            self.paused = False
        return data


class Response:
    """A response whose head has arrived; the body streams through `stream()`."""

    def __init__(self, client: Upstream, conn: _Conn, read_timeout: float) -> None:
        self._client = client
        self._conn = conn
        self._timeout = read_timeout
        self.status_code = conn.status
        self.headers = conn.headers

    @property
    def finished(self) -> bool:
        """The whole body has arrived and been handed out."""
        return self._conn.complete and not self._conn.chunks

    async def stream(self) -> AsyncIterator[bytes]:
        conn = self._conn
        while True:
            if conn.chunks:
                yield conn.take()
                continue
            if conn.complete:
                break
            await conn.wait(self._timeout)

    async def read(self) -> bytes:
        return b"".join([piece async for piece in self.stream()])

    async def aclose(self) -> None:
        """Give the connection back if the exchange ended cleanly, else close it (aborting the request)."""
        conn = self._conn
        reusable = (
            self.finished  # every byte handed out, so nothing of this answer is left on the wire
            and conn.error is None
            and not conn.closed
            and not conn.head_only
            and conn.keep_alive
        )
        conn.active = False
        if reusable:
            self._client._release(conn)
        else:
            conn._close()


class Upstream:
    def __init__(
        self,
        base_url: str,
        *,
        connect_timeout_s: float,
        read_timeout_s: float,
        max_idle: int = 16,
        on_connect: Callable[[], None] | None = None,
    ) -> None:
        parts = urlsplit(base_url)
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError(f"not an http(s) URL: {base_url!r}")
        self.base_url = base_url
        self.host = parts.hostname
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if parts.scheme == "https" else None
        self.prefix = parts.path.rstrip("/")
        self.host_header = parts.netloc.rsplit("@", 1)[-1].encode("idna")
        self.connect_timeout_s = connect_timeout_s
        self.read_timeout_s = read_timeout_s
        self.max_idle = max_idle
        self.connects = 0  # connections opened
        self.on_connect = on_connect
        self._idle: list[_Conn] = []

    async def request(
        self,
        method: str,
        target: str,
        headers: list[tuple[bytes, bytes]],
        body: bytes,
        *,
        still_working: Callable[[], Awaitable[bool]] | None = None,
    ) -> Response:
        """Send one request; returns once the response head is in. A request sent on a kept-alive connection
        that the server had already closed got no answer at all, so it is sent once more on a new one."""
        head = self._head(method, target, headers, body)
        while True:
            conn = await self._connection()
            try:
                return await self._exchange(conn, method, head, body, still_working)
            except _NoResponse:
                if not conn.reused:
                    raise
            except asyncio.CancelledError:
                conn._close()
                raise

    async def aclose(self) -> None:
        for conn in self._idle:
            conn._close()
        self._idle.clear()

    def _head(self, method: str, target: str, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
        lines = [f"{method} {self.prefix}{target} HTTP/1.1".encode("latin-1"), b"host: " + self.host_header]
        lines += [name + b": " + value for name, value in headers]
        if body or method not in ("GET", "HEAD", "DELETE", "OPTIONS"):
            lines.append(b"content-length: " + str(len(body)).encode())
        return b"\r\n".join(lines) + b"\r\n\r\n"

    async def _connection(self) -> _Conn:
        while self._idle:
            conn = self._idle.pop()
            if not conn.closed:
                conn.reused = True
                return conn
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(self.connect_timeout_s):
                transport, conn = await loop.create_connection(
                    lambda: _Conn(loop), self.host, self.port, ssl=self.ssl
                )
        except (OSError, TimeoutError, ssl.SSLError) as exc:
            raise UpstreamError(f"cannot connect to {self.host}:{self.port} ({type(exc).__name__})") from exc
        self.connects += 1
        if self.on_connect is not None:
            self.on_connect()
        sock = transport.get_extra_info("socket")
        if sock is not None:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return conn

    async def _exchange(
        self,
        conn: _Conn,
        method: str,
        head: bytes,
        body: bytes,
        still_working: Callable[[], Awaitable[bool]] | None,
    ) -> Response:
        conn._reset()
        conn.still_working = still_working
        conn.active = True
        conn.head_only = method == "HEAD"
        assert conn.transport is not None
        if conn.closed:
            raise _NoResponse("connection closed")
        if len(body) < _ONE_WRITE_BYTES:
            conn.transport.write(head + body)
        else:  # not worth copying a large body to save a syscall
            conn.transport.write(head)
            conn.transport.write(body)
        while not conn.head_done:
            await conn.wait(self.read_timeout_s)
        return Response(self, conn, self.read_timeout_s)

    def _release(self, conn: _Conn) -> None:
        if len(self._idle) < self.max_idle:
            self._idle.append(conn)
        else:
            conn._close()
