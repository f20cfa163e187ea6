"""Which runtime each server is, proven before a snapshot is restored into it or recorded from it.

`RuntimeGuard` keeps every server's fingerprint true (issue 16 A): it probes, re-fingerprints after a
restart, measures the runtime canary (canary.py) on the server's reference slot, and brackets every
restore and save commit with `same_runtime()`: is the server still the instance its fingerprint was made
for? When it is not, or cannot be told, it re-probes and re-fingerprints first, and the residency of
every slot is forgotten (the next request restores instead of trusting an emptied slot).

Each server's epoch (the count of restarts seen) is a fact of its identity (`fingerprint/identity.py`,
which moves it at the restart it is told of); this guard acts on it: every slot's residency forgotten. An
operation that spans a change of runtime is void: `mark()` before it, `still()` after (the closing
bracket), judged by the one trust rule (`store/trust.py`) on the identity's state, epoch and fingerprint.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvsidecar.coordinator.canary import measure_canary
from kvsidecar.coordinator.exits import ExitWatch
from kvsidecar.coordinator.guard import PersistGuard
from kvsidecar.coordinator.pool import SlotPool
from kvsidecar.coordinator.scope import ScopeGate
from kvsidecar.coordinator.server import RefreshResult, ServerRuntime
from kvsidecar.coordinator.sessions import SessionEvent, SessionTable
from kvsidecar.coordinator.state import Slot
from kvsidecar.coordinator.telemetry import Telemetry
from kvsidecar.errors import KvError
from kvsidecar.fingerprint.runtime import RuntimeFingerprint
from kvsidecar.fingerprint.savepath import llama_save_dir
from kvsidecar.store.trust import Decision, Saved, trust


@dataclass(frozen=True)
class RuntimeMark:
    """What an operation on a server started under: the epoch and the fingerprint it was proven for."""

    epoch: int
    fingerprint: RuntimeFingerprint | None

    def saved(self) -> Saved | None:
        """What the operation's result is recorded under, for the trust rule (None: no fingerprint)."""
        fp = self.fingerprint
        if fp is None:
            return None
        return Saved(fingerprint=fp.digest, components=fp.components, epoch=self.epoch)


class RuntimeGuard:
    def __init__(
        self,
        *,
        sessions: SessionTable,
        pool: SlotPool,
        telemetry: Telemetry,
        persist: PersistGuard,
        scopes: ScopeGate,
    ) -> None:
        self.sessions = sessions
        self.pool = pool
        self.telemetry = telemetry
        self.persist = persist
        self.scopes = scopes  # told of each instance first seen (which scopes its RAM cache may hold)
        self.exits = ExitWatch(telemetry=telemetry)  # how a local process ended, and crash loops

    @staticmethod
    def epoch(srv: ServerRuntime) -> int:
        """How many restarts of the server have been seen (status: `restarts_seen`)."""
        return srv.identity.now.epoch

    def mark(self, srv: ServerRuntime, fingerprint: RuntimeFingerprint | None = None) -> RuntimeMark:
        """The opening bracket: now, under `fingerprint` (default: the server's current one)."""
        return RuntimeMark(self.epoch(srv), fingerprint if fingerprint is not None else srv.fingerprint)

    async def still(self, srv: ServerRuntime, mark: RuntimeMark) -> bool:
        """The closing bracket: the server provably is still the runtime `mark` was taken under (no restart
        seen since, the same fingerprint: the trust rule's `RESTORE`)."""
        saved = mark.saved()
        if saved is None or not await self.same_runtime(srv):
            return False
        return trust(saved, srv.identity.now).decision is Decision.RESTORE

    async def refresh(
        self, srv: ServerRuntime, *, slot: Slot | None = None, force: bool = False, bracket: bool = False
    ) -> RefreshResult:
        """Re-probe (and, when needed, re-fingerprint) a server; one refresh per server at a time, so an
        acquire that needs a fingerprint waits for the one being built (a whole-file model hash).

        `slot`: a slot the caller holds and whose content is forfeit, on which the canary may run. A
        caller with a slot needs the server now: one in sleep mode is woken and fingerprinted after its
        model is loaded again; the probe loop (no slot) never wakes it (issue 26 A). `bracket`: a step of
        a save's or a restore's bracket, not an idle moment: the canary's slot goes back quietly (no
        clean-ahead or protect save is started from inside another persistence operation).
        """
        async with srv.refresh_lock:
            before = srv.process
            result = await srv.refresh(force=force, wake=slot is not None)
            if self.exits.note(srv, before) and before is not None:
                srv.identity.exited(before)  # out of reach, its process seen ended: gone
            if result.restarted:
                self.forget_residency(srv, result.reason or "restart")
            if result.available and (result.new_process or not self.scopes.ledger.known(srv)):
                await self.scopes.first_sight(srv)  # before the canary: its own task would count
            if srv.needs_canary:
                await self._canary(srv, slot, quiet=bracket)
        if not result.available and srv.caps is None:
            self.telemetry.server_unavailable(srv.name, srv.last_error)
        return result

    async def same_runtime(self, srv: ServerRuntime, slot: Slot | None = None) -> bool:
        """The bracket of every restore and save commit: True when the server provably is the instance
        its fingerprint was made for (re-fingerprinting first when it is not, or cannot be told)."""
        if srv.available and srv.fingerprint is not None:
            same = await srv.same_instance()
            if same is True:
                return True
            forfeit = slot is not None and slot.owner is None
            if same is None and forfeit and slot is not None and slot.id != srv.canary_slot_id:
                # Nothing tells instances apart and the canary can only be re-measured on the reference
                # slot: this restore cannot be proven, so it does not happen (the fingerprint stays).
                await self.refresh(srv, bracket=True)
                return False
            await self.refresh(srv, slot=slot, force=same is None and forfeit, bracket=True)
        else:
            await self.refresh(srv, slot=slot, bracket=True)
        return srv.available and srv.fingerprint is not None

    def forget_residency(self, srv: ServerRuntime, reason: str) -> None:
        """The server lost (or may have lost) every slot's content: believe nothing is resident. (Its
        identity counted the restart when it saw it.)"""
        self.telemetry.server_restarted(srv.name, reason)
        for slot in srv.slots.values():
            self.disown(slot)  # unsaved progress is gone with the server

    def disown(self, slot: Slot) -> None:
        if (rt := self.sessions.get(slot.owner)) is not None:
            self.sessions.give_up_unsaved(rt)
            self.sessions.apply(rt, SessionEvent.LOST)
        self.pool.forget_content(slot)

    async def _canary(self, srv: ServerRuntime, slot: Slot | None, *, quiet: bool) -> None:
        """Measure the canary on the reference slot: on `slot` when it is that slot and its content is
        forfeit, else on it when it is free (its owner, which without a fingerprint could never be saved
        or trusted, gives it up); else it stays pending: the probe loop and the next acquire try again,
        and until then nothing is restored or saved. Always the same slot: a state file differs with it."""
        ref = srv.slots.get(srv.canary_slot_id)
        if ref is None:
            return
        own = ref is not slot
        if own and not self.pool.try_take(srv, ref, "canary"):
            return
        if not own and ref.owner is not None:
            return
        if own:
            self.disown(ref)
        else:  # the caller's slot, about to be erased: what it holds goes to the RAM cache first
            await self.scopes.hand_off(srv, ref)
        epoch = self.epoch(srv)
        try:
            held = self.sessions.store.snapshot_anchor(srv.name) or srv.config.snapshot_dir
            canary = measure_canary(srv.backend, ref.id, held, llama_save_dir(srv.process))
            async with self.persist.persisting(srv, "canary", slot=ref) as op:
                digest = await op.call(canary)
            if self.epoch(srv) == epoch and await srv.same_instance() is not False:
                srv.set_canary(digest)
                self.telemetry.canary(srv.name, digest)
        except KvError as exc:
            srv.identity.canary_failed()
            self.telemetry.canary_failed(srv.name, exc)
        finally:
            self.pool.erased(ref)
            if own:  # inside a save's or a restore's bracket this is no idle moment: given back quietly
                self.pool.give_back(srv, ref, quiet=quiet)
