"""A cold start (spec §53), the other half of `Restorer.load()`: what the slot holds when no snapshot of
the session's own is restored.

Issue 28: KV is shared between sessions only within one credential scope. A cold start keeps the slot's KV
(llama-server reuses only its exact common prefix with the prompt, so it can change how fast, never what,
the answer is) when the runtime is proven, no restore failed into the slot, the slot's previous user was
of the same scope, and the scope gate allows KV of another session of the scope at all (`share`,
coordinator/scope.py); with a `donor` (the `prefix_from` hint) it starts from that session's newest snapshot
instead, read only (the donor's files and state are never changed), when the donor's recorded scope is the
session's. Otherwise the slot is erased. Whatever it ends with, the scope gate checks it before the request
runs.
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Protocol

from kvsidecar.backend.base import RestoreResult
from kvsidecar.coordinator.guard import PersistGuard, Persisting
from kvsidecar.coordinator.pool import SlotPool
from kvsidecar.coordinator.runtime import RuntimeGuard, RuntimeMark
from kvsidecar.coordinator.server import ServerRuntime
from kvsidecar.coordinator.sessions import SessionTable
from kvsidecar.coordinator.state import AcquireResult, SessionRuntime, Slot
from kvsidecar.coordinator.telemetry import Telemetry
from kvsidecar.errors import KvError
from kvsidecar.fingerprint.runtime import RuntimeFingerprint
from kvsidecar.store.naming import SnapshotIdentity
from kvsidecar.store.snapshots import Candidate, SnapshotStore


class RestoreSteps(Protocol):
    """A session's own restore, whose steps a donor's restore shares (restore.Restorer)."""

    async def restore_call(
        self, op: Persisting, srv: ServerRuntime, slot: Slot, candidate: Candidate
    ) -> RestoreResult: ...

    async def void_reason(
        self, srv: ServerRuntime, mark: RuntimeMark, candidate: Candidate
    ) -> str | None: ...


class ColdStart:
    def __init__(
        self,
        *,
        store: SnapshotStore,
        sessions: SessionTable,
        pool: SlotPool,
        guard: RuntimeGuard,
        persist: PersistGuard,
        telemetry: Telemetry,
        steps: RestoreSteps,
    ) -> None:
        self.store = store
        self.sessions = sessions
        self.pool = pool
        self.guard = guard
        self.persist = persist
        self.telemetry = telemetry
        self.steps = steps  # the restore call and its closing bracket, for a donor's snapshot

    async def start(
        self,
        load: Persisting,
        srv: ServerRuntime,
        slot: Slot,
        rt: SessionRuntime,
        result: AcquireResult,
        *,
        attempted: bool,
        share_prefix: bool,
        donor: SnapshotIdentity | None,
        held_by: str | None,
        isolated: bool = False,
        donor_point: str | None = None,
    ) -> None:
        """`load`: the load this ends (allowed: the runtime is proven and the breaker let it run);
        `attempted`: a restore was handed to the server and did not count (the slot's KV is unknown);
        `share_prefix`: KV may be shared at all (`restore.share_prefix`); `held_by`: the key whose KV the
        slot held until this switch; `isolated`: its own snapshot was not loaded (scope.py), so until a turn
        of it succeeds the slot is not its to come back to (its snapshot is). `donor_point`: the donor's
        generation the start plan proved (plan.py); only that one is restored."""
        fingerprint = srv.fingerprint
        reachable = srv.available and not self.persist.circuit_open(srv)
        share = load.allowed and not attempted and share_prefix
        kept: int | None = None
        if share and donor is not None and fingerprint is not None:
            why = await self._donate(srv, slot, rt, donor, fingerprint, result, held_by, donor_point)
            if why == "failed":
                share = False  # handed to the server and not counted: the slot's KV is unknown now
            elif why in ("restored", "resident"):
                kept = result.shared_tokens
                share = True
        elif donor is not None:
            self.telemetry.prefix_donated(srv.name, rt, donor.short, None, "off")
        keep = share and (kept is not None or (slot.scope is not None and slot.scope == rt.scope))
        erased = False
        if not keep and (load.allowed or reachable):
            erased = await self._erase(srv, slot, result)
        elif keep and kept is None:
            kept = await self._slot_tokens(load, srv, slot)
        # kept KV of unknown size: None; an erase that failed leaves KV of whoever had it (the scope gate,
        # scope.py, sees it before any request runs)
        tokens = 0 if erased else kept if keep else None
        scope = rt.scope if keep or erased else None
        self.pool.started_cold(slot, tokens, foreign=keep or isolated, scope=scope)
        self.sessions.started_cold(rt)
        self.telemetry.cold(srv.name, result.outcome, result.reason)

    async def _erase(self, srv: ServerRuntime, slot: Slot, result: AcquireResult) -> bool:
        await self.guard.scopes.hand_off(srv, slot)  # what the slot holds goes to the RAM cache first
        try:
            async with self.persist.persisting(srv, "erase", slot=slot) as op:
                await op.call(srv.backend.erase_slot(slot.id))
            result.actions.append("erase")
            return True
        except KvError as exc:
            # Leftover KV changes no answer (the engine only reuses an exact token prefix); the scope gate
            # erases it again, or refuses the request, before a request of another scope could see it.
            self.telemetry.erase_failed(slot.id, exc)
            return False

    async def _slot_tokens(self, load: Persisting, srv: ServerRuntime, slot: Slot) -> int | None:
        """How many tokens the slot's kept KV holds, as llama-server says (None: it cannot say). A cold
        start is followed by a prefill, so this one /slots read costs nothing that shows; it gives the
        lease its baseline (a claim is in use once the slot's tokens move, issue 26 C)."""
        with contextlib.suppress(KvError, TimeoutError):
            for s in await load.call(srv.backend.inspect_slots()):
                if s.id == slot.id:
                    return s.n_tokens
        return None

    async def _donate(
        self,
        srv: ServerRuntime,
        slot: Slot,
        rt: SessionRuntime,
        donor: SnapshotIdentity,
        fingerprint: RuntimeFingerprint,
        result: AcquireResult,
        held_by: str | None,
        point: str | None,
    ) -> str:
        """Issue 28: a cold session starts from `donor`'s newest snapshot (same provider, model, runtime and
        credential scope). The donor's files and manifest are only read; its state is not changed. Returns
        restored / resident (the slot still holds the donor's KV) / none / refused / failed.

        The donor's scope is part of its key (`SnapshotIdentity`), and the scope its manifest recorded must
        be the session's too: what is on disk decides, not what this daemon remembers (a manifest written
        before scopes were recorded, whose scope is unknown, is never a donor)."""
        donor_rt = self.sessions.get(donor.key)
        manifest = self.store.get(donor.key)
        tokens: int | None = None
        if donor.scope != rt.scope:
            why = "refused"
        elif held_by == donor.key and slot.scope == rt.scope:
            why = "resident"  # it was just evicted from this very slot: its KV is there already
        elif manifest is not None and manifest.scope != rt.scope:
            why = "refused"  # recorded under another scope, or before scopes were recorded
        else:
            with self.sessions.busy_with(donor.key):  # retention leaves its files alone meanwhile
                why, tokens = await self._restore_donor(srv, slot, donor, donor_rt, fingerprint, point)
        if why == "restored":
            result.shared_tokens = tokens
            result.actions.append(f"prefix_from {donor.short}")
        self.telemetry.prefix_donated(srv.name, rt, donor.short, tokens, why)
        return why

    async def _restore_donor(
        self,
        srv: ServerRuntime,
        slot: Slot,
        donor: SnapshotIdentity,
        donor_rt: SessionRuntime | None,
        fingerprint: RuntimeFingerprint,
        point: str | None,
    ) -> tuple[str, int | None]:
        try:
            candidate, _ = await asyncio.to_thread(
                self.store.find_restorable, donor, fingerprint, max_tokens=srv.slot_n_ctx
            )
        except KvError:
            return "none", None
        if candidate is None or (
            donor_rt is not None and (candidate.generation, fingerprint.digest) in donor_rt.refused
        ):
            return "none", None
        if candidate.generation != point:  # the donor saved again since the plan: not the point it proved
            return "moved", None
        await self.guard.scopes.hand_off(srv, slot)  # what the slot holds goes to the RAM cache first
        mark = self.guard.mark(srv, fingerprint)
        called = False
        try:
            async with self.persist.persisting(srv, "restore", slot=slot) as op:
                restored = await self.steps.restore_call(op, srv, slot, candidate)
                called = True
                # the same closing bracket as a session's own restore; nothing of the donor's is marked
                if await self.steps.void_reason(srv, mark, candidate) is not None:
                    op.void()
                    return "failed", None
        except KvError:
            if called:
                raise
            return "failed", None
        self.telemetry.restored(srv.name, restored.bytes_read, restored.measured_ms)
        return "restored", restored.tokens
