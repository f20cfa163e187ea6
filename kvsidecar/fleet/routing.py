"""`FleetRouter`: which host serves a hook call, in fleet mode, and the forwarding of calls between hosts.

Each kvsidecar stays the only writer of its own llama-server's slots: a call for a session that belongs
elsewhere is forwarded, whole, to that host's hook API (`advertise_url`, the fleet's shared token, header
`X-KV-Fleet-Hop`), and its answer is passed back unchanged. Where a session belongs:

1. the live host that holds its ownership lease;
2. else the live host where it is resident in a slot (no I/O at all there);
3. else (acquire only) placement among the live hosts running the same runtime as this one (equal
   fingerprint digests: never a host with another model): a free slot, this host first; then a clean slot
   (its eviction costs no save); then this host. A session placed here is claimed before it is served, so
   two hosts racing for one new session agree on one of them.

A host that cannot be reached loses the session to this one at once (the ownership is taken over; fencing
keeps the unreachable host's later writes out): its session is restored here from the shared directory.

Lease ids name their host (`<host_id>~<id>`), so a release sent to any host reaches the one holding the
lease. Session-scoped calls without a provider and model (events, save, invalidate, purge) go to every
live host and their answers are summed: each host acts on what it holds of the session.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, cast

import httpx
from starlette.responses import Response

from kvsidecar.client import AsyncKvSidecar, wire
from kvsidecar.client.wire import segment
from kvsidecar.coordinator.caller import Caller
from kvsidecar.coordinator.ownership import Claim
from kvsidecar.errors import KvError, LeaseNotFound, NotFound
from kvsidecar.files.documents import PEER_ANSWER, DocumentError
from kvsidecar.fleet.agent import MAX_LEASE_CHARS, RELEASES_KEPT
from kvsidecar.fleet.plane import HostRecord, session_hash
from kvsidecar.fleet.redis_guard import RedisDown
from kvsidecar.http.guards import DEADLINE_HEADER, HOP_HEADER
from kvsidecar.logs import event

if TYPE_CHECKING:
    from kvsidecar.coordinator.core import Coordinator
    from kvsidecar.fleet.agent import FleetAgent

log = logging.getLogger("kvsidecar.fleet")

LEASE_SEP = "~"  # never in a host id nor in a local lease id (urlsafe base64)
# A host that refuses the connection, or drops it before answering (it died mid-call), or never answers:
# the session is taken over here (fencing keeps whatever the other host still writes out).
UNREACHABLE = (httpx.TransportError,)
# Hops a call may take: 1, a host routed it (the receiver serves it unless another host claimed the session
# meanwhile: then it follows the claim once more); 2, served where it lands.
MAX_HOPS = 2
MAX_DEADLINE_MS = 999_999_999  # the most X-KV-Deadline-Ms says (9 digits; forward_timeout_s has no cap)


class Forwarded(Response):
    """Another host's answer, passed back as it came (status, JSON body, Retry-After)."""


class FleetRouter:
    def __init__(
        self,
        agent: FleetAgent,
        coordinator: Coordinator,
        *,
        token: str | None,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        """`token`: the fleet's shared API token, sent to every peer; `transport`: tests' stand-in peers."""
        self.agent = agent
        self.coordinator = coordinator
        self.host_id = agent.host_id
        # The peers' hook API, through the hook-API client; never an environment proxy between hosts.
        self.peers = AsyncKvSidecar(
            token=token,
            timeout_s=httpx.Timeout(agent.settings.forward_timeout_s, connect=agent.op_timeout_s),
            transport=transport,
            trust_env=False,
        )
        self.placed: dict[str, tuple[float, int]] = {}  # host -> (heartbeat seen, placements since)

    async def aclose(self) -> None:
        await self.peers.aclose()

    # where ---------------------------------------------------------------------------------------------
    def _live(self) -> dict[str, HostRecord]:
        """The live hosts to route by: none while Redis is down or the last heartbeat could not read them."""
        agent = self.agent
        return dict(agent.hosts) if agent.redis_up and agent.hosts_fresh else {}

    async def owner_of(self, key: str) -> str | None:
        """The live host where `key` belongs now (its lease, then its residency; this host included), or
        None when it belongs nowhere (or Redis cannot say: then it is served here)."""
        live = self._live()
        if not live:
            return self.host_id
        try:
            async with self.agent.redis.guarded(2):
                held = await self.agent.leases.holder(key)
                if held is not None and held.holder in live:
                    return held.holder
                found = await self.agent.plane.where(key, live)
        except RedisDown:  # Redis trouble: serve here (a restore or a cold prefill, never wrong)
            return self.host_id
        hosts = [r.host_id for r in found]
        if self.host_id in hosts:
            return self.host_id
        return hosts[0] if hosts else None

    def place(self, server: str) -> str | None:
        """The host (other than this one) a new session of `server` should go to, or None for here."""
        live = self._live()
        mine = next((s for s in self.agent.record().servers if s.name == server), None)
        if mine is None or mine.fingerprint is None:
            return None
        best: tuple[int, int, int, str] | None = None
        for host_id, record in live.items():
            srv = next((s for s in record.servers if s.name == server), None)
            if host_id == self.host_id:
                srv = mine  # this host's own slots, as they are now
            if srv is None or srv.fingerprint != mine.fingerprint:
                continue
            free = srv.slots_free - self._recent(host_id, record.time)
            tier = 0 if free > 0 else 1 if srv.slots_clean > 0 else 2
            rank = (tier, 0 if host_id == self.host_id else 1, -free, host_id)
            if best is None or rank < best:
                best = rank
        if best is None or best[3] == self.host_id or best[0] == 2:
            return None
        return best[3]

    def _recent(self, host_id: str, seen: float) -> int:
        """Sessions this host sent to `host_id` since that host's record was written (not in it yet)."""
        at, count = self.placed.get(host_id, (0.0, 0))
        return count if at == seen else 0

    def _count_placement(self, host_id: str) -> None:
        record = self._live().get(host_id)
        if record is not None:
            at, count = self.placed.get(host_id, (0.0, 0))
            self.placed[host_id] = (record.time, count + 1 if at == record.time else 1)

    # forwarding ----------------------------------------------------------------------------------------
    async def forward(
        self,
        host_id: str,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        hop: int,
        caller: Caller | None = None,
    ) -> Response:
        """The call, forwarded to `host_id`, with the budget this host waits for it (X-KV-Deadline-Ms:
        `forward_timeout_s`, or what is left of its own caller's deadline): the receiver gives up before
        this host does, so it never grants a lease this host no longer waits for. With `caller`, the call
        is also given up (its connection closed: the receiver sees its caller leave) once that caller is
        gone."""
        record = self._live().get(host_id)
        if record is None:
            raise httpx.ConnectError(f"host {host_id} is not live")
        if self.agent.names_this_host(record.advertise_url):  # a record naming this host: served here
            raise httpx.ConnectError(f"host {host_id}'s advertise_url is this host's own listener")
        budget = self.agent.settings.forward_timeout_s
        left = caller.remaining() if caller is not None else None
        if left is not None:
            budget = min(budget, left)
        budget_ms = min(MAX_DEADLINE_MS, max(1, int(budget * 1000)))  # the receiver takes 1-9 digits
        headers = {HOP_HEADER: str(hop + 1), DEADLINE_HEADER: str(budget_ms)}
        # an origin (plane.HostRecord.from_json), then our path; the answer comes back as it is
        call = wire.raw(cast("wire.Method", method), path, body)  # the method of one of our routes
        request = self.peers.send(call, origin=record.advertise_url, headers=headers)
        try:
            async with asyncio.timeout(budget):
                answer = await self._while_live(host_id, request, caller)
        except TimeoutError:
            if caller is not None and caller.gone():
                raise caller.error(host_id) from None
            raise httpx.ReadTimeout(f"host {host_id} did not answer within {budget:.0f}s") from None
        headers = {k: v for k, v in answer.headers.items() if k.lower() in ("retry-after", "content-type")}
        return Forwarded(answer.content, status_code=answer.status_code, headers=headers)

    async def _while_live(
        self, host_id: str, request: Awaitable[httpx.Response], caller: Caller | None = None
    ) -> httpx.Response:
        """The peer's answer, unless the peer drops out of the live hosts first (stopped, partitioned: its
        kernel may still accept connections): then ConnectError, and the caller takes the session over.
        A `caller` that goes away first: KV_SLOT_BUSY (the request is cancelled, its connection closed)."""
        task = asyncio.ensure_future(request)
        gone = asyncio.ensure_future(caller.wait()) if caller is not None else None
        try:
            while True:
                waiting = {task} if gone is None else {task, gone}
                done, _ = await asyncio.wait(
                    waiting, timeout=self.agent.settings.heartbeat_s, return_when=asyncio.FIRST_COMPLETED
                )
                if task in done:
                    return task.result()
                if caller is not None and caller.gone():
                    raise caller.error(host_id)
                if not self.is_live(host_id):
                    raise httpx.ConnectError(f"host {host_id} stopped answering and is no longer live")
        finally:
            if gone is not None:
                gone.cancel()
            if not task.done():
                task.cancel()
                await asyncio.gather(task, return_exceptions=True)

    def is_live(self, host_id: str) -> bool:
        """Whether a call waiting on `host_id` should go on waiting: False only when Redis answered and
        the host's record is gone (it stopped heartbeating). While Redis or the view is unavailable
        nothing is known, and a peer that may be fine is not given up."""
        agent = self.agent
        if not agent.redis_up or not agent.hosts_fresh:
            return True
        return host_id in agent.hosts

    def host_of_proxy(self, url: str) -> str | None:
        return next((h for h, r in self._live().items() if r.proxy_url == url), None)

    async def acquire(
        self,
        key: str | None,
        server: str | None,
        path: str,
        body: dict[str, Any],
        hop: int,
        serve: Callable[[], Awaitable[dict[str, Any]]],
        *,
        caller: Caller | None = None,
    ) -> dict[str, Any] | Response:
        """An acquire (or a restore): forwarded to the host the session belongs to, or served here. A caller
        that is gone (disconnected, past its deadline) gets nothing: no claim, no forward, no lease."""
        if caller is not None and caller.gone():
            raise self._abandoned(caller, server)
        if key is None or server is None or hop >= MAX_HOPS:  # a peer insisted: served where it lands
            return self.named(await serve())
        target = await self.decide(key, server, hop)
        if caller is not None and caller.gone():  # it left while Redis was asked: forward nothing
            raise self._abandoned(caller, server)
        if target != self.host_id:
            try:
                answer = await self.forward(target, "POST", path, body, hop, caller)
            except UNREACHABLE as exc:
                if caller is not None and caller.gone():
                    raise caller.error(server) from None
                await self._take_over(key, target, exc)
            else:
                if caller is not None and caller.gone():  # granted as the caller left: nobody holds it
                    await self._drop_granted(target, answer)
                    raise caller.error(server)
                return answer
        return self.named(await serve())

    def _abandoned(self, caller: Caller, server: str | None) -> KvError:
        """The answer to a call whose caller is gone (a peer that gave up on this host, e.g. while it was
        stopped): nothing was claimed, forwarded or granted for it."""
        event(log, logging.INFO, "kv.fleet.acquire_abandoned", why=caller.why or "deadline")
        return caller.error(server or self.host_id)

    async def _drop_granted(self, host_id: str, answer: Response) -> None:
        """Release, on `host_id`, the lease its answer granted for a caller that is gone meanwhile."""
        try:
            data = PEER_ANSWER.read(bytes(answer.body)) if answer.status_code == 200 else None
        except ValueError:  # the reader's refusal (DocumentError)
            return
        lease = data.get("lease_id") if isinstance(data, dict) else None
        if not isinstance(lease, str) or not lease or len(lease) > 256:
            return
        path = f"/v1/leases/{segment(lease)}/release"
        with contextlib.suppress(*UNREACHABLE, KvError):
            await self.forward(host_id, "POST", path, {"status": "aborted"}, MAX_HOPS - 1)

    async def decide(self, key: str, server: str, hop: int) -> str:
        """The host that serves session key `key` of `server` now (this host's id: here). A session placed
        here, or routed here by a peer, is claimed first; one claimed by another host meanwhile follows it."""
        target = await self.owner_of(key) if hop == 0 else self.host_id
        if target is None:  # nobody holds it: place it
            target = self.place(server) or self.host_id
            if target != self.host_id:
                self._count_placement(target)
        if target == self.host_id:
            claim = await self.coordinator.ownership.claim(key)
            if not claim.write and claim.holder is not None and claim.holder in self._live():
                target = claim.holder  # another host claimed it first (a race): follow it
        return target

    async def proxy_target(self, key: str, server: str, hop: int) -> tuple[str, str] | None:
        """The proxy mode's route: (host id, its proxy URL) of the host that serves the session, or None
        for this host (also when that host runs no proxy, or a peer insisted)."""
        if hop >= MAX_HOPS:
            return None
        target = await self.decide(key, server, hop)
        record = self._live().get(target)
        url = record.proxy_url if record is not None else None  # an origin: the path is the proxy's own
        if url is not None and self.agent.names_this_host(url):
            url = None  # a record naming this host's own proxy: served here
        return (target, url) if target != self.host_id and url is not None else None

    async def proxy_unreachable(self, key: str, host_id: str, exc: BaseException) -> None:
        """The proxy could not reach `host_id`: the session is taken over here."""
        await self._take_over(key, host_id, exc)

    async def _take_over(self, key: str, host_id: str, exc: BaseException) -> Claim:
        event(
            log,
            logging.WARNING,
            "kv.fleet.host_unreachable",
            host=host_id,
            snapshot=key[:8],
            error=type(exc).__name__,
        )
        return await self.coordinator.ownership.claim(key, force=True)

    def named(self, answer: dict[str, Any]) -> dict[str, Any]:
        if answer.get("lease_id"):
            answer["lease_id"] = f"{self.host_id}{LEASE_SEP}{answer['lease_id']}"
        if answer.get("outcome") != "bypass":
            answer["host"] = self.host_id
        return answer

    async def release(
        self, lease_id: str, body: dict[str, Any], hop: int, serve: Callable[[str], Awaitable[dict[str, Any]]]
    ) -> dict[str, Any] | Response:
        host_id, sep, local = lease_id.rpartition(LEASE_SEP)
        if not sep or host_id == self.host_id:
            return await serve(local)
        if hop >= MAX_HOPS:
            raise LeaseNotFound("no such lease (its host is not this one)")
        if host_id in self._live():
            try:
                path = f"/v1/leases/{segment(lease_id)}/release"
                return await self.forward(host_id, "POST", path, body, hop)
            except UNREACHABLE:
                pass
        return await self._queue_release(host_id, local, body)

    async def _queue_release(self, host_id: str, local: str, body: dict[str, Any]) -> dict[str, Any]:
        """A release for a host that is not live (stopped, partitioned) or cannot be reached: recorded in
        Redis for that host, which applies it at its next heartbeat once it is back
        (`FleetAgent.apply_releases`); until then its lease holds a slot nobody can use anyway. Only for a
        host this one has seen live (a made-up host id is no lease: 404), and bounded (RELEASES_KEPT per
        host, for lease_ttl_s)."""
        if host_id not in self.agent.seen or len(local) > MAX_LEASE_CHARS:
            raise LeaseNotFound("no such lease (its host is unknown here)")
        item = json.dumps({**body, "lease": local}, separators=(",", ":"))
        key = self.agent.plane.keys.releases(host_id)
        ttl_ms = max(1, int(self.coordinator.config.api.lease_ttl_s * 1000))
        try:
            async with self.agent.redis.guarded(2), self.agent.client.pipeline(transaction=True) as pipe:
                pipe.rpush(key, item)
                pipe.ltrim(key, -RELEASES_KEPT, -1)
                pipe.pexpire(key, ttl_ms)
                await pipe.execute()
        except RedisDown:
            raise LeaseNotFound(
                f"the lease's host {host_id} is not live and the release could not be recorded",
                hint="retry the release; the lease also ends at its TTL",
            ) from None
        event(log, logging.WARNING, "kv.fleet.release_queued", host=host_id)
        return {"released": False, "dirty": False, "queued": True, "host": host_id}

    async def _holding(self, session_id: str) -> set[str]:
        live = self._live()
        if not live:
            return set()
        try:
            async with self.agent.redis.guarded(2):
                return await self.agent.plane.holding_session(session_hash(session_id), live)
        except RedisDown:
            return set()

    async def everywhere(
        self,
        session_id: str,
        method: str,
        path: str,
        body: dict[str, Any] | None,
        hop: int,
        serve: Callable[[], Awaitable[dict[str, Any]]],
        sum_keys: tuple[str, ...],
        *,
        every_host: bool = False,
    ) -> dict[str, Any]:
        """A session-scoped call on this host and on every live host holding the session in a slot (found by
        its session hash in the residency map); the numbers in `sum_keys` summed. NotFound only when no host
        knows the session. A session held nowhere is this host's to act on (a flush has nothing to save; a
        purge or an invalidate claims its keys here)."""
        if hop > 0:
            return await serve()
        if every_host:  # purge, invalidate: a host may own the session without holding it in a slot
            peers = sorted(set(self._live()) - {self.host_id})
        else:
            peers = sorted(await self._holding(session_id) - {self.host_id})
        results: list[dict[str, Any] | BaseException] = list(
            await asyncio.gather(
                serve(), *(self._peer(h, method, path, body) for h in peers), return_exceptions=True
            )
        )
        answers = [r for r in results if isinstance(r, dict)]
        if not answers:
            first = results[0]
            raise first if isinstance(first, KvError) else NotFound("no such session")
        out = dict(answers[0])
        for key in sum_keys:
            out[key] = sum(_count(a.get(key)) for a in answers)
        return out

    async def _peer(
        self, host_id: str, method: str, path: str, body: dict[str, Any] | None
    ) -> dict[str, Any]:
        response = await self.forward(host_id, method, path, body, 0)
        if response.status_code != 200:
            raise NotFound(f"host {host_id}: {response.status_code}")
        try:
            data: dict[str, Any] = PEER_ANSWER.read(bytes(response.body))
        except DocumentError as exc:
            raise NotFound(f"host {host_id}: not an answer of ours ({exc.reason})") from None
        return data


def _count(value: object) -> int:
    """A count in a peer's answer (anything else counts as 0: a peer's answer is input like any other)."""
    return value if type(value) is int and 0 <= value < 1 << 62 else 0
