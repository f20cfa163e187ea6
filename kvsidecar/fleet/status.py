"""`kvsidecar fleet status`: the fleet as Redis holds it (read directly, no daemon needed): Redis health
and ping latency, the live hosts (age of their last heartbeat, slots per server), sessions resident per
host, and the leader."""

from __future__ import annotations

import contextlib
import time
from typing import Any

from kvsidecar.config import FleetConfig
from kvsidecar.fleet import redacted
from kvsidecar.fleet.ownership import Leases
from kvsidecar.fleet.plane import FleetPlane, HostRecord, connect
from kvsidecar.fleet.redis_guard import RedisDown, RedisGuard


def _host_view(record: HostRecord, sessions: int, now: float) -> dict[str, Any]:
    return {
        "host_id": record.host_id,
        "advertise_url": record.advertise_url,
        "version": record.version,
        "age_s": round(max(0.0, now - record.time), 3),
        "sessions": sessions,
        "servers": [
            {
                "name": s.name,
                "base_url": s.base_url,
                "fingerprint": s.fingerprint[:12] if s.fingerprint else None,
                "slots_total": s.slots_total,
                "slots_free": s.slots_free,
                "slots_clean": s.slots_clean,
            }
            for s in record.servers
        ],
    }


async def gather(fleet: FleetConfig, *, timeout_s: float = 2.0, **redis_options: Any) -> dict[str, Any]:
    """The report (never raises for a Redis that is down: `redis.up` is false and `error` says why)."""
    client = connect(fleet.redis_url, timeout_s=timeout_s, **redis_options)
    guard = RedisGuard(timeout_s=timeout_s)
    plane = FleetPlane(client, key_prefix=fleet.key_prefix, host_ttl_s=fleet.host_ttl_s)
    leases = Leases(client, key_prefix=fleet.key_prefix)
    redis: dict[str, Any] = {"url": redacted(fleet.redis_url), "up": False, "ping_ms": None, "error": None}
    out: dict[str, Any] = {"key_prefix": fleet.key_prefix, "redis": redis, "leader": None, "hosts": []}
    try:
        async with guard.guarded(4):
            redis["ping_ms"] = round(await plane.ping_ms(), 3)
            hosts = await plane.live_hosts()
            sessions = await plane.sessions_per_host(hosts) if hosts else {}
            out["leader"] = await leases.leader()
        redis["up"] = True
        now = time.time()
        out["hosts"] = [_host_view(hosts[h], sessions.get(h, 0), now) for h in sorted(hosts)]
    except RedisDown as exc:
        redis["error"] = type(exc.cause).__name__  # its text may name the server; never the URL's password
    finally:
        with contextlib.suppress(RedisDown):
            async with guard.guarded():
                await client.aclose()
    return out


def render(report: dict[str, Any]) -> str:
    redis = report["redis"]
    health = f"up (ping {redis['ping_ms']:.2f} ms)" if redis["up"] else f"DOWN ({redis['error']})"
    lines = [
        f"redis    {redis['url']}  {health}",
        f"prefix   {report['key_prefix']}",
        f"leader   {report['leader'] or '-'}",
        f"hosts    {len(report['hosts'])}",
    ]
    if report["hosts"]:
        lines.append(f"  {'HOST':<20} {'AGE':>6} {'SESSIONS':>8}  SLOTS free/clean/total per server  URL")
    for host in report["hosts"]:
        slots = ", ".join(
            f"{s['name']} {s['slots_free']}/{s['slots_clean']}/{s['slots_total']}" for s in host["servers"]
        )
        lines.append(
            f"  {host['host_id']:<20} {host['age_s']:>5.1f}s {host['sessions']:>8}  {slots or '-'}  "
            f"{host['advertise_url']}"
        )
    return "\n".join(lines)
