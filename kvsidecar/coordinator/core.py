"""The coordinator: who owns each slot, when to restore, save and erase (spec §18-34, §50-53, §69-72).

Flow of one model call: `acquire()` picks the session's slot and prepares it (resident: nothing to do;
otherwise checkpoint the previous owner, then restore the session's snapshot or erase for a cold start)
and returns a lease; the harness runs inference with `id_slot`; `release()` ends the lease, marks the
session dirty on success and checks how much of a restore the engine actually reused.

Invariant 1: nothing here ever touches a prompt or a reply; the harness' conversation is built from its own
log, so what kvsidecar does to a slot can change how fast an answer comes, never what it says.

`Coordinator` composes the parts, each one noun (see each module's docstring):
  pool.SlotPool          which request may use which slot, FIFO hand-over (Invariant 8)
  leases.LeaseTable      leases and their expiry timers
  sessions.SessionTable  sessions and their state machine
  runtime.RuntimeGuard   server identity, fingerprint and canary; the bracket of every restore and save
  restore.Restorer       find, verify, restore or start cold; verify reuse
  save.Saver             save a slot into the next generation
  checkpoint.CheckpointPolicy  when to save: switch, idle, hints, shutdown
  telemetry.Telemetry    logs and metrics;  views               status and session views
Everything runs on the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import Awaitable, Callable
from functools import partial
from typing import Any, Literal, TypeVar

from apscheduler.schedulers.asyncio import AsyncIOScheduler

from kvsidecar.backend.base import KvBackend
from kvsidecar.config import Config
from kvsidecar.coordinator import views
from kvsidecar.coordinator.caller import Caller
from kvsidecar.coordinator.canary import sweep_canary_files
from kvsidecar.coordinator.checkpoint import CheckpointPolicy
from kvsidecar.coordinator.costs import CostModel
from kvsidecar.coordinator.leases import LeaseTable
from kvsidecar.coordinator.ownership import KeyOwnership
from kvsidecar.coordinator.pool import SlotPool, owner_slot
from kvsidecar.coordinator.restore import Restorer
from kvsidecar.coordinator.runtime import RuntimeGuard
from kvsidecar.coordinator.save import Saver
from kvsidecar.coordinator.server import ProcessFinder, ServerRuntime, build_servers
from kvsidecar.coordinator.sessions import SessionEvent, SessionTable, track_context
from kvsidecar.coordinator.state import HOOK_SCOPE, AcquireResult, Lease, Outcome, SessionRuntime, Slot
from kvsidecar.coordinator.telemetry import Telemetry
from kvsidecar.errors import KvError, LeaseNotFound, NotFound, SlotBusy
from kvsidecar.fingerprint.runtime import FileDigestCache, ProcessInfo
from kvsidecar.fingerprint.savepath import llama_save_dir
from kvsidecar.metrics import Metrics
from kvsidecar.store.atomic import SHARED_TEMP_AGE_S
from kvsidecar.store.naming import SnapshotIdentity, validate_label, validate_session_id
from kvsidecar.store.snapshots import SnapshotStore

__all__ = ["AcquireResult", "Coordinator"]

T = TypeVar("T")
ReleaseStatus = Literal["ok", "error", "aborted"]
EventType = Literal["created", "switch", "flush", "turn_end", "step_end", "disposed"]
INVALIDATED = "INVALIDATED_BY_REQUEST"


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
        self.acquire_timeout_s = acquire_timeout_s
        self.servers = build_servers(config, backends, process_finder, process_check, digests, monotonic)
        self.scheduler = AsyncIOScheduler(timezone="UTC")  # the daemon's retention job runs on it
        self.costs = CostModel()
        self.telemetry = Telemetry(self.metrics, self.costs)
        self.monotonic = monotonic
        self.sessions = SessionTable(store)
        self.pool = SlotPool(is_dirty=self.sessions.is_dirty, monotonic=monotonic)
        self.leases = LeaseTable(on_expire=self._on_lease_timer, on_claim=self._on_claim_timer)
        self.telemetry.watch(
            servers=self.servers,
            leases=self.leases,
            store=store,
            quota_bytes=lambda: self.config.retention.max_total_bytes,
        )
        self.guard = RuntimeGuard(sessions=self.sessions, pool=self.pool, telemetry=self.telemetry)
        # who may write a key's files: always this host, unless fleet mode installs its gate
        self.ownership = KeyOwnership(store=store, sessions=self.sessions, servers=self.servers)
        self.restorer = Restorer(
            config=config,
            store=store,
            sessions=self.sessions,
            guard=self.guard,
            telemetry=self.telemetry,
            costs=self.costs,
        )
        self.saver = Saver(
            config=config,
            store=store,
            sessions=self.sessions,
            guard=self.guard,
            telemetry=self.telemetry,
            costs=self.costs,
            monotonic=monotonic,
            ownership=self.ownership,
        )
        self.checkpoints = CheckpointPolicy(
            config=config,
            servers=self.servers,
            sessions=self.sessions,
            pool=self.pool,
            saver=self.saver,
            costs=self.costs,
            telemetry=self.telemetry,
            spawn=self.spawn,
            monotonic=monotonic,
            acquire_timeout_s=acquire_timeout_s,
        )
        self.pool.on_given_back = self.checkpoints.given_back
        self.pending_restart: list[str] = []  # restart-only keys a SIGHUP found changed (status shows them)
        self.fleet_view: Callable[[], dict[str, Any]] | None = None  # fleet mode's part of status()
        self.proxy_view: Callable[[], dict[str, Any]] | None = None  # the proxy's part (issue 28)
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False
        self._started = False

    @property
    def after_save(self) -> Callable[[], None] | None:
        """Called (on the loop) after every save attempt: the daemon checks retention limits here."""
        return self.saver.after_save

    @after_save.setter
    def after_save(self, hook: Callable[[], None] | None) -> None:
        self.saver.after_save = hook

    # lifecycle ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        self.scheduler.start()
        self._started = True
        self.checkpoints.active = True
        for srv in self.servers.values():
            shared = SHARED_TEMP_AGE_S if self.config.fleet.enabled else 0.0  # another host's may be fresh
            held = self.store.snapshot_anchor(srv.name) or srv.config.snapshot_dir  # never through its path
            await asyncio.to_thread(sweep_canary_files, held, min_age_s=shared)
            await self.guard.refresh(srv)
            self.spawn(self._probe_loop(srv))

    async def aclose(self) -> None:
        """Stop taking work, checkpoint dirty slots within the bound, stop every task and timer."""
        if self._closing:
            return
        self._closing = True
        self.checkpoints.close()  # no timer or background save starts from here on
        if self.config.checkpoint.on_shutdown:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self.checkpoints.checkpoint_all("shutdown"), self.config.checkpoint.shutdown_timeout_s
                )
        self.pool.closing = True
        for srv in self.servers.values():
            self.pool.wake_all(srv)  # requests still waiting for a slot answer KV_SHUTTING_DOWN
        self.restorer.close()
        self.leases.cancel_timers()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._started:
            self.scheduler.shutdown(wait=False)
            await asyncio.sleep(0)  # AsyncIOScheduler finishes its shutdown in a loop callback
        for srv in self.servers.values():
            srv.close()
            await srv.backend.aclose()

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        """A background task the coordinator owns: cancelled and awaited by aclose()."""
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _probe_loop(self, srv: ServerRuntime) -> None:
        while True:
            await asyncio.sleep(srv.config.probe_interval_s)
            await self.guard.refresh(srv)
            # a directory whose path now leads elsewhere is logged (kv.store.dir_moved) even with no traffic
            self.store.dir_faults({srv.name: llama_save_dir(srv.process)})
            self.forget_idle_sessions()

    def forget_idle_sessions(self) -> int:
        held = self.protected_keys() | {
            s.claimed_by for v in self.servers.values() for s in v.slots.values() if s.claimed_by
        }
        return self.sessions.forget_idle(held)

    # acquire -----------------------------------------------------------------------------------------
    def route(self, provider: str) -> ServerRuntime | None:
        name = self.config.server_for(provider)
        return self.servers[name] if name is not None else None

    def session_key(
        self, session_id: str, provider: str, model: str, purpose: str | None
    ) -> tuple[str | None, str | None]:
        """(identity key, server) an acquire of these would manage; (None, None) for a bypass or an
        auxiliary request (fleet routing: nothing to route by). Bad labels are left to acquire."""
        srv = self.route(provider)
        if srv is None or purpose is not None or not self.config.enabled:
            return None, None
        try:
            validate_label("provider", provider)
            validate_label("model", model)
            validate_session_id(session_id)
        except KvError:
            return None, None
        key = SnapshotIdentity(server=srv.name, provider=provider, model=model, session_id=session_id).key
        return key, srv.name

    async def acquire(
        self,
        session_id: str | None,
        *,
        provider: str,
        model: str,
        purpose: str | None = None,
        seq: int | None = None,
        caller: Caller | None = None,
        scope: str = HOOK_SCOPE,
        prefix_from: str | None = None,
    ) -> AcquireResult:
        """`caller`: who waits for the answer; once it is gone the wait ends and no lease is granted.
        `scope`: the caller's credential scope; `prefix_from`: a session of the same provider, model and
        scope whose newest snapshot a cold start of this one may begin from (issue 28; restore.py)."""
        validate_label("provider", provider)
        validate_label("model", model)
        if session_id is not None:
            validate_session_id(session_id)
        if prefix_from is not None:
            validate_session_id(prefix_from)
        srv = self.route(provider)
        if srv is None or not self.config.enabled or self._closing:
            return AcquireResult(
                outcome=Outcome.BYPASS, reason="unmanaged provider" if srv is None else "disabled"
            )
        if session_id is None or purpose is not None:
            # Invariant 7: auxiliary requests never become a session's state.
            return await self._acquire(srv, None, seq=None, caller=caller, scope=scope)
        if caller is not None and caller.gone():  # before any claim or wait: nobody reads the answer
            raise caller.error(srv.name)
        identity = SnapshotIdentity(server=srv.name, provider=provider, model=model, session_id=session_id)
        # fleet: take (or keep) the key before touching it; a stale local copy is dropped first. A host
        # that may not write it still serves the session (a restore is a read); its saves are refused.
        await self.ownership.claim(identity.key)
        donor = None
        if prefix_from is not None and prefix_from != session_id:
            donor = SnapshotIdentity(server=srv.name, provider=provider, model=model, session_id=prefix_from)
        return await self._acquire(srv, identity, seq=seq, caller=caller, scope=scope, donor=donor)

    async def _acquire(
        self,
        srv: ServerRuntime,
        identity: SnapshotIdentity | None,
        *,
        seq: int | None,
        caller: Caller | None = None,
        scope: str = HOOK_SCOPE,
        donor: SnapshotIdentity | None = None,
    ) -> AcquireResult:
        lease = Lease(
            id=secrets.token_urlsafe(16),
            server=srv.name,
            slot_id=-1,
            key=identity.key if identity else None,
            session_id=identity.session_id if identity else None,
            outcome=Outcome.COLD,
        )
        timeout = self.acquire_timeout_s if self.acquire_timeout_s is not None else srv.config.slot_wait_s
        self.checkpoints.note_request(srv, identity.key if identity else None)
        try:
            slot = await self.pool.take(srv, lease.key, lease, timeout, caller)
        except SlotBusy:
            if caller is not None and caller.gone():
                self.telemetry.acquire_abandoned(srv.name, None, lease.session_id, caller.why)
            raise
        try:
            if identity is None:
                result = await self._prepare_aux(srv, slot)
                slot.scope = scope
            else:
                rt = self.sessions.runtime(identity)
                rt.scope = scope
                if seq is not None:
                    rt.seq = seq
                if rt.released_at is not None:  # think time: from its last release to this acquire
                    think_s = self.monotonic() - rt.released_at
                    rt.think_s.append(think_s)
                    self.costs.observe_think(srv.name, think_s)
                    self.telemetry.think(srv.name, think_s)
                    rt.released_at = None
                with self.sessions.busy_with(rt.key):
                    result = await self._prepare(srv, slot, rt, donor)
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
        lease.outcome = result.outcome
        result.lease_id, result.server, result.base_url, result.slot_id = (
            lease.id,
            srv.name,
            srv.config.base_url,
            slot.id,
        )
        # a lease nobody uses (no model call on its slot, no renewal) ends after the short claim TTL
        self.leases.add(lease, self.config.api.lease_ttl_s, claim_s=self.config.api.lease_claim_ttl_s)
        lease.tokens_at_grant = slot.tokens if result.outcome is not Outcome.RESIDENT else None
        self.telemetry.acquired(srv.name, slot.id, result.outcome, lease.session_id)
        if result.evicted is not None:
            # the slot changed hands: a request of the evicted session that waited for it as its own now
            # takes another free slot instead of waiting for this call to end
            self.pool.dispatch(srv)
        return result

    async def _prepare_aux(self, srv: ServerRuntime, slot: Slot) -> AcquireResult:
        """Spec §72: checkpoint the owner, then the slot belongs to no session."""
        result = AcquireResult(outcome=Outcome.COLD, reason="auxiliary")
        evicted = self.sessions.get(slot.owner)
        if slot.owner is not None:
            result.evicted = await self.checkpoints.evict(srv, slot, result)
        if evicted is not None:  # its save's commit, overlapped with nothing here
            await Saver.wait_commit(evicted)
        slot.owner, slot.holds_aux = None, True
        return result

    async def _prepare(
        self, srv: ServerRuntime, slot: Slot, rt: SessionRuntime, donor: SnapshotIdentity | None = None
    ) -> AcquireResult:
        # Invariant 6: a resident session costs no disk I/O and no management call. A local server's
        # process is checked (a /proc read, no HTTP): after a restart the slot is empty, not resident.
        if slot.owner == rt.key and srv.process is not None and not srv.process_check(srv.process):
            await self.guard.refresh(srv)
        if slot.owner == rt.key:
            return AcquireResult(outcome=Outcome.RESIDENT)
        result = AcquireResult(outcome=Outcome.COLD)
        evicted = self.sessions.get(slot.owner)
        if slot.owner is not None:  # if a save comes first, the incoming snapshot is read meanwhile
            result.evicted = await self.checkpoints.evict(
                srv, slot, result, before_save=partial(self.restorer.preread, srv, rt)
            )
        self.telemetry.switch(srv.name, slot.id, rt, result.evicted)
        await Saver.wait_commit(rt)  # its own last save may still be committing (evicted just before)
        await self.restorer.load(
            srv, slot, rt, result, donor=donor, held_by=evicted.key if evicted is not None else None
        )
        if evicted is not None:  # the evicted session's commit ran while this one restored
            await Saver.wait_commit(evicted)
        slot.owner, slot.holds_aux, slot.scope = rt.key, False, rt.scope
        self.telemetry.loaded(srv.name, slot.id, rt, result)
        return result

    # release -----------------------------------------------------------------------------------------
    async def release(
        self,
        lease_id: str,
        *,
        status: ReleaseStatus,
        prompt_tokens: int | None = None,
        cached_tokens: int | None = None,
        prompt_ms: float | None = None,
    ) -> dict[str, Any]:
        lease = self.leases.pop(lease_id)
        if lease is None:
            raise LeaseNotFound("no such lease (already released or expired)")
        srv = self.servers[lease.server]
        slot = srv.slots.get(lease.slot_id)
        out: dict[str, Any] = {"released": True, "dirty": False}
        self.telemetry.released(lease, status, prompt_tokens, cached_tokens)
        rt = self.sessions.get(lease.key)
        if prompt_tokens and prompt_ms is not None and status == "ok":
            self.costs.observe_prefill(srv.name, tokens=prompt_tokens, ms=prompt_ms)
        if rt is not None and slot is not None and slot.owner == rt.key and status == "ok":
            rt.dirty_revision += 1
            self.sessions.apply(rt, SessionEvent.RAN)
            out.update(dirty=True, revision=rt.dirty_revision)
            if lease.outcome in (Outcome.COLD, Outcome.COLD_FALLBACK) and cached_tokens:
                # a cold start's reuse came from KV another session left (or donated): issue 28
                out["shared_tokens"] = cached_tokens
                self.telemetry.shared_prefix(srv.name, cached_tokens)
            elif rt.context_tokens is not None:
                out["held_tokens"] = rt.context_tokens  # what its slot held: the proxy explains low reuse
            track_context(rt, prompt_tokens, cached_tokens)
            slot.foreign_kv = False  # the engine replaced what it did not reuse: the slot is rt's now
            if rt.verify_tokens is not None:
                out["restore_verification"] = self.restorer.verify_reuse(
                    srv, rt, prompt_tokens, cached_tokens
                )
            rt.released_at = self.monotonic()
            self.checkpoints.touched(rt)
        elif slot is not None and slot.foreign_kv and rt is not None and slot.owner == rt.key:
            slot.owner = None  # no turn of rt ran on the KV its cold start kept: not rt's to come back to
        if slot is not None:
            self.pool.give_back(srv, slot)
        return out

    def renew(self, lease_id: str) -> None:
        """Push a lease's expiry back by a full TTL (the proxy does so while its request is in flight)."""
        self.leases.renew(lease_id, self.config.api.lease_ttl_s)

    def _on_lease_timer(self, lease_id: str) -> None:
        self.spawn(self._expire(lease_id))

    def _on_claim_timer(self, lease_id: str) -> None:
        self.spawn(self._check_claim(lease_id))

    async def _check_claim(self, lease_id: str) -> None:
        """A claimed lease's claim TTL ran out (issue 26 C): is anyone using it? Yes when the engine is
        working on its slot, or the slot's tokens moved since the grant (a model call ran): then it keeps its
        full TTL. No: nobody holds it (its caller left as it was granted, its answer never arrived): it ends
        now, as aborted. The engine cannot say: asked again later, within the full TTL."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.active:
            return
        srv = self.servers[lease.server]
        api = self.config.api
        in_use: bool | None = None
        found = []
        if srv.sleeping:  # sleep mode: no call runs on it (a call wakes it), and /slots would wake it
            in_use = False
        else:
            try:
                async with asyncio.timeout(max(1.0, min(10.0, api.lease_claim_ttl_s))):
                    found = [s for s in await srv.backend.inspect_slots() if s.id == lease.slot_id]
            except (KvError, TimeoutError):
                found = []
        if found:
            seen = found[0]
            moved = lease.tokens_at_grant is not None and seen.n_tokens not in (None, lease.tokens_at_grant)
            in_use = seen.is_processing or moved
        lease = self.leases.get(lease_id)
        if lease is None or lease.active:  # released or renewed meanwhile
            return
        if in_use:
            self.leases.activate(lease_id, api.lease_ttl_s)
            return
        left = lease.granted_at + api.lease_ttl_s - asyncio.get_running_loop().time()
        if in_use is None and left > 0:
            self.leases.recheck(lease_id, min(api.lease_claim_ttl_s, left))
            return
        self.telemetry.lease_expired(lease, unclaimed=in_use is False)
        with contextlib.suppress(LeaseNotFound):
            await self.release(lease_id, status="aborted")

    async def _expire(self, lease_id: str) -> None:
        lease = self.leases.get(lease_id)
        if lease is None:
            return
        self.telemetry.lease_expired(lease)
        with contextlib.suppress(LeaseNotFound):
            await self.release(lease_id, status="aborted")

    # events and manual operations -------------------------------------------------------------------
    async def session_event(
        self, session_id: str, type_: EventType, *, seq: int | None = None
    ) -> dict[str, Any]:
        """Lifecycle hints (spec §50). Restores stay lazy: `created`/`switch` change nothing (§51)."""
        saved = 0
        for rt in self.sessions.known(session_id):
            if seq is not None:
                rt.seq = seq
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
                    slot.owner = None
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
        if self.config.fleet.enabled:
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

    async def with_slot(self, server: str, fn: Callable[[int], Awaitable[T]]) -> T:
        """Run fn(slot_id) holding a slot of `server` as an auxiliary request (doctor's probes): the
        owner is checkpointed first and the next session request restores as usual."""
        result = await self._acquire(self.servers[server], None, seq=None)
        assert result.lease_id is not None and result.slot_id is not None
        self.renew(result.lease_id)  # held here, by this call: active, not a claim
        try:
            return await fn(result.slot_id)
        finally:
            await self.release(result.lease_id, status="aborted")

    def reconfigure(self, config: Config) -> list[str]:
        """SIGHUP: apply what is safe to change live; return the restart-only keys that changed."""
        needs_restart = [
            k
            for k in ("servers", "routes", "api", "proxy", "state_dir")
            if getattr(config, k) != getattr(self.config, k)
        ]
        live = config.model_copy(update={k: getattr(self.config, k) for k in needs_restart})
        self.config = live
        policy_changed = live.checkpoint.policy != self.checkpoints.config.checkpoint.policy
        for part in (self.restorer, self.saver, self.checkpoints):
            part.config = live
        if policy_changed:
            self.checkpoints.policy_changed()
        for srv in self.servers.values():
            srv.breaker.max_consecutive_failures = live.failure.max_consecutive_failures
            srv.breaker.base_cooldown_s = live.failure.cooldown_s
        return needs_restart

    def protected_keys(self) -> set[str]:
        """Snapshots retention must not touch: resident in a slot, leased, or under an operation."""
        keys = {lease.key for lease in self.leases if lease.key is not None} | set(self.sessions.busy)
        for srv in self.servers.values():
            keys |= {s.owner for s in srv.slots.values() if s.owner is not None}
        return keys

    # views -------------------------------------------------------------------------------------------
    def session_views(self, session_id: str | None = None) -> list[dict[str, Any]]:
        return views.session_views(self.sessions, self.store, self.servers, session_id, now=self.monotonic())

    def status(self) -> dict[str, Any]:
        out = views.status(
            enabled=self.config.enabled,
            servers=self.servers,
            sessions=self.sessions,
            store=self.store,
            open_leases=len(self.leases),
            stats=self.telemetry.stats(),
            costs=self.costs.view(),
            pending_restart=self.pending_restart,
            now=self.monotonic(),
        )
        if self.fleet_view is not None:
            out["fleet"] = self.fleet_view()
        if self.proxy_view is not None:
            out["proxy"] = self.proxy_view()
        return out
