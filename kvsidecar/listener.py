"""Connection limits for the HTTP listeners (hook API and proxy), below the ASGI apps.

uvicorn times out an idle kept-alive connection, but nothing else: a client that opens a connection and
sends half a request head (or a body at one byte a minute, or stops reading an answer) holds its file
descriptor and, in the proxy, its slot lease for as long as it likes. This protocol is uvicorn's own
httptools protocol with four limits per listener (`api.*` / `proxy.*` in the config):

- `header_timeout_s`: a request head must be complete this long after the connection opened or the
  previous answer ended; else the connection is closed (408 when it can be said without blocking).
- `body_timeout_s`: the body must be complete this long after its head; else the connection is dropped
  and the app sees the client leave (`http.disconnect`), never a short body.
- `client_stall_s`: when an answer cannot be written because the client does not read it (the send buffer
  stays above its high-water mark), the connection is dropped after this long; the app sees the client
  leave, which in the proxy closes the upstream request and releases the lease.
- `max_connections`: at the cap, a connection that is only waiting for a request head is dropped to make
  room (half-sent heads first, oldest first); when every connection is busy with a request the newcomer is
  refused (503 `KV_TOO_MANY_CONNECTIONS` with `Retry-After`, closed). So a flood of half-sent requests
  cannot keep /healthz (or anything else) out, and the listener never holds more descriptors than its cap.

Every limit is a timer armed and disarmed on events the protocol sees anyway (two `call_later` per
request), so the hook fast path pays a few microseconds (measured: bench_hooks p50 +0.01-0.02 ms).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from kvsidecar.errors import KvError, RequestTimeout, TooManyConnections, http_status
from kvsidecar.logs import event

log = logging.getLogger("kvsidecar.listener")


def _canned(error: KvError, shape: Callable[[KvError], Any] | None = None) -> bytes:
    """A whole `connection: close` error answer, written by the protocol itself (no app involved), in the
    listener's error shape (default: the hook API's); a 503 says when to try again (`retry-after`, seconds,
    as the apps' own 503s do)."""
    body = json.dumps(shape(error) if shape is not None else {"error": error.to_dict()}).encode()
    status = http_status(error)
    retry = "retry-after: 1\r\n" if status == HTTPStatus.SERVICE_UNAVAILABLE else ""
    head = (
        f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
        f"{retry}connection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


def _refused() -> KvError:
    return TooManyConnections("too many connections, every one busy with a request")


def _timed_out() -> KvError:
    return RequestTimeout("the request head did not arrive in time")


@dataclass(frozen=True, kw_only=True)
class Limits:
    max_connections: int
    header_timeout_s: float
    body_timeout_s: float
    client_stall_s: float

    @classmethod
    def of(cls, section: Any) -> Limits:
        """From an `api` or `proxy` config section."""
        return cls(
            max_connections=section.max_connections,
            header_timeout_s=section.header_timeout_s,
            body_timeout_s=section.body_timeout_s,
            client_stall_s=section.client_stall_s,
        )


@dataclass
class ListenerState:
    """One listener's open connections, oldest first, and what its limits did (for tests and logs)."""

    name: str
    limits: Limits
    shape: Callable[[KvError], Any] | None = None  # its error bodies (the proxy: OpenAI's), see _canned
    open: dict[LimitedHttpProtocol, None] = field(default_factory=dict)
    accepted: int = 0  # connections the listener took in, admitted or not
    evicted: int = 0
    refused: int = 0
    timed_out: int = 0
    stalled: int = 0
    refused_answer: bytes = field(init=False, repr=False)
    timed_out_answer: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.refused_answer = _canned(_refused(), self.shape)
        self.timed_out_answer = _canned(_timed_out(), self.shape)

    def admit(self, conn: LimitedHttpProtocol) -> bool:
        self.accepted += 1
        if len(self.open) >= self.limits.max_connections:
            # Half-sent heads go first (what a slowloris holds), then connections that sent nothing
            # (fresh, or kept alive between requests); oldest first. A request in progress never goes.
            idle = [c for c in self.open if c.waiting_for_head]
            oldest = next((c for c in idle if c.head_begun), None) or next(iter(idle), None)
            if oldest is None:
                self.refused += 1
                return False
            self.evicted += 1
            self.drop(oldest)
            oldest.abort()
        self.open[conn] = None
        return True

    def drop(self, conn: LimitedHttpProtocol) -> None:
        self.open.pop(conn, None)


class LimitedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with the limits above. Use `protocol_for(state)` to get a class."""

    listener: ListenerState

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None  # head or body, whichever is awaited
        self._stall: asyncio.TimerHandle | None = None
        self._counted = False
        self.head_begun = False  # bytes of the awaited request head have arrived

    @property
    def waiting_for_head(self) -> bool:
        """No request in progress: a fresh connection, or a kept-alive one between requests."""
        return self.cycle is None or self.cycle.response_complete

    def abort(self) -> None:
        if self.transport is not None and not self.transport.is_closing():
            self.transport.abort()

    # connection --------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if not self.listener.admit(self):
            event(log, logging.WARNING, "kv.listener.refused", listener=self.listener.name)
            transport.write(self.listener.refused_answer)
            transport.close()
            return
        self._counted = True
        self._await_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        self.listener.drop(self)
        super().connection_lost(exc)

    # request -----------------------------------------------------------------------------------------
    def on_headers_complete(self) -> None:
        self._arm(self.listener.limits.body_timeout_s, self._body_timeout)
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if not self.transport.is_closing() and self.waiting_for_head and self._counted:
            self._await_head()

    def data_received(self, data: bytes) -> None:
        self.head_begun = True
        super().data_received(data)

    # answer ------------------------------------------------------------------------------------------
    def pause_writing(self) -> None:
        super().pause_writing()
        if self._stall is None:
            self._stall = self.loop.call_later(self.listener.limits.client_stall_s, self._stalled)

    def resume_writing(self) -> None:
        super().resume_writing()
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None

    # timers ------------------------------------------------------------------------------------------
    def _await_head(self) -> None:
        self.head_begun = False
        self._arm(self.listener.limits.header_timeout_s, self._head_timeout)

    def _arm(self, delay: float, callback: Callable[[], None]) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(delay, callback)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _head_timeout(self) -> None:
        self._deadline = None
        if not self.waiting_for_head or self.transport.is_closing():
            return
        self.listener.timed_out += 1
        if self.transport.get_write_buffer_size() != 0:
            self.abort()  # close() would wait for a client that does not read
            return
        if self.head_begun:  # half a request: say why (into an empty buffer, so close() will not wait)
            self.transport.write(self.listener.timed_out_answer)
        self.transport.close()

    def _body_timeout(self) -> None:
        self._deadline = None
        self.listener.timed_out += 1
        event(log, logging.INFO, "kv.listener.body_timeout", listener=self.listener.name)
        self.abort()

    def _stalled(self) -> None:
        self._stall = None
        self.listener.stalled += 1
        event(
            log,
            logging.WARNING,
            "kv.listener.client_stalled",
            listener=self.listener.name,
            stall_s=self.listener.limits.client_stall_s,
        )
        self.abort()


def protocol_for(state: ListenerState) -> type[LimitedHttpProtocol]:
    """A protocol class bound to one listener's state (uvicorn instantiates it per connection)."""
    return type(f"LimitedHttpProtocol_{state.name}", (LimitedHttpProtocol,), {"listener": state})
