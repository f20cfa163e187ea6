"""Fleet mode (docs/FLEET.md): several kvsidecars on one shared snapshot filesystem, coordinated by Redis.

This package is the coordination plane only, and is imported only when `fleet.enabled` (or by
`kvsidecar fleet status`): single-host mode never loads redis.

| module | owns |
|---|---|
| `plane.py` | `FleetPlane`: the Redis connection, its key names, the host registry and the residency map |
| `ownership.py` | session ownership leases with fencing tokens, and the leader lease (atomic Lua scripts) |
| `agent.py` | `FleetAgent`: what the daemon runs (heartbeat, residency publishing, leader, Redis health) |
| `status.py` | `kvsidecar fleet status`: a fleet-wide report read from Redis directly |
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
