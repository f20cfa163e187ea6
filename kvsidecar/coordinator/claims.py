"""When a lease ends without a release: its claim TTL or its full TTL ran out (issue 26 C, spec §59).

A lease is granted *claimed*; when its claim TTL runs out `LeaseEnds.check_claim()` asks whether anyone
uses it: yes when the engine is working on its slot, or the slot's tokens moved since the grant (a model
call ran); then it keeps its full TTL (`LeaseTable.activate`). No: nobody holds it (its caller left as it
was granted, its answer never arrived): it ends now, as aborted. The engine cannot say: asked again later,
within the full TTL. `expire()` ends a lease whose full TTL ran out. Either end is a release with status
"aborted" (the coordinator's `release`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable
from typing import Any

from kvsidecar.backend.base import BackendSlot
from kvsidecar.config import ApiConfig
from kvsidecar.coordinator.leases import LeaseTable
from kvsidecar.coordinator.server import ServerRuntime
from kvsidecar.coordinator.telemetry import Telemetry
from kvsidecar.errors import KvError, LeaseNotFound

Release = Callable[[str], Awaitable[Any]]  # end a lease as aborted


class LeaseEnds:
    def __init__(
        self,
        *,
        servers: dict[str, ServerRuntime],
        leases: LeaseTable,
        api: ApiConfig,
        telemetry: Telemetry,
        release: Release,
    ) -> None:
        self.servers = servers
        self.leases = leases
        self.api = api  # restart-only: a SIGHUP never changes it
        self.telemetry = telemetry
        self.release = release

    async def check_claim(self, lease_id: str) -> None:
        """A claimed lease's claim TTL ran out: is anyone using it?"""
        lease = self.leases.get(lease_id)
        if lease is None or lease.active:
            return
        in_use: bool | None = None
        srv = self.servers[lease.server]
        if srv.sleeping:  # sleep mode: no call runs on it (a call wakes it), and /slots would wake it
            in_use = False
        else:
            found = [s for s in await self._slots(srv) if s.id == lease.slot_id]
            if found:
                seen = found[0]
                moved = lease.tokens_at_grant is not None and seen.n_tokens not in (
                    None,
                    lease.tokens_at_grant,
                )
                in_use = seen.is_processing or moved
        lease = self.leases.get(lease_id)
        if lease is None or lease.active:  # released or renewed meanwhile
            return
        if in_use:
            self.leases.activate(lease_id, self.api.lease_ttl_s)
            return
        left = lease.granted_at + self.api.lease_ttl_s - asyncio.get_running_loop().time()
        if in_use is None and left > 0:
            self.leases.recheck(lease_id, min(self.api.lease_claim_ttl_s, left))
            return
        self.telemetry.lease_expired(lease, unclaimed=in_use is False)
        with contextlib.suppress(LeaseNotFound):
            await self.release(lease_id)

    async def _slots(self, srv: ServerRuntime) -> list[BackendSlot]:
        try:
            async with asyncio.timeout(max(1.0, min(10.0, self.api.lease_claim_ttl_s))):
                return await srv.backend.inspect_slots()
        except (KvError, TimeoutError):
            return []

    async def expire(self, lease_id: str) -> None:
        lease = self.leases.get(lease_id)
        if lease is None:
            return
        self.telemetry.lease_expired(lease)
        with contextlib.suppress(LeaseNotFound):
            await self.release(lease_id)
