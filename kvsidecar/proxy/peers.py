"""Fleet mode (docs/FLEET.md): a proxied session that belongs on another host goes to that host's proxy,
whole (the client's headers, token and session id; the body as it came), and its answer streams back.

The forwarding host passes on only an answer that names the host it sent the request to (`PEER_HEADER`,
which every proxy sets on its answers to a forwarded request): one from anything else (a llama-server,
another service that a host record named) never reaches the client. A host that cannot be reached, or that
stops being live before its answer begins, loses the session to this one (the fleet router takes it over),
and the request is served here.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial
from typing import TYPE_CHECKING, Any

from starlette.types import Message, Receive, Scope, Send

from kvsidecar.config import ProxyConfig
from kvsidecar.coordinator.core import Coordinator
from kvsidecar.http.guards import HOP_HEADER, hop_count
from kvsidecar.proxy.client_content import SIGNAL as CONTENT_SIGNAL
from kvsidecar.proxy.forward import PEER_HEADER, Forwarder, Outbound, hop_by_hop
from kvsidecar.proxy.sessions import SlotCall
from kvsidecar.proxy.upstream import Upstream, UpstreamError, UpstreamTimeout

if TYPE_CHECKING:
    from kvsidecar.fleet.routing import FleetRouter

_GONE = object()  # a peer proxy that stopped being live before it answered
HOP = HOP_HEADER.lower().encode()


def as_host(send: Send, host_id: str) -> Send:
    """`send`, naming this host on the answer's head: on every answer of a proxy to a request forwarded by
    another host, the answering host's id (`PEER_HEADER`)."""

    async def marked(message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != PEER_HEADER]
            message = {**message, "headers": [*headers, (PEER_HEADER, host_id.encode())]}
        await send(message)

    return marked


class PeerProxies:
    """The forwarders to other hosts' proxies (one per URL, its connections kept)."""

    def __init__(
        self,
        coordinator: Coordinator,
        cfg: ProxyConfig,
        scope_of: Callable[[SlotCall], str],
        *,
        session_header: bytes,
        fleet: Callable[[], FleetRouter | None],
    ) -> None:
        self.coordinator = coordinator
        self.cfg = cfg
        self.scope_of = scope_of  # the credential scope a request's session key is in (`Proxy.scope`)
        self.session_header = session_header
        self.fleet = fleet  # asked when a peer falls silent: whether its host is still live
        self.requests = coordinator.metrics.proxy_request
        self._peers: dict[str, Forwarder] = {}

    async def aclose(self) -> None:
        for forwarder in self._peers.values():
            await forwarder.upstream.aclose()

    async def serve(
        self,
        router: FleetRouter,
        scope: Scope,
        receive: Receive,
        send: Send,
        call: SlotCall,
        *,
        provider: str | None,
        model: str,
    ) -> bool:
        """Fleet mode: a session that belongs on another host goes to that host's proxy, whole (the client's
        headers, token and session id; the body as it came), and its answer streams back. False: served
        here (it belongs here, or the other host could not be reached: then the session is taken over)."""
        if call.session is None or provider is None:
            return False
        hop = hop_count(dict(scope.get("headers", [])))
        key, server = self.coordinator.session_key(call.session, provider, model, None, self.scope_of(call))
        if key is None or server is None:
            return False
        target = await router.proxy_target(key, server, hop)
        if target is None:
            return False
        host_id, url = target
        out_headers = self._headers(scope, call, hop)
        path = call.path
        if scope.get("query_string"):
            path += "?" + scope["query_string"].decode("latin-1")
        out = Outbound(method=scope["method"], path=path, body=call.body, headers=out_headers)
        failed: list[UpstreamError] = []

        def unreachable(exc: UpstreamError) -> bool:
            if isinstance(exc, UpstreamTimeout):
                return False  # it is working on it, silently: answered as any silent upstream
            failed.append(exc)
            return True

        started: list[bool] = []

        async def tracked(message: Message) -> None:
            if message["type"] == "http.response.start":
                started.append(True)
            await send(message)

        forwarding = asyncio.ensure_future(
            self._peer(url).forward(
                scope, out, receive, tracked, no_answer=unreachable, peer_host=host_id.encode()
            )
        )
        result = await self._until_gone(forwarding, router, host_id, started)
        if result is _GONE:  # the peer dropped out of the fleet before answering (stopped, partitioned)
            failed.append(UpstreamError(f"host {host_id} is no longer live"))
        if failed:
            await router.proxy_unreachable(key, host_id, failed[0])
            return False
        self.requests.labels("fleet", result or "aborted").inc()
        return True

    def _headers(self, scope: Scope, call: SlotCall, hop: int) -> list[tuple[bytes, bytes]]:
        """The client's headers for another host's proxy; a content-derived id is named in the session
        header, since the peer's conversation table may not know the conversation (issue 28)."""
        drop = hop_by_hop(scope["headers"]) | {HOP}
        named = call.signal == CONTENT_SIGNAL and call.session is not None
        if named:
            drop.add(self.session_header)
        out = [(k, v) for k, v in scope["headers"] if k not in drop]
        out.append((HOP, str(hop + 1).encode()))
        if named and call.session is not None:
            out.append((self.session_header, call.session.encode()))
        return out

    @staticmethod
    async def _until_gone(
        forwarding: asyncio.Future[tuple[str | None, Any]],
        router: FleetRouter,
        host_id: str,
        started: list[bool],
    ) -> str | object | None:
        """The forward's result, or _GONE when the peer stopped being live before its answer began (the
        forward is then cancelled, and the request is served here). Once the answer has begun streaming it
        runs to its end (the peer's and the client's own limits end it)."""
        try:
            while True:
                done, _ = await asyncio.wait({forwarding}, timeout=router.agent.settings.heartbeat_s)
                if done:
                    return forwarding.result()[0]
                if not started and not router.is_live(host_id):
                    return _GONE
        finally:
            if not forwarding.done():
                forwarding.cancel()
                await asyncio.gather(forwarding, return_exceptions=True)

    def _peer(self, url: str) -> Forwarder:
        """The forwarder to another host's proxy (one per URL, its connections kept)."""
        forwarder = self._peers.get(url)
        if forwarder is None:
            server = self.coordinator.config.servers[self.cfg.server]
            upstream = Upstream(
                url,
                connect_timeout_s=server.connect_timeout_s,
                read_timeout_s=self.cfg.upstream_timeout_s,
            )
            forwarder = self._peers[url] = Forwarder(upstream, partial(self._working, url), peer=True)
        return forwarder

    async def _working(self, url: str, _slot: int | None) -> bool:
        """Asked after `proxy.upstream_timeout_s` of silence from another host's proxy: it is working on
        the request while that host is live (its own limits end a request); a host that dropped out of the
        fleet (stopped, partitioned) is not, and the request ends as for any silent upstream (504)."""
        router = self.fleet()
        if router is None:
            return False
        host_id = router.host_of_proxy(url)
        return host_id is not None and router.is_live(host_id)
