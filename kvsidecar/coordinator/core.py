"""The coordinator: who owns each slot, when to restore, save and erase (spec §18-34, §50-53, §69-72).

Flow of one model call: `acquire()` picks the session's slot and prepares it (resident: nothing to do;
otherwise checkpoint the previous owner, then restore the session's snapshot or erase for a cold start)
and returns a lease; the harness runs inference with `id_slot`; `release()` ends the lease, marks the
session dirty on success and checks how much of a restore the engine actually reused.

Invariant 1: nothing here ever touches a prompt or a reply; the harness' conversation is built from its own
log, so what kvsidecar does to a slot can change how fast an answer comes, never what it says.

`Coordinator` composes the parts, each one noun (docs/ARCHITECTURE.md): pool, leases, sessions, guards,
acquirer, plan of a start, restorer, saver, checkpoints, operations, router swaps, models, telemetry, views.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from typing import Any, Literal, TypeVar

from kvsidecar.backend.base import KvBackend
from kvsidecar.backend.prompts import PromptTokens
from kvsidecar.config import Config
from kvsidecar.coordinator import views
from kvsidecar.coordinator.acquire import Acquirer, PromptSource, ReleaseStatus
from kvsidecar.coordinator.caller import Caller
from kvsidecar.coordinator.canary import sweep_canary_files
from kvsidecar.coordinator.checkpoint import CheckpointPolicy
from kvsidecar.coordinator.claims import LeaseEnds
from kvsidecar.coordinator.costs import CostModel
from kvsidecar.coordinator.guard import PersistGuard
from kvsidecar.coordinator.leases import LeaseTable
from kvsidecar.coordinator.operations import INVALIDATED, SessionOperations
from kvsidecar.coordinator.ownership import KeyGate, KeyOwnership
from kvsidecar.coordinator.pool import SlotPool
from kvsidecar.coordinator.reconfig import applied
from kvsidecar.coordinator.restore import Restorer
from kvsidecar.coordinator.router_models import RouterModels
from kvsidecar.coordinator.runtime import RuntimeGuard
from kvsidecar.coordinator.save import Saver
from kvsidecar.coordinator.savepoints import SavePoints
from kvsidecar.coordinator.scope import ScopeGate, ScopeLedger
from kvsidecar.coordinator.server import ProcessFinder, ServerRuntime, build_servers, server_maker
from kvsidecar.coordinator.sessions import SessionTable
from kvsidecar.coordinator.state import HOOK_SCOPE, HOOK_SIGNAL, UNKNOWN_CLIENT, AcquireResult, Outcome
from kvsidecar.coordinator.swaps import ModelSwaps
from kvsidecar.coordinator.switch import Switch
from kvsidecar.coordinator.telemetry import ResidencyObserver, Telemetry
from kvsidecar.errors import ShuttingDown
from kvsidecar.files.atomic import SHARED_TEMP_AGE_S
from kvsidecar.fingerprint.file_digests import FileDigestCache
from kvsidecar.fingerprint.llama_process import ProcessInfo
from kvsidecar.fingerprint.savepath import llama_save_dir
from kvsidecar.metrics import Metrics
from kvsidecar.store.naming import (
    SnapshotIdentity,
    managed_key,
    validate_label,
    validate_scope,
    validate_session_id,
)
from kvsidecar.store.snapshots import SnapshotStore

__all__ = ["INVALIDATED", "AcquireResult", "Coordinator", "EventType", "ReleaseStatus"]

T = TypeVar("T")
EventType = Literal["created", "switch", "flush", "turn_end", "step_end", "disposed"]


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
        gate: KeyGate | None = None,
        observers: Sequence[ResidencyObserver] = (),
        fleet_view: Callable[[], dict[str, Any]] | None = None,
        after_save: Callable[[], None] | None = None,
        pending_restart: list[str] | None = None,
    ) -> None:
        # gate, observers, fleet_view: fleet mode's write gate, residency observer and status section (the
        # daemon's FleetAgent); after_save: the daemon's retention check; pending_restart: the daemon's list
        # of restart-only keys a SIGHUP found changed (it alone writes it; status shows it).
        self.config = config
        self.store = store
        self.metrics = metrics or Metrics()
        self.clock, self.monotonic = clock, monotonic
        make = server_maker(config, process_finder, process_check, digests, monotonic, self._wake)
        self.servers = build_servers(config, backends, make)  # a router's models found: router_models.py
        self.router_models = RouterModels(config=config, servers=self.servers, store=store, make=make)
        self.costs = CostModel()
        self.telemetry = Telemetry(self.metrics, self.costs)
        self.telemetry.observers.extend(observers)
        self.sessions = SessionTable(store)
        # a give-back is the checkpoint policy's idle check (its background saves)
        self.pool = SlotPool(
            is_dirty=self.sessions.is_dirty, monotonic=monotonic, on_given_back=self._given_back
        )
        self.leases = LeaseTable(on_expire=self._on_lease_timer, on_claim=self._on_claim_timer)
        self.telemetry.watch(
            servers=self.servers,
            leases=self.leases,
            waiting=self.pool.waiting,
            store=store,
            quota_bytes=lambda: self.config.retention.max_total_bytes,
        )
        # acquire_timeout_s: how long an acquire (and a background save's prediction) may wait for a slot
        self._compose_persistence(gate=gate, after_save=after_save, acquire_timeout_s=acquire_timeout_s)
        self._compose_requests(acquire_timeout_s)
        self.pending_restart: list[str] = pending_restart if pending_restart is not None else []
        # the parts of status() other packages own: fleet mode's (given here), the proxy's (it adds its own)
        self.sections = views.StatusSections()
        if fleet_view is not None:
            self.sections.add("fleet", fleet_view)
        self.router_models.shown_in(self.sections, self.swaps)  # status: router_models, router_discovery
        self._tasks: set[asyncio.Task[Any]] = set()
        self._closing = False

    def _compose_persistence(
        self, *, gate: KeyGate | None, after_save: Callable[[], None] | None, acquire_timeout_s: float | None
    ) -> None:
        """The parts that persist KV, each given what it uses: the persistence guard and the runtime
        bracket first, then who may write a key, restore, save and the checkpoint policy."""
        config, store, sessions, telemetry = self.config, self.store, self.sessions, self.telemetry
        self.persist = PersistGuard(telemetry=telemetry)
        # whose KV a request may run on (one credential scope never runs on another's), on every path
        self.scopes = ScopeGate(
            pool=self.pool, persist=self.persist, telemetry=telemetry, ledger=ScopeLedger()
        )
        self.guard = RuntimeGuard(
            sessions=sessions, pool=self.pool, telemetry=telemetry, persist=self.persist, scopes=self.scopes
        )
        # who may write a key's files: always this host, unless fleet mode installs its gate
        self.ownership = KeyOwnership(store=store, sessions=sessions, servers=self.servers, gate=gate)
        self.restorer = Restorer(
            config=config,
            store=store,
            sessions=sessions,
            pool=self.pool,
            guard=self.guard,
            persist=self.persist,
            telemetry=telemetry,
            costs=self.costs,
        )
        self.saver = Saver(
            config=config,
            store=store,
            sessions=sessions,
            guard=self.guard,
            persist=self.persist,
            telemetry=telemetry,
            costs=self.costs,
            monotonic=self.monotonic,
            ownership=self.ownership,
            after_save=after_save,
        )
        self.checkpoints = CheckpointPolicy(
            config=config,
            servers=self.servers,
            sessions=sessions,
            pool=self.pool,
            saver=self.saver,
            costs=self.costs,
            telemetry=telemetry,
            spawn=self.spawn,
            monotonic=self.monotonic,
            acquire_timeout_s=acquire_timeout_s,
        )
        self.swaps = ModelSwaps(self.servers, self.checkpoints, self.metrics, refresh=self.guard.refresh)

    def _compose_requests(self, acquire_timeout_s: float | None) -> None:
        """The parts that serve requests: the switch, the acquire path, the end of a lease nobody released,
        and the session operations."""
        config, sessions, telemetry = self.config, self.sessions, self.telemetry
        self.switch = Switch(
            sessions=sessions,
            pool=self.pool,
            guard=self.guard,
            restorer=self.restorer,
            checkpoints=self.checkpoints,
            telemetry=telemetry,
            gate=self.scopes,
        )
        self.acquirer = Acquirer(
            servers=self.servers,
            sessions=sessions,
            pool=self.pool,
            leases=self.leases,
            switch=self.switch,
            restorer=self.restorer,
            checkpoints=self.checkpoints,
            costs=self.costs,
            telemetry=telemetry,
            api=config.api,
            monotonic=self.monotonic,
            acquire_timeout_s=acquire_timeout_s,
        )
        self.acquirer.swaps = self.swaps  # a router's models: room made before the slot (swaps.py)
        self.release = self.acquirer.release
        self.savepoints = SavePoints(self.acquirer, self.saver)  # the prompt's end, before the proxy forwards
        self.lease_ends = LeaseEnds(
            servers=self.servers,
            leases=self.leases,
            api=config.api,
            telemetry=telemetry,
            release=partial(self.release, status="aborted"),
        )
        self.operations = SessionOperations(
            servers=self.servers,
            sessions=sessions,
            pool=self.pool,
            checkpoints=self.checkpoints,
            ownership=self.ownership,
            store=self.store,
            fleet=config.fleet.enabled,
            members=self.router_models.members,  # `checkpoint --server ENTRY`: a router's models discovered
        )

    async def _wake(self, srv: ServerRuntime) -> None:
        await self.swaps.load(srv)  # room made on a router before a model of it is loaded (swaps.py)

    def _given_back(self, srv: ServerRuntime) -> None:
        self.swaps.given_back(srv)  # an unload of a router's model waiting for its slots looks again
        self.checkpoints.given_back(srv)

    # lifecycle ---------------------------------------------------------------------------------------
    async def start(self) -> None:
        self.checkpoints.start()
        await self.router_models.start()  # the models a router lists now are servers from here on
        for srv in list(self.servers.values()):
            shared = SHARED_TEMP_AGE_S if self.config.fleet.enabled else 0.0  # another host's may be fresh
            held = self.store.snapshot_anchor(srv.name) or srv.config.snapshot_dir  # never through its path
            await asyncio.to_thread(sweep_canary_files, held, min_age_s=shared)
            await self.guard.refresh(srv)
            self.spawn(self._probe_loop(srv))
        self.router_models.watch(self.spawn, partial(self._probe_loop, first=True))  # no sweep: siblings'

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
        self.pool.close()
        for srv in self.servers.values():
            self.pool.wake_all(srv)  # requests still waiting for a slot answer KV_SHUTTING_DOWN
        self.restorer.close()
        self.leases.cancel_timers()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for srv in self.servers.values():
            srv.close()
            await srv.backend.aclose()

    def spawn(self, coro: Awaitable[Any]) -> asyncio.Task[Any]:
        """A background task the coordinator owns: cancelled and awaited by aclose()."""
        task: asyncio.Task[Any] = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _probe_loop(self, srv: ServerRuntime, *, first: bool = False) -> None:
        if first:  # a router's model found after the start
            await self.guard.refresh(srv)
        while not self._closing:  # a cancel lost in a refresh (3.11's wait_for) never leaves it sleeping
            await asyncio.sleep(srv.config.probe_interval_s)
            await self.guard.refresh(srv)
            self.swaps.observe(srv)  # a router's model unloaded meanwhile: reported
            # a directory whose path now leads elsewhere is logged (kv.store.dir_moved) even with no traffic
            self.store.dir_faults({srv.name: llama_save_dir(srv.process)})
            self.forget_idle_sessions()

    def forget_idle_sessions(self) -> int:
        held = self.protected_keys() | {
            s.claimed_by for v in self.servers.values() for s in v.slots.values() if s.claimed_by
        }
        return self.sessions.forget_idle(held)

    # acquire -----------------------------------------------------------------------------------------
    def route(self, provider: str, model: str | None = None) -> ServerRuntime | None:
        """The server of `provider`; a provider routed to a router's model goes by `model` (docs/SWAPS.md)."""
        name = self.config.server_for(provider, model)
        if name is None and model is not None:  # a model discovered, or one the router runs under an alias
            return self.router_models.find(self.config.routes.get(provider), model, aliases=self.swaps)
        return self.servers.get(name) if name is not None else None  # None: a router's discovering entry

    def session_key(
        self, session_id: str, provider: str, model: str, purpose: str | None, scope: str = HOOK_SCOPE
    ) -> tuple[str | None, str | None]:
        """(identity key, server) an acquire of these would manage; (None, None) for a bypass or an
        auxiliary request (fleet routing: nothing to route by). Bad labels are left to acquire."""
        srv = self.route(provider, model)
        if srv is None or purpose is not None or not self.config.enabled:
            return None, None
        key = managed_key(srv.name, provider=provider, model=model, session_id=session_id, scope=scope)
        return (key, srv.name) if key is not None else (None, None)

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
        extends: bool = False,
        signal: str = HOOK_SIGNAL,
        client: str = UNKNOWN_CLIENT,
        runs_on: str | None = None,
        prompt: PromptTokens | PromptSource | None = None,
    ) -> AcquireResult:
        """`runs_on`: the model the call runs on when the label is not it (the proxy: the body's `model`;
        it picks a router's model, docs/SWAPS.md). `caller`: who waits (once gone, no lease). `scope`: the
        credential scope, part of the identity. `prefix_from`: a same-scope session whose snapshot a cold
        start may begin from (coldstart.py). `extends`: the prompt is known to extend the session's last one
        (scope.py). `signal`, `client`: what named it. `prompt`: the request's tokens, or why they are
        unknown: what its start is planned from (plan.py)."""
        validate_label("provider", provider)
        validate_label("model", model)
        for named_id in (session_id, prefix_from):
            if named_id is not None:
                validate_session_id(named_id)
        srv = self.route(provider, model if runs_on is None else runs_on)
        if srv is None or not self.config.enabled or self._closing:
            return AcquireResult(
                outcome=Outcome.BYPASS, reason="unmanaged provider" if srv is None else "disabled"
            )
        if session_id is None or purpose is not None:
            # Invariant 7: auxiliary requests never become a session's state.
            validate_scope(scope)  # a session's is checked as part of its identity
            return await self.acquirer.acquire(srv, None, caller=caller, scope=scope)
        if caller is not None and caller.gone():  # before any claim or wait: nobody reads the answer
            raise caller.error(srv.name)
        identity = SnapshotIdentity(
            server=srv.name, provider=provider, model=model, session_id=session_id, scope=scope
        )
        # fleet: take (or keep) the key before touching it; a stale local copy is dropped first. A host
        # that may not write it still serves the session (a restore is a read); its saves are refused.
        await self.ownership.claim(identity.key)
        other = prefix_from if prefix_from != session_id else None
        donor = dataclasses.replace(identity, session_id=other) if other is not None else None
        return await self.acquirer.acquire(
            srv,
            identity,
            seq=seq,
            caller=caller,
            scope=scope,
            donor=donor,
            extends=extends,
            named=(client, signal),
            prompt=prompt,
        )

    # release: `self.release` is the acquirer's (lease ends, numbers of the run, a turn cut short) ----------
    def renew(self, lease_id: str) -> None:
        """Push a lease's expiry back by a full TTL (the proxy does so while its request is in flight)."""
        self.leases.renew(lease_id, self.config.api.lease_ttl_s)

    def _on_lease_timer(self, lease_id: str) -> None:
        self.spawn(self.lease_ends.expire(lease_id))

    def _on_claim_timer(self, lease_id: str) -> None:
        self.spawn(self.lease_ends.check_claim(lease_id))

    # events and manual operations -------------------------------------------------------------------
    async def session_event(
        self, session_id: str, type_: EventType, *, seq: int | None = None
    ) -> dict[str, Any]:
        """Lifecycle hints (spec §50). Restores stay lazy: `created`/`switch` change nothing (§51)."""
        return await self.operations.event(session_id, type_, seq)

    async def save(self, session_id: str) -> dict[str, Any]:
        return await self.operations.save(session_id)

    async def invalidate(self, session_id: str) -> dict[str, Any]:
        return await self.operations.invalidate(session_id)

    async def purge(self, session_id: str) -> dict[str, Any]:
        """Forget the session and delete its files (operations.py: in fleet mode only a key's owner)."""
        return await self.operations.purge(session_id)

    async def checkpoint(self, server: str | None, *, wait: bool, timeout_s: float | None) -> dict[str, Any]:
        """Save every dirty slot of a server (None: all) before a planned stop (operations.py)."""
        if self._closing:
            raise ShuttingDown("kvsidecar is stopping: its shutdown checkpoint saves every dirty slot")
        timeout = self.config.checkpoint.shutdown_timeout_s if timeout_s is None else timeout_s
        return await self.operations.checkpoint(server, wait=wait, timeout_s=timeout)

    async def with_slot(self, server: str, fn: Callable[[int], Awaitable[T]]) -> T:
        """Run fn(slot_id) holding a slot of `server` as an auxiliary request (doctor's probes): the
        owner is checkpointed first and the next session request restores as usual."""
        return await self.acquirer.holding(self.servers[server], fn)

    def reconfigure(self, config: Config) -> list[str]:
        """SIGHUP: apply what is safe to change live; return the restart-only keys that changed."""
        parts = (self.restorer, self.saver, self.checkpoints)
        self.config, needs_restart = applied(self.config, config, parts, self.servers)
        return needs_restart

    def protected_keys(self) -> set[str]:
        """Snapshots retention must not touch: resident in a slot, leased, or under an operation."""
        keys = {lease.key for lease in self.leases if lease.key is not None} | set(self.sessions.busy)
        return keys | {s.owner for srv in self.servers.values() for s in srv.slots.values() if s.owner}

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
            restarts=self.guard.epoch,
            now=self.monotonic(),
        )
        out.update(self.sections.render())
        return out
