"""Connection limits for the HTTP listeners (hook API and proxy), below the ASGI apps.

uvicorn times out an idle kept-alive connection, but nothing else: a client that opens a connection and
sends half a request head (or a body at one byte a minute, or stops reading an answer) holds its file
descriptor and, in the proxy, its slot lease for as long as it likes. This protocol is uvicorn's own
httptools protocol with four limits per listener (`api.*` / `proxy.*` in the config; the listener's
state, its counters and canned answers are `kvsidecar.http.limits`):

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

Request heads are held to limits below what llama-server's HTTP library (cpp-httplib, as llama.cpp builds
it: 100 headers, 8 KiB a header line, a 32 KiB target) accepts, so that nothing the proxy takes in is
refused by llama-server after a slot was prepared for it: at most `MAX_HEADERS` headers, each line
(`name: value`) at most `MAX_HEADER_LINE` bytes, `MAX_HEAD_BYTES` in all, a target of at most
`MAX_TARGET` bytes. Beyond: 431 `KV_HEADERS_TOO_LARGE` in the listener's shape, closed, before the app runs.
The target must be origin-form (`/path?query`); an absolute-form target (`http://host/path`) names the
authority the request is for, so it replaces the `Host` header (RFC 9112 §3.2.2: the app's Host guard
checks it); any other form (`*`, `host:port`, another scheme, userinfo) is 400 `KV_BAD_REQUEST`.

Slow bodies, per credential (`max_slow_bodies`, `slow_body_s`): a body still arriving `slow_body_s` after its
head counts against its credential (the app's `ListenerState.credential`: the proxy's token, one bucket
for requests without it); with `max_slow_bodies` of them already counted, it is answered 429
`KV_TOO_MANY_BODIES` (`Retry-After`) and closed. A body sent with its head never counts. At
`max_connections` with no idle connection left, a credential with more than `max_slow_bodies` bodies still
arriving (counted or not yet) loses its oldest one the same way (429) to make room for the newcomer: one
credential's slow uploads cannot keep the listener full for `body_timeout_s`.

A request the HTTP parser refuses (a bad request line or header, two Content-Lengths, broken chunked
framing) is answered 400 `KV_BAD_REQUEST` in the listener's error shape and the connection closed, in place
of uvicorn's plain-text 400. On a pipelined connection the answers to the requests before it go out whole
first (a bad request queued behind them never reaches the app), and the 400 follows them; it is never
written into another answer. Every canned answer is in the listener's shape (the proxy's: OpenAI's),
built by its state (`kvsidecar.http.limits.ListenerState`).

Every limit is a timer armed and disarmed on events the protocol sees anyway (two `call_later` per
request), so the hook fast path pays a few microseconds (measured: bench_hooks p50 +0.01-0.02 ms).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Any, NoReturn

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from kvsidecar.http.limits import ListenerState
from kvsidecar.logs import event

log = logging.getLogger("kvsidecar.listener")

# A request head, at most (cpp-httplib as llama.cpp builds it: 100 headers, 8192 bytes a header line with
# its CRLF, a 32768-byte target; the proxy adds a few headers of its own, so the count has room).
MAX_HEADERS = 64
MAX_HEADER_LINE = 8000  # `name: value`, without the CRLF
MAX_TARGET = 8192
MAX_HEAD_BYTES = 32 * 1024  # the target and every header line together
LINGER_S = 2.0  # after a refusal: how long what the client still sends is read and dropped


class _Refused(Exception):
    """Raised from a parser callback (the parser stops there): the head is refused, see `_refuse_head`."""


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
        self._refusal: bytes | None = None  # the answer to a refused head (431, a bad target), else 400
        self._prior: RequestResponseCycle | None = None  # the request before the newest one
        self._head_bytes = 0  # of the request head being parsed: its target and header lines
        self._body: RequestResponseCycle | None = None  # the request whose body is still arriving
        # Requests parsed on this connection and not yet answered, oldest first: the running one and those
        # pipelined behind it (uvicorn's own connection_lost tells only the newest one the client left).
        self._unanswered: list[RequestResponseCycle] = []
        self.credential = b""  # whose that request is (ListenerState.credential)

    @property
    def waiting_for_head(self) -> bool:
        """No request in progress: a fresh connection, or a kept-alive one between requests."""
        return self.cycle is None or self.cycle.response_complete

    @property
    def body_pending(self) -> bool:
        """A request's body is still arriving, and nothing has answered the request yet."""
        cycle = self._body
        return cycle is not None and cycle.more_body and not cycle.response_started

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
        for cycle in self._unanswered:  # a pipelined request behind it must not hide the running one's
            if not cycle.response_complete:  # client leaving (an acquire waiting for a slot: issue 26 C)
                cycle.disconnected = True
                cycle.message_event.set()
        self._unanswered = []
        self._body = None
        if self._stall is not None:
            self._stall.cancel()
            self._stall = None
        self.listener.drop(self)
        super().connection_lost(exc)

    # request -----------------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self._head_bytes = 0
        super().on_message_begin()

    def on_url(self, url: bytes) -> None:
        super().on_url(url)
        self._head_bytes += len(url)
        if len(self.url) > MAX_TARGET:
            self._refuse_head(self.listener.too_large_answer(f"a request target over {MAX_TARGET} bytes"))

    def on_header(self, name: bytes, value: bytes) -> None:
        super().on_header(name, value)
        line = len(name) + 2 + len(value)
        self._head_bytes += line + 2
        if len(self.headers) > MAX_HEADERS:
            self._refuse_head(self.listener.too_large_answer(f"more than {MAX_HEADERS} headers"))
        if line > MAX_HEADER_LINE:
            self._refuse_head(self.listener.too_large_answer(f"a header line over {MAX_HEADER_LINE} bytes"))
        if self._head_bytes > MAX_HEAD_BYTES:
            self._refuse_head(self.listener.too_large_answer(f"a head over {MAX_HEAD_BYTES} bytes"))

    def on_headers_complete(self) -> None:
        self._check_target()
        self._prior = self.cycle
        super().on_headers_complete()
        cycle = self.cycle
        if cycle is self._prior:  # not a request the app sees (an upgrade)
            self._arm(self.listener.limits.body_timeout_s, self._body_timeout)
            return
        self._body = cycle
        self._unanswered = [c for c in self._unanswered if not c.response_complete] + [cycle]
        self.credential = self.listener.credential(self.headers)
        limits = self.listener.limits
        self._arm(min(limits.slow_body_s, limits.body_timeout_s), self._body_slow)

    def _refuse_head(self, answer: bytes) -> NoReturn:
        """Stop parsing: the parser raises, uvicorn calls `send_400_response`, which sends `answer`."""
        self._refusal = answer
        raise _Refused

    def _check_target(self) -> None:
        """Origin-form, or absolute-form http(s) whose authority then stands for the Host header."""
        url = self.url
        if url.startswith(b"/"):
            return
        if url[:7].lower() != b"http://" and url[:8].lower() != b"https://":
            self._refuse_head(self.listener.bad_target_answer)
        try:
            parsed = httptools.parse_url(url)
        except httptools.HttpParserInvalidURLError:
            self._refuse_head(self.listener.bad_target_answer)
        if parsed.userinfo or not parsed.host or b"%" in parsed.host:
            self._refuse_head(self.listener.bad_target_answer)
        authority = b"[" + parsed.host + b"]" if b":" in parsed.host else parsed.host
        if parsed.port is not None:
            authority += b":%d" % parsed.port
        self.headers[:] = [(k, v) for k, v in self.headers if k != b"host"] + [(b"host", authority)]

    def on_message_complete(self) -> None:
        self._disarm()
        self._body_done()
        super().on_message_complete()

    def _body_done(self) -> None:
        self._body = None
        self.listener.unslow(self)

    def on_response_complete(self) -> None:
        if self._body is not None and self._body.response_complete:
            self._body_done()  # answered: whatever of its body still comes is not waited for by anyone
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
        refused = self._refusal
        if refused is not None:
            if refused is self.listener.bad_target_answer:
                self.listener.bad_targets += 1
                event(log, logging.INFO, "kv.listener.bad_target", listener=self.listener.name)
            else:
                self.listener.too_large += 1
                event(log, logging.INFO, "kv.listener.head_too_large", listener=self.listener.name)
        else:
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
        self.transport.write(self._refusal or self.listener.bad_request_answer)
        if not self.transport.can_write_eof():
            self.transport.close()
            return
        # A close with the client's bytes still unread sends a reset, which can destroy the answer before
        # the client reads it (a head too large is refused mid-send): end our side after the answer, drop
        # what still comes (data_received, `_malformed`), and close once the client has or LINGER_S passed.
        self.transport.write_eof()
        self.transport.resume_reading()
        self._deadline = self.loop.call_later(LINGER_S, self.abort)

    def cut_slow_body(self) -> None:
        """End the request whose body is still arriving: 429 `KV_TOO_MANY_BODIES` (when nothing of an
        answer has gone out and the send buffer is empty), closed; its app sees the client leave."""
        cycle = self._body
        self._disarm()
        self._body_done()
        self.listener.too_slow += 1
        event(log, logging.INFO, "kv.listener.slow_body_refused", listener=self.listener.name)
        if self.transport.is_closing():
            return
        self._stop_reading()
        if cycle is not None:
            cycle.disconnected = True
            cycle.message_event.set()
        if cycle is None or cycle.response_started or self.transport.get_write_buffer_size() != 0:
            self.abort()
            return
        self.transport.write(self.listener.too_slow_answer)
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

    def _body_slow(self) -> None:
        """`slow_body_s` after the head: a body still arriving counts against its credential's cap."""
        self._deadline = None
        limits = self.listener.limits
        rest = max(limits.body_timeout_s - limits.slow_body_s, 0.0)  # of body_timeout_s
        if not self.body_pending or self.transport.is_closing():
            if self._body is not None and not self.transport.is_closing():  # answered, body still coming
                self._arm(rest, self._body_timeout)
            return
        if not self.listener.count_slow(self):
            self.cut_slow_body()
            return
        self._arm(rest, self._body_timeout)

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
