"""`FleetAgent`: what a kvsidecar with `fleet.enabled` runs beside its coordinator.

- A heartbeat task, every `fleet.heartbeat_s`: this host's record (host id, advertised URL, per server
  its base URL, runtime fingerprint digest and slot counts) with the host TTL; the whole residency map of
  this host (which repairs any event that was dropped); a campaign for the leader lease; the live hosts.
- Residency events: the coordinator's telemetry calls `slot_loaded` / `server_emptied` (the
  `ResidencyObserver` protocol) in the middle of an acquire. They only append to a bounded queue (the
  oldest dropped and counted when full) that a publisher task drains: no acquire ever waits on Redis.
- Redis health: every call to Redis (here, in the gate, the leader's retention and the router) runs in the
  agent's guard (`redis`, a `RedisGuard`: redis_guard.py), which bounds it and reports a failure here
  (`went_down`): the first logs one WARNING (`KV_FLEET_REDIS_DOWN`) and the daemon goes on serving as a
  single host; the heartbeat keeps trying and, when Redis answers again, logs the recovery and registers
  everything again (record, residency, leader).
- The write gate (`FleetGate`, gate.py): built by the agent, which shows its counters (status, metrics).
- Releases other hosts recorded for this one while it was not live (routing.py queues them): applied
  after each heartbeat.

It is built before the coordinator, which takes its gate, its residency observer and its status section
(`view`) at construction; `start(coordinator)` then begins heartbeating that coordinator's slots.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kvsidecar import __version__
from kvsidecar.errors import KvError
from kvsidecar.files.documents import QUEUED_RELEASE
from kvsidecar.fleet import REDIS_DOWN, redacted
from kvsidecar.fleet.gate import FleetGate
from kvsidecar.fleet.ownership import Leases
from kvsidecar.fleet.plane import (
    FleetPlane,
    HostRecord,
    ServerRecord,
    connect,
    origin_of,
    same_endpoint,
    session_hash,
)
from kvsidecar.fleet.redis_guard import RedisDown, RedisGuard
from kvsidecar.logs import event

if TYPE_CHECKING:
    from kvsidecar.config import Config
    from kvsidecar.coordinator.core import Coordinator
    from kvsidecar.coordinator.server import ServerRuntime
    from kvsidecar.fleet.gate import FenceFactory
    from kvsidecar.metrics import Metrics

log = logging.getLogger("kvsidecar.fleet")

QUEUE_MAX = 1024
OP_TIMEOUT_S = 1.0  # each Redis round trip (the guard's unit); a heartbeat is bounded by 4 of them
HEARTBEAT_TRIPS = 4
RELEASES_KEPT = 1024  # releases recorded for one host that is not live (the oldest are dropped beyond)
MAX_LEASE_CHARS = 128  # a local lease id is 22 characters (token_urlsafe(16))


@dataclass(frozen=True)
class _Op:
    key: str
    where: tuple[str, int] | None  # (server, slot) it is resident in; None: no longer resident here


class FleetAgent:
    def __init__(
        self, config: Config, *, fence_for: FenceFactory, metrics: Metrics | None = None, **redis_options: Any
    ) -> None:
        """`fence_for`: the store's fence files (`SnapshotStore.fence_with`), for the gate; `metrics`: the
        daemon's, which then shows the fleet's series."""
        fleet = config.fleet
        self.settings = fleet
        self.host_id = fleet.effective_host_id()
        self.advertise_url = config.advertise_url()
        self.advertise_proxy_url = config.advertise_proxy_url()
        self.coordinator: Coordinator | None = None  # the host this agent speaks for, from start()
        self.op_timeout_s = OP_TIMEOUT_S
        self.client = connect(fleet.redis_url, timeout_s=self.op_timeout_s, **redis_options)
        self.redis = RedisGuard(timeout_s=self.op_timeout_s, on_down=self.went_down)  # every call's bound
        self.plane = FleetPlane(
            self.client,
            key_prefix=fleet.key_prefix,
            host_ttl_s=fleet.host_ttl_s,
            own_host=self.host_id,
            local_origins=frozenset(
                o for s in config.servers.values() if (o := origin_of(s.base_url)) is not None
            ),
        )
        self.own_origins = own_origins(config)  # never forwarded to (routing.py, proxy/app.py): served here
        self.leases = Leases(self.client, key_prefix=fleet.key_prefix)
        self.queue: deque[_Op] = deque()
        self.dropped = 0  # residency events dropped from a full queue (the next heartbeat repairs them)
        self.mirror: dict[tuple[str, int], str] = {}  # (server, slot) -> key, as the events told
        self.redis_up = False
        self.down_since: float | None = None
        self.ping_ms: float | None = None
        self.is_leader = False
        self.hosts: dict[str, HostRecord] = {}  # live hosts at the last heartbeat
        self.hosts_fresh = False  # the last heartbeat refreshed `hosts` (else nothing routes by them)
        self.seen: set[str] = set()  # hosts seen live (routing.py records releases only for those)
        self.heartbeats = 0  # successful ones
        self.last_heartbeat: float | None = None  # wall clock
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._write = asyncio.Lock()  # residency writes: a replace never interleaves with an event
        self._tasks: list[asyncio.Task[None]] = []
        self.gate = FleetGate(self, fence_for)  # the write gate (fencing): the coordinator's, in fleet mode
        if metrics is not None:
            metrics.registry.register(FleetCollector(self))

    # lifecycle ---------------------------------------------------------------------------------------
    def start(self, coordinator: Coordinator) -> None:
        """Start the heartbeat and the publisher for `coordinator` (the one built with this agent's gate,
        observer and view); returns at once (Redis may be down: serving goes on)."""
        self.coordinator = coordinator
        self._tasks = [
            asyncio.create_task(self._heartbeat_loop(), name="kv-fleet-heartbeat"),
            asyncio.create_task(self._publish_loop(), name="kv-fleet-publish"),
        ]
        event(
            log,
            logging.INFO,
            "kv.fleet.started",
            host=self.host_id,
            redis=redacted(self.settings.redis_url),
            advertise=self.advertise_url,
        )

    async def aclose(self) -> None:
        """Stop the tasks; leave the fleet now (record, residency, leader) if Redis answers. From here on
        the write gate acts as without Redis (only provably owned keys): the client is closed."""
        self._stop.set()
        self._wake.set()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        with contextlib.suppress(RedisDown):
            async with self.redis.guarded(2, report=False):  # leaving: a Redis that is down is no news
                await self.plane.deregister(self.host_id)
                if self.is_leader:
                    await self.leases.resign(self.host_id)
        self.redis_up = False
        with contextlib.suppress(RedisDown):
            async with self.redis.guarded(report=False):
                await self.client.aclose()

    # the observer (called inside acquires: no awaits, never raises) ----------------------------------
    def slot_loaded(self, server: str, slot: int, key: str) -> None:
        previous = self.mirror.get((server, slot))
        self.mirror[(server, slot)] = key
        if previous is not None and previous != key and previous not in self.mirror.values():
            self._enqueue(_Op(previous, None))
        self._enqueue(_Op(key, (server, slot)))

    def server_emptied(self, server: str) -> None:
        for where in [w for w in self.mirror if w[0] == server]:
            key = self.mirror.pop(where)
            if key not in self.mirror.values():
                self._enqueue(_Op(key, None))

    def _enqueue(self, op: _Op) -> None:
        if len(self.queue) >= QUEUE_MAX:
            self.queue.popleft()
            self.dropped += 1
        self.queue.append(op)
        self._wake.set()

    # the tasks ---------------------------------------------------------------------------------------
    async def _publish_loop(self) -> None:
        while not self._stop.is_set():
            await self._wake.wait()
            self._wake.clear()
            if not self.redis_up:
                continue  # the heartbeat that finds Redis back replaces the whole map
            try:
                await self._publish()
            except RedisDown:
                pass  # the guard reported it; the heartbeat that finds Redis back republishes all
            except Exception:
                log.exception("kv.fleet.publish_failed")

    async def _publish(self) -> None:
        async with self._write:
            while self.queue:
                op = self.queue[0]
                async with self.redis.guarded():
                    if op.where is None:
                        await self.plane.drop_resident(self.host_id, [op.key])
                    else:
                        await self.plane.set_resident(self.host_id, op.key, *op.where, sid=self.sid(op.key))
                self.queue.popleft()

    async def _heartbeat_loop(self) -> None:
        while not self._stop.is_set():
            try:
                async with self.redis.guarded(HEARTBEAT_TRIPS):
                    await self.heartbeat()
            except RedisDown:
                pass  # the guard reported it (went_down): the next beat tries again
            except Exception:  # a bug (or a value we cannot read) must not end fleet mode: next beat retries
                log.exception("kv.fleet.heartbeat_failed")
                self.hosts_fresh = False  # a live view this beat could not refresh: routing serves here
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self.settings.heartbeat_s):
                    await self._stop.wait()

    async def heartbeat(self) -> None:
        """One heartbeat (the loop's body; tests call it directly): record, residency, leader, hosts."""
        self.ping_ms = await self.plane.ping_ms()
        await self.plane.register(self.record())
        async with self._write:
            truth = self.residency()
            self.queue.clear()  # every event queued so far is part of this truth
            self.mirror = {where: key for key, where in truth.items()}
            await self.plane.replace_residency(self.host_id, truth, {k: self.sid(k) for k in truth})
        self.is_leader = await self.leases.campaign(self.host_id, self.settings.host_ttl_s)
        self.hosts = await self.plane.live_hosts()
        self.hosts_fresh = True
        if len(self.seen) < RELEASES_KEPT:
            self.seen.update(self.hosts)
        self.heartbeats += 1
        self.last_heartbeat = time.time()
        self._came_back()
        await self.apply_releases()

    async def apply_releases(self) -> int:
        """Apply the releases other hosts recorded for this one while it was not live (after each
        heartbeat). Each entry is hostile input: anything but a lease id and a valid release body is
        skipped. Returns how many leases were released."""
        from kvsidecar.api.bodies import ReleaseBody  # the release route's own body model

        if self.coordinator is None:
            return 0
        key = self.plane.keys.releases(self.host_id)
        async with self.redis.guarded(), self.client.pipeline(transaction=True) as pipe:
            pipe.lrange(key, 0, RELEASES_KEPT - 1)
            pipe.ltrim(key, RELEASES_KEPT, -1)
            items, _ = await pipe.execute()
        released = 0
        for raw in items if isinstance(items, list) else []:
            try:
                data = QUEUED_RELEASE.read(raw) if isinstance(raw, bytes | str) else None
                lease = data.pop("lease", None) if isinstance(data, dict) else None
                if not isinstance(lease, str) or not lease or len(lease) > MAX_LEASE_CHARS:
                    continue
                body = ReleaseBody.model_validate(data)
                await self.coordinator.release(
                    lease,
                    status=body.status,
                    prompt_tokens=body.prompt_tokens,
                    cached_tokens=body.cached_tokens,
                    prompt_ms=body.prompt_ms,
                )
                released += 1
            except (ValueError, KvError):  # not one of ours, or the lease ended meanwhile
                continue
        if released:
            event(log, logging.INFO, "kv.fleet.releases_applied", count=released)
        return released

    def went_down(self, exc: BaseException) -> None:
        self.ping_ms = None
        if self.redis_up or self.down_since is None:
            self.redis_up, self.down_since, self.is_leader = False, time.monotonic(), False
            event(
                log,
                logging.WARNING,
                "kv.fleet.redis_down",
                code=REDIS_DOWN,
                redis=redacted(self.settings.redis_url),
                error=type(exc).__name__,
                detail="serving as a single host until Redis answers again",
            )

    def _came_back(self) -> None:
        if not self.redis_up:
            down_s = None if self.down_since is None else round(time.monotonic() - self.down_since, 1)
            self.redis_up, self.down_since = True, None
            event(log, logging.INFO, "kv.fleet.registered", host=self.host_id, down_s=down_s)
            self._wake.set()

    # what this host is -------------------------------------------------------------------------------
    # (a host not started yet holds nothing)
    def sid(self, key: str) -> str:
        """The session hash of a key this host knows ("" if it knows none)."""
        rt = self.coordinator.sessions.get(key) if self.coordinator is not None else None
        return session_hash(rt.identity.session_id) if rt is not None else ""

    def residency(self) -> dict[str, tuple[str, int]]:
        """Session key -> (server, slot), from the coordinator's slots (the truth)."""
        host = self.coordinator
        return {
            slot.owner: (srv.name, slot.id)
            for srv in (host.servers.values() if host is not None else ())
            for slot in srv.slots.values()
            if slot.owner is not None
        }

    def record(self) -> HostRecord:
        host = self.coordinator
        servers = (
            [] if host is None else [_server_record(s, host.sessions.is_dirty) for s in host.servers.values()]
        )
        return HostRecord(
            host_id=self.host_id,
            advertise_url=self.advertise_url,
            version=__version__,
            time=time.time(),
            servers=tuple(servers),
            proxy_url=self.advertise_proxy_url,
        )

    def names_this_host(self, origin: str) -> bool:
        """Whether a peer's URL (an origin) is one of this host's own listeners."""
        return any(same_endpoint(origin, own) for own in self.own_origins)

    def view(self) -> dict[str, Any]:
        """The `fleet` section of GET /v1/status (no Redis call: what the last heartbeat saw)."""
        age = None if self.last_heartbeat is None else round(time.time() - self.last_heartbeat, 3)
        return {
            "host_id": self.host_id,
            "advertise_url": self.advertise_url,
            "redis": redacted(self.settings.redis_url),
            "redis_up": self.redis_up,
            "ping_ms": None if self.ping_ms is None else round(self.ping_ms, 3),
            "leader": self.is_leader,
            "hosts": sorted(self.hosts) if self.redis_up else [],
            "resident_sessions": len(self.residency()),
            "heartbeat_age_s": age,
            "publish_queue": len(self.queue),
            "publish_dropped": self.dropped,
            "owned_sessions": len(self.gate.tokens),
            "fenced": self.gate.fence.refused,
        }


def _server_record(srv: ServerRuntime, dirty: Callable[[str], bool]) -> ServerRecord:
    """One server of this host's record: its runtime and how many of its slots are free, or clean (owned
    by a session whose turns are all saved: its eviction costs no save)."""
    slots = list(srv.slots.values())
    idle = [s for s in slots if s.holder is None]
    return ServerRecord(
        name=srv.name,
        base_url=srv.config.base_url,
        fingerprint=srv.fingerprint.digest if srv.fingerprint is not None else None,
        slots_total=len(slots),
        slots_free=sum(1 for s in idle if s.owner is None),
        slots_clean=sum(1 for s in idle if s.owner is not None and not dirty(s.owner)),
    )


def own_origins(config: Config) -> frozenset[str]:
    """This host's own listeners (a wildcard listener also as loopback), as advertised and as configured:
    a host record that names one of them is never forwarded to (the call is served here)."""
    urls = [config.advertise_url(), config.advertise_proxy_url() or ""]
    sections = [config.api, config.proxy] if config.proxy.enabled else [config.api]
    for section in sections:
        host = section.host
        host = "127.0.0.1" if host in ("0.0.0.0", "::", "") else host
        urls.append(f"http://{'[' + host + ']' if ':' in host else host}:{section.port}")
    return frozenset(o for u in urls if u and (o := origin_of(u)) is not None)


class FleetCollector(Collector):
    """The fleet gauges, read at scrape time (registered only when fleet mode runs)."""

    def __init__(self, agent: FleetAgent) -> None:
        self.agent = agent

    def collect(self) -> Iterable[Metric]:
        a = self.agent
        yield GaugeMetricFamily(
            "kvsidecar_fleet_hosts",
            "Live hosts in the fleet as this host saw them at its last heartbeat (0 while Redis is down)",
            value=len(a.hosts) if a.redis_up else 0,
        )
        yield GaugeMetricFamily(
            "kvsidecar_fleet_redis_up", "1 if Redis answered the last heartbeat", value=a.redis_up
        )
        yield GaugeMetricFamily(
            "kvsidecar_fleet_leader", "1 if this host holds the fleet's leader lease", value=a.is_leader
        )
        yield CounterMetricFamily(
            "kvsidecar_fleet_fenced",
            "Writes and deletes of a session's files refused by the shared store's fence (a stale token)",
            value=a.gate.fence.refused,
        )
        yield CounterMetricFamily(
            "kvsidecar_fleet_taken_over",
            "Claims that found another host had owned the session since (this host's copy was dropped)",
            value=a.gate.taken_over,
        )
        yield CounterMetricFamily(
            "kvsidecar_fleet_records_refused",
            "Host records read from Redis and refused: not one a kvsidecar writes (a URL that is not an "
            "origin, a bad field), or a URL naming a llama-server or this host's own listener",
            value=a.plane.refused_records,
        )
        yield CounterMetricFamily(
            "kvsidecar_fleet_publish_dropped",
            "Residency events dropped from the full publish queue (the next heartbeat republishes all)",
            value=a.dropped,
        )
