"""The coordinator: who owns each slot, when to restore, save and erase (spec §18-34, §50-53, §69-72).

Flow of one model call: `acquire()` picks the session's slot and prepares it (resident: nothing to do;
otherwise save the previous owner if dirty, then restore the session's snapshot or erase for a cold start)
and returns a lease; the harness runs inference with `id_slot`; `release()` ends the lease, marks the
session dirty on success and checks how much of a restore the engine actually reused.

Invariant 1: nothing here ever touches a prompt or a reply; the harness' conversation is built from its own
log, so what kvsidecar does to a slot can change how fast an answer comes, never what it says.

Everything here runs on the event loop. Slots are handed to waiters in arrival order by `_dispatch`; a
slot's content is only changed (restore, erase, save, inference) while its `holder` is set, which makes
those operations serial per slot (Invariant 8).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Literal, TypeVar

from apscheduler.schedulers.asyncio import AsyncIOScheduler

from kvsidecar.backend.base import KvBackend
from kvsidecar.config import Config
from kvsidecar.coordinator.breaker import BreakerState, CircuitBreaker
from kvsidecar.coordinator.canary import measure_canary, sweep_canary_files
from kvsidecar.coordinator.server import ProcessFinder, RefreshResult, ServerRuntime
from kvsidecar.coordinator.state import Lease, Outcome, SessionRuntime, SessionState, Slot
from kvsidecar.errors import (
    BackendError,
    BackendUnavailable,
    ConnectionLost,
    KvError,
    LeaseNotFound,
    NotFound,
    OperationTimeout,
    RestoreFailed,
    SaveFailed,
    SlotBusy,
)
from kvsidecar.logs import event
from kvsidecar.metrics import Metrics
from kvsidecar.store.fingerprint import FileDigestCache, ProcessInfo, RuntimeFingerprint
from kvsidecar.store.naming import SnapshotIdentity, short_id, validate_label, validate_session_id
from kvsidecar.store.snapshots import Candidate, Rejection, SnapshotStore

log = logging.getLogger("kvsidecar.coordinator")
T = TypeVar("T")

ReleaseStatus = Literal["ok", "error", "aborted"]
EventType = Literal["created", "switch", "flush", "turn_end", "step_end", "disposed"]
INVALIDATED = "INVALIDATED_BY_REQUEST"
MARGIN_S = 5.0


@dataclass(kw_only=True)
class AcquireResult:
    outcome: Outcome
    lease_id: str | None = None
    server: str | None = None
    base_url: str | None = None
    slot_id: int | None = None
    restored_tokens: int | None = None
    restore_ms: float | None = None
    restore_server_ms: float | None = None  # llama-server's own timings.restore_ms
    evicted: str | None = None
    reason: str | None = None
    actions: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {k: (v.value if isinstance(v, Outcome) else v) for k, v in self.__dict__.items()}


@dataclass(kw_only=True)
class Stats:
    acquires: int = 0
    resident: int = 0
    restores: int = 0
    restore_hits: int = 0
    restore_failures: int = 0
    restore_ineffective: int = 0
    cold_starts: int = 0
    cold_fallbacks: int = 0
    saves: int = 0
    save_failures: int = 0
    switches: int = 0
    server_restarts: int = 0
    leases_expired: int = 0


class Coordinator:
    def __init__(
        self,
        *,
        config: Config,
        store: SnapshotStore,
        backends: dict[str, KvBackend],
        metrics: Metrics | None = None,
        process_finder: ProcessFinder | None = None,
        process_check: Callable[[ProcessInfo], bool] | None = None,
        digests: FileDigestCache | None = None,
        clock: Callable[[], float] = time.time,
        monotonic: Callable[[], float] = time.monotonic,
        acquire_timeout_s: float | None = None,
    ) -> None:
        self.config = config
        self.store = store
        self.metrics = metrics or Metrics()
        self.clock = clock
        self.monotonic = monotonic
        self.acquire_timeout_s = acquire_timeout_s
        self.stats = Stats()
        self.servers = {
            name: ServerRuntime(
                name=name,
                config=cfg,
                backend=backends[name],
                breaker=CircuitBreaker(
                    max_consecutive_failures=config.failure.max_consecutive_failures,
                    cooldown_s=config.failure.cooldown_s,
                    clock=monotonic,
                ),
                process_finder=process_finder,
                process_check=process_check,
                digests=digests,
            )
            for name, cfg in config.servers.items()
        }
        self.scheduler = AsyncIOScheduler(timezone="UTC")
        self._sessions: dict[str, SessionRuntime] = {}  # identity key -> runtime
        self._by_session: dict[str, set[str]] = {}  # session id -> identity keys
        self._leases: dict[str, Lease] = {}
        self._preparing: set[str] = set()  # lease ids holding a slot while it is being prepared
        self._idle_armed: set[str] = set()  # session keys with a pending idle job
        self._busy_keys: dict[str, int] = {}  # keys being restored or saved right now (retention keeps off)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False
        self._started = False
        # Called (on the loop) after every successful save: the daemon checks retention limits here.
        self.after_save: Callable[[], None] | None = None

    # lifecycle ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        self.scheduler.start()
        self._started = True
        for srv in self.servers.values():
            await asyncio.to_thread(sweep_canary_files, srv.config.snapshot_dir)
            await self._refresh(srv)
            self._spawn(self._probe_loop(srv))

    async def aclose(self) -> None:
        """Stop taking work, checkpoint dirty slots within the bound, stop every task and timer."""
        if self._closing:
            return
        self._closing = True
        if self.config.checkpoint.on_shutdown:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._checkpoint_all("shutdown"), self.config.checkpoint.shutdown_timeout_s
                )
        for lease in list(self._leases.values()):
            if lease.expiry is not None:
                lease.expiry.cancel()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._started:
            self.scheduler.shutdown(wait=False)
            await asyncio.sleep(0)  # AsyncIOScheduler finishes its shutdown in a loop callback
        for srv in self.servers.values():
            await srv.backend.aclose()

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        """A background task the coordinator owns: cancelled and awaited by aclose()."""
        return self._spawn(coro)

    def _spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _probe_loop(self, srv: ServerRuntime) -> None:
        while True:
            await asyncio.sleep(srv.config.probe_interval_s)
            await self._refresh(srv)
            self._forget_idle_sessions()

    async def _refresh(
        self, srv: ServerRuntime, *, slot: Slot | None = None, force: bool = False
    ) -> RefreshResult:
        """Re-probe (and, when needed, re-fingerprint) a server; one refresh per server at a time.

        `slot`: a slot the caller holds and whose content is forfeit, on which the canary may run.
        """
        async with srv.refresh_lock:
            result = await srv.refresh(force=force)
            if result.restarted:
                self._forget_residency(srv, result.reason or "restart")
            if srv.needs_canary:
                await self._canary(srv, slot)
        if not result.available and srv.caps is None:
            event(log, logging.WARNING, "kv.backend.unavailable", server=srv.name, error=srv.last_error)
        return result

    async def _canary(self, srv: ServerRuntime, slot: Slot | None) -> None:
        """Measure the runtime canary on the server's reference slot: on `slot` when it is that slot and
        its content is forfeit, else on it when it is free and no session owns it; else leave it pending
        (the probe loop and the next acquire try again; until then nothing is restored or saved).

        Always the same slot: llama-server's state file differs with the slot it was saved from."""
        ref = srv.slots.get(srv.canary_slot_id)
        if ref is None:
            return
        own = ref is not slot
        if own and (not ref.free or ref.claimed_by is not None or srv.waiters):
            return
        if not own and ref.owner is not None:
            return
        if own:
            ref.holder = "canary"
            # Without a fingerprint its owner could never be saved or trusted: it gives the slot up (its
            # next request runs cold) rather than keep persistence off for the whole server.
            self._disown_slot(ref)
        epoch = srv.epoch
        try:
            digest = await self._persist(srv, measure_canary(srv.backend, ref.id, srv.config.snapshot_dir))
            if srv.epoch == epoch and await srv.same_instance() is not False:
                srv.set_canary(digest)
                event(log, logging.INFO, "kv.backend.canary", server=srv.name, digest=digest[:12])
        except KvError as exc:
            srv.canary_failures += 1
            event(
                log,
                logging.WARNING,
                "kv.backend.canary.failed",
                server=srv.name,
                code=exc.code,
                error=exc.message,
            )
        finally:
            ref.tokens = 0
            if own:
                await self._give_back(srv, ref)

    def _disown_slot(self, slot: Slot) -> None:
        if slot.owner is not None and (rt := self._sessions.get(slot.owner)) is not None:
            rt.saved_revision = rt.dirty_revision
            rt.state = self._resting_state(rt)
        slot.owner, slot.holds_aux, slot.tokens = None, False, None

    async def _same_runtime(self, srv: ServerRuntime, slot: Slot | None = None) -> bool:
        """The bracket of every restore and save commit: is the server provably the instance its
        fingerprint was made for? When it is not, or cannot be told, re-probe and re-fingerprint first
        (on `slot`, when the caller holds one whose content is forfeit)."""
        if srv.available and srv.fingerprint is not None:
            same = await srv.same_instance()
            if same is True:
                return True
            forfeit = slot is not None and slot.owner is None
            if same is None and forfeit and slot is not None and slot.id != srv.canary_slot_id:
                # Nothing tells instances apart and the canary can only be re-measured on the reference
                # slot: this restore cannot be proven, so it does not happen (the fingerprint stays).
                await self._refresh(srv)
                return False
            await self._refresh(srv, slot=slot, force=same is None and forfeit)
        else:
            await self._refresh(srv, slot=slot)
        return srv.available and srv.fingerprint is not None

    def _forget_residency(self, srv: ServerRuntime, reason: str) -> None:
        """The server lost (or may have lost) every slot's content: believe nothing is resident."""
        srv.epoch += 1
        self.stats.server_restarts += 1
        self.metrics.server_restarts.labels(srv.name).inc()
        event(log, logging.WARNING, "kv.backend.restarted", server=srv.name, reason=reason)
        for slot in srv.slots.values():
            self._disown_slot(slot)  # unsaved progress is gone with the server

    def _forget_idle_sessions(self) -> None:
        """Drop sessions that hold nothing: no snapshot, no slot, no lease, no operation (item D14)."""
        held = self.protected_keys() | {s.claimed_by for v in self.servers.values() for s in v.slots.values()}
        for key, rt in list(self._sessions.items()):
            if key in held or rt.dirty or self.store.get(key) is not None:
                continue
            self._drop_runtime(rt)

    def _drop_runtime(self, rt: SessionRuntime) -> None:
        if rt.key in self._idle_armed:
            with contextlib.suppress(Exception):
                self.scheduler.remove_job(f"idle:{rt.key}")
            self._idle_armed.discard(rt.key)
        self._sessions.pop(rt.key, None)
        keys = self._by_session.get(rt.identity.session_id)
        if keys is not None:
            keys.discard(rt.key)
            if not keys:
                del self._by_session[rt.identity.session_id]

    # sessions ----------------------------------------------------------------------------------------
    def route(self, provider: str) -> ServerRuntime | None:
        name = self.config.server_for(provider)
        return self.servers[name] if name is not None else None

    def _runtime(self, identity: SnapshotIdentity) -> SessionRuntime:
        rt = self._sessions.get(identity.key)
        if rt is None:
            rt = SessionRuntime(identity=identity)
            rt.state = self._resting_state(rt)
            self._sessions[identity.key] = rt
            self._by_session.setdefault(identity.session_id, set()).add(identity.key)
        return rt

    def _resting_state(self, rt: SessionRuntime) -> SessionState:
        manifest = self.store.get(rt.key)
        if manifest is None:
            return SessionState.NONE
        return SessionState.SAVED if manifest.has_valid else SessionState.INVALID

    def _is_dirty(self, key: str) -> bool:
        rt = self._sessions.get(key)
        return rt is not None and rt.dirty

    # acquire -----------------------------------------------------------------------------------------
    async def acquire(
        self,
        session_id: str | None,
        *,
        provider: str,
        model: str,
        purpose: str | None = None,
        seq: int | None = None,
    ) -> AcquireResult:
        validate_label("provider", provider)
        validate_label("model", model)
        if session_id is not None:
            validate_session_id(session_id)
        srv = self.route(provider)
        if srv is None or not self.config.enabled or self._closing:
            return AcquireResult(
                outcome=Outcome.BYPASS, reason="unmanaged provider" if srv is None else "disabled"
            )
        self.stats.acquires += 1
        if session_id is None or purpose is not None:
            # Invariant 7: auxiliary requests never become a session's state.
            return await self._acquire_slot(srv, None, seq=None)
        identity = SnapshotIdentity(server=srv.name, provider=provider, model=model, session_id=session_id)
        return await self._acquire_slot(srv, identity, seq=seq)

    async def _take_slot(self, srv: ServerRuntime, key: str | None, holder: Lease | str) -> Slot:
        """Wait (bounded) in the server's FIFO queue for the slot spec §64 picks, and hold it.

        Hand-over is done by `_dispatch`, synchronously, in queue order: a request that arrives while
        others wait cannot overtake them (a releasing client re-acquiring at once would otherwise starve
        everyone else), but a waiter that can be served is never stuck behind one that cannot.
        """
        timeout = self.acquire_timeout_s if self.acquire_timeout_s is not None else srv.config.slot_wait_s
        waiter: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        entry = (key, holder, waiter)
        srv.waiters.append(entry)
        self._dispatch(srv)
        try:
            async with asyncio.timeout(timeout):
                return await asyncio.shield(waiter)
        except BaseException as exc:
            with contextlib.suppress(ValueError):
                srv.waiters.remove(entry)
            if waiter.done() and not waiter.cancelled():  # handed a slot just as we gave up: give it back
                await self._give_back(srv, waiter.result())
            waiter.cancel()
            if isinstance(exc, TimeoutError):
                raise SlotBusy(f"no slot of server {srv.name} became free within {timeout:.0f}s") from None
            raise

    def _dispatch(self, srv: ServerRuntime) -> None:
        """Give free slots to waiters, first come first served. Runs with no await: nothing interleaves."""
        for entry in list(srv.waiters):
            key, holder, waiter = entry
            if waiter.done():
                srv.waiters.remove(entry)
                continue
            slot = srv.select_slot(key, self._is_dirty)
            if slot is None:
                continue
            slot.holder, slot.claimed_by = holder, key
            if isinstance(holder, Lease):
                holder.slot_id = slot.id
                self._preparing.add(holder.id)
            srv.waiters.remove(entry)
            waiter.set_result(slot)

    async def _give_back(self, srv: ServerRuntime, slot: Slot) -> None:
        slot.holder = None
        slot.claimed_by = None
        slot.last_used_at = self.monotonic()
        self._dispatch(srv)

    async def _acquire_slot(
        self, srv: ServerRuntime, identity: SnapshotIdentity | None, *, seq: int | None
    ) -> AcquireResult:
        now = self.clock()
        lease = Lease(
            id=secrets.token_urlsafe(16),
            server=srv.name,
            slot_id=-1,
            key=identity.key if identity else None,
            session_id=identity.session_id if identity else None,
            outcome=Outcome.COLD,
            acquired_at=now,
            expires_at=now + self.config.api.lease_ttl_s,
        )
        slot = await self._take_slot(srv, lease.key, lease)
        try:
            if identity is None:
                result = await self._prepare_aux(srv, slot)
            else:
                rt = self._runtime(identity)
                if seq is not None:
                    rt.seq = seq
                result = await self._prepare(srv, slot, rt)
        except BaseException:
            await self._give_back(srv, slot)
            raise
        finally:
            self._preparing.discard(lease.id)
        lease.outcome = result.outcome
        result.lease_id, result.server, result.base_url, result.slot_id = (
            lease.id,
            srv.name,
            srv.config.base_url,
            slot.id,
        )
        self._leases[lease.id] = lease
        lease.expiry = asyncio.get_running_loop().call_later(
            self.config.api.lease_ttl_s, lambda: self._spawn(self._expire(lease.id))
        )
        self.metrics.acquire.labels(srv.name, result.outcome.value).inc()
        event(
            log,
            logging.DEBUG,
            "kv.slot.acquire",
            server=srv.name,
            slot=slot.id,
            outcome=result.outcome.value,
            session=lease.session_id,
        )  # debug level: the full id is allowed here
        return result

    async def _prepare_aux(self, srv: ServerRuntime, slot: Slot) -> AcquireResult:
        """Spec §72: save the owner if dirty, then the slot belongs to no session."""
        result = AcquireResult(outcome=Outcome.COLD, reason="auxiliary")
        if slot.owner is not None:
            result.evicted = await self._evict(srv, slot, result)
        slot.owner, slot.holds_aux = None, True
        return result

    async def _prepare(self, srv: ServerRuntime, slot: Slot, rt: SessionRuntime) -> AcquireResult:
        with self._busy(rt.key):
            return await self._prepare_slot(srv, slot, rt)

    async def _prepare_slot(self, srv: ServerRuntime, slot: Slot, rt: SessionRuntime) -> AcquireResult:
        rt.last_used_at = self.clock()
        # Invariant 6: a resident session costs no disk I/O and no management call. A local server's
        # process is checked (a /proc read, no HTTP): after a restart the slot is empty, not resident.
        if slot.owner == rt.key and srv.process is not None and not srv.process_check(srv.process):
            await self._refresh(srv)
        if slot.owner == rt.key:
            self.stats.resident += 1
            return AcquireResult(outcome=Outcome.RESIDENT)
        result = AcquireResult(outcome=Outcome.COLD)
        if slot.owner is not None:
            result.evicted = await self._evict(srv, slot, result)
        event(
            log,
            logging.INFO,
            "kv.session.switch",
            server=srv.name,
            slot=slot.id,
            to=rt.identity.short,
            evicted=result.evicted,
        )
        self.stats.switches += 1
        self.metrics.switch.labels(srv.name).inc()
        await self._load_session(srv, slot, rt, result)
        slot.owner, slot.holds_aux = rt.key, False
        event(
            log,
            logging.INFO,
            "kv.session.restore.success" if result.outcome is Outcome.RESTORED else "kv.session.cold",
            server=srv.name,
            slot=slot.id,
            session=rt.identity.short,
            tokens=result.restored_tokens,
            restore_ms=result.restore_ms,
            reason=result.reason,
            evicted=result.evicted,
        )
        return result

    async def _evict(self, srv: ServerRuntime, slot: Slot, result: AcquireResult) -> str | None:
        """Invariant 3: a dirty slot is checkpointed before it is reassigned (unless on_switch is off)."""
        owner = slot.owner
        rt = self._sessions.get(owner) if owner else None
        slot.owner = None
        if rt is None:
            return None
        if rt.dirty and self.config.checkpoint.on_switch:
            await self._save(srv, slot, rt, trigger="switch", actions=result.actions)
        if rt.dirty:  # not saved (policy off or failure): that progress is gone from the slot
            rt.saved_revision = rt.dirty_revision
        rt.state = self._resting_state(rt)
        return rt.identity.short

    async def _load_session(
        self, srv: ServerRuntime, slot: Slot, rt: SessionRuntime, result: AcquireResult
    ) -> None:
        """Restore the session's snapshot into the slot, or erase the slot for a cold start (spec §23)."""
        persist_ok = await self._same_runtime(srv, slot)
        trial = persist_ok and srv.breaker.state is BreakerState.HALF_OPEN
        persist_ok = persist_ok and srv.breaker.allow()
        try:
            await self._load_or_cold(srv, slot, rt, result, persist_ok)
        finally:
            if trial and persist_ok:  # this call held the half-open trial: it ends here, whatever happened
                srv.breaker.end_trial()

    async def _load_or_cold(
        self, srv: ServerRuntime, slot: Slot, rt: SessionRuntime, result: AcquireResult, persist_ok: bool
    ) -> None:
        fingerprint = srv.fingerprint  # the one proven for this instance just now
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
            first = rejections[0].reason if rejections else None
            if candidate is not None and await self._restore(
                srv, slot, rt, candidate, fingerprint, result, first
            ):
                return
            if candidate is None:
                self.metrics.restore_miss.labels(srv.name).inc()
            if rejections and result.outcome is Outcome.COLD:
                result.outcome, result.reason = Outcome.COLD_FALLBACK, rejections[0].reason
                rt.state = SessionState.INVALID
        reachable = srv.available and srv.breaker.state is not BreakerState.OPEN
        await self._cold(srv, slot, rt, result, erase=persist_ok or reachable)

    async def _find(
        self, srv: ServerRuntime, rt: SessionRuntime, fingerprint: RuntimeFingerprint
    ) -> tuple[Candidate | None, list[Rejection]]:
        try:
            candidate, rejections = await asyncio.to_thread(
                self.store.find_restorable, rt.identity, fingerprint, max_tokens=srv.slot_n_ctx
            )
        except KvError as exc:  # the manifest could not be read: this session is cold, nothing else fails
            event(log, logging.WARNING, "kv.snapshot.unreadable", session=rt.identity.short, code=exc.code)
            return None, []
        if candidate is not None and (candidate.generation, fingerprint.digest) in rt.refused:
            # This runtime already refused exactly this file: do not hand it over again.
            return None, []
        for rej in rejections:
            self.metrics.invalidated.labels(rej.reason).inc()
            event(
                log,
                logging.WARNING,
                "kv.snapshot.rejected",
                session=rt.identity.short,
                generation=rej.generation,
                reason=rej.reason,
                detail=rej.detail,
            )
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
        self.metrics.restore.labels(srv.name).inc()
        self.stats.restores += 1
        rt.state = SessionState.RESTORING
        event(
            log,
            logging.INFO,
            "kv.session.restore.start",
            session=rt.identity.short,
            slot=slot.id,
            generation=candidate.generation,
            tokens=candidate.record.tokens,
            bytes=candidate.record.bytes,
        )
        epoch = srv.epoch
        try:
            restored = await self._persist(srv, srv.backend.restore_slot(slot.id, candidate.record.filename))
        except asyncio.CancelledError:
            rt.state = self._resting_state(rt)
            raise
        except KvError as exc:
            await self._restore_failed(srv, slot, rt, candidate, exc, result)
            return False
        try:
            if restored.tokens != candidate.record.tokens:
                raise RestoreFailed(
                    f"server restored {restored.tokens} tokens, the snapshot has {candidate.record.tokens}"
                )
        except KvError as exc:
            await self._restore_failed(srv, slot, rt, candidate, exc, result)
            return False
        # The closing bracket: a restart during the restore means the KV went into an unknown runtime.
        if not await self._same_runtime(srv) or srv.epoch != epoch or srv.fingerprint != fingerprint:
            result.outcome, result.reason = Outcome.COLD_FALLBACK, "server restarted during restore"
            rt.state = self._resting_state(rt)
            event(log, logging.WARNING, "kv.session.restore.voided", session=rt.identity.short)
            return False
        self._restore_ok(srv, slot, rt, restored.tokens, restored.bytes_read, restored.measured_ms, result)
        result.restore_server_ms = restored.server_ms
        if candidate.fallback:
            result.reason = f"previous generation ({fallback_reason or 'fallback'})"
        return True

    def _restore_ok(
        self,
        srv: ServerRuntime,
        slot: Slot,
        rt: SessionRuntime,
        tokens: int,
        nbytes: int,
        ms: float,
        result: AcquireResult,
    ) -> None:
        srv.breaker.success()
        result.outcome, result.restored_tokens, result.restore_ms = Outcome.RESTORED, tokens, round(ms, 3)
        result.actions.append(f"restore {rt.identity.short}")
        rt.state, rt.verify_tokens = SessionState.ACTIVE_CLEAN, tokens
        rt.saved_revision = rt.dirty_revision
        slot.tokens = tokens
        self.stats.restore_hits += 1
        self.metrics.restore_hit.labels(srv.name).inc()
        self.metrics.restore_bytes.labels(srv.name).inc(nbytes)
        self.metrics.restore_ms.labels(srv.name).observe(ms)
        self.store.touch(rt.key, persist=False)

    async def _restore_failed(
        self,
        srv: ServerRuntime,
        slot: Slot,
        rt: SessionRuntime,
        candidate: Candidate,
        exc: KvError,
        result: AcquireResult,
    ) -> None:
        """Fall back to cold. Only evidence about the file may invalidate it (checked before the restore:
        size, header, checksum), so a failure the server causes never marks the snapshot invalid:
        - refused (HTTP 400, a token count that differs): this runtime cannot take this file; it is not
          offered to this fingerprint again, and the runtime is re-fingerprinted (what did we miss?);
        - the server died under the restore: not offered again by this daemon (no crash loop), kept on disk;
        - unreachable, unsupported, timeout: nothing is known about the file; it stays as it was."""
        if not isinstance(exc, RestoreFailed):  # a refusal of one file says nothing about the server
            self._breaker_failure(srv, exc)
        self.stats.restore_failures += 1
        self.metrics.restore_failure.labels(srv.name, exc.code).inc()
        if srv.fingerprint is not None and (isinstance(exc, RestoreFailed | ConnectionLost)):
            rt.refused.add((candidate.generation, srv.fingerprint.digest))
        event(
            log,
            logging.WARNING,
            "kv.session.restore.failed",
            session=rt.identity.short,
            code=exc.code,
            error=exc.message,
        )
        result.outcome, result.reason = Outcome.COLD_FALLBACK, exc.code
        rt.state, rt.last_error = self._resting_state(rt), exc.code
        if isinstance(exc, RestoreFailed):  # when in doubt, re-fingerprint (unless the instance is proven)
            slot.owner = None
            await self._same_runtime(srv, slot)
        if self.config.failure.strict:
            raise exc

    async def _cold(
        self, srv: ServerRuntime, slot: Slot, rt: SessionRuntime, result: AcquireResult, *, erase: bool
    ) -> None:
        """Spec §53: erase the slot and let the engine prefill; the next checkpoint makes the snapshot."""
        if erase:
            try:
                await self._persist(srv, srv.backend.erase_slot(slot.id))
                srv.breaker.success()
                result.actions.append("erase")
            except KvError as exc:
                # Leftover KV is harmless for correctness (the engine only reuses an exact token prefix).
                self._breaker_failure(srv, exc)
                event(log, logging.WARNING, "kv.slot.erase.failed", slot=slot.id, code=exc.code)
        slot.tokens = 0
        rt.verify_tokens = None
        if rt.state is not SessionState.INVALID:
            rt.state = SessionState.COLD
        if result.outcome is Outcome.COLD:
            self.stats.cold_starts += 1
        else:
            self.stats.cold_fallbacks += 1
        self.metrics.cold.labels(srv.name, result.reason or "no snapshot").inc()

    async def _persist(self, srv: ServerRuntime, op: Awaitable[T]) -> T:
        """A persistence call with its own bound (spec §59), independent of any inference timeout."""
        try:
            return await asyncio.wait_for(op, srv.config.persist_timeout_s + MARGIN_S)
        except TimeoutError:
            raise OperationTimeout(
                f"persistence call to {srv.name} ran past {srv.config.persist_timeout_s}s"
            ) from None

    def _breaker_failure(self, srv: ServerRuntime, exc: KvError) -> None:
        if not isinstance(exc, BackendError):
            return
        if srv.breaker.failure(exc.code):
            self.metrics.circuit_open.labels(srv.name).inc()
            event(
                log,
                logging.ERROR,
                "kv.persistence.circuit_open",
                server=srv.name,
                code=exc.code,
                cooldown_s=srv.breaker.cooldown_s,
            )
        if isinstance(exc, BackendUnavailable | OperationTimeout):
            srv.available = False  # the probe loop brings it back, and says whether it restarted

    # save --------------------------------------------------------------------------------------------
    async def _save(
        self,
        srv: ServerRuntime,
        slot: Slot,
        rt: SessionRuntime,
        *,
        trigger: str,
        actions: list[str] | None = None,
    ) -> bool:
        """Checkpoint the slot into the session's next generation. Caller holds the slot. True if saved.

        Coalescing (spec §27): if the saved revision already equals the dirty one, nothing happens.
        """
        if not rt.dirty:
            return True
        trial = srv.breaker.state is BreakerState.HALF_OPEN
        if srv.fingerprint is None or not srv.available or not srv.breaker.allow():
            self.stats.save_failures += 1
            self.metrics.save_failure.labels(srv.name, "KV_BACKEND_UNAVAILABLE").inc()
            return False
        try:
            with self._busy(rt.key):
                return await self._save_now(srv, slot, rt, trigger=trigger, actions=actions)
        finally:
            if trial:  # this call held the half-open trial
                srv.breaker.end_trial()

    async def _save_now(
        self, srv: ServerRuntime, slot: Slot, rt: SessionRuntime, *, trigger: str, actions: list[str] | None
    ) -> bool:
        fingerprint = srv.fingerprint
        assert fingerprint is not None  # checked by _save
        revision, previous_state = rt.dirty_revision, rt.state
        rt.state = SessionState.SAVING
        event(
            log,
            logging.INFO,
            "kv.session.save.start",
            session=rt.identity.short,
            trigger=trigger,
            slot=slot.id,
        )
        started = self.monotonic()
        epoch = srv.epoch
        if not await self._same_runtime(srv) or srv.epoch != epoch or srv.fingerprint != fingerprint:
            # The server restarted since this slot was filled: its content is gone, nothing to save.
            rt.state = previous_state
            self.metrics.save_failure.labels(srv.name, "KV_SERVER_RESTARTED").inc()
            return False
        plan = None
        try:
            plan = await asyncio.to_thread(self.store.begin_save, rt.identity, fingerprint=fingerprint)
            saved = await self._persist(srv, srv.backend.save_slot(slot.id, plan.filename))
            self._check_saved(saved.tokens)
            # The closing bracket: a file written by another instance is not this session's KV.
            if not await self._same_runtime(srv) or srv.epoch != epoch or srv.fingerprint != fingerprint:
                raise SaveFailed("llama-server restarted during the save; the file is discarded")
            await asyncio.to_thread(
                self.store.commit_save,
                plan,
                saved,
                fingerprint=fingerprint,
                revision=revision,
                session_seq=rt.seq,
            )
        except KvError as exc:
            if plan is not None:
                self.store.abort_save(plan, discard=True)
            if self.after_save is not None:  # a full disk is a reason to run retention now
                self.after_save()
            self._breaker_failure(srv, exc)
            self.stats.save_failures += 1
            self.metrics.save_failure.labels(srv.name, exc.code).inc()
            rt.state, rt.last_error = previous_state, exc.code
            event(
                log,
                logging.WARNING,
                "kv.session.save.failed",
                session=rt.identity.short,
                trigger=trigger,
                code=exc.code,
                error=exc.message,
            )
            if self.config.failure.strict:
                raise
            return False
        except BaseException:  # cancelled: no half-written file left behind, no session stuck in SAVING
            if plan is not None:
                self.store.abort_save(plan, discard=True)
            rt.state = previous_state
            raise
        if srv.breaker.success():
            event(log, logging.INFO, "kv.persistence.circuit_recovered", server=srv.name)
        ms = (self.monotonic() - started) * 1000
        rt.saved_revision = max(rt.saved_revision, revision)
        rt.state = SessionState.ACTIVE_CLEAN if slot.owner == rt.key else SessionState.SAVED
        self.stats.saves += 1
        self.metrics.save.labels(srv.name, trigger).inc()
        self.metrics.save_bytes.labels(srv.name).inc(saved.bytes_written)
        self.metrics.save_ms.labels(srv.name).observe(ms)
        if actions is not None:
            actions.append(f"save {rt.identity.short}")
        if self.after_save is not None:
            self.after_save()
        event(
            log,
            logging.INFO,
            "kv.session.save.success",
            session=rt.identity.short,
            trigger=trigger,
            tokens=saved.tokens,
            bytes=saved.bytes_written,
            save_ms=round(ms, 1),
        )
        return True

    @staticmethod
    def _check_saved(tokens: int) -> None:
        """A dirty session's slot holds its prompt: an empty save is an emptied slot, never a checkpoint."""
        if tokens <= 0:
            raise SaveFailed("llama-server saved an empty slot (it lost the session's KV); not recorded")

    async def _checkpoint(
        self, rt: SessionRuntime, trigger: str, *, only_revision: int | None = None
    ) -> bool:
        """Save a session where it is resident, waiting for its slot to be free. False if nothing saved."""
        srv = self.servers.get(rt.identity.server)
        if srv is None or srv.owner_slot(rt.key) is None or not rt.dirty:
            return False
        if only_revision is not None and rt.dirty_revision != only_revision:
            return False  # an old timer: a newer request rescheduled it (spec §71)
        slot = await self._take_slot(srv, rt.key, trigger)
        try:
            if slot.owner != rt.key:  # ownership moved while we waited; save-before-evict handled it
                return False
            return await self._save(srv, slot, rt, trigger=trigger)
        finally:
            await self._give_back(srv, slot)

    async def _checkpoint_all(self, trigger: str) -> None:
        for rt in list(self._sessions.values()):
            if rt.dirty:
                with contextlib.suppress(KvError):
                    await self._checkpoint(rt, trigger)

    # release -----------------------------------------------------------------------------------------
    async def release(
        self,
        lease_id: str,
        *,
        status: ReleaseStatus,
        prompt_tokens: int | None = None,
        cached_tokens: int | None = None,
    ) -> dict[str, Any]:
        lease = self._leases.pop(lease_id, None)
        if lease is None:
            raise LeaseNotFound("no such lease (already released or expired)")
        if lease.expiry is not None:
            lease.expiry.cancel()
        srv = self.servers[lease.server]
        slot = srv.slots.get(lease.slot_id)
        out: dict[str, Any] = {"released": True, "dirty": False}
        event(
            log,
            logging.DEBUG,
            "kv.slot.release",
            server=srv.name,
            slot=lease.slot_id,
            status=status,
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
            session=lease.session_id,
        )
        rt = self._sessions.get(lease.key) if lease.key else None
        if rt is not None and slot is not None and slot.owner == rt.key:
            if status == "ok":
                rt.dirty_revision += 1
                rt.state = SessionState.ACTIVE_DIRTY
                out["dirty"] = True
                out["revision"] = rt.dirty_revision
                self._schedule_idle(rt)
            if rt.verify_tokens is not None and status == "ok":
                out["restore_verification"] = self._verify_restore(srv, rt, prompt_tokens, cached_tokens)
        if slot is not None:
            await self._give_back(srv, slot)
        return out

    def _verify_restore(
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
        self.metrics.restore_verified.labels(srv.name, result).inc()
        if result == "ineffective":
            self.stats.restore_ineffective += 1
            event(
                log,
                logging.ERROR,
                "kv.session.restore.ineffective",
                session=rt.identity.short,
                restored=restored,
                reused=cached_tokens,
                computed=prompt_tokens,
                hint="the engine recomputed the prompt after a restore: SWA/hybrid model without --swa-full?",
            )
        return result

    def renew(self, lease_id: str) -> None:
        """Push a lease's expiry back by a full TTL (the proxy does so while its request is in flight)."""
        lease = self._leases.get(lease_id)
        if lease is None:
            return
        if lease.expiry is not None:
            lease.expiry.cancel()
        ttl = self.config.api.lease_ttl_s
        lease.expires_at = self.clock() + ttl
        lease.expiry = asyncio.get_running_loop().call_later(ttl, lambda: self._spawn(self._expire(lease_id)))

    async def _expire(self, lease_id: str) -> None:
        lease = self._leases.get(lease_id)
        if lease is None:
            return
        self.stats.leases_expired += 1
        self.metrics.leases_expired.labels(lease.server).inc()
        event(
            log,
            logging.WARNING,
            "kv.lease.expired",
            server=lease.server,
            slot=lease.slot_id,
            session=short_id(lease.session_id) if lease.session_id else None,
        )
        with contextlib.suppress(LeaseNotFound):
            await self.release(lease_id, status="aborted")

    # timers ------------------------------------------------------------------------------------------
    def _schedule_idle(self, rt: SessionRuntime) -> None:
        """Push the session's idle deadline back; add an APScheduler job only if none is pending.

        Re-adding the job on every request costs ~0.2 ms of scheduler bookkeeping on the resident hot
        path, so the job stays put and, when it fires early, re-arms itself for the current deadline.
        """
        idle_s = self.config.checkpoint.idle_s
        if idle_s is None or not self._started or self._closing:
            return
        rt.idle_due = self.monotonic() + idle_s
        if rt.key not in self._idle_armed:
            self._arm_idle(rt.key, idle_s)

    def _arm_idle(self, key: str, delay_s: float) -> None:
        from datetime import UTC, datetime, timedelta

        self._idle_armed.add(key)
        self.scheduler.add_job(
            self._on_idle,
            "date",
            run_date=datetime.now(UTC) + timedelta(seconds=max(0.0, delay_s)),
            args=[key],
            id=f"idle:{key}",
            replace_existing=True,
            misfire_grace_time=None,
        )

    async def _on_idle(self, key: str) -> None:
        """Spec §71: when the timer fires, recheck the deadline, ownership and revision before saving."""
        self._idle_armed.discard(key)
        rt = self._sessions.get(key)
        if rt is None or self._closing or rt.idle_due is None:
            return
        remaining = rt.idle_due - self.monotonic()
        if remaining > 0.001:  # a request came in since the job was armed: wait for the new deadline
            self._arm_idle(key, remaining)
            return
        rt.idle_due = None
        with contextlib.suppress(KvError):
            await self._checkpoint(rt, "idle", only_revision=rt.dirty_revision)

    def idle_job(self, key: str) -> Any:
        return self.scheduler.get_job(f"idle:{key}")

    # events and manual operations -------------------------------------------------------------------
    def _known(self, session_id: str) -> list[SessionRuntime]:
        validate_session_id(session_id)
        keys = set(self._by_session.get(session_id, set()))
        keys |= {m.key for m in self.store.all() if m.session_id == session_id}
        out = []
        for key in keys:
            rt = self._sessions.get(key)
            if rt is None and (m := self.store.get(key)) is not None:
                rt = self._runtime(m.identity)
            if rt is not None:
                out.append(rt)
        return out

    async def session_event(
        self, session_id: str, type_: EventType, *, seq: int | None = None
    ) -> dict[str, Any]:
        """Lifecycle hints (spec §50). Restores stay lazy: `created`/`switch` change nothing (§51)."""
        cp = self.config.checkpoint
        trigger = {
            "flush": cp.on_session_flush,
            "turn_end": cp.on_turn_end,
            "step_end": cp.on_step_end,
            "disposed": cp.on_disposed,
        }.get(type_, False)
        saved = 0
        for rt in self._known(session_id):
            if seq is not None:
                rt.seq = seq
            if trigger and await self._checkpoint(rt, type_):
                saved += 1
            if type_ == "disposed":
                await self._disown(rt)
        return {"type": type_, "saved": saved}

    async def _disown(self, rt: SessionRuntime) -> None:
        srv = self.servers.get(rt.identity.server)
        if srv is not None and srv.owner_slot(rt.key) is not None:
            slot = await self._take_slot(srv, rt.key, "dispose")
            try:
                if slot.owner == rt.key:
                    slot.owner = None
            finally:
                await self._give_back(srv, slot)
        with contextlib.suppress(Exception):
            self.scheduler.remove_job(f"idle:{rt.key}")
        self._drop_runtime(rt)

    async def save(self, session_id: str) -> dict[str, Any]:
        results = {}
        for rt in self._known(session_id):
            results[rt.identity.short] = await self._checkpoint(rt, "manual")
        if not results:
            raise NotFound("no such session")
        return {"saved": sum(results.values()), "checked": len(results)}

    async def invalidate(self, session_id: str) -> dict[str, Any]:
        marked = 0
        for rt in self._known(session_id):
            m = self.store.get(rt.key)
            for gen, _ in m.ordered_generations() if m else []:
                self.store.mark_invalid(rt.key, gen, INVALIDATED)
                marked += 1
            rt.state = SessionState.INVALID if m else rt.state
        return {"invalidated": marked}

    async def purge(self, session_id: str) -> dict[str, Any]:
        freed = 0
        found = self._known(session_id)
        if not found:
            raise NotFound("no such session")
        for rt in found:
            await self._disown(rt)
            freed += await asyncio.to_thread(self.store.purge, rt.key)
        return {"purged": len(found), "bytes_freed": freed}

    async def with_slot(self, server: str, fn: Callable[[int], Awaitable[T]]) -> T:
        """Run fn(slot_id) holding a slot of `server` as an auxiliary request (doctor's probes): the
        owner is checkpointed first and the next session request restores as usual."""
        result = await self._acquire_slot(self.servers[server], None, seq=None)
        assert result.lease_id is not None and result.slot_id is not None
        try:
            return await fn(result.slot_id)
        finally:
            await self.release(result.lease_id, status="aborted")

    def reconfigure(self, config: Config) -> list[str]:
        """SIGHUP: apply what is safe to change live; name what needs a restart."""
        needs_restart = [
            k
            for k in ("servers", "routes", "api", "state_dir")
            if getattr(config, k) != getattr(self.config, k)
        ]
        if not needs_restart:
            self.config = config
            for srv in self.servers.values():
                srv.breaker.max_consecutive_failures = config.failure.max_consecutive_failures
                srv.breaker.base_cooldown_s = config.failure.cooldown_s
        return needs_restart

    @contextlib.contextmanager
    def _busy(self, key: str) -> Any:
        self._busy_keys[key] = self._busy_keys.get(key, 0) + 1
        try:
            yield
        finally:
            self._busy_keys[key] -= 1
            if not self._busy_keys[key]:
                del self._busy_keys[key]

    def protected_keys(self) -> set[str]:
        """Snapshots retention must not touch: resident in a slot, leased, or under an operation."""
        keys = {lease.key for lease in self._leases.values() if lease.key is not None} | set(self._busy_keys)
        for srv in self.servers.values():
            keys |= {s.owner for s in srv.slots.values() if s.owner is not None}
        return keys

    # views -------------------------------------------------------------------------------------------
    def session_views(self, session_id: str | None = None) -> list[dict[str, Any]]:
        keys = set(self._sessions) | {m.key for m in self.store.all()}
        views = []
        for key in keys:
            rt = self._sessions.get(key)
            m = self.store.get(key)
            ident = rt.identity if rt else m.identity if m else None
            if ident is None or (session_id is not None and ident.session_id != session_id):
                continue
            srv = self.servers.get(ident.server)
            slot = srv.owner_slot(key) if srv else None
            views.append(
                {
                    "session": ident.session_id if session_id else ident.short,
                    "provider": ident.provider,
                    "model": ident.model,
                    "server": ident.server,
                    "state": (
                        rt.state if rt else SessionState.SAVED if m and m.has_valid else SessionState.INVALID
                    ).value,
                    "resident_slot": slot.id if slot else None,
                    "dirty_revision": rt.dirty_revision if rt else 0,
                    "saved_revision": rt.saved_revision if rt else 0,
                    "snapshot": None
                    if m is None
                    else {
                        "current": m.current,
                        "bytes": m.total_bytes,
                        "updated_at": m.updated_at,
                        "generations": {
                            g: {
                                "tokens": r.tokens,
                                "bytes": r.bytes,
                                "invalid_reason": r.invalid_reason,
                                "saved_at": r.saved_at,
                            }
                            for g, r in m.ordered_generations()
                        },
                    },
                }
            )
        return sorted(views, key=lambda v: (v["server"], v["session"]))

    def status(self) -> dict[str, Any]:
        manifests = self.store.all()
        valid = sum(1 for m in manifests if m.has_valid)
        return {
            "enabled": self.config.enabled,
            "servers": [self._server_view(srv) for srv in self.servers.values()],
            "snapshots": {
                "known": len(manifests),
                "valid": valid,
                "invalid": len(manifests) - valid,
                "bad_manifests": len(self.store.bad_manifests()),
                "bytes": sum(m.total_bytes for m in manifests),
            },
            "leases": len(self._leases),
            "stats": dict(self.stats.__dict__),
        }

    def _server_view(self, srv: ServerRuntime) -> dict[str, Any]:
        def slot_state(s: Slot) -> str:
            if isinstance(s.holder, Lease):
                return "inference"
            if isinstance(s.holder, str):
                return s.holder
            if s.owner is None:
                return "aux" if s.holds_aux else "idle"
            return "dirty" if self._is_dirty(s.owner) else "ready"

        return {
            "name": srv.name,
            "kind": srv.backend.kind,
            "endpoint": srv.config.base_url,
            "mode": srv.config.mode.value,
            "available": srv.available,
            "persistence": srv.breaker.state.value,
            "last_error": srv.last_error,
            "fingerprint": srv.fingerprint.digest[:16] if srv.fingerprint else None,
            "runtime": {
                "identity": srv.identity_kind,
                "canary": (srv.canary[:12] if srv.canary else "pending")
                if srv.config.runtime_canary
                else "off",
                "canary_failures": srv.canary_failures,
                "restarts_seen": srv.epoch,
            },
            "slots": [
                {
                    "id": s.id,
                    "owner": self._sessions[s.owner].identity.short if s.owner in self._sessions else None,
                    "state": slot_state(s),
                    "tokens": s.tokens,
                }
                for s in sorted(srv.slots.values(), key=lambda s: s.id)
            ],
        }
