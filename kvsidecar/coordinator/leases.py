"""The lease table: which request holds which slot, until release or expiry (spec §20, §59).

A lease expires `lease_ttl_s` after it was granted or last renewed, on a `loop.call_later` timer: the
expiry callback runs `on_expire(lease_id)` as a task the coordinator owns.

A lease nobody can reach must not hold its slot that long (issue 26 C): a new lease is *claimed* (granted,
not yet seen in use) and its first timer is the short claim TTL (`api.lease_claim_ttl_s`). When it fires,
`on_claim(lease_id)` asks whether the lease is in use (the coordinator looks at its slot in the engine); a
lease in use becomes *active* (`activate`) and keeps its full TTL from the grant; one that is not is ended
then. A renewal (the proxy's keep-alive) makes a lease active at once. Everything here runs on the event
loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterator

from kvsidecar.coordinator.state import Lease


class LeaseTable:
    def __init__(
        self, *, on_expire: Callable[[str], None], on_claim: Callable[[str], None] | None = None
    ) -> None:
        self._by_id: dict[str, Lease] = {}
        self._on_expire = on_expire
        self._on_claim = on_claim

    def __len__(self) -> int:
        return len(self._by_id)

    def __contains__(self, lease_id: object) -> bool:
        return lease_id in self._by_id

    def __iter__(self) -> Iterator[Lease]:
        return iter(list(self._by_id.values()))

    def get(self, lease_id: str) -> Lease | None:
        return self._by_id.get(lease_id)

    def add(self, lease: Lease, ttl_s: float, *, claim_s: float | None = None) -> None:
        """Hold `lease`: it expires after `ttl_s`; with `claim_s` (shorter), it is checked for use then."""
        self._by_id[lease.id] = lease
        lease.granted_at = asyncio.get_running_loop().time()
        if claim_s is not None and claim_s < ttl_s and self._on_claim is not None:
            lease.active = False
            self._arm(lease, claim_s, self._on_claim)
        else:
            lease.active = True
            self._arm(lease, ttl_s, self._on_expire)

    def renew(self, lease_id: str, ttl_s: float) -> bool:
        """Push a lease's expiry back by a full TTL (it is in use: active); False when there is no such
        lease."""
        lease = self._by_id.get(lease_id)
        if lease is None:
            return False
        lease.active = True
        self._arm(lease, ttl_s, self._on_expire)
        return True

    def activate(self, lease_id: str, ttl_s: float) -> bool:
        """A claimed lease was seen in use: active, expiring `ttl_s` after its grant (at the earliest now)."""
        lease = self._by_id.get(lease_id)
        if lease is None:
            return False
        lease.active = True
        left = lease.granted_at + ttl_s - asyncio.get_running_loop().time()
        self._arm(lease, max(0.0, left), self._on_expire)
        return True

    def recheck(self, lease_id: str, after_s: float) -> bool:
        """A claimed lease whose use could not be seen either way: asked again after `after_s`."""
        lease = self._by_id.get(lease_id)
        if lease is None or self._on_claim is None:
            return False
        self._arm(lease, after_s, self._on_claim)
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

    def _arm(self, lease: Lease, delay_s: float, callback: Callable[[str], None]) -> None:
        if lease.expiry is not None:
            lease.expiry.cancel()
        lease.expiry = asyncio.get_running_loop().call_later(delay_s, callback, lease.id)
