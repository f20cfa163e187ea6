"""Lifecycle hints and the operator's session operations: save, invalidate, purge (spec §50-51, §20), and
the checkpoint of every dirty slot of a server before a planned stop (`kvsidecar checkpoint`).

A hint may cause a save (as configured, checkpoint.py); `disposed` also forgets the session: its slot no
longer counts as its (`SlotPool.vacate`, holding the slot) and its record is dropped. Restores stay lazy:
`created`/`switch` change nothing (§51). In fleet mode only a key's owner writes its files: a host that may
not write a key marks or deletes nothing of it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from kvsidecar.coordinator.checkpoint import CheckpointPolicy
from kvsidecar.coordinator.ownership import KeyOwnership
from kvsidecar.coordinator.pool import SlotPool, owner_slot
from kvsidecar.coordinator.server import ServerRuntime
from kvsidecar.coordinator.sessions import SessionEvent, SessionTable
from kvsidecar.coordinator.state import SessionRuntime
from kvsidecar.errors import NotFound, OperationTimeout, SaveFailed
from kvsidecar.store.naming import validate_session_id
from kvsidecar.store.snapshots import SnapshotStore

INVALIDATED = "INVALIDATED_BY_REQUEST"
CHECKPOINT = "checkpoint"  # the save trigger of a planned stop (kvsidecar_save_total{trigger})


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
        members: Callable[[str], list[str] | None] = lambda _name: None,
    ) -> None:
        self.servers = servers
        self.sessions = sessions
        self.pool = pool
        self.checkpoints = checkpoints
        self.ownership = ownership
        self.store = store
        self.fleet = fleet  # fleet mode (restart-only): the shared manifests are read before a purge
        self.members = members  # a router's entry that discovers its models -> the servers they are

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

    async def checkpoint(self, server: str | None, *, wait: bool, timeout_s: float) -> dict[str, Any]:
        """Save every dirty slot of `server` (None: every server) now, before a planned stop: the shutdown
        checkpoint's own loop (`CheckpointPolicy.checkpoint_all`), run as the coordinator's task, so that a
        caller that leaves or gives up never cancels a save. With `wait` the answer comes once every save
        has committed: KV_SAVE_FAILED naming each session a stop would cost its unsaved turns, or
        KV_OPERATION_TIMEOUT past `timeout_s` (the saves go on)."""
        group = self.members(server) if server is not None and server not in self.servers else None
        if server is not None and server not in self.servers and group is None:
            raise NotFound(f"no such server: {server[:64]!r}", hint=f"Servers: {', '.join(self.servers)}.")
        names = group if group is not None else [server] if server is not None else list(self.servers)
        dirty = sum(1 for rt in self.sessions.by_key.values() if rt.dirty and rt.identity.server in names)
        task = self.checkpoints.spawn(self._checkpoint_all(names if server is not None else None))
        out: dict[str, Any] = {"servers": names, "dirty": dirty, "waited": wait, "saved": None}
        if not wait:
            return out
        done, _ = await asyncio.wait([task], timeout=timeout_s)
        if not done:
            raise OperationTimeout(
                f"{dirty} dirty session(s): not all saved within {timeout_s:g} s (the saves go on)",
                hint="Wait longer (--timeout), or see `kvsidecar status` for the sessions still unsaved.",
            )
        results = task.result()
        failed = [f"{rt.identity.short} ({code})" for rt, code in results if code is not None]
        if failed:
            raise SaveFailed(
                f"{len(failed)} of {len(results)} dirty session(s) not saved: {', '.join(failed)}",
                hint="A stop now costs those sessions their unsaved turns; see the daemon log and status.",
            )
        return {**out, "saved": len(results)}

    async def _checkpoint_all(self, names: list[str] | None) -> list[tuple[SessionRuntime, str | None]]:
        """The checkpoint of every server (None), or of these, one after the other (a router's models)."""
        if names is None:
            return await self.checkpoints.checkpoint_all(CHECKPOINT)
        out: list[tuple[SessionRuntime, str | None]] = []
        for name in names:
            out += await self.checkpoints.checkpoint_all(CHECKPOINT, server=name)
        return out
