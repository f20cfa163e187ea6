"""The lease table: which request holds which slot, until release or expiry (spec §20, §59).

A lease expires `lease_ttl_s` after it was granted or last renewed, on a `loop.call_later` timer: the
expiry callback runs `on_expire(lease_id)` as a task the coordinator owns. Everything here runs on the
event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

from kvsidecar.coordinator.state import Lease


class LeaseTable:
    def __init__(self, *, on_expire: Callable[[str], None]) -> None:
        self._by_id: dict[str, Lease] = {}
        self._on_expire = on_expire

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self._by_id

    def __iter__(self) -> Iterator[Lease]:
        return iter(list(self._by_id.values()))

    def get(self, lease_id: str) -> Lease | None:
        return self._by_id.get(lease_id)

    def add(self, lease: Lease, ttl_s: float) -> None:
        self._by_id[lease.id] = lease
        self._arm(lease, ttl_s)

    def renew(self, lease_id: str, ttl_s: float) -> bool:
        """Push a lease's expiry back by a full TTL; False when there is no such lease."""
        lease = self._by_id.get(lease_id)
        if lease is None:
            return False
        self._arm(lease, ttl_s)
        return True

    def pop(self, lease_id: str) -> Lease | None:
        lease = self._by_id.pop(lease_id, None)
        if lease is not None and lease.expiry is not None:
            lease.expiry.cancel()
            lease.expiry = None
        return lease

    def cancel_timers(self) -> None:
        for lease in self._by_id.values():
            if lease.expiry is not None:
                lease.expiry.cancel()

    def _arm(self, lease: Lease, ttl_s: float) -> None:
        if lease.expiry is not None:
            lease.expiry.cancel()
        lease.expiry = asyncio.get_running_loop().call_later(ttl_s, self._on_expire, lease.id)
