"""Who may write a session key's files: the coordinator's side of fleet ownership.

On a single host the answer is always "this host" (`LocalGate`). In fleet mode the gate
(`kvsidecar.fleet.gate.FleetGate`) takes the key's ownership lease on Redis and records its fencing token
in the shared store; its answer says whether this host may write the key now, and whether what this host
holds of the key (a slot's KV, the manifest it read) may be out of date because another host owned the
key since. A stale copy is forgotten here, before anything is read or written: the slot no longer counts
as the session's, the session's unsaved revision is given up (another host has newer state), and the
manifest is read again from the shared directory. The coordinator never imports redis: the daemon passes
the fleet agent's gate to the coordinator at construction (`gate=`).
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Protocol

from kvsidecar.coordinator.pool import SlotPool
from kvsidecar.coordinator.server import ServerRuntime
from kvsidecar.coordinator.sessions import SessionTable
from kvsidecar.coordinator.state import Lease
from kvsidecar.logs import event
from kvsidecar.store.snapshots import SnapshotStore

log = logging.getLogger("kvsidecar.fleet")


@dataclass(frozen=True, kw_only=True)
class Claim:
    write: bool  # this host may write (save, commit, delete) the key's files now
    stale: bool = False  # another host owned the key since this host last did: local copies are out of date
    holder: str | None = None  # the host that owns the key, when it is not this one


class KeyGate(Protocol):
    async def claim(self, key: str, *, force: bool = False, keep: bool = False) -> Claim:
        """Take (or keep) the right to write `key`; never raises (an unreachable coordination plane is an
        answer: write only what this host still provably owns). `force`: from a holder that cannot be
        reached. `keep` (a save): only renew what this host owns and nobody owned since; never take a key
        afresh (a save of a copy another host may have moved on from must not make this host the owner).
        Call it through `KeyOwnership.claim`, which acts on a stale answer."""
        ...


class LocalGate:
    """Single host: this daemon is the only writer of its store."""

    async def claim(self, key: str, *, force: bool = False, keep: bool = False) -> Claim:
        return Claim(write=True)


class KeyOwnership:
    def __init__(
        self,
        *,
        store: SnapshotStore,
        sessions: SessionTable,
        servers: dict[str, ServerRuntime],
        gate: KeyGate | None = None,
    ) -> None:
        self.store = store
        self.sessions = sessions
        self.servers = servers
        self.gate: KeyGate = gate if gate is not None else LocalGate()  # fleet mode: its FleetGate

    async def claim(self, key: str, *, force: bool = False, keep: bool = False) -> Claim:
        """The gate's answer, after dropping what this host holds of `key` if the answer says it is stale
        (every claim goes through here: a stale answer acted on by nobody would leave the copy trusted)."""
        claim = await self.gate.claim(key, force=force, keep=keep)
        if claim.stale:
            await self.forget(key)
        return claim

    def held_here(self, key: str) -> bool:
        """`key` is in one of this host's slots, or one of its sessions is working on it now."""
        in_slot = any(s.owner == key for srv in self.servers.values() for s in srv.slots.values())
        return in_slot or key in self.sessions.busy

    async def forget(self, key: str) -> None:
        """Another host owned `key` since: what this host holds of it is not the session's state any more."""
        dropped = []
        for srv in self.servers.values():
            for slot in srv.slots.values():
                # not under a running inference (its release is refused a save later); an internal
                # operation (the save that found out) lets go of it here
                if slot.owner == key and not isinstance(slot.holder, Lease):
                    SlotPool.vacate(slot)
                    dropped.append("slot")
        rt = self.sessions.get(key)
        if rt is not None and self.sessions.give_up_unsaved(rt):  # older than the other host's state
            dropped.append("unsaved turns")
        await asyncio.to_thread(self.store.reload, key)
        if dropped:
            event(
                log, logging.INFO, "kv.fleet.stale_copy_dropped", snapshot=key[:8], dropped="+".join(dropped)
            )
