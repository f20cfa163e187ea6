"""A scripted HTTP origin on a loopback port, for the proxy's upstream client and the proxy itself.

Each accepted connection runs `handler(conn)`; the handler reads requests and writes whatever bytes the
test wants, including broken ones. Everything it saw is recorded.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any


@dataclass
class Request:
    method: str
    target: str
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class OriginConn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    index: int

    async def read_request(self) -> Request | None:
        """The next request on this connection, or None at EOF."""
        try:
            head = await self.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError):
            return None
        lines = head.decode("latin-1").split("\r\n")
        method, target, _ = lines[0].split(" ", 2)
        headers: dict[str, str] = {}
        for line in lines[1:]:
            if line:
                name, value = line.split(":", 1)
                headers[name.strip().lower()] = value.strip()
        body = await self.reader.readexactly(int(headers.get("content-length", "0")))
        return Request(method, target, headers, body)

    async def send(self, data: bytes) -> None:
        self.writer.write(data)
        await self.writer.drain()

    async def respond(
        self, body: bytes = b"ok", *, status: int = 200, headers: tuple[tuple[str, str], ...] = ()
    ) -> None:
        head = f"HTTP/1.1 {status} X\r\ncontent-length: {len(body)}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers)
        await self.send(head.encode() + b"\r\n" + body)

    def close(self) -> None:
        self.writer.close()


Handler = Callable[[OriginConn], Awaitable[None]]


@dataclass
class Origin:
    handler: Handler
    server: asyncio.Server | None = None
    connections: int = 0
    requests: list[Request] = field(default_factory=list)

    @property
    def url(self) -> str:
        assert self.server is not None
        host, port = self.server.sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    async def start(self) -> Origin:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def stop(self) -> None:
        if self.server is not None:
            self.server.close()
            await self.server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        conn = OriginConn(reader, writer, self.connections)
        try:
            await self.handler(conn)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    def recording(self, request: Request | None) -> Request | None:
        if request is not None:
            self.requests.append(request)
        return request


def keep_alive_origin(
    answer: Callable[[Request], Awaitable[tuple[int, bytes, tuple[tuple[str, str], ...]]]] | None = None,
) -> Origin:
    """An origin that answers every request on a connection (Content-Length framing) until EOF."""

    async def handler(conn: OriginConn) -> None:
        while True:
            request = origin.recording(await conn.read_request())
            if request is None:
                return
            status, body, headers = (
                await answer(request) if answer else (200, b"hello " + request.target.encode(), ())
            )
            await conn.respond(body, status=status, headers=headers)

    origin = Origin(handler)  # the handler finds it when a connection comes in
    return origin
