"""The checks a request's head gets before anything of it is read, on every listener (hook API and proxy):
one of each credential header, a loopback `Host` (the DNS-rebinding guard), the bearer token; and the
reading of the two headers fleet hosts send with a forwarded call (`X-KV-Fleet-Hop`, `X-KV-Deadline-Ms`).

The token is compared here only (`token_matches`), for the apps' checks and for the listener's slow-body
buckets (`bearer_credential`) alike, so that the two never disagree on whose a request is.
"""

from __future__ import annotations

import hmac
import re
from collections.abc import Callable, Mapping, Sequence

from starlette.types import Scope

from kvsidecar.config import is_loopback
from kvsidecar.errors import BadRequest, KvError, Unauthorized

HOP_HEADER = "X-KV-Fleet-Hop"
# The caller's budget for the call in milliseconds, counted from its receipt (hosts' clocks may differ):
# 1-9 digits. Fleet hosts send it with every forwarded call; any client may.
DEADLINE_HEADER = "X-KV-Deadline-Ms"
# Whose a request is, from its headers: the listener's slow-body bucket (kvsidecar.http.limits).
Credential = Callable[[list[tuple[bytes, bytes]]], bytes]


def anyone(_: list[tuple[bytes, bytes]]) -> bytes:
    """The one bucket of a listener without a token."""
    return b""


def token_matches(headers: Mapping[bytes, bytes], expected: bytes, api_key_header: bool = False) -> bool:
    """The request carries the token: `Authorization` is `expected` (`Bearer <token>`), compared in constant
    time. With `api_key_header`, `X-Api-Key: <token>` is accepted too, and a request that carries both must
    carry the token in both (two credentials that disagree are never resolved by picking one)."""
    auth = headers.get(b"authorization")
    key = headers.get(b"x-api-key") if api_key_header else None
    if auth is None and key is None:
        return False
    ok = True
    if auth is not None:
        ok &= hmac.compare_digest(auth, expected)
    if key is not None:
        ok &= hmac.compare_digest(b"Bearer " + key, expected)
    return ok


def bearer_credential(expected: bytes | None, *, api_key_header: bool = False) -> Credential:
    """A listener's slow-body buckets: requests carrying its bearer token (`expected`, the whole
    `Authorization` value; with `api_key_header`, also `X-Api-Key: <token>`, as the proxy accepts it), and
    everything else (no token configured: one bucket for all). A request whose credential headers
    disagree, or that repeats one, is not the token's."""
    if expected is None:
        return anyone

    def credential(headers: list[tuple[bytes, bytes]]) -> bytes:
        seen: dict[bytes, bytes] = {}
        for name, value in headers:
            if name == b"authorization" or (api_key_header and name == b"x-api-key"):
                if name in seen:
                    return b""
                seen[name] = value
        return b"token" if token_matches(seen, expected, api_key_header) else b""

    return credential


def refuse(
    scope: Scope,
    headers: dict[bytes, bytes],
    *,
    expected: bytes | None,
    check_host: bool,
    exempt: bool | None = None,
    api_key_header: bool = False,
) -> KvError | None:
    """The checks every listener makes before reading a request: one of each credential header and at most
    one Host (a second one is read differently by each parser on the way: never guessed at), loopback Host,
    bearer token.

    `exempt`: the route needs no token (default: the path is our `/healthz`). `api_key_header` (the proxy):
    the token may also come as `X-Api-Key: <token>` (Anthropic's SDKs, `ANTHROPIC_API_KEY`); see
    `token_matches`."""
    counts: dict[bytes, int] = {}
    for name, _ in scope.get("headers", ()):
        if name in _ONCE:
            counts[name] = counts.get(name, 0) + 1
    twice = sorted(n.decode() for n, c in counts.items() if c > 1)
    if twice:
        return BadRequest(
            f"more than one {twice[0]} header", hint="Send each of Host, Authorization, X-Api-Key once."
        )
    if check_host and not _loopback_host(headers.get(b"host", b"").decode("latin-1")):
        return BadRequest("Host header must name a loopback address", hint="DNS rebinding guard")
    if exempt is None:
        exempt = scope.get("path") == "/healthz"  # liveness probe
    if expected is not None and not exempt and not token_matches(headers, expected, api_key_header):
        return Unauthorized("missing or wrong bearer token")
    return None


_ONCE = frozenset({b"host", b"authorization", b"x-api-key"})
# host[:port]: a name or IPv4 address, or an [IPv6] address; the port 1-5 digits
_HOST = re.compile(r"\A(?:\[([0-9A-Fa-f:.]+)\]|([A-Za-z0-9.-]+))(?::([0-9]{1,5}))?\Z")


def _loopback_host(host_header: str) -> bool:
    m = _HOST.match(host_header)
    if m is None or (m.group(3) is not None and not 0 < int(m.group(3)) < 65536):
        return False
    if m.group(1) is not None:
        return ":" in m.group(1) and is_loopback(m.group(1))  # brackets hold an IPv6 address only
    return is_loopback(m.group(2).lower())


def deadline_budget(headers: Sequence[tuple[bytes, bytes]]) -> float | None:
    """The X-KV-Deadline-Ms budget in seconds; None without the header. Anything but 1-9 ASCII digits
    (around them, optional whitespace, RFC 9110 §5.5) is refused (400 KV_BAD_REQUEST), and so is a second
    X-KV-Deadline-Ms header (which one counts would be a guess): a deadline is not guessed."""
    name = DEADLINE_HEADER.lower().encode()
    values = [v for k, v in headers if k == name]
    if not values:
        return None
    if len(values) > 1:
        raise BadRequest(f"more than one {DEADLINE_HEADER} header")
    raw = values[0].strip(b" \t")
    if not (1 <= len(raw) <= 9 and raw.isdigit() and raw.isascii()):
        raise BadRequest(f"{DEADLINE_HEADER}: must be 1-9 digits (milliseconds)")
    return int(raw) / 1000.0


def hop_count(headers: dict[bytes, bytes]) -> int:
    """The fleet hop count a peer set (one digit; anything else counts as none): the hook API's and the
    proxy's reading of X-KV-Fleet-Hop."""
    raw = headers.get(HOP_HEADER.lower().encode(), b"")
    return int(raw) if len(raw) == 1 and raw.isdigit() else 0
