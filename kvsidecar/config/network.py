"""The network sections: the hook API's listener (`api`) and the proxy's (`proxy`), with the limits every
connection to a listener has (`Listener`), and the two address rules kvsidecar applies wherever a host is
named: `is_loopback` (what may listen without a token) and `http_origin` (the only form a fleet peer's
address may take)."""

from __future__ import annotations

import ipaddress
import re
from typing import Literal

from pydantic import ByteSize, Field

from kvsidecar.config.values import Bytes, ListenAddress, PathValue, Section


def is_loopback(host: str) -> bool:
    """A loopback host name or address (no port, no brackets)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class Listener(Section):
    """A config section with a `listen: HOST:PORT` address, and the limits every connection to it has."""

    listen: ListenAddress
    # Open connections at most; at the cap, the oldest one still waiting for a request head is dropped
    # to make room, and when every one is busy with a request the newcomer is refused.
    max_connections: int = Field(default=256, ge=1, le=100_000)
    # A request head must arrive within this (from the connect, or from the end of the previous answer).
    header_timeout_s: float = Field(default=10.0, gt=0)
    # A request body must arrive within this once its head is in.
    body_timeout_s: float = Field(default=30.0, gt=0)
    # A client that does not take the answer (nothing drained) for this long is cut.
    client_stall_s: float = Field(default=60.0, gt=0)
    # Request bodies still arriving `slow_body_s` after their head, per credential (the bearer token; one
    # bucket for requests without it): one more is answered 429 KV_TOO_MANY_BODIES and closed.
    max_slow_bodies: int = Field(default=32, ge=1, le=100_000)
    slow_body_s: float = Field(default=1.0, gt=0)

    @property
    def host(self) -> str:
        return self.listen.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.listen.rpartition(":")[2])


class ApiConfig(Listener):
    listen: ListenAddress = "127.0.0.1:8377"
    unix_socket: PathValue | None = None
    token_file: PathValue | None = None
    allow_public_bind: bool = False
    max_body_bytes: Bytes = ByteSize(64 * 1024)
    lease_ttl_s: float = Field(default=600.0, gt=0)
    # A lease not yet seen in use (no model call on its slot, no renewal) ends this long after its grant
    # instead of after lease_ttl_s: nobody holds it (its caller left as it was granted). Issue 26 C.
    lease_claim_ttl_s: float = Field(default=30.0, gt=0)


class ProxyConfig(Listener):
    """The OpenAI-compatible proxy listener (llama-server's own API, session-pinned)."""

    enabled: bool = False
    listen: ListenAddress = "127.0.0.1:8378"
    server: str = "local"  # the llama-server it forwards to
    provider: str | None = None  # provider name used for acquire (default: the first routed to `server`)
    session_header: str = "X-Session-Id"
    session_field: str | None = None  # or a body field, e.g. "user" or "prompt_cache_key"
    # What names a session's KV: the session id and the request's `model` string (two model strings are two
    # sessions), or the session id alone (for clients that vary `model`; llama-server runs its own model).
    identity: Literal["session+model", "session"] = "session+model"
    # Issue 28: a request that names no session (aider, curl, the openai SDK) continues the conversation of
    # the same credential whose messages it extends (a content-derived id, digests only); off: it runs as an
    # auxiliary request, as before. docs/CLIENTS.md
    content_identity: bool = True
    max_body_bytes: Bytes = ByteSize(32 * 2**20)
    body_timeout_s: float = Field(default=120.0, gt=0)  # bodies here run to megabytes
    upstream_timeout_s: float = Field(default=600.0, gt=0)


# An origin and nothing else: http(s), a host (a name, an IPv4 or a bracketed IPv6 literal), an explicit
# port, at most a lone "/" (no path, query, fragment, userinfo, escapes, spaces or controls).
_ORIGIN = re.compile(
    r"\A(https?)://(?:\[([0-9A-Fa-f:.]{2,45})\]|([A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?))"
    r":([0-9]{1,5})/?\Z"
)


def http_origin(value: object) -> str | None:
    """`scheme://host:port` (lower-cased host) when `value` is exactly an http(s) origin, else None.

    Fleet mode builds every URL it sends to from such an origin and a path of its own: a host record (a
    Redis value, input like any other) can name where a host is, never what is asked of it there."""
    if not isinstance(value, str) or len(value) > 300:
        return None
    m = _ORIGIN.match(value)
    if m is None:
        return None
    scheme, v6, name, port = m.groups()
    if not 0 < int(port) < 65536 or port.startswith("0"):
        return None
    if v6 is not None:
        try:
            host = f"[{ipaddress.IPv6Address(v6).compressed}]"
        except ValueError:
            return None
    else:
        host = name.lower()
        labels = host.split(".")
        if any(
            not label or len(label) > 63 or label.startswith("-") or label.endswith("-") for label in labels
        ):
            return None
        if all(label.isdigit() for label in labels):  # dotted digits: an IPv4 address, canonical only
            try:
                if str(ipaddress.IPv4Address(host)) != host:
                    return None
            except ValueError:
                return None
    return f"{scheme}://{host}:{int(port)}"
