"""Bringing a session into a slot: find its snapshot, verify it, restore it, or start cold (spec §23-25).

`Restorer.load()` runs while the caller holds the slot and the slot's previous owner is already saved:
the server's runtime is proven (RuntimeGuard), the newest generation that fits it is checked on disk (the
store: size, header, checksum, fingerprint) and handed to llama-server; anything unusable costs a cold
start (the slot is erased), never a wrong conversation (Invariant 5). After the first inference,
`verify_reuse()` checks that the engine actually reused what was restored (Invariant 10).

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
from functools import partial

from kvsidecar.backend.base import RestoreResult
from kvsidecar.config import Config
from kvsidecar.coordinator.breaker import BreakerState
from kvsidecar.coordinator.carry import CARRIED, CarryOver
from kvsidecar.coordinator.costs import CostModel
from kvsidecar.coordinator.runtime import RuntimeGuard
from kvsidecar.coordinator.server import ServerRuntime
from kvsidecar.coordinator.sessions import SessionEvent, SessionTable
from kvsidecar.coordinator.state import HOOK_SCOPE, AcquireResult, Outcome, SessionRuntime, Slot
from kvsidecar.coordinator.telemetry import Telemetry
from kvsidecar.errors import BackendUnavailable, ConnectionLost, KvError, RestoreFailed, SnapshotError
from kvsidecar.fingerprint.runtime import RuntimeFingerprint
from kvsidecar.fingerprint.savepath import llama_save_dir
from kvsidecar.store.confined import DIR_MOVED
from kvsidecar.store.naming import SnapshotIdentity
from kvsidecar.store.snapshots import Candidate, Rejection, SnapshotStore


class Restorer:
    def __init__(
        self,
        *,
        config: Config,
        store: SnapshotStore,
        sessions: SessionTable,
        guard: RuntimeGuard,
        telemetry: Telemetry,
        costs: CostModel,
    ) -> None:
        self.costs = costs
        self.config = config
        self.store = store
        self.sessions = sessions
        self.guard = guard
        self.telemetry = telemetry
        self.carry = CarryOver(config=config, store=store, guard=guard, telemetry=telemetry)
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
        if srv.breaker.state is BreakerState.OPEN:  # no restore will follow
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
    ) -> None:
        """Restore the session's snapshot into the slot, or start cold (issue 28: from the KV the slot holds,
        or from `donor`'s snapshot, within one credential scope; else erased). `held_by`: the key whose KV
        the slot held until this switch."""
        proven = await self.guard.same_runtime(srv, slot)
        trial = proven and srv.breaker.state is BreakerState.HALF_OPEN
        persist_ok = proven and srv.breaker.allow()
        try:
            await self._load(srv, slot, rt, result, persist_ok, donor, held_by)
        finally:
            if trial and persist_ok:  # this call held the half-open trial: it ends here, whatever happened
                srv.breaker.end_trial()

    async def _load(
        self,
        srv: ServerRuntime,
        slot: Slot,
        rt: SessionRuntime,
        result: AcquireResult,
        persist_ok: bool,
        donor: SnapshotIdentity | None = None,
        held_by: str | None = None,
    ) -> None:
        fingerprint = srv.fingerprint  # the one proven for this instance just now
        attempted = False  # a restore was handed to the server and did not count: the slot holds unknown KV
        if not persist_ok:
            # Invariant 5: persistence failure defaults to cold inference.
            result.outcome = Outcome.COLD_FALLBACK
            result.reason = (
                "circuit open" if srv.breaker.state is BreakerState.OPEN else "persistence unavailable"
            )
            if self.config.failure.strict:
                raise BackendUnavailable(
                    f"persistence for server {srv.name} is unavailable ({result.reason})"
                )
        elif self.config.restore.enabled and fingerprint is not None:
            candidate, rejections = await self._find(srv, rt, fingerprint)
            if candidate is None and rejections:
                # Saved under another llama.cpp build: carried over when the new build is proven to compute
                # the same KV (a new generation of ours), then found and restored like any other.
                why = await self.carry.carry(srv, slot, rt, rejections, fingerprint)
                if why is None:
                    candidate, rejections = await self._find(srv, rt, fingerprint)
                    if candidate is not None and await self._restore(
                        srv, slot, rt, candidate, fingerprint, result, None
                    ):
                        result.reason = CARRIED
                        return
                    attempted = candidate is not None
            first = rejections[0].reason if rejections else None
            if candidate is not None and await self._restore(
                srv, slot, rt, candidate, fingerprint, result, first
            ):
                return
            attempted = attempted or candidate is not None
            if candidate is None:
                self.telemetry.restore_miss(srv.name)
            if rejections and result.outcome is Outcome.COLD:
                result.outcome, result.reason = Outcome.COLD_FALLBACK, rejections[0].reason
                self.sessions.apply(rt, SessionEvent.REJECTED)
        await self._start_cold(srv, slot, rt, result, persist_ok, attempted, donor, held_by)

    async def _start_cold(
        self,
        srv: ServerRuntime,
        slot: Slot,
        rt: SessionRuntime,
        result: AcquireResult,
        persist_ok: bool,
        attempted: bool,
        donor: SnapshotIdentity | None,
        held_by: str | None,
    ) -> None:
        fingerprint = srv.fingerprint
        reachable = srv.available and srv.breaker.state is not BreakerState.OPEN
        share = persist_ok and not attempted and self.config.restore.share_prefix
        kept: int | None = None
        if share and donor is not None and fingerprint is not None:
            why = await self._donate(srv, slot, rt, donor, fingerprint, result, held_by)
            if why == "failed":
                share = False  # handed to the server and not counted: the slot's KV is unknown now
            elif why in ("restored", "resident"):
                kept = result.shared_tokens
                share = True
        elif donor is not None:
            self.telemetry.prefix_donated(srv.name, rt, donor.short, None, "off")
        # Keep the slot's KV for a plain cold start (llama-server reuses only its exact common prefix with
        # the prompt, so it can change how fast, never what, the answer is) when the runtime is proven, no
        # restore failed into the slot, and its previous user was of the same credential scope.
        keep = share and (kept is not None or (slot.scope is not None and slot.scope == rt.scope))
        await self._cold(srv, slot, rt, result, erase=not keep and (persist_ok or reachable), kept=kept)
        slot.foreign_kv = keep

    async def _find(
        self, srv: ServerRuntime, rt: SessionRuntime, fingerprint: RuntimeFingerprint
    ) -> tuple[Candidate | None, list[Rejection]]:
        try:
            candidate, rejections = await asyncio.to_thread(
                self.store.find_restorable, rt.identity, fingerprint, max_tokens=srv.slot_n_ctx
            )
        except KvError as exc:  # the manifest could not be read: this session is cold, nothing else fails
            self.telemetry.unreadable(rt, exc)
            return None, []
        if candidate is not None and (candidate.generation, fingerprint.digest) in rt.refused:
            return None, []  # this runtime already refused exactly this file: not handed over again
        for rej in rejections:
            self.telemetry.rejected(rt, rej)
        return candidate, rejections

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
        self.telemetry.restore_start(srv.name, slot.id, rt, candidate)
        self.sessions.apply(rt, SessionEvent.RESTORE_BEGIN)
        epoch = srv.epoch
        try:
            restored = await self._restore_call(srv, slot, candidate)
        except asyncio.CancelledError:
            self.sessions.apply(rt, SessionEvent.RESTORE_FAILED)
            raise
        except KvError as exc:
            await self._failed(srv, slot, rt, candidate, exc, result)
            return False
        try:
            confirmed = await self._confirmed(srv, rt, candidate, fingerprint, epoch, result)
        except BaseException:  # cancelled, or the checks themselves failed: never left RESTORING
            self.sessions.apply(rt, SessionEvent.RESTORE_FAILED)
            raise
        if not confirmed:
            return False
        self.guard.breaker_success(srv)
        result.outcome, result.restored_tokens = Outcome.RESTORED, restored.tokens
        result.restore_ms, result.restore_server_ms = round(restored.measured_ms, 3), restored.server_ms
        result.actions.append(f"restore {rt.identity.short}")
        if candidate.fallback:
            result.reason = f"previous generation ({fallback_reason or 'fallback'})"
        self.sessions.apply(rt, SessionEvent.RESTORED)
        rt.verify_tokens, rt.saved_revision = restored.tokens, rt.dirty_revision
        rt.base_tokens = rt.context_tokens = slot.tokens = restored.tokens
        slot.foreign_kv = False
        rt.base_generation, rt.append_only = candidate.generation, True
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

    async def _restore_call(self, srv: ServerRuntime, slot: Slot, candidate: Candidate) -> RestoreResult:
        """Hand a verified candidate to llama-server. It reads <its --slot-save-path>/<name> by path: right
        before, that path (and the configured one) must still lead to the held directory and the name to the
        verified file; it must restore exactly the snapshot's tokens (RestoreFailed otherwise)."""
        self.store.check_before_restore(candidate, llama_save_dir(srv.process))
        restored = await self.guard.persist(srv, srv.backend.restore_slot(slot.id, candidate.record.filename))
        if restored.tokens != candidate.record.tokens:
            raise RestoreFailed(
                f"server restored {restored.tokens} tokens, the snapshot has {candidate.record.tokens}"
            )
        return restored

    async def _confirmed(
        self,
        srv: ServerRuntime,
        rt: SessionRuntime,
        candidate: Candidate,
        fingerprint: RuntimeFingerprint,
        epoch: int,
        result: AcquireResult,
    ) -> bool:
        """The closing bracket: the server is still the runtime the file belongs to (a restart during the
        restore means the KV went into an unknown runtime), and the file is still the one we verified."""
        if not await self.guard.same_runtime(srv) or srv.epoch != epoch or srv.fingerprint != fingerprint:
            result.outcome, result.reason = Outcome.COLD_FALLBACK, "server restarted during restore"
            self.sessions.apply(rt, SessionEvent.RESTORE_FAILED)
            self.telemetry.restore_voided(rt)
            return False
        if self.store.snapshot_dir_fault(srv.name, llama_save_dir(srv.process)) is not None:
            # the path led elsewhere when the server read it: what it read is unknown (the slot is erased)
            result.outcome, result.reason = Outcome.COLD_FALLBACK, DIR_MOVED
            self.sessions.apply(rt, SessionEvent.RESTORE_FAILED)
            self.telemetry.restore_voided(rt)
            return False
        return await self._still_the_verified_file(rt, candidate, result)

    async def _still_the_verified_file(
        self, rt: SessionRuntime, candidate: Candidate, result: AcquireResult
    ) -> bool:
        """After llama-server read the file: is the name still the file we verified? (A swap in between
        means the server may have read something else: the restore does not count.)"""
        try:
            unchanged = await asyncio.to_thread(self.store.confirm_unchanged, candidate)
        except OSError:  # cannot tell: the restore does not count
            unchanged = False
        if unchanged:
            return True
        with contextlib.suppress(KvError):
            await asyncio.to_thread(
                self.store.mark_invalid, rt.key, candidate.generation, "SNAPSHOT_FILE_UNSAFE"
            )
        result.outcome, result.reason = Outcome.COLD_FALLBACK, "SNAPSHOT_FILE_UNSAFE"
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
        if not isinstance(
            exc, RestoreFailed | SnapshotError
        ):  # one file's problem says nothing of the server
            self.guard.breaker_failure(srv, exc)
        self.telemetry.restore_failed(srv.name, rt, exc)
        if srv.fingerprint is not None and isinstance(exc, RestoreFailed | ConnectionLost):
            rt.refused.add((candidate.generation, srv.fingerprint.digest))
        result.outcome, result.reason = Outcome.COLD_FALLBACK, exc.code
        self.sessions.apply(rt, SessionEvent.RESTORE_FAILED)
        rt.last_error = exc.code
        if isinstance(exc, RestoreFailed):  # when in doubt, re-fingerprint (unless the instance is proven)
            slot.owner = None
            await self.guard.same_runtime(srv, slot)
        if self.config.failure.strict:
            raise exc

    async def _donate(
        self,
        srv: ServerRuntime,
        slot: Slot,
        rt: SessionRuntime,
        donor: SnapshotIdentity,
        fingerprint: RuntimeFingerprint,
        result: AcquireResult,
        held_by: str | None,
    ) -> str:
        """Issue 28: a cold session starts from `donor`'s newest snapshot (same provider, model, runtime and
        credential scope). The donor's files and manifest are only read; its state is not changed. Returns
        restored / resident (the slot still holds the donor's KV) / none / refused / failed."""
        donor_rt = self.sessions.get(donor.key)
        donor_scope = donor_rt.scope if donor_rt is not None else None
        tokens: int | None = None
        if donor_scope is None and rt.scope != HOOK_SCOPE:
            why = "refused"  # unknown scope: only the hook API (the operator's token) may name it
        elif donor_scope is not None and donor_scope != rt.scope:
            why = "refused"
        elif held_by == donor.key and slot.scope == rt.scope:
            why = "resident"  # it was just evicted from this very slot: its KV is there already
        else:
            with self.sessions.busy_with(donor.key):  # retention leaves its files alone meanwhile
                why, tokens = await self._restore_donor(srv, slot, donor, donor_rt, fingerprint)
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
        epoch = srv.epoch
        try:
            restored = await self._restore_call(srv, slot, candidate)
        except KvError as exc:
            if not isinstance(exc, RestoreFailed):
                self.guard.breaker_failure(srv, exc)
            return "failed", None
        # the same closing bracket as a session's own restore; nothing of the donor's is marked either way
        if not await self.guard.same_runtime(srv) or srv.epoch != epoch or srv.fingerprint != fingerprint:
            return "failed", None
        if self.store.snapshot_dir_fault(srv.name, llama_save_dir(srv.process)) is not None:
            return "failed", None
        try:
            unchanged = await asyncio.to_thread(self.store.confirm_unchanged, candidate)
        except OSError:
            unchanged = False
        if not unchanged:
            return "failed", None
        self.guard.breaker_success(srv)
        self.telemetry.restored(srv.name, restored.bytes_read, restored.measured_ms)
        return "restored", restored.tokens

    async def _cold(
        self,
        srv: ServerRuntime,
        slot: Slot,
        rt: SessionRuntime,
        result: AcquireResult,
        *,
        erase: bool,
        kept: int | None = None,
    ) -> None:
        """Spec §53: let the engine prefill (from the slot's KV when kept, else from an erased slot); the
        next checkpoint makes the snapshot. `kept`: the tokens a donor's snapshot put there."""
        if erase:
            try:
                await self.guard.persist(srv, srv.backend.erase_slot(slot.id))
                self.guard.breaker_success(srv)
                result.actions.append("erase")
            except KvError as exc:
                # Leftover KV is harmless for correctness (the engine only reuses an exact token prefix).
                self.guard.breaker_failure(srv, exc)
                self.telemetry.erase_failed(slot.id, exc)
        if not erase and kept is None:
            kept = await self._slot_tokens(srv, slot)
        slot.tokens = 0 if erase else kept  # kept KV of unknown size: None
        rt.verify_tokens = rt.base_tokens = rt.context_tokens = rt.base_generation = None
        rt.append_only = False
        self.sessions.apply(rt, SessionEvent.COLD_START)
        self.telemetry.cold(srv.name, result.outcome, result.reason)

    async def _slot_tokens(self, srv: ServerRuntime, slot: Slot) -> int | None:
        """How many tokens the slot's kept KV holds, as llama-server says (None: it cannot say). A cold
        start is followed by a prefill, so this one /slots read costs nothing that shows; it gives the
        lease its baseline (a claim is in use once the slot's tokens move, issue 26 C)."""
        with contextlib.suppress(KvError, TimeoutError):
            for s in await self.guard.persist(srv, srv.backend.inspect_slots()):
                if s.id == slot.id:
                    return s.n_tokens
        return None

    def verify_reuse(
        self, srv: ServerRuntime, rt: SessionRuntime, prompt_tokens: int | None, cached_tokens: int | None
    ) -> str:
        """Invariant 10: an HTTP-successful restore is not a usable one until the engine reused it (§24)."""
        restored, rt.verify_tokens = rt.verify_tokens or 0, None
        if cached_tokens is None:
            result = "unknown"
        else:
            expected = restored if prompt_tokens is None else min(restored, prompt_tokens + cached_tokens)
            ok = expected == 0 or cached_tokens >= self.config.restore.min_reuse_ratio * expected
            result = "effective" if ok else "ineffective"
        self.telemetry.restore_verified(srv.name, rt, result, restored, cached_tokens, prompt_tokens)
        return result
