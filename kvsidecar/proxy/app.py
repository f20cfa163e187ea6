"""Proxy mode: llama-server's own HTTP API on a second listener, with session-pinned KV persistence.

Only an allowlist of llama-server's routes is forwarded (`kvsidecar.backend.llama_http.ROUTES`: all of
kvsidecar's knowledge of llama-server's routes, slot pinning and API key lives there), matched as
cpp-httplib will route the path (escapes `%XX`, `%uXXXX` decoded once, compared literally and
case-sensitively) and forwarded under its canonical spelling. Slot management, settings, model management,
stream replay, tools and anything unknown get 403 `KV_PROXY_FORBIDDEN`: kvsidecar is the only client of
slot actions. Every body then passes one gate (`kvsidecar.proxy.gate`) before anything of it reaches
llama-server or a peer. Refusals come in the route's own error shape (Anthropic's on its routes).

Every forwarded route that runs on a slot goes through the coordinator, so nothing the proxy forwards
can change a slot kvsidecar believes it knows:

- with a session id (the `X-Session-Id` header by default, or a body field such as `user` /
  `prompt_cache_key`): acquire the session, set `id_slot` and `cache_prompt: true`, forward, stream the
  answer back chunk by chunk, release with the engine's own `timings.prompt_n` / `timings.cache_n`;
- without one: an auxiliary lease (the reserved aux slot, or a slot whose owner is saved first), with
  `id_slot` set to it whatever the client asked for.

`/v1/messages` (Anthropic Messages: Claude Code) is converted (`kvsidecar.proxy.anthropic`): llama-server's
own route drops `id_slot`, so the proxy builds the very chat completion llama-server would (token for token
the same prompt), pins it and sends it to `/v1/chat/completions`, and turns the answer back into an
Anthropic message or event stream (`kvsidecar.proxy.forward`). It does so on every pool size, one slot
included, so a session's KV is the same whatever `--parallel` is. A request that cannot be converted is an
Anthropic-shaped 400 before any slot is acquired. `/v1/messages/count_tokens` runs on no slot and passes
through. Claude Code's reachability probes (`HEAD /` in 2.1.197, `HEAD /api/hello` in 2.1.332; no
credentials) are answered here, 404 with no body as llama-server answers them, before the token check,
and reach nothing. The proxy's token is accepted as `Authorization: Bearer
<token>` or `X-Api-Key: <token>` (a request with both must carry it in both); neither is forwarded.

Routes where llama-server ignores `id_slot` (embeddings, rerank, transcriptions, ...)
are forwarded only to a llama-server with a single slot, which the lease then holds. Requests for more
than one completion (`n`, `n_cmpl`) are refused: llama-server would run the others on other slots.

A session's KV is named by its id and (`proxy.identity: session+model`, the default) the `model` string;
a snapshot is restored only into the runtime it was saved under, whatever the string says.
A client that disconnects (or is cut by the listener's limits) aborts the upstream request and the lease;
the session keeps what its slot holds once llama-server stopped, and the conversation table knows each turn
from its dispatch (`kvsidecar.proxy.sessions`). Pure ASGI, nothing buffered on the way back. The hop:
`kvsidecar.proxy.forward`; the proxy's own answers: `kvsidecar.proxy.answers`; fleet peers:
`kvsidecar.proxy.peers`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from kvsidecar.backend.llama_http import (
    ANTHROPIC_ROUTES,
    PUBLIC_PATHS,
    RouteKind,
    classify,
    llama_path,
    read_api_key,
)
from kvsidecar.backend.prompts import PromptTokens
from kvsidecar.config import Config
from kvsidecar.coordinator.caller import Caller
from kvsidecar.coordinator.core import Coordinator
from kvsidecar.coordinator.state import HOOK_SCOPE, AcquireResult, Outcome
from kvsidecar.errors import (
    BackendUnavailable,
    BadRequest,
    ConfigError,
    InvariantViolation,
    KvError,
    PayloadTooLarge,
    ProxyForbidden,
)
from kvsidecar.http.guards import bearer_credential, refuse
from kvsidecar.http.limits import Limits, ListenerState
from kvsidecar.http.messages import ClientGone, read_body, watch_disconnect
from kvsidecar.proxy import answers
from kvsidecar.proxy.answers import PROMPT_DIVERGED, SIGNAL_NONE, error_answer, kv_headers, openai_error
from kvsidecar.proxy.anthropic_errors import ConversionError
from kvsidecar.proxy.forward import Convert, Forwarder, Outbound, Release, lifespan
from kvsidecar.proxy.gate import admit, check_token_ids, token_ids
from kvsidecar.proxy.outbound import Outbounds, pinned_body
from kvsidecar.proxy.peers import HOP, PeerProxies, as_host
from kvsidecar.proxy.prompt_tokens import request_tokens_of
from kvsidecar.proxy.sessions import ProxySessions, SlotCall
from kvsidecar.proxy.upstream import Upstream

if TYPE_CHECKING:
    from kvsidecar.fleet.routing import FleetRouter

log = logging.getLogger("kvsidecar.proxy")
AUX_PURPOSE = "proxy"
# Claude Code's reachability probes (HEAD, no credentials): `/` in 2.1.197, `/api/hello` in 2.1.332. Matched
# on the path as llama-server decodes it; llama-server answers both 404.
PROBES = frozenset({"/", "/api/hello"})


class _Sent:
    """`send`, remembering whether an answer has started (an unexpected error can still be answered)."""

    __slots__ = ("send", "started")

    def __init__(self, send: Send) -> None:
        self.send, self.started = send, False

    async def __call__(self, message: Message) -> None:
        self.started = True
        await self.send(message)


def _no_fleet() -> FleetRouter | None:
    return None


class Proxy:
    """The proxy as one ASGI app (see the module docstring): refuse, read, acquire, pin, forward, release."""

    def __init__(
        self,
        coordinator: Coordinator,
        config: Config,
        *,
        token: str | None,
        check_host: bool,
        fleet: Callable[[], FleetRouter | None] = _no_fleet,
    ) -> None:
        self.coordinator = coordinator
        self.cfg = config.proxy
        self.provider = config.proxy_provider()
        server = config.servers[self.cfg.server]
        self.expected = f"Bearer {token}".encode() if token else None
        self.check_host = check_host
        self.llama_auth = None
        if server.api_key_file is not None:
            if self.expected is None:  # config validation says so too; never run without it
                raise ConfigError(
                    f"api.token_file: required with servers.{self.cfg.server}.api_key_file and the proxy on"
                )
            key = read_api_key(Path(server.api_key_file), setting=f"servers.{self.cfg.server}.api_key_file")
            self.llama_auth = f"Bearer {key}".encode()
        self.upstream = Upstream(
            server.base_url,
            connect_timeout_s=server.connect_timeout_s,
            read_timeout_s=self.cfg.upstream_timeout_s,
            on_connect=coordinator.metrics.proxy_connect.inc,
        )
        self.forwarder = Forwarder(self.upstream, self._busy)
        self.requests = coordinator.metrics.proxy_request
        self.sessions = ProxySessions(coordinator, self.cfg)
        self.outbound = Outbounds(
            session_header=self.sessions.session_header, expected=self.expected, llama_auth=self.llama_auth
        )
        self.listener = ListenerState(
            "proxy",
            Limits.of(self.cfg),
            shape=openai_error,
            credential=bearer_credential(self.expected, api_key_header=True),
        )
        # fleet mode: the daemon's router while it runs (asked on every request), and the forwarders to
        # other hosts' proxies
        self.fleet = fleet
        self.peers = PeerProxies(
            coordinator,
            self.cfg,
            self.scope,
            session_header=self.sessions.session_header,
            fleet=lambda: self.fleet(),
        )
        coordinator.sections.add("proxy", self.view)

    async def aclose(self) -> None:
        await self.peers.aclose()
        await self.upstream.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        router = self.fleet()
        if router is not None and any(k == HOP for k, _ in scope.get("headers", ())):
            send = as_host(send, router.host_id)  # a peer's forward: say which kvsidecar answers it
        sent = _Sent(send)
        try:
            await self._handle(scope, receive, sent)
        except Exception:
            log.exception("kv.proxy.unexpected_error")
            if sent.started:
                raise  # the listener cuts the connection: a broken answer never looks complete
            bug = InvariantViolation("unexpected error in the proxy; see the daemon log", hint="A bug.")
            await self._refuse(bug, scope, receive, send)

    async def _handle(self, scope: Scope, receive: Receive, send: Send) -> None:
        raw_path = scope.get("raw_path") or scope["path"].encode("utf-8")
        route = classify(scope["method"], raw_path)
        probe = scope["method"] == "HEAD" and llama_path(raw_path) in PROBES  # Claude Code's, no token
        public = probe or (route is not None and route[0] in PUBLIC_PATHS)
        headers = dict(scope.get("headers", []))
        refusal = refuse(
            scope,
            headers,
            expected=self.expected,
            check_host=self.check_host,
            exempt=public,
            api_key_header=True,
        )
        if refusal is None and probe:  # llama-server's answer (404, no body); nothing upstream is asked
            await send({"type": "http.response.start", "status": 404, "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return
        if refusal is None and route is None:
            shown = scope["path"][:80]
            refusal = ProxyForbidden(f"the proxy does not forward {scope['method']} {shown!r}")
        if refusal is not None:
            await self._refuse(refusal, scope, receive, send)
            return
        assert route is not None
        path, kind = route
        try:
            body = await read_body(receive, self.cfg.max_body_bytes)
        except ClientGone:
            return
        if body is None:
            too_big = PayloadTooLarge(f"request body is over {self.cfg.max_body_bytes} bytes")
            await self._refuse(too_big, scope, receive, send)
            return
        srv = self.coordinator.servers.get(self.cfg.server)  # None: a router's entry discovering its models
        try:  # the one body gate: nothing of a body reaches llama-server (or a peer) before it
            data = admit(scope["method"], path, scope["headers"], body, srv.caps if srv is not None else None)
            if (ids := token_ids(path, data)) is not None:
                check_token_ids(ids, await self.sessions.n_vocab(self.provider, data))
        except KvError as exc:
            await self._refuse(exc, scope, receive, send)
            return
        if kind is RouteKind.INFO:
            out = self.outbound.request(scope, path, body, authenticated=not public, pinned=False)
            await self._forward(scope, out, receive, send, kind="passthrough")
            return
        try:
            call = self.sessions.read(scope, headers, path, kind, body)
        except (KvError, ConversionError) as exc:
            await self._refuse(exc, scope, receive, send)
            return
        except Exception:  # a body none of the readers should have failed on: a 400, never a 500
            log.exception("kv.proxy.unreadable_body")
            await self._refuse(BadRequest(f"the proxy could not read this {path} body"), scope, receive, send)
            return
        await self._on_slot(scope, receive, send, call)

    async def _refuse(
        self, exc: KvError | ConversionError, scope: Scope, receive: Receive, send: Send
    ) -> None:
        """Answer a refusal in the route's own shape (Anthropic's on its routes, OpenAI's elsewhere); an
        Anthropic request that cannot be converted is Anthropic's 400 with the conversion's code."""
        self.requests.labels("refused", exc.code).inc()
        route = classify(scope["method"], scope.get("raw_path") or scope["path"].encode("utf-8"))
        if isinstance(exc, ConversionError):
            answer = Response(exc.body(), status_code=exc.status, media_type="application/json")
        else:
            answer = error_answer(exc, anthropic=route is not None and route[0] in ANTHROPIC_ROUTES)
        await answer(scope, receive, send)

    def _check_unpinned(self, call: SlotCall) -> None:
        """A route that ignores id_slot is safe only where llama-server has no other slot to pick."""
        if call.route is not RouteKind.UNPINNED:
            return
        srv = self.sessions.serving(self.provider, self.sessions.runs_on(call))  # a router's: the model's
        caps = srv.caps if srv is not None else None
        if caps is None:
            raise BackendUnavailable(f"llama-server at {self.upstream.base_url} has not answered a probe yet")
        if caps.props.get("slots_known") is False:  # a router's model never loaded, no --parallel given
            raise BackendUnavailable(f"{call.path}: the model is not loaded yet, its slot count is unknown")
        if caps.total_slots != 1:
            raise ProxyForbidden(
                f"{call.path} runs on a slot llama-server picks itself (it ignores id_slot); with "
                f"{caps.total_slots} slots it could overwrite a session's slot, so the proxy forwards it "
                "only to a llama-server with one slot (--parallel 1)"
            )

    def scope(self, call: SlotCall) -> str:
        """A request's credential scope (docs/CLIENTS.md): with the operator's token every client holds it."""
        return HOOK_SCOPE if self.expected is not None else call.credential

    def _kv_headers(self, call: SlotCall, lease: AcquireResult) -> list[tuple[bytes, bytes]] | None:
        signal = (b"x-kv-signal", (call.signal or SIGNAL_NONE).encode())
        if call.session is None:
            return [signal]  # an auxiliary request is no session's: nothing else to say about one
        out = kv_headers(lease, restore_enabled=self.coordinator.config.restore.enabled)
        out.append(signal)
        if call.diverged is not None:  # its messages stopped extending the session's last request
            if not any(k == b"x-kv-reason" for k, _ in out):
                out.append((b"x-kv-reason", PROMPT_DIVERGED.encode()))
            out.append((b"x-kv-diverged-message", str(call.diverged).encode()))
        router = self.fleet()
        if router is not None:  # fleet mode: which host served it
            out.append((b"x-kv-host", router.host_id.encode()))
        return out

    def view(self) -> dict[str, Any]:
        """The proxy's part of status: the conversation table's size and the latest divergences."""
        return self.sessions.view()

    async def _on_slot(self, scope: Scope, receive: Receive, send: Send, call: SlotCall) -> None:
        """Acquire (the session, or an auxiliary lease), pin, forward, release."""
        call = self.sessions.resolve(call)  # before the fleet hand-off: fleet routing goes by the session
        kind = "managed" if call.session is not None else "auxiliary"
        self.coordinator.metrics.proxy_session_signal.labels(call.signal or SIGNAL_NONE, kind).inc()
        router = self.fleet()
        if router is not None and await self.peers.serve(
            router, scope, receive, send, call, provider=self.provider, model=self.sessions.model_label(call)
        ):
            return  # fleet mode: another host's proxy served it
        if self.provider is None or not self.coordinator.config.enabled:  # no slot of it is managed
            why = "unmanaged provider" if self.provider is None else "disabled"
            bypass = AcquireResult(outcome=Outcome.BYPASS, reason=why)
            out = self.outbound.request(scope, call.path, call.body, authenticated=True, pinned=False)
            extra = self._kv_headers(call, bypass)
            await self._forward(scope, out, receive, send, kind="passthrough", extra=extra)
            return
        lease = await self._acquire(scope, receive, send, call, self.provider)
        if lease is None:
            return  # refused, and answered
        extra = self._kv_headers(call, lease)
        if lease.lease_id is None or lease.slot_id is None:  # bypass (disabled, shutting down)
            out = self.outbound.request(scope, call.path, call.body, authenticated=True, pinned=False)
            await self._forward(scope, out, receive, send, kind="passthrough", extra=extra)
            return
        await self._run(scope, receive, send, call, lease, kind=kind, extra=extra)

    async def _acquire(
        self, scope: Scope, receive: Receive, send: Send, call: SlotCall, provider: str
    ) -> AcquireResult | None:
        """The call's lease (or a bypass); None when it was refused (answered here)."""
        # a client that hangs up while its acquire waits for a slot gets no lease (issue 26 C)
        caller = Caller()
        watch = asyncio.ensure_future(watch_disconnect(receive, caller))
        try:
            self._check_unpinned(call)
            donor = self.sessions.donor(call)
            prompt = partial(self._prompt_tokens, call, provider, donor=donor is not None)  # once let in
            return await self.coordinator.acquire(
                call.session,
                provider=provider,
                model=self.sessions.model_label(call),
                purpose=None if call.session is not None else AUX_PURPOSE,
                caller=caller,
                scope=self.scope(call),
                prefix_from=donor,
                extends=self.sessions.conversations.known_extension(
                    call.credential, call.session, call.norm, new=call.new, diverged=call.diverged
                ),
                signal=call.signal or SIGNAL_NONE,  # what named it, and which client (the session's view)
                client=answers.client_of(call.signal, scope["headers"], call.data),
                runs_on=self.sessions.runs_on(call),
                prompt=prompt,
            )
        except KvError as exc:
            await self._refuse(exc, scope, receive, send)
            return None
        finally:
            watch.cancel()
            await asyncio.gather(watch, return_exceptions=True)

    async def _prompt_tokens(self, call: SlotCall, provider: str, *, donor: bool) -> PromptTokens | None:
        """The tokens a session's request puts in its slot, when they can change what it starts from (every
        memory class but plain attention, and a donor proposed on any: coordinator/plan.py). Unknown tokens
        are a fact for the plan, never an error: the request is forwarded as sent either way."""
        if call.session is None:
            return None
        srv = self.coordinator.route(provider, self.sessions.runs_on(call))
        tok = None if srv is None else self.coordinator.restorer.planner.tokenizer_for(srv, always=donor)
        return None if tok is None else await request_tokens_of(tok, call)

    async def _run(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        call: SlotCall,
        lease: AcquireResult,
        *,
        kind: str,
        extra: list[tuple[bytes, bytes]] | None,
    ) -> None:
        """Pin the request to the lease's slot, forward it, release the lease with llama-server's numbers."""
        assert lease.lease_id is not None and lease.slot_id is not None
        turn = self.sessions.begin(call)  # the table knows the turn before its answer can end
        release = Release(
            self.coordinator, lease.lease_id, held=self.sessions.held(call, lease.slot_id, lease.server)
        )
        status, timings = "aborted", None
        try:
            if lease.prompt_point:  # the plan saves the prompt's end before generating (never fails the call)
                extra = answers.with_point(extra, await self.coordinator.savepoints.take(lease.lease_id))
            body, pinned, convert = pinned_body(call, lease.slot_id)
            out = self.outbound.request(
                scope, call.path, body, authenticated=True, pinned=pinned, converted=convert
            )
            status, timings = await self._forward(
                scope,
                out,
                receive,
                send,
                kind=kind,
                extra=extra,
                release=release,
                slot_id=lease.slot_id,
                convert=convert,
            )
        finally:
            await release(status, timings)  # a no-op when the pump already released at the answer's end
            self.sessions.end(call, turn, release.status or status, lease, release)

    async def _forward(
        self,
        scope: Scope,
        out: Outbound,
        receive: Receive,
        send: Send,
        *,
        kind: str,
        extra: list[tuple[bytes, bytes]] | None = None,
        release: Release | None = None,
        slot_id: int | None = None,
        convert: Convert | None = None,
    ) -> tuple[str, dict[str, Any] | None]:
        """Forward, count; returns the lease's release status (ok / error / aborted) and the timings."""
        result, timings = await self.forwarder.forward(
            scope, out, receive, send, extra=extra, release=release, slot_id=slot_id, convert=convert
        )
        self.requests.labels(kind, result or "aborted").inc()
        if result is None:
            return "aborted", None
        return ("ok" if result == "ok" else "error"), timings

    async def _busy(self, slot_id: int | None) -> bool:
        """Is llama-server processing on `slot_id` (any slot: None)? Asked after a silence."""
        servers = self.coordinator.servers
        url = servers[self.cfg.server].config.base_url
        # a router's models share its address: any of them still working on that slot id counts
        for srv in [s for s in servers.values() if s.config.base_url == url and not s.sleeping]:
            slots = await srv.backend.inspect_slots()
            if any(s.is_processing for s in slots if slot_id is None or s.id == slot_id):
                return True
        return False
