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

A request the HTTP parser refuses (a bad request line or header, two Content-Lengths, broken chunked
framing) is answered 400 `KV_BAD_REQUEST` in the listener's error shape and the connection closed, in place
of uvicorn's plain-text 400. On a pipelined connection the answers to the requests before it go out whole
first (a bad request queued behind them never reaches the app), and the 400 follows them; it is never
written into another answer. Every canned answer is `_canned` in the listener's shape (the proxy's: OpenAI's).

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

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from kvsidecar.errors import BadRequest, KvError, RequestTimeout, TooManyConnections, http_status
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


def _malformed() -> KvError:
    return BadRequest(
        "malformed HTTP request (request line, header, Content-Length or chunked framing)",
        hint="Send one well-formed HTTP/1.1 request; the connection was closed.",
    )


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
    bad_requests: int = 0  # requests the HTTP parser refused
    refused_answer: bytes = field(init=False, repr=False)
    timed_out_answer: bytes = field(init=False, repr=False)
    bad_request_answer: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.refused_answer = _canned(_refused(), self.shape)
        self.timed_out_answer = _canned(_timed_out(), self.shape)
        self.bad_request_answer = _canned(_malformed(), self.shape)

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
        self._malformed = False  # the parser refused what followed: 400, then close
        self._prior: RequestResponseCycle | None = None  # the request before the newest one

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
        self._prior = self.cycle
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        self._disarm()
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()  # starts the next queued request, if any
        if self.transport.is_closing() or not self.waiting_for_head:
            return
        if self._malformed:
            self._answer_malformed()
        elif self._counted:
            self._await_head()

    def data_received(self, data: bytes) -> None:
        if self._malformed:
            return  # a 400 is due: nothing after the bad bytes is a request
        self.head_begun = True
        super().data_received(data)

    def send_400_response(self, msg: str) -> None:
        """The HTTP parser refused the bytes (uvicorn calls this; `msg` is its plain-text reason): 400
        `KV_BAD_REQUEST` in this listener's shape, then close; never written into another answer.

        `self.cycle` is the newest request whose head was parsed. When answers to earlier requests are
        still due (that request is whole, or it is queued in `self.pipeline` behind a running one), they
        go out first: a bad request in the queue is dropped (its app never runs), nothing more is read,
        and `on_response_complete` writes the 400 once the last of them is complete."""
        if self._malformed or self.transport.is_closing():
            return
        self._malformed = True
        self.listener.bad_requests += 1
        event(log, logging.INFO, "kv.listener.bad_request", listener=self.listener.name)
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            self._answer_malformed()  # no answer in flight
            return
        self._disarm()  # the bad request's body timer: the running answer is not bounded by it
        self._stop_reading()
        if not cycle.more_body:
            return  # it is whole: its answer (and those before it) first, then the 400
        if self.pipeline and self.pipeline[0][0] is cycle:
            self.pipeline.popleft()  # its own body was bad, and it was queued behind a running answer
            assert self._prior is not None  # a request is queued only behind another one
            self.cycle = self._prior  # the last answer due before the 400 (and what a disconnect ends)
            return
        cycle.disconnected = True  # its own body was bad, and it is the running one: it sees the
        cycle.message_event.set()  # client leave, and what it sends goes nowhere
        if cycle.response_started:
            self.abort()  # its answer has begun: the 400 cannot be said
        else:
            self._answer_malformed()

    def _stop_reading(self) -> None:
        """Pause reading for good: uvicorn's flow control resumes only what it paused itself."""
        self.transport.pause_reading()
        self.flow.read_paused = False

    def _answer_malformed(self) -> None:
        self._disarm()
        self.transport.write(self.listener.bad_request_answer)
        self.transport.close()

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
