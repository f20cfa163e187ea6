"""One listener's state below its ASGI app (hook API or proxy): its `Limits` (`api.*` / `proxy.*` in the
config), its open connections, oldest first, with what its limits did to them, and the canned answers
its protocol (`kvsidecar.http.listener`) writes without the app.

Who goes at the cap (`ListenerState.admit`): a connection only waiting for a request head (half-sent heads
first, oldest first); else the oldest body still arriving of the credential with the most of them, when
it has more than `max_slow_bodies` (429); else the newcomer is refused (503). A slow body counts against
its credential (`count_slow`), at most `max_slow_bodies` at a time.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any, Protocol

from kvsidecar.errors import (
    BadRequest,
    HeadersTooLarge,
    KvError,
    RequestTimeout,
    TooManyBodies,
    TooManyConnections,
    http_status,
)
from kvsidecar.http.guards import Credential, anyone


class Connection(Protocol):
    """What the listener's state needs of a connection (`kvsidecar.http.listener.LimitedHttpProtocol`)."""

    credential: bytes  # whose its request is (ListenerState.credential)
    head_begun: bool  # bytes of the awaited request head have arrived

    @property
    def waiting_for_head(self) -> bool: ...

    @property
    def body_pending(self) -> bool: ...

    def abort(self) -> None: ...

    def cut_slow_body(self) -> None: ...


def _canned(error: KvError, shape: Callable[[KvError], Any] | None = None) -> bytes:
    """A whole `connection: close` error answer, written by the protocol itself (no app involved), in the
    listener's error shape (default: the hook API's); a 503 says when to try again (`retry-after`, seconds,
    as the apps' own 503s do)."""
    body = json.dumps(shape(error) if shape is not None else {"error": error.to_dict()}).encode()
    status = http_status(error)
    retry = "retry-after: 1\r\n" if status in (HTTPStatus.SERVICE_UNAVAILABLE, 429) else ""
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


def _too_large(what: str) -> KvError:
    return HeadersTooLarge(f"request head too large: {what}")


def _bad_target() -> KvError:
    return BadRequest(
        "the request target must be a path (/...) or an http(s) URL without userinfo",
        hint="Send the request to kvsidecar directly, as to an origin server; the connection was closed.",
    )


def _too_slow() -> KvError:
    return TooManyBodies("too many request bodies of this credential are arriving slowly")


@dataclass(frozen=True, kw_only=True)
class Limits:
    max_connections: int
    header_timeout_s: float
    body_timeout_s: float
    client_stall_s: float
    max_slow_bodies: int = 32
    slow_body_s: float = 1.0

    @classmethod
    def of(cls, section: Any) -> Limits:
        """From an `api` or `proxy` config section."""
        return cls(
            max_connections=section.max_connections,
            header_timeout_s=section.header_timeout_s,
            body_timeout_s=section.body_timeout_s,
            client_stall_s=section.client_stall_s,
            max_slow_bodies=section.max_slow_bodies,
            slow_body_s=section.slow_body_s,
        )


@dataclass
class ListenerState:
    """One listener's open connections, oldest first, and what its limits did (for tests and logs)."""

    name: str
    limits: Limits
    shape: Callable[[KvError], Any] | None = None  # its error bodies (the proxy: OpenAI's), see _canned
    credential: Credential = anyone  # whose a request is, from its headers (the slow-body buckets)
    open: dict[Connection, None] = field(default_factory=dict)
    slow: dict[bytes, dict[Connection, None]] = field(default_factory=dict)  # by credential
    accepted: int = 0  # connections the listener took in, admitted or not
    evicted: int = 0
    refused: int = 0
    timed_out: int = 0
    stalled: int = 0
    bad_requests: int = 0  # requests the HTTP parser refused
    too_large: int = 0  # request heads over the limits (431)
    bad_targets: int = 0  # request targets in a form other than origin- or absolute-form http(s)
    too_slow: int = 0  # bodies cut for their credential's slow-body cap (or to make room at the cap)
    refused_answer: bytes = field(init=False, repr=False)
    timed_out_answer: bytes = field(init=False, repr=False)
    bad_request_answer: bytes = field(init=False, repr=False)
    bad_target_answer: bytes = field(init=False, repr=False)
    too_slow_answer: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.refused_answer = _canned(_refused(), self.shape)
        self.timed_out_answer = _canned(_timed_out(), self.shape)
        self.bad_request_answer = _canned(_malformed(), self.shape)
        self.bad_target_answer = _canned(_bad_target(), self.shape)
        self.too_slow_answer = _canned(_too_slow(), self.shape)

    def too_large_answer(self, what: str) -> bytes:
        return _canned(_too_large(what), self.shape)

    def admit(self, conn: Connection) -> bool:
        self.accepted += 1
        if len(self.open) >= self.limits.max_connections:
            # Half-sent heads go first (what a slowloris holds), then connections that sent nothing
            # (fresh, or kept alive between requests); oldest first. A request in progress never goes.
            idle = [c for c in self.open if c.waiting_for_head]
            oldest = next((c for c in idle if c.head_begun), None) or next(iter(idle), None)
            if oldest is None:
                # Then a body still arriving, of a credential with more of them than max_slow_bodies
                # (the one with the most): its oldest. Else every connection is busy: refused.
                uploading = [c for c in self.open if c.body_pending]
                per: dict[bytes, int] = {}
                for c in uploading:
                    per[c.credential] = per.get(c.credential, 0) + 1
                heaviest = max(per, key=lambda k: per[k], default=None)
                if heaviest is None or per[heaviest] <= self.limits.max_slow_bodies:
                    self.refused += 1
                    return False
                victim = next(c for c in uploading if c.credential == heaviest)
                self.drop(victim)
                victim.cut_slow_body()
            else:
                self.evicted += 1
                self.drop(oldest)
                oldest.abort()
        self.open[conn] = None
        return True

    def drop(self, conn: Connection) -> None:
        self.open.pop(conn, None)
        self.unslow(conn)

    def unslow(self, conn: Connection) -> None:
        bucket = self.slow.get(conn.credential)
        if bucket is not None:
            bucket.pop(conn, None)
            if not bucket:
                del self.slow[conn.credential]

    def count_slow(self, conn: Connection) -> bool:
        """Count `conn`'s body as slow for its credential; False when the credential is at its cap."""
        bucket = self.slow.setdefault(conn.credential, {})
        if conn in bucket:
            return True
        if len(bucket) >= self.limits.max_slow_bodies:
            return False
        bucket[conn] = None
        return True
