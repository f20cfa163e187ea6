"""A switch: a slot the caller holds changes hands (spec §21-22, §52, §72).

`Switch.to_session()` prepares the slot for an incoming session: a resident session needs nothing
(Invariant 6: no disk I/O, no management call); otherwise the slot's owner is evicted
(`CheckpointPolicy.evict`: saved first when dirty, Invariant 3) while the incoming session's snapshot is
read ahead, the session is restored or started cold (`Restorer.load`) while the evicted session's save
commits, and the slot is assigned to it (`SlotPool.assign`). `Switch.to_aux()` evicts the same way and
lends the slot to an auxiliary request, which becomes no session's state (Invariant 7).

Every path ends at the scope gate (`ScopeGate.admit`, coordinator/scope.py): whatever the slot holds then
(the session's own KV, kept or donated KV, an auxiliary request's leftovers) is checked against the request
about to run, and erased when it may not run on it. A resident session whose own KV the gate refuses starts
cold on its own slot. Which KV may be loaded at all (its own snapshot, another session's) is asked of the gate
before anything is loaded, so that nothing is restored only to be erased.
"""

from __future__ import annotations

from functools import partial

from kvsidecar.backend.prompts import KnownTokens, PromptTokens
from kvsidecar.coordinator.checkpoint import CheckpointPolicy
from kvsidecar.coordinator.plan import PLAIN_CLASS, R_SWA_WINDOW, SWA_FULL, UNKNOWN_CLASS, ModelFacts, rule_of
from kvsidecar.coordinator.pool import SlotPool
from kvsidecar.coordinator.restore import Restorer
from kvsidecar.coordinator.runtime import RuntimeGuard
from kvsidecar.coordinator.save import Saver
from kvsidecar.coordinator.scope import ISOLATED, Incoming, ScopeGate, Verdict
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
        gate: ScopeGate,
    ) -> None:
        self.sessions = sessions
        self.pool = pool
        self.guard = guard
        self.restorer = restorer
        self.checkpoints = checkpoints
        self.telemetry = telemetry
        self.gate = gate

    async def to_session(
        self,
        srv: ServerRuntime,
        slot: Slot,
        rt: SessionRuntime,
        incoming: Incoming,
        donor: SnapshotIdentity | None = None,
        prompt: PromptTokens | None = None,
    ) -> AcquireResult:
        # Invariant 6: a resident session costs no disk I/O and no management call. A local server's
        # process is checked (a /proc read, no HTTP): after a restart the slot is empty, not resident.
        if slot.owner == rt.key and srv.process is not None and not srv.process_check(srv.process):
            await self.guard.refresh(srv)
        if slot.owner == rt.key:
            found = self.gate.judge(srv, self.gate.held(slot, incoming, own=True), incoming)
            if found is Verdict.RUN and not _extends(slot.window_floor, prompt):
                return await self._isolate(srv, slot, rt, R_SWA_WINDOW)  # wrong KV to go on from: erased
            if found is Verdict.RUN:
                self.gate.ran(srv, incoming)
                point = self.restorer.planner.resident_point(  # the prompt's end saved first, or not
                    srv,
                    prompt,
                    restore_enabled=self.restorer.config.restore.enabled,
                    oversubscribed=self.restorer.oversubscribed(srv),
                )
                return AcquireResult(outcome=Outcome.RESIDENT, prompt_point=point)
            return await self._isolate(srv, slot, rt, found)
        result = AcquireResult(outcome=Outcome.COLD)
        own, share = self.gate.may_use_own(srv, incoming), self.gate.may_share(srv, incoming)
        await self._change_hands(srv, slot, result, rt, donor, own=own, share=share, prompt=prompt)
        restored = result.outcome is Outcome.RESTORED
        ram_right = await self._ram_copy_right(srv)
        if restored and isinstance(prompt, KnownTokens) and result.restored_tokens and not ram_right:
            # the plan proved the prompt extends the restored tokens but at most the last (plan.py)
            self.pool.floored(slot, tuple(prompt.tokens[: result.restored_tokens - 1]))
        elif not restored and not _extends(slot.window_floor, prompt):  # kept KV of a restore it leaves
            await self.gate.erase(srv, slot, R_SWA_WINDOW, result)
        prime = self.restorer.config.restore.share_prefix and ram_right
        await self.gate.admit(srv, slot, incoming, result, own=restored, prime=prime)
        self.pool.assign(srv, slot, rt.key, rt.scope)
        self.telemetry.loaded(srv.name, slot.id, rt, result)
        return result

    async def _isolate(
        self, srv: ServerRuntime, slot: Slot, rt: SessionRuntime, why: Verdict | str
    ) -> AcquireResult:
        """A resident session whose own KV its request may not run on (scope.py, rule 3; or, on SWA with
        --swa-full, a prompt that leaves a restore's window: `R_SWA_WINDOW`): erased, it starts cold on its
        own slot (its saved snapshots stay as they are)."""
        reason = ISOLATED if isinstance(why, Verdict) else why
        result = AcquireResult(outcome=Outcome.COLD, reason=reason)
        await self.gate.erase(srv, slot, why, result)
        # until a turn of it succeeds here, the empty slot is not its to come back to (its snapshot is)
        self.pool.started_cold(slot, 0, foreign=True, scope=rt.scope)
        self.sessions.started_cold(rt)
        self.telemetry.cold(srv.name, result.outcome, result.reason)
        return result

    async def to_aux(self, srv: ServerRuntime, slot: Slot, incoming: Incoming) -> AcquireResult:
        """Spec §72: checkpoint the owner, then the slot belongs to no session."""
        result = AcquireResult(outcome=Outcome.COLD, reason="auxiliary")
        await self._change_hands(srv, slot, result, None, None)
        prime = await self._ram_copy_right(srv)
        await self.gate.admit(srv, slot, incoming, result, own=False, prime=prime)
        self.pool.lend_to_aux(srv, slot, incoming.scope)
        return result

    async def _ram_copy_right(self, srv: ServerRuntime) -> bool:
        """Is what llama-server's RAM cache gives back the KV a resident slot holds? Not on SWA with
        `--swa-full` (its copy keeps only the window's last positions of the SWA layers, and llama-server
        reuses a prefix of it past a divergence that the window then lacks: docs/MODELS.md), nor for a class
        that could not be read: kvsidecar then neither hands a slot's KV to that cache (`arm`) nor primes an
        empty slot (an empty slot is never given anything from it)."""
        memory = await self.restorer.planner.memory(srv)
        model = ModelFacts(kind=memory.kind, swa_full=memory.swa_full)
        return memory.kind != UNKNOWN_CLASS and rule_of(model) != SWA_FULL

    async def _change_hands(
        self,
        srv: ServerRuntime,
        slot: Slot,
        result: AcquireResult,
        rt: SessionRuntime | None,
        donor: SnapshotIdentity | None,
        *,
        own: bool = True,
        share: bool = True,
        prompt: PromptTokens | None = None,
    ) -> None:
        """Evict the slot's owner, then load the incoming session (None: an auxiliary request)."""
        evicted = self.sessions.get(slot.owner)
        unsaved = evicted is not None and evicted.dirty  # turns no snapshot of it holds yet
        if slot.owner is not None:  # if a save comes first, the incoming snapshot is read meanwhile
            before_save = partial(self.restorer.preread, srv, rt) if rt is not None else None
            result.evicted = await self.checkpoints.evict(srv, slot, result, before_save=before_save)
        if rt is not None:
            self.telemetry.switch(srv.name, slot.id, rt, result.evicted)
            held_by = evicted.key if evicted is not None else None
            # a model whose snapshots a next prompt may not use (not plain), or a session whose last turns no
            # save holds (it failed, or was skipped): the RAM cache keeps the evicted session's KV, with its
            # checkpoints, as llama-server alone would (coordinator/plan.py); handed over only if a restore
            # or an erase replaces it (`ScopeGate.arm`: a kept slot needs no park)
            saved = evicted is not None and f"save {evicted.identity.short}" in result.actions
            plain = (await self.restorer.planner.memory(srv)).kind == PLAIN_CLASS
            owned_too = not plain or (unsaved and not saved)
            if await self._ram_copy_right(srv):
                self.gate.arm(srv, slot, held_by, owned_too=owned_too)
            try:
                await self.restorer.load(
                    srv, slot, rt, result, donor=donor, held_by=held_by, own=own, share=share, prompt=prompt
                )
            finally:
                self.gate.disarm(srv, slot)
        if evicted is not None:  # the evicted session's save commits meanwhile (save.py `overlap`)
            await Saver.wait_commit(evicted)


def _extends(floor: tuple[int, ...] | None, prompt: PromptTokens | None) -> bool:
    """May a prompt run on KV restored under `floor` (None: no such restore)? Only one whose tokens extend it;
    a prompt whose tokens are not known proves nothing (fail closed)."""
    if floor is None:
        return True
    return isinstance(prompt, KnownTokens) and tuple(prompt.tokens[: len(floor)]) == floor
