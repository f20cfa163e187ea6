"""Bringing a session into a slot: find its snapshot, verify it, restore it, or start cold (spec §23-25).

`Restorer.load()` runs while the caller holds the slot and the slot's previous owner is already saved:
the server's runtime is proven (RuntimeGuard), the newest generation that fits it is checked on disk (the
store: size, header, checksum, fingerprint) and handed to llama-server; anything unusable costs a cold
start (coldstart.py: the slot is erased, or keeps KV within one credential scope), never a wrong
conversation (Invariant 5). The load is one guarded persistence operation (guard.py: the breaker's gate
and trial); each restore in it is judged on its own. After the first inference, `verify_reuse()` checks
that the engine actually reused what was restored (Invariant 10).

Only evidence about a file invalidates it (the store's checks). A failure the server causes never does:
- refused (HTTP 400, a token count that differs): this runtime cannot take this file; it is not offered
  to this fingerprint again (in memory), and the runtime is re-proven (when in doubt, re-fingerprint);
- the server died under the restore: the same, so a file that crashes the server is not retried;
- unreachable, unsupported, timeout: nothing is known about the file; it stays as it was.
"""

from __future__ import annotations

import asyncio
import contextlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from functools import partial

from kvsidecar.backend.base import RestoreResult
from kvsidecar.backend.llama_router import RouterModelBackend
from kvsidecar.backend.prompts import PromptTokens
from kvsidecar.config import Config
from kvsidecar.coordinator.carry import CARRIED, CarryOver
from kvsidecar.coordinator.coldstart import ColdStart
from kvsidecar.coordinator.costs import CostModel
from kvsidecar.coordinator.guard import PersistGuard, Persisting
from kvsidecar.coordinator.plan import CARRY_OVER, DONOR, RESTORE, Flags, StartFacts, StartPlan
from kvsidecar.coordinator.pool import SlotPool
from kvsidecar.coordinator.runtime import RuntimeGuard, RuntimeMark
from kvsidecar.coordinator.save import Saver
from kvsidecar.coordinator.scope import ISOLATED
from kvsidecar.coordinator.server import ServerRuntime
from kvsidecar.coordinator.sessions import SessionEvent, SessionTable
from kvsidecar.coordinator.starts import Own, Planner
from kvsidecar.coordinator.state import AcquireResult, Outcome, SessionRuntime, Slot
from kvsidecar.coordinator.telemetry import Telemetry
from kvsidecar.errors import BackendUnavailable, ConnectionLost, KvError, RestoreFailed
from kvsidecar.files.confined import DIR_MOVED
from kvsidecar.fingerprint.runtime import RuntimeFingerprint
from kvsidecar.fingerprint.savepath import llama_save_dir
from kvsidecar.store.naming import SnapshotIdentity
from kvsidecar.store.snapshots import Candidate, Rejection, SnapshotStore

Found = tuple[
    list[Candidate], list[Rejection]
]  # the session's restorable points (newest first), what was not


class Restorer:
    def __init__(
        self,
        *,
        config: Config,
        store: SnapshotStore,
        sessions: SessionTable,
        pool: SlotPool,
        guard: RuntimeGuard,
        persist: PersistGuard,
        telemetry: Telemetry,
        costs: CostModel,
    ) -> None:
        self.costs = costs
        self.config = config
        self.store = store
        self.sessions = sessions
        self.pool = pool
        self.guard = guard
        self.persist = persist
        self.telemetry = telemetry
        self.carry = CarryOver(config=config, store=store, telemetry=telemetry)
        self.planner = Planner(store=store, guard=guard, costs=costs)
        self.cold = ColdStart(
            store=store,
            sessions=sessions,
            pool=pool,
            guard=guard,
            persist=persist,
            telemetry=telemetry,
            steps=self,
        )
        self._reader: ThreadPoolExecutor | None = None  # read ahead (`preread`), started on first use
        self._preread_turn = 0
        self._closed = False

    def preread(self, srv: ServerRuntime, rt: SessionRuntime) -> None:
        """A switch's save is about to run: have the incoming session's snapshot read meanwhile, so that
        the restore after the save finds it in the page cache. One reader thread of its own (a read ahead
        of a large file takes seconds to queue); a newer switch's read ahead, or shutdown, stops an older
        one. Nothing waits for it; the restore verifies everything as ever."""
        if self._closed or not self.config.restore.enabled or srv.fingerprint is None:
            return
        if self.persist.circuit_open(srv):  # no restore will follow
            return
        if self._reader is None:
            self._reader = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kv-preread")
        self._preread_turn += 1
        turn = self._preread_turn

        def stop() -> bool:
            return self._closed or self._preread_turn != turn

        asyncio.get_running_loop().run_in_executor(
            self._reader, partial(self.store.preread, rt.identity, srv.fingerprint.digest, stop=stop)
        )

    def reconfigure(self, config: Config) -> None:
        """SIGHUP: the live configuration, here and in the carry-over it built."""
        self.config = config
        self.carry.reconfigure(config)

    def close(self) -> None:
        """Shutdown: a read ahead under way stops at its next step; queued ones never start."""
        self._closed = True
        if self._reader is not None:
            self._reader.shutdown(wait=False, cancel_futures=True)

    async def load(
        self,
        srv: ServerRuntime,
        slot: Slot,
        rt: SessionRuntime,
        result: AcquireResult,
        *,
        donor: SnapshotIdentity | None = None,
        held_by: str | None = None,
        own: bool = True,
        share: bool = True,
        prompt: PromptTokens | None = None,
    ) -> None:
        """Restore the session's snapshot into the slot, or start cold (issue 28: from the KV the slot holds,
        or from `donor`'s snapshot, within one credential scope; else erased). `held_by`: the key whose KV
        the slot held until this switch. `own` / `share`: whether its request may run on its own snapshot /
        on KV of another session of its scope (coordinator/scope.py); when not, that KV is never loaded (a
        session whose own snapshot may not be used starts cold, `ISOLATED`). `prompt`: the request's tokens,
        or why they are unknown (None: not given); what is restored, kept or donated is the start plan's
        (plan.py), made from them and the other facts here (starts.py)."""
        await Saver.wait_commit(rt)  # its own last save may still be committing (evicted just before)
        proven = await self.guard.same_runtime(srv, slot)
        async with self.persist.persisting(srv, "load", slot=slot, ready=proven) as op:
            fingerprint = srv.fingerprint  # the one proven for this instance just now
            attempted = False  # a restore was handed to the server and did not count: unknown KV in the slot
            donor_point, plan_kind = None, None  # the donor's generation the plan proved: no plan, no donor
            if not op.allowed:
                self._unavailable(srv, result)
            elif not own:  # its snapshot (if any) is not loaded: cold, and why
                result.reason = ISOLATED if self.store.get(rt.key) is not None else None
            elif self.config.restore.enabled and fingerprint is not None:
                plan, found = await self._plan(srv, slot, rt, result, fingerprint, prompt, donor, share)
                plan_kind = plan.kind
                restored, attempted = await self._from_snapshot(
                    op, srv, slot, rt, result, fingerprint, plan, found
                )
                if restored:
                    return
                donor_point = plan.point if plan.kind == DONOR else None
                if donor is not None and plan.kind != DONOR:  # the plan found it useless or not worth it
                    self.telemetry.prefix_donated(srv.name, rt, donor.short, None, plan.reason)
            if donor is not None and donor_point is None:  # restore off, unproven runtime, isolated: no plan
                if plan_kind is None:
                    self.telemetry.prefix_donated(srv.name, rt, donor.short, None, "unplanned")
                donor = None
            share = self.config.restore.share_prefix and share
            await self.cold.start(
                op, srv, slot, rt, result, attempted=attempted, share_prefix=share, donor=donor,
                held_by=held_by, isolated=not own, donor_point=donor_point,
            )  # fmt: skip
            donated = any(a.startswith("prefix_from") for a in result.actions)
            if plan_kind in (RESTORE, CARRY_OVER, DONOR) and not donated:  # the plan's restore did not happen
                result.proved, result.expected_reuse = False, None

    def oversubscribed(self, srv: ServerRuntime) -> bool:
        """Does `srv` know more sessions than it has slots, or is it a router's model that will be unloaded
        (evictions to come)?"""
        if isinstance(srv.backend, RouterModelBackend) and srv.backend.crowded:
            return True
        return sum(1 for r in self.sessions.by_key.values() if r.identity.server == srv.name) > len(srv.slots)

    def _unavailable(self, srv: ServerRuntime, result: AcquireResult) -> None:
        """Invariant 5: persistence failure defaults to cold inference (strict mode: it fails the acquire)."""
        result.outcome = Outcome.COLD_FALLBACK
        result.reason = "circuit open" if self.persist.circuit_open(srv) else "persistence unavailable"
        if self.config.failure.strict:
            raise BackendUnavailable(f"persistence for server {srv.name} is unavailable ({result.reason})")

    async def _plan(
        self,
        srv: ServerRuntime,
        slot: Slot,
        rt: SessionRuntime,
        result: AcquireResult,
        fingerprint: RuntimeFingerprint,
        prompt: PromptTokens | None,
        donor: SnapshotIdentity | None,
        share: bool,
    ) -> tuple[StartPlan, Found]:
        """The start plan (plan.py) from the facts read now (starts.py); the answer carries it."""
        candidates, rejections = await self._find(srv, rt, fingerprint)
        flags = Flags(
            share_prefix=self.config.restore.share_prefix,
            share=share,
            oversubscribed=self.oversubscribed(srv),
        )
        own = Own(candidates=tuple(candidates), rejections=tuple(rejections))
        plan, facts = await self.planner.plan(srv, slot, rt, own, prompt=prompt, donor=donor, flags=flags)
        tell(result, plan, facts)
        self.telemetry.planned(srv.name, rt, plan, facts.model.kind)
        return plan, (candidates, rejections)

    async def _from_snapshot(
        self,
        op: Persisting,
        srv: ServerRuntime,
        slot: Slot,
        rt: SessionRuntime,
        result: AcquireResult,
        fingerprint: RuntimeFingerprint,
        plan: StartPlan,
        found: Found,
    ) -> tuple[bool, bool]:
        """The plan's generation restored (carried over first when the plan says so): (restored,
        attempted and not counted). A plan that restores nothing: the reason is its."""
        attempted = False
        candidates, rejections = found
        candidate = chosen(candidates, plan.point)
        if plan.kind not in (RESTORE, CARRY_OVER):
            if rejections and candidate is None and result.outcome is Outcome.COLD:
                result.outcome, result.reason = Outcome.COLD_FALLBACK, rejections[0].reason
                self.sessions.apply(rt, SessionEvent.REJECTED)
            elif candidate is not None:  # a snapshot the plan did not restore: why (X-KV-Reason)
                result.reason = plan.reason
            return False, False
        if candidate is None and rejections:
            # Saved under another llama.cpp build: carried over when the new build is proven to compute
            # the same KV (a new generation of ours), then found and restored like any other.
            await self.guard.scopes.hand_off(srv, slot)  # the carry-over writes into the slot
            why = await self.carry.carry(op, srv, slot, rt, rejections, fingerprint)
            if why is None:
                candidates, rejections = await self._find(srv, rt, fingerprint)
                candidate = candidates[0] if candidates else None
                if candidate is not None and await self._restore(
                    srv, slot, rt, candidate, fingerprint, result, None
                ):
                    result.reason = CARRIED
                    return True, False
                attempted = candidate is not None
        first = rejections[0].reason if rejections else None
        if candidate is not None and await self._restore(
            srv, slot, rt, candidate, fingerprint, result, first
        ):
            return True, False
        attempted = attempted or candidate is not None
        if candidate is None:
            self.telemetry.restore_miss(srv.name)
        if rejections and result.outcome is Outcome.COLD:
            result.outcome, result.reason = Outcome.COLD_FALLBACK, rejections[0].reason
            self.sessions.apply(rt, SessionEvent.REJECTED)
        return False, attempted

    async def _find(self, srv: ServerRuntime, rt: SessionRuntime, fingerprint: RuntimeFingerprint) -> Found:
        """The session's restorable points, newest first (every generation that passes the candidate
        checks), and why the others were passed over."""
        try:
            candidates, rejections = await asyncio.to_thread(
                self.store.find_points, rt.identity, fingerprint, max_tokens=srv.slot_n_ctx
            )
        except KvError as exc:  # the manifest could not be read: this session is cold, nothing else fails
            self.telemetry.unreadable(rt, exc)
            return [], []
        # a file this runtime already refused is not handed over again; nor, when the newest was refused, an
        # older one (the same runtime would likely refuse it too: the session starts cold, as it did)
        if candidates and (candidates[0].generation, fingerprint.digest) in rt.refused:
            return [], []
        candidates = [c for c in candidates if (c.generation, fingerprint.digest) not in rt.refused]
        for rej in rejections:
            self.telemetry.rejected(rt, rej)
        return candidates, rejections

    async def _restore(
        self,
        srv: ServerRuntime,
        slot: Slot,
        rt: SessionRuntime,
        candidate: Candidate,
        fingerprint: RuntimeFingerprint,
        result: AcquireResult,
        fallback_reason: str | None,
    ) -> bool:
        await self.guard.scopes.hand_off(srv, slot)  # what the slot holds goes to the RAM cache first
        self.telemetry.restore_start(srv.name, slot.id, rt, candidate)
        self.sessions.apply(rt, SessionEvent.RESTORE_BEGIN)
        mark = self.guard.mark(srv, fingerprint)
        called = False  # llama-server has read the file: what fails from here on is the closing checks
        try:
            async with self.persist.persisting(srv, "restore", slot=slot) as op:
                restored = await self.restore_call(op, srv, slot, candidate)
                called = True
                if not await self._confirmed(srv, rt, candidate, mark, result):
                    op.void()
                    return False
        except KvError as exc:
            if called:  # the checks themselves failed: never left RESTORING
                self.sessions.apply(rt, SessionEvent.RESTORE_FAILED)
                raise
            await self._failed(srv, slot, rt, candidate, exc, result)
            return False
        except BaseException as exc:  # cancelled, or the checks failed: never left RESTORING
            if called or isinstance(exc, asyncio.CancelledError):
                self.sessions.apply(rt, SessionEvent.RESTORE_FAILED)
            raise
        result.outcome, result.restored_tokens = Outcome.RESTORED, restored.tokens
        self.planner.expect(rt, result.expected_reuse)
        result.restore_ms, result.restore_server_ms = round(restored.measured_ms, 3), restored.server_ms
        result.actions.append(f"restore {rt.identity.short}")
        if candidate.fallback:
            result.reason = f"previous generation ({fallback_reason or 'fallback'})"
        self.sessions.restored(rt, tokens=restored.tokens, generation=candidate.generation)
        self.pool.loaded(slot, restored.tokens, rt.scope)
        self.telemetry.restored(srv.name, restored.bytes_read, restored.measured_ms)
        self.costs.observe_transfer(
            srv.name,
            kind="restore",
            nbytes=restored.bytes_read,
            tokens=restored.tokens,
            server_ms=restored.server_ms,
            measured_ms=restored.measured_ms,
        )
        self.store.touch(rt.key, persist=False)
        return True

    async def restore_call(
        self, op: Persisting, srv: ServerRuntime, slot: Slot, candidate: Candidate
    ) -> RestoreResult:
        """Hand a verified candidate to llama-server. It reads <its --slot-save-path>/<name> by path: right
        before, that path (and the configured one) must still lead to the held directory and the name to the
        verified file; it must restore exactly the snapshot's tokens (RestoreFailed otherwise)."""
        self.store.check_before_restore(candidate, llama_save_dir(srv.process))
        restored = await op.call(srv.backend.restore_slot(slot.id, candidate.record.filename))
        if restored.tokens != candidate.record.tokens:
            raise RestoreFailed(
                f"server restored {restored.tokens} tokens, the snapshot has {candidate.record.tokens}"
            )
        return restored

    async def void_reason(self, srv: ServerRuntime, mark: RuntimeMark, candidate: Candidate) -> str | None:
        """The closing bracket of a restore: why what llama-server read may not be the verified file of this
        runtime (None: it is). The server must still be the runtime the file belongs to (a restart during
        the restore means the KV went into an unknown runtime), the path must still lead to the held
        directory, and the name must still be the file we verified (a swap in between means the server may
        have read something else)."""
        reason = None
        if not await self.guard.still(srv, mark):
            reason = "server restarted during restore"
        elif self.store.snapshot_dir_fault(srv.name, llama_save_dir(srv.process)) is not None:
            reason = DIR_MOVED  # what it read is unknown (the slot is erased)
        elif not await self._unchanged(candidate):
            reason = "SNAPSHOT_FILE_UNSAFE"
        return reason

    async def _unchanged(self, candidate: Candidate) -> bool:
        try:
            return await asyncio.to_thread(self.store.confirm_unchanged, candidate)
        except OSError:  # cannot tell: the restore does not count
            return False

    async def _confirmed(
        self,
        srv: ServerRuntime,
        rt: SessionRuntime,
        candidate: Candidate,
        mark: RuntimeMark,
        result: AcquireResult,
    ) -> bool:
        reason = await self.void_reason(srv, mark, candidate)
        if reason is None:
            return True
        if reason == "SNAPSHOT_FILE_UNSAFE":  # the name may lead to another file now: never offered again
            with contextlib.suppress(KvError):
                await asyncio.to_thread(self.store.mark_invalid, rt.key, candidate.generation, reason)
        result.outcome, result.reason = Outcome.COLD_FALLBACK, reason
        self.sessions.apply(rt, SessionEvent.RESTORE_FAILED)
        self.telemetry.restore_voided(rt)
        return False

    async def _failed(
        self,
        srv: ServerRuntime,
        slot: Slot,
        rt: SessionRuntime,
        candidate: Candidate,
        exc: KvError,
        result: AcquireResult,
    ) -> None:
        """The server failed the restore (its verdict is the guard's): the session starts cold."""
        self.telemetry.restore_failed(srv.name, rt, exc)
        if srv.fingerprint is not None and isinstance(exc, RestoreFailed | ConnectionLost):
            rt.refused.add((candidate.generation, srv.fingerprint.digest))
        result.outcome, result.reason = Outcome.COLD_FALLBACK, exc.code
        self.sessions.apply(rt, SessionEvent.RESTORE_FAILED, error=exc.code)
        if isinstance(exc, RestoreFailed):  # when in doubt, re-fingerprint (unless the instance is proven)
            self.pool.vacate(slot)
            await self.guard.same_runtime(srv, slot)
        if self.config.failure.strict:
            raise exc

    def verify_reuse(
        self, srv: ServerRuntime, rt: SessionRuntime, prompt_tokens: int | None, cached_tokens: int | None
    ) -> str:
        """Invariant 10: an HTTP-successful restore is not a usable one until the engine reused it (§24)."""
        restored = self.sessions.take_verify(rt)
        planned = self.planner.expected(rt)  # what the start plan proved the engine would reuse
        if cached_tokens is None:
            result = "unknown"
        else:
            expected = restored if prompt_tokens is None else min(restored, prompt_tokens + cached_tokens)
            if planned is not None:
                expected = min(expected, planned)
            ok = expected == 0 or cached_tokens >= self.config.restore.min_reuse_ratio * expected
            result = "effective" if ok else "ineffective"
        self.telemetry.restore_verified(srv.name, rt, result, restored, cached_tokens, prompt_tokens)
        return result


def chosen(candidates: list[Candidate], generation: str | None) -> Candidate | None:
    """The candidate of the plan's generation (the newest when the plan names none). One the plan chose over
    a newer valid point is its choice (the longest the prompt can use), not a fallback."""
    if generation is None:
        return candidates[0] if candidates else None
    for i, c in enumerate(candidates):
        if str(c.generation) == generation:
            return c if i == 0 else replace(c, fallback=False)
    return None


def tell(result: AcquireResult, plan: StartPlan, facts: StartFacts) -> None:
    """The answer carries the plan: its kind and reason, the class, the reuse it expects and whether the
    prompt's tokens proved it (headers, logs and status show them)."""
    result.plan, result.plan_reason, result.memory_class = plan.kind, plan.reason, facts.model.kind
    result.expected_reuse, result.proved = plan.expected_reuse, plan.proved
    result.prompt_point = plan.take_prompt_point
