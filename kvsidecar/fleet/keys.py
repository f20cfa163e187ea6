"""`FleetKeys`: the names of fleet mode's Redis keys, built here and nowhere else.

Every key is under `fleet.key_prefix` (`P` below). Host ids are validated `[A-Za-z0-9._-]{1,64}`; session
keys are our own 128-bit hex identity keys, never a client string.

    P:hosts              SET     host ids that ever registered (pruned of the dead by live hosts)
    P:host:<H>           STRING  JSON record of host H, PX host_ttl: gone when H stops heartbeating
    P:res:<H>            HASH    session key -> JSON {server, slot, t, sid}: what H holds, PX host_ttl
    P:owner:<K>          STRING  "<H>|<token>", PX owner_lease_ttl (ownership.py)
    P:fence:<K>          STRING  the fencing counter of session key K (ownership.py), never expires
    P:leader             STRING  the leader's host id, PX host_ttl (ownership.py)
    P:releases:<H>       LIST    JSON releases other hosts recorded for H while it was not live (routing.py
                                 queues them, agent.py applies them), PX lease_ttl, at most RELEASES_KEPT

Snapshots never go through Redis; losing every key above loses nothing that is not rebuilt by the next
heartbeats (see docs/FLEET.md for what a lost fencing counter means).
"""

from __future__ import annotations


class FleetKeys:
    """The key names under one prefix."""

    def __init__(self, prefix: str) -> None:
        self.prefix = prefix

    def _name(self, *parts: str) -> str:
        return ":".join((self.prefix, *parts))

    @property
    def hosts(self) -> str:
        return self._name("hosts")

    def host(self, host_id: str) -> str:
        return self._name("host", host_id)

    @property
    def host_prefix(self) -> str:
        """`P:host:`, for the ownership script, which asks whether a holder's record still exists."""
        return self.host("")

    def residency(self, host_id: str) -> str:
        return self._name("res", host_id)

    def owner(self, key: str) -> str:
        return self._name("owner", key)

    def fence(self, key: str) -> str:
        return self._name("fence", key)

    @property
    def leader(self) -> str:
        return self._name("leader")

    def releases(self, host_id: str) -> str:
        return self._name("releases", host_id)
