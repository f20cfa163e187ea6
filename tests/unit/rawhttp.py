"""HTTP over a bare socket, for request targets that a client library would normalise (`/./x`, `//x`,
`%2e`), and for connections that misbehave on purpose (half a request, or never reading the answer)."""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit


@dataclass
class RawResponse:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def _address(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


async def raw_request(
    url: str,
    method: str,
    target: str,
    *,
    headers: dict[str, str] | None = None,
    body: bytes = b"",
    timeout_s: float = 10.0,
) -> RawResponse:
    """One request on its own connection (`connection: close`), target sent byte for byte."""
    host, port = _address(url)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        head = f"{method} {target} HTTP/1.1\r\nhost: {host}:{port}\r\nconnection: close\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
        head += f"content-length: {len(body)}\r\n\r\n"
        writer.write(head.encode("latin-1") + body)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), timeout_s)
    finally:
        writer.close()
    head_bytes, _, rest = data.partition(b"\r\n\r\n")
    lines = head_bytes.decode("latin-1").split("\r\n")
    status = int(lines[0].split(" ", 2)[1])
    parsed = {k.strip().lower(): v.strip() for k, v in (line.split(":", 1) for line in lines[1:] if line)}
    if parsed.get("transfer-encoding") == "chunked":
        rest = _unchunk(rest)
    return RawResponse(status, parsed, rest)


def _unchunk(data: bytes) -> bytes:
    out = bytearray()
    while data:
        size_line, _, data = data.partition(b"\r\n")
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            break
        out += data[:size]
        data = data[size + 2 :]
    return bytes(out)


def open_socket(url: str, *, rcvbuf: int | None = None) -> socket.socket:
    """A blocking loopback socket to `url`; `rcvbuf` shrinks its receive window (a client that reads
    nothing then stalls the sender after a few kilobytes)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.connect(_address(url))
    return sock


async def read_until_closed(sock: socket.socket, *, within_s: float) -> bytes | None:
    """Everything the other end sends until it closes (or resets) the connection; None when it is still
    open after `within_s`. Non-blocking: the server under test may share this event loop."""
    sock.setblocking(False)
    loop = asyncio.get_running_loop()
    data = bytearray()

    async def drain() -> None:
        while True:
            try:
                chunk = await loop.sock_recv(sock, 65536)
            except (ConnectionResetError, BrokenPipeError):
                return
            if not chunk:
                return
            data.extend(chunk)

    try:
        await asyncio.wait_for(drain(), within_s)
    except TimeoutError:
        return None
    return bytes(data)


async def closed_by_peer(sock: socket.socket, *, within_s: float) -> bool:
    """Whether the other end closes (or resets) the connection within `within_s`."""
    return await read_until_closed(sock, within_s=within_s) is not None
