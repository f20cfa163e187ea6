"""Lifecycle hints and the operator's session operations: save, invalidate, purge (spec §50-51, §20).

A hint may cause a save (as configured, checkpoint.py); `disposed` also forgets the session: its slot no
longer counts as its (`SlotPool.vacate`, holding the slot) and its record is dropped. Restores stay lazy:
`created`/`switch` change nothing (§51). In fleet mode only a key's owner writes its files: a host that may
not write a key marks or deletes nothing of it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kvsidecar.coordinator.checkpoint import CheckpointPolicy
from kvsidecar.coordinator.ownership import KeyOwnership
from kvsidecar.coordinator.pool import SlotPool, owner_slot
from kvsidecar.coordinator.server import ServerRuntime
from kvsidecar.coordinator.sessions import SessionEvent, SessionTable
from kvsidecar.coordinator.state import SessionRuntime
from kvsidecar.errors import NotFound
from kvsidecar.store.naming import validate_session_id
from kvsidecar.store.snapshots import SnapshotStore

INVALIDATED = "INVALIDATED_BY_REQUEST"


class SessionOperations:
    def __init__(
        self,
        *,
        servers: dict[str, ServerRuntime],
        sessions: SessionTable,
        pool: SlotPool,
        checkpoints: CheckpointPolicy,
        ownership: KeyOwnership,
        store: SnapshotStore,
        fleet: bool,
    ) -> None:
        self.servers = servers
        self.sessions = sessions
        self.pool = pool
        self.checkpoints = checkpoints
        self.ownership = ownership
        self.store = store
        self.fleet = fleet  # fleet mode (restart-only): the shared manifests are read before a purge

    async def event(self, session_id: str, type_: str, seq: int | None) -> dict[str, Any]:
        saved = 0
        for rt in self.sessions.known(session_id):
            self.sessions.hinted(rt, seq)
            if await self.checkpoints.on_event(rt, type_):
                saved += 1
            if type_ == "disposed":
                await self._disown(rt)
        return {"type": type_, "saved": saved}

    async def _disown(self, rt: SessionRuntime) -> None:
        srv = self.servers.get(rt.identity.server)
        if srv is not None and owner_slot(srv, rt.key) is not None:
            slot = await self.pool.take(srv, rt.key, "dispose", srv.config.slot_wait_s)
            try:
                if slot.owner == rt.key:
                    self.pool.vacate(slot)
            finally:
                self.pool.give_back(srv, slot)
        self.sessions.drop(rt)

    async def save(self, session_id: str) -> dict[str, Any]:
        results = [await self.checkpoints.checkpoint(rt, "manual") for rt in self.sessions.known(session_id)]
        if not results:
            raise NotFound("no such session")
        return {"saved": sum(results), "checked": len(results)}

    async def invalidate(self, session_id: str) -> dict[str, Any]:
        marked = 0
        for rt in self.sessions.known(session_id):
            if not (await self.ownership.claim(rt.key)).write:  # fleet: its owner marks it, durably
                continue
            m = self.store.get(rt.key)
            for gen, _ in m.ordered_generations() if m else []:
                await asyncio.to_thread(self.store.mark_invalid, rt.key, gen, INVALIDATED)
                marked += 1
            if m:
                self.sessions.apply(rt, SessionEvent.INVALIDATED)
        return {"invalidated": marked}

    async def purge(self, session_id: str) -> dict[str, Any]:
        """Forget the session and delete its files. `purged` counts the identities whose files are gone:
        in fleet mode only a key's owner deletes them (0: another host owns the session now), and the shared
        manifests are read first (another host may have committed the session since this one started)."""
        validate_session_id(session_id)
        if self.fleet:
            await asyncio.to_thread(self.store.reload_all)
        found = self.sessions.known(session_id)
        if not found:
            raise NotFound("no such session")
        freed = purged = 0
        for rt in found:
            await self._disown(rt)
            if (await self.ownership.claim(rt.key)).write:  # fleet: only the key's owner deletes its files
                freed += await asyncio.to_thread(self.store.purge, rt.key)
                purged += 1
        return {"purged": purged, "bytes_freed": freed}
