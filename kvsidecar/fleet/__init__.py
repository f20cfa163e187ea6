"""Fleet mode (docs/FLEET.md): several kvsidecars on one shared snapshot filesystem, coordinated by Redis.

This package is the coordination plane only, and is imported only when `fleet.enabled` (or by
`kvsidecar fleet status`): single-host mode never loads redis.

| module | owns |
|---|---|
| `plane.py` | `FleetPlane`: the Redis connection, host registry and residency map |
| `keys.py` | `FleetKeys`: every Redis key name, built in one place |
| `redis_guard.py` | `RedisGuard.guarded()`: the one guarded Redis call (its bound; failures as `RedisDown`) |
| `ownership.py` | session ownership leases with fencing tokens, and the leader lease (atomic Lua scripts) |
| `gate.py` | `FleetGate`: the right to write a key's files (claims, fencing); the leader's retention |
| `agent.py` | `FleetAgent`: what the daemon runs (heartbeat, residency, leader, Redis health, the gate) |
| `routing.py` | `FleetRouter`: which host serves a hook call; forwarding it (through `kvsidecar.client`) |
| `status.py` | `kvsidecar fleet status`: a fleet-wide report read from Redis directly |

Imports go one way: routing -> agent -> gate -> plane, ownership -> keys; redis_guard below all (the gate
types what it needs of the agent as `gate.RedisLink`).
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

REDIS_DOWN = "KV_FLEET_REDIS_DOWN"  # logged once (WARNING) when Redis stops answering; serving goes on


def redacted(url: str) -> str:
    """A Redis URL fit for logs and status: any password replaced by `***` (the user name is kept)."""
    try:
        parts = urlsplit(url)
        netloc = parts.netloc
    except ValueError:
        return "<unparsable redis_url>"
    if "@" not in netloc:
        return url
    userinfo, _, hostport = netloc.rpartition("@")
    user, sep, _password = userinfo.partition(":")
    shown = f"{user}:***" if sep else ("***" if user else "")
    return urlunsplit(parts._replace(netloc=f"{shown}@{hostport}"))
