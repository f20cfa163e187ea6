"""The request as llama-server gets it: the body pinned to the lease's slot (an Anthropic request as the
chat completion llama-server would build), and the headers and target the hop sends (no hop-by-hop headers,
session header or kvsidecar's token; llama-server's own key only for a client that proved it holds ours).
"""

from __future__ import annotations

from starlette.types import Scope

from kvsidecar.backend.llama_http import CONVERTED_TARGET, RouteKind, pin
from kvsidecar.proxy.anthropic import chat_request_bytes
from kvsidecar.proxy.forward import Convert, Outbound, hop_by_hop
from kvsidecar.proxy.sessions import SlotCall


def pinned_body(call: SlotCall, slot_id: int) -> tuple[bytes, bool, Convert | None]:
    """The body llama-server gets (`id_slot` set; an Anthropic request as a chat completion), whether it is
    pinned JSON now, and how its answer is converted back."""
    body, pinned = call.body, call.route is not RouteKind.UNPINNED and call.data is not None
    convert: Convert | None = None
    cache_prompt = call.session is not None
    if call.route is RouteKind.CONVERTED and call.data is not None:
        # an auxiliary request keeps llama-server's default (cache_prompt on), as pin() leaves it
        body = chat_request_bytes(call.data, slot_id=slot_id, cache_prompt=True if cache_prompt else None)
        convert = "stream" if call.data.get("stream") is True else "json"
    elif pinned:
        assert call.data is not None
        body = pin(call.body, call.data, slot_id, cache_prompt=cache_prompt)
    return body, pinned, convert


class Outbounds:
    """Builds each outbound request from the client's: `session_header` is never forwarded, `expected` is
    the proxy's own credential (None: no token), `llama_auth` llama-server's key (None: it has none)."""

    def __init__(self, *, session_header: bytes, expected: bytes | None, llama_auth: bytes | None) -> None:
        self.session_header, self.expected, self.llama_auth = session_header, expected, llama_auth

    def request(
        self,
        scope: Scope,
        path: str,
        body: bytes,
        *,
        authenticated: bool,
        pinned: bool,
        converted: Convert | None = None,
    ) -> Outbound:
        """The canonical path; no hop-by-hop headers, session header or our token (in either form:
        llama-server takes `X-Api-Key` as its own key); llama-server's key only for a client that proved it
        holds ours. `converted`: an Anthropic request sent as a chat completion (no query string, no
        `anthropic-*` headers)."""
        drop = hop_by_hop(scope["headers"]) | {self.session_header}
        if self.expected is not None or self.llama_auth is not None:
            drop |= {b"authorization", b"x-api-key"}
        # the gate read every body it lets through as plain text (a compressed one is refused), whatever
        # the client said it was: llama-server, built without zlib, answers an encoding 415 with no body
        drop |= {b"content-encoding"}
        if pinned:  # the body is plain JSON now
            drop |= {b"content-type"}
        headers = [
            (k, v)
            for k, v in scope["headers"]
            if k not in drop and not (converted is not None and k.startswith(b"anthropic-"))
        ]
        if pinned:
            headers.append((b"content-type", b"application/json"))
        if self.llama_auth is not None and authenticated and self.expected is not None:
            headers.append((b"authorization", self.llama_auth))
        target = path if converted is None else CONVERTED_TARGET
        if scope.get("query_string") and converted is None:  # `?beta=true` means nothing to llama-server
            target += "?" + scope["query_string"].decode("latin-1")
        return Outbound(method=scope["method"], path=target, body=body, headers=headers)
