"""A switch: a slot the caller holds changes hands (spec §21-22, §52, §72).

`Switch.to_session()` prepares the slot for an incoming session: a resident session needs nothing
(Invariant 6: no disk I/O, no management call); otherwise the slot's owner is evicted
(`CheckpointPolicy.evict`: saved first when dirty, Invariant 3) while the incoming session's snapshot is
read ahead, the session is restored or started cold (`Restorer.load`) while the evicted session's save
commits, and the slot is assigned to it (`SlotPool.assign`). `Switch.to_aux()` evicts the same way and
lends the slot to an auxiliary request, which becomes no session's state (Invariant 7).
"""

from __future__ import annotations

from functools import partial

from kvsidecar.coordinator.checkpoint import CheckpointPolicy
from kvsidecar.coordinator.pool import SlotPool
from kvsidecar.coordinator.restore import Restorer
from kvsidecar.coordinator.runtime import RuntimeGuard
from kvsidecar.coordinator.save import Saver
from kvsidecar.coordinator.server import ServerRuntime
from kvsidecar.coordinator.sessions import SessionTable
from kvsidecar.coordinator.state import AcquireResult, Outcome, SessionRuntime, Slot
from kvsidecar.coordinator.telemetry import Telemetry
from kvsidecar.store.naming import SnapshotIdentity


class Switch:
    def __init__(
        self,
        *,
        sessions: SessionTable,
        pool: SlotPool,
        guard: RuntimeGuard,
        restorer: Restorer,
        checkpoints: CheckpointPolicy,
        telemetry: Telemetry,
    ) -> None:
        self.sessions = sessions
        self.pool = pool
        self.guard = guard
        self.restorer = restorer
        self.checkpoints = checkpoints
        self.telemetry = telemetry

    async def to_session(
        self, srv: ServerRuntime, slot: Slot, rt: SessionRuntime, donor: SnapshotIdentity | None = None
    ) -> AcquireResult:
        # Invariant 6: a resident session costs no disk I/O and no management call. A local server's
        # process is checked (a /proc read, no HTTP): after a restart the slot is empty, not resident.
        if slot.owner == rt.key and srv.process is not None and not srv.process_check(srv.process):
            await self.guard.refresh(srv)
        if slot.owner == rt.key:
            return AcquireResult(outcome=Outcome.RESIDENT)
        result = AcquireResult(outcome=Outcome.COLD)
        await self._change_hands(srv, slot, result, rt, donor)
        self.pool.assign(srv, slot, rt.key, rt.scope)
        self.telemetry.loaded(srv.name, slot.id, rt, result)
        return result

    async def to_aux(self, srv: ServerRuntime, slot: Slot, scope: str) -> AcquireResult:
        """Spec §72: checkpoint the owner, then the slot belongs to no session."""
        result = AcquireResult(outcome=Outcome.COLD, reason="auxiliary")
        await self._change_hands(srv, slot, result, None, None)
        self.pool.lend_to_aux(srv, slot, scope)
        return result

    async def _change_hands(
        self,
        srv: ServerRuntime,
        slot: Slot,
        result: AcquireResult,
        rt: SessionRuntime | None,
        donor: SnapshotIdentity | None,
    ) -> None:
        """Evict the slot's owner, then load the incoming session (None: an auxiliary request)."""
        evicted = self.sessions.get(slot.owner)
        if slot.owner is not None:  # if a save comes first, the incoming snapshot is read meanwhile
            before_save = partial(self.restorer.preread, srv, rt) if rt is not None else None
            result.evicted = await self.checkpoints.evict(srv, slot, result, before_save=before_save)
        if rt is not None:
            self.telemetry.switch(srv.name, slot.id, rt, result.evicted)
            held_by = evicted.key if evicted is not None else None
            await self.restorer.load(srv, slot, rt, result, donor=donor, held_by=held_by)
        if evicted is not None:  # the evicted session's save commits meanwhile (save.py `overlap`)
            await Saver.wait_commit(evicted)
