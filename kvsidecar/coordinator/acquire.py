"""The acquire path: one model call's lease, from its wait for a slot to its release (spec §20-22, §59).

`Acquirer.acquire()` queues for the slot the pool picks (FIFO, bounded; a caller that is gone ends the
wait), has the switch prepare it (resident: nothing to do; else evict and load), and grants a lease, first
*claimed* (claims.py ends it if nobody uses it). `release()` ends the lease: on success the session's slot
moved past its snapshot (a new revision, dirty), the engine's reuse of a restore is checked (Invariant 10)
and the checkpoint policy is told; the slot goes to the next waiter.
"""

from __future__ import annotations

import secrets
from collections.abc import Awaitable, Callable
from typing import Any, Literal, TypeVar

from kvsidecar.backend.prompts import KnownTokens, PromptTokens
from kvsidecar.config import ApiConfig
from kvsidecar.coordinator.caller import Caller
from kvsidecar.coordinator.checkpoint import CheckpointPolicy
from kvsidecar.coordinator.costs import CostModel
from kvsidecar.coordinator.leases import LeaseTable
from kvsidecar.coordinator.pool import SlotPool
from kvsidecar.coordinator.restore import Restorer
from kvsidecar.coordinator.scope import Incoming
from kvsidecar.coordinator.server import ServerRuntime
from kvsidecar.coordinator.sessions import SessionTable
from kvsidecar.coordinator.state import (
    HOOK_SCOPE,
    HOOK_SIGNAL,
    UNKNOWN_CLIENT,
    AcquireResult,
    Lease,
    Outcome,
    SessionRuntime,
    Slot,
)
from kvsidecar.coordinator.swaps import ModelSwaps
from kvsidecar.coordinator.switch import Switch
from kvsidecar.coordinator.telemetry import Telemetry
from kvsidecar.errors import LeaseNotFound, SlotBusy
from kvsidecar.store.naming import SnapshotIdentity

T = TypeVar("T")
# a request's tokens read once its server can tokenize (a router's model is loaded by `enter` first)
PromptSource = Callable[[], Awaitable[PromptTokens | None]]
ReleaseStatus = Literal["ok", "error", "aborted"]


class Acquirer:
    def __init__(
        self,
        *,
        servers: dict[str, ServerRuntime],
        sessions: SessionTable,
        pool: SlotPool,
        leases: LeaseTable,
        switch: Switch,
        restorer: Restorer,
        checkpoints: CheckpointPolicy,
        costs: CostModel,
        telemetry: Telemetry,
        api: ApiConfig,
        monotonic: Callable[[], float],
        acquire_timeout_s: float | None = None,
    ) -> None:
        self.servers = servers
        self.sessions = sessions
        self.pool = pool
        self.leases = leases
        self.switch = switch
        self.restorer = restorer
        self.checkpoints = checkpoints
        self.costs = costs
        self.telemetry = telemetry
        self.api = api  # restart-only: a SIGHUP never changes it
        self.monotonic = monotonic
        self.acquire_timeout_s = acquire_timeout_s
        # a router's models: an acquire is let in (room made on the router) before it waits for a slot, and
        # counts as a user of its model until its lease ends (coordinator/swaps.py)
        self.swaps: ModelSwaps | None = None

    async def acquire(
        self,
        srv: ServerRuntime,
        identity: SnapshotIdentity | None,
        *,
        seq: int | None = None,
        caller: Caller | None = None,
        scope: str = HOOK_SCOPE,
        donor: SnapshotIdentity | None = None,
        extends: bool = False,
        named: tuple[str, str] = (UNKNOWN_CLIENT, HOOK_SIGNAL),
        prompt: PromptTokens | PromptSource | None = None,
    ) -> AcquireResult:
        """A lease on a slot of `srv` prepared for `identity` (None: an auxiliary request of `scope`; a
        session's scope is its identity's). `extends`: its prompt is known to extend the session's last one
        (coordinator/scope.py). `named`: the client and the signal that named the session (the session's
        view shows them). `prompt`: the request's tokens, or why unknown (the start plan's, plan.py); or what
        reads them, called once the acquire is let in (a router's model loaded: it tokenizes)."""
        if self.swaps is not None:
            await self.swaps.enter(srv, caller)
        try:
            if callable(prompt):
                prompt = await prompt()
            return await self._acquire(
                srv,
                identity,
                seq=seq,
                caller=caller,
                scope=scope,
                donor=donor,
                extends=extends,
                named=named,
                prompt=prompt,
            )
        except BaseException:
            if self.swaps is not None:
                self.swaps.leave(srv)
            raise

    async def _acquire(
        self,
        srv: ServerRuntime,
        identity: SnapshotIdentity | None,
        *,
        seq: int | None,
        caller: Caller | None,
        scope: str,
        donor: SnapshotIdentity | None,
        extends: bool,
        named: tuple[str, str],
        prompt: PromptTokens | None,
    ) -> AcquireResult:
        key, session_id = (identity.key, identity.session_id) if identity else (None, None)
        lease = Lease(
            id=secrets.token_urlsafe(16),
            server=srv.name,
            slot_id=-1,
            key=key,
            session_id=session_id,
            outcome=Outcome.COLD,
        )
        timeout = self.acquire_timeout_s if self.acquire_timeout_s is not None else srv.config.slot_wait_s
        self.checkpoints.note_request(srv, key)
        try:
            slot = await self.pool.take(srv, lease.key, lease, timeout, caller)
        except SlotBusy:
            if caller is not None and caller.gone():
                self.telemetry.acquire_abandoned(srv.name, None, lease.session_id, caller.why)
            raise
        try:
            incoming = Incoming(
                scope=identity.scope if identity is not None else scope, session=key, extends=extends
            )
            result = await self._prepare(
                srv, slot, identity, incoming, seq=seq, donor=donor, named=named, prompt=prompt
            )
            if caller is not None and caller.gone():
                # the caller left while its slot was prepared: the restore ran to its end (the slot holds
                # what its records say), but no lease is granted; the slot goes to the next waiter now
                self.telemetry.acquire_abandoned(srv.name, slot.id, lease.session_id, caller.why)
                raise caller.error(srv.name)
        except BaseException:
            self.pool.give_back(srv, slot)
            raise
        finally:
            self.pool.preparing.discard(lease.id)
        if result.prompt_point and isinstance(prompt, KnownTokens):
            lease.prompt_point = prompt.tokens  # the proxy has it taken before forwarding (savepoints.py)
        self._grant(srv, slot, lease, result)
        return result

    async def _prepare(
        self,
        srv: ServerRuntime,
        slot: Slot,
        identity: SnapshotIdentity | None,
        incoming: Incoming,
        *,
        seq: int | None,
        donor: SnapshotIdentity | None,
        named: tuple[str, str],
        prompt: PromptTokens | None = None,
    ) -> AcquireResult:
        if identity is None:
            return await self.switch.to_aux(srv, slot, incoming)
        rt = self.sessions.runtime(identity)
        client, signal = named
        think_s = self.sessions.arrived(rt, seq=seq, now=self.monotonic(), client=client, signal=signal)
        if think_s is not None:  # think time: from its last release to this acquire
            self.costs.observe_think(srv.name, think_s)
            self.telemetry.think(srv.name, think_s)
        with self.sessions.busy_with(rt.key):
            result = await self.switch.to_session(srv, slot, rt, incoming, donor, prompt)
        self.restorer.planner.ran(srv, rt)  # its KV is on this instance now (its RAM cache may keep it)
        self.sessions.prepared(rt, result.outcome.value, result.reason)
        return result

    async def holding(self, srv: ServerRuntime, fn: Callable[[int], Awaitable[T]]) -> T:
        """Run fn(slot_id) under an auxiliary lease that this call holds (active, not a claim)."""
        result = await self.acquire(srv, None)
        assert result.lease_id is not None and result.slot_id is not None
        self.leases.renew(result.lease_id, self.api.lease_ttl_s)
        try:
            return await fn(result.slot_id)
        finally:
            await self.release(result.lease_id, status="aborted")

    def _grant(self, srv: ServerRuntime, slot: Slot, lease: Lease, result: AcquireResult) -> None:
        lease.outcome = result.outcome
        result.lease_id, result.server, result.base_url, result.slot_id = (
            lease.id,
            srv.name,
            srv.config.base_url,
            slot.id,
        )
        # a lease nobody uses (no model call on its slot, no renewal) ends after the short claim TTL
        self.leases.add(lease, self.api.lease_ttl_s, claim_s=self.api.lease_claim_ttl_s)
        lease.tokens_at_grant = slot.tokens if result.outcome is not Outcome.RESIDENT else None
        self.telemetry.acquired(srv.name, slot.id, result.outcome, lease.session_id)
        if result.evicted is not None:
            # the slot changed hands: a request of the evicted session that waited for it as its own now
            # takes another free slot instead of waiting for this call to end
            self.pool.dispatch(srv)

    async def release(
        self,
        lease_id: str,
        *,
        status: ReleaseStatus,
        prompt_tokens: int | None = None,
        cached_tokens: int | None = None,
        prompt_ms: float | None = None,
        held_tokens: int | None = None,
    ) -> dict[str, Any]:
        """End a lease. `held_tokens`: of a turn its client aborted, what the slot holds now that
        llama-server has stopped it (the prompt and the answer so far: the session's, unsaved)."""
        lease = self.leases.pop(lease_id)
        if lease is None:
            raise LeaseNotFound("no such lease (already released or expired)")
        srv = self.servers[lease.server]
        try:
            return self._released(srv, lease, status, prompt_tokens, cached_tokens, prompt_ms, held_tokens)
        finally:
            if self.swaps is not None:
                self.swaps.leave(srv)  # its model may be unloaded now (its turn is marked unsaved above)

    def _released(
        self,
        srv: ServerRuntime,
        lease: Lease,
        status: ReleaseStatus,
        prompt_tokens: int | None,
        cached_tokens: int | None,
        prompt_ms: float | None,
        held_tokens: int | None,
    ) -> dict[str, Any]:
        slot = srv.slots.get(lease.slot_id)
        out: dict[str, Any] = {"released": True, "dirty": False}
        self.telemetry.released(lease, status, prompt_tokens, cached_tokens)
        rt = self.sessions.get(lease.key)
        if prompt_tokens and prompt_ms is not None and status == "ok":
            self.costs.observe_prefill(srv.name, tokens=prompt_tokens, ms=prompt_ms)
        if rt is not None and slot is not None and slot.owner == rt.key and status == "ok":
            out.update(dirty=True, revision=self.sessions.ran(rt))
            if lease.outcome in (Outcome.COLD, Outcome.COLD_FALLBACK) and cached_tokens:
                # a cold start's reuse came from KV another session left (or donated): issue 28
                out["shared_tokens"] = cached_tokens
                self.telemetry.shared_prefix(srv.name, cached_tokens)
            elif rt.context_tokens is not None:
                out["held_tokens"] = rt.context_tokens  # what its slot held: the proxy explains low reuse
            self.sessions.track_context(rt, prompt_tokens, cached_tokens)
            self.pool.owner_ran(slot)  # the engine replaced what it did not reuse: the slot is rt's now
            if rt.verify_tokens is not None:
                out["restore_verification"] = self.restorer.verify_reuse(
                    srv, rt, prompt_tokens, cached_tokens
                )
            self.sessions.released(rt, self.monotonic())
            self.checkpoints.touched(rt)
        elif (
            rt is not None
            and slot is not None
            and slot.owner == rt.key
            and status == "aborted"
            and held_tokens
        ):
            out.update(dirty=True, revision=self._kept_aborted(slot, rt, held_tokens))
        elif slot is not None and slot.foreign_kv and rt is not None and slot.owner == rt.key:
            # no turn of rt ran on the KV its cold start kept: not rt's to come back to
            self.pool.vacate(slot)
        if slot is not None:
            # whatever ran under the lease, the slot is not known to be empty any more (scope.py)
            ran = rt is not None and slot.owner == rt.key and status == "ok"
            self.pool.touched(slot, rt.context_tokens if ran and rt is not None else None)
            self.pool.give_back(srv, slot)
        return out

    def _kept_aborted(self, slot: Slot, rt: SessionRuntime, held_tokens: int) -> int:
        """A turn its client aborted left `held_tokens` of the session's prompt and answer in its slot: the
        session's KV now (its next request, a re-prompt with the partial answer, continues it), marked
        unsaved so that an eviction saves it. Returns the new revision."""
        revision = self.sessions.ran(rt)
        self.sessions.track_context(rt, held_tokens, 0)  # how much it reused is unknown: not append-only
        self.sessions.take_verify(rt)  # a restore's reuse cannot be judged from a turn that was cut
        self.pool.owner_ran(slot)
        self.sessions.released(rt, self.monotonic())
        self.checkpoints.touched(rt)
        return revision
