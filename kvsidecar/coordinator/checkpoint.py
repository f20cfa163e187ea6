"""The checkpoint policy: when a session's slot is saved, and what happens to unsaved progress.

Each decision is a pure function in decisions.py (of the slots, sessions, demand, costs and `now`; the rules
and their reasons are written there); this module reads their inputs from live state (facts.py), calls
them, and acts on the answers: timers, saves, counters (spec §26-29, §50, §58, §71):
- `evict()`: a dirty slot is saved before it is given to another session (Invariant 3), when
  `checkpoint.on_switch` is on, unless the cost-aware policy skips that save (`decisions.skip_save`); what
  is not saved then is gone from the slot.
- `touched()` / the idle timer: a dirty session is saved after `idle_s` without requests. One
  `loop.call_later` timer per session; a request only pushes the deadline back, and a timer that fires
  early re-arms itself for the current deadline (spec §71), so the resident hot path does no timer work.
- clean ahead (cost-aware policy): a timer after each release (`decisions.clean_ahead_delay`), then the
  check (`clean_ahead()`, `decisions.clean_ahead`), retried whenever a slot is given back and its server is
  idle (`given_back()`, `decisions.clean_next`). A `turn_end` hint starts the check at once.
- protect (issue 26): background saves that bound a resident session's unsaved work, at an idle moment of
  its server (`protect()`, `decisions.protect_choice`); a timer at half the time bound and at the bound
  (`decisions.protect_check_in`) finds an idle moment that comes while nothing is given back.
- `on_event()`: lifecycle hints (`flush`, `turn_end`, `step_end`, `disposed`) as configured.
- `checkpoint_all()`: shutdown, and a planned stop of a server (`kvsidecar checkpoint`).
- saves nothing can use (`decisions.save_useless`: SWA without `--swa-full`): none of the above; the
  unsaved turns are written off (and counted) where a save would have been.

A request for another slot that arrives during a background save cannot interrupt it inside llama-server:
its first token is late by at most the rest of that save (the predictions keep those saves to idle gaps).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

from kvsidecar.config import CheckpointConfig, Config
from kvsidecar.coordinator import decisions, facts
from kvsidecar.coordinator.breaker import BreakerState
from kvsidecar.coordinator.costs import CostModel, Costs
from kvsidecar.coordinator.decisions import PROTECT_FORCED as PROTECT_FORCED  # re-exported: the triggers
from kvsidecar.coordinator.decisions import PROTECT_PREDICTED as PROTECT_PREDICTED
from kvsidecar.coordinator.decisions import ModelFacts, Rules
from kvsidecar.coordinator.facts import Moment
from kvsidecar.coordinator.pool import CLEANING, SlotPool, aux_slot_id, owner_slot
from kvsidecar.coordinator.save import Saver
from kvsidecar.coordinator.server import ServerRuntime
from kvsidecar.coordinator.sessions import SessionEvent, SessionTable
from kvsidecar.coordinator.state import AcquireResult, SessionRuntime, Slot
from kvsidecar.coordinator.telemetry import Telemetry
from kvsidecar.errors import BackendUnavailable, KvError, SaveFailed

_DEMAND_KEYS_MAX = 4096  # more sessions than this lately: as good as "always a switch coming"
_AUX_DEMAND_KEY = "\0auxiliary"  # matches no session key


class CheckpointPolicy:
    def __init__(
        self,
        *,
        config: Config,
        servers: dict[str, ServerRuntime],
        sessions: SessionTable,
        pool: SlotPool,
        saver: Saver,
        costs: CostModel,
        telemetry: Telemetry,
        spawn: Callable[[Awaitable[Any]], asyncio.Task[Any]],
        monotonic: Callable[[], float] = time.monotonic,
        acquire_timeout_s: float | None = None,
    ) -> None:
        self.acquire_timeout_s = acquire_timeout_s
        self.costs = costs
        self.telemetry = telemetry
        self.config = config
        self.servers = servers
        self.sessions = sessions
        self.pool = pool
        self.saver = saver
        self.spawn = spawn
        self.monotonic = monotonic
        self.active = False  # timers are armed only between start() and close()
        self._cleaning: set[str] = set()  # keys with a clean ahead started by given_back, not yet done
        self._rules_of: CheckpointConfig | None = None  # the configuration _rules_now was built from
        self._rules_now = Rules()
        # by server name: session key -> when it last asked for a slot there, oldest first (the demand)
        self._requested: dict[str, OrderedDict[str, float]] = {}
        telemetry.watch_unsaved(
            servers=servers, sessions=lambda: list(sessions.by_key.values()), monotonic=monotonic
        )

    async def evict(
        self,
        srv: ServerRuntime,
        slot: Slot,
        result: AcquireResult,
        *,
        before_save: Callable[[], None] | None = None,
    ) -> str | None:
        """The slot goes to another session (or an auxiliary request): checkpoint its owner first.
        `before_save`: called when that save is about to run (a switch reads its incoming file then)."""
        rt = self.sessions.get(slot.owner)
        self.pool.vacate(slot)
        if rt is None:
            return None
        save = rt.dirty and self.config.checkpoint.on_switch and not self._useless(srv, rt, "switch")
        if save and not self._skip_save(srv, rt):
            if before_save is not None:
                before_save()
            # overlap: the commit (checksum, manifest) runs while the slot's next session restores
            await self.saver.save(srv, slot, rt, trigger="switch", actions=result.actions, overlap=True)
        self.sessions.give_up_unsaved(rt)  # not saved (policy off or failure): that progress is gone
        self.sessions.apply(rt, SessionEvent.EVICTED)
        return rt.identity.short

    def _skip_save(self, srv: ServerRuntime, rt: SessionRuntime) -> bool:
        """Cost-aware: is recomputing since the newest saved generation cheaper than saving the slot?"""
        fingerprint = srv.fingerprint.digest if srv.fingerprint is not None else None
        newest = facts.newest_generation(rt, self.sessions.store.get(rt.key))
        session = facts.session_facts(rt.key, rt, self.monotonic(), cleaning=False, newest=newest)
        skip = decisions.skip_save(session, self._costs(srv.name), self._rules(), fingerprint)
        if skip is None:
            return False
        self.telemetry.save_skipped(srv.name, rt, "recompute_cheaper", skip.recompute_s, skip.save_s)
        return True

    def _useless(self, srv: ServerRuntime, rt: SessionRuntime | None, trigger: str) -> bool:
        """No save of this server's slots could ever be restored (decisions.save_useless): True, and the
        session's unsaved turns (if any) are written off and counted, not saved."""
        reason = decisions.save_useless(ModelFacts.of(srv.memory))
        if reason is None:
            return False
        if rt is not None and self.sessions.give_up_unsaved(rt):
            self.telemetry.save_useless(srv.name, rt, trigger, reason)
        return True

    async def checkpoint(self, rt: SessionRuntime, trigger: str, *, only_revision: int | None = None) -> bool:
        """Save a session where it is resident, waiting for its slot to be free. False if nothing saved."""
        srv = self.servers.get(rt.identity.server)
        if srv is None or owner_slot(srv, rt.key) is None or not rt.dirty:
            return False
        if only_revision is not None and rt.dirty_revision != only_revision:
            return False  # an old timer: a newer request rescheduled it (spec §71)
        if self._useless(srv, rt, trigger):
            return False
        slot = await self.pool.take(srv, rt.key, trigger, srv.config.slot_wait_s)
        try:
            if slot.owner != rt.key:  # ownership moved while we waited; save-before-evict handled it
                return False
            return await self.saver.save(srv, slot, rt, trigger=trigger)
        finally:
            self.pool.give_back(srv, slot)

    async def checkpoint_all(
        self, trigger: str, *, server: str | None = None
    ) -> list[tuple[SessionRuntime, str | None]]:
        """Save every dirty session where it is resident, on `server` (None: every server): at shutdown, and
        before a planned stop (`kvsidecar checkpoint`). Each session that was dirty, with None when the
        revision it had then is saved (or its KV is no longer in a slot of the server: saved or given up at
        its switch, or lost), else the code of why not: what a stop of the server would lose."""
        out: list[tuple[SessionRuntime, str | None]] = []
        for rt in list(self.sessions.by_key.values()):
            if server is not None and rt.identity.server != server:
                continue
            await self.saver.wait_commit(rt)  # a switch's commit left running by a cancelled acquire
            if not rt.dirty:
                continue
            revision, code = rt.dirty_revision, None
            try:
                await self.checkpoint(rt, trigger)
            except KvError as exc:
                code = exc.code
            srv = self.servers[rt.identity.server]
            kept = rt.saved_revision >= revision or owner_slot(srv, rt.key) is None
            why = code or (BackendUnavailable.code if not srv.available else rt.last_error) or SaveFailed.code
            out.append((rt, None if kept else why))
        return out

    async def on_event(self, rt: SessionRuntime, type_: str) -> bool:
        """A lifecycle hint (spec §50): True if it caused a save."""
        cp = self.config.checkpoint
        wanted = {
            "flush": cp.on_session_flush,
            "turn_end": cp.on_turn_end,
            "step_end": cp.on_step_end,
            "disposed": cp.on_disposed,
        }.get(type_, False)
        if not wanted and type_ == "turn_end" and self.config.checkpoint.policy == "cost-aware":
            # the harness says the model is done for now: clean early, without holding the hint's caller
            self.spawn(self._clean_ahead_quietly(rt))
            return False
        return bool(wanted) and await self.checkpoint(rt, type_)

    # idle timers --------------------------------------------------------------------------------------
    def touched(self, rt: SessionRuntime) -> None:
        """The session ran: push its idle deadline back (a timer only if none is pending), and under the
        cost-aware policy arm its clean-ahead check for when it has been idle as long as a save takes."""
        now = self.monotonic()
        self.sessions.mark_unsaved(rt, now)  # since its first unsaved turn
        self._arm_protect(rt, now)
        self._arm_clean_ahead(rt)
        idle_s = self.config.checkpoint.idle_s
        if idle_s is None or not self.active:
            return
        rt.idle_due = self.monotonic() + idle_s
        if rt.idle_timer is None:
            self._arm(rt, idle_s)

    def _arm(self, rt: SessionRuntime, delay_s: float) -> None:
        key = rt.key
        rt.idle_timer = asyncio.get_running_loop().call_later(
            max(0.0, delay_s), lambda: self.spawn(self.on_idle(key))
        )

    async def on_idle(self, key: str) -> None:
        """The timer fired: recheck the deadline, ownership and revision before saving (spec §71)."""
        rt = self.sessions.get(key)
        if rt is None:
            return
        rt.idle_timer = None
        if not self.active or rt.idle_due is None or self.config.checkpoint.idle_s is None:
            return
        remaining = rt.idle_due - self.monotonic()
        if remaining > 0.001:  # a request came in since the timer was armed: wait for the new deadline
            self._arm(rt, remaining)
            return
        rt.idle_due = None
        with contextlib.suppress(KvError):
            await self.checkpoint(rt, "idle", only_revision=rt.dirty_revision)

    # clean ahead ---------------------------------------------------------------------------------------
    def _arm_clean_ahead(self, rt: SessionRuntime) -> None:
        rt.cancel_clean_ahead()
        rt.clean_due_at = None
        if self.config.checkpoint.policy != "cost-aware" or not self.active:
            return
        now = self.monotonic()
        costs = self._costs(rt.identity.server)
        delay_s = decisions.clean_ahead_delay(rt.context_tokens, rt.think_s, costs)
        if delay_s is None:
            return
        key, revision = rt.key, rt.dirty_revision
        rt.clean_due_at = now + delay_s
        rt.clean_timer = asyncio.get_running_loop().call_later(
            delay_s, lambda: self.spawn(self._clean_ahead_timer(key, revision))
        )

    async def _clean_ahead_timer(self, key: str, revision: int) -> None:
        rt = self.sessions.get(key)
        if rt is None:
            return
        rt.clean_timer = None
        if rt.dirty_revision == revision:  # a newer request re-armed it otherwise
            with contextlib.suppress(KvError):
                await self.clean_ahead(rt)

    def given_back(self, srv: ServerRuntime) -> None:
        """A slot was given back and the waiters served: if the server may now take a background save, clean
        the next victim whose clean ahead is due. A check that came while the server was busy (another slot
        working, say) is retried here instead of being lost until the switch pays for it. One at a time: the
        save's own give-back comes here again for the next one. Else, a resident session whose unsaved work
        is due is saved (`protect`)."""
        if not self.active or self.pool.queued(srv):
            return
        moment = self._moment(srv)  # read once, for both decisions
        if self._cleaning_on() and decisions.clean_due(moment.sessions, moment.now):
            moment = moment._replace(server=moment.server._replace(coming=self.switches_coming(srv)))
            if self._clean_next(moment):
                return
        self.protect(srv, moment)

    def _clean_next(self, moment: Moment) -> bool:
        """given_back's clean ahead: True if one was started (then no protect() save starts now)."""
        key = decisions.clean_next(moment.server, moment.sessions, self._rules(), moment.now)
        rt = self.sessions.get(key)
        if rt is None:
            return False
        self._cleaning.add(rt.key)
        self.spawn(self._clean_ahead_quietly(rt))
        return True

    def _cleaning_on(self) -> bool:
        """Clean ahead is in force: cost-aware policy, saves at switches on (SIGHUP may change either)."""
        cp = self.config.checkpoint
        return self.active and cp.policy == "cost-aware" and cp.on_switch

    async def _clean_ahead_quietly(self, rt: SessionRuntime) -> None:
        try:
            with contextlib.suppress(KvError):  # strict mode raises; a background save has no caller
                await self.clean_ahead(rt)
        finally:
            self._cleaning.discard(rt.key)

    def note_request(self, srv: ServerRuntime, key: str | None) -> None:
        """A session (None: an auxiliary request, which takes a session's slot unless one is reserved for
        them) asked this server for a slot. Recency order, oldest first; bounded whatever ids clients send.
        A session's own request voids a background save of it that was due."""
        if key is not None and (rt := self.sessions.get(key)) is not None:
            rt.clean_due_at = None
        if key is None:
            if aux_slot_id(srv) is not None:
                return
            key = _AUX_DEMAND_KEY
        recent = self.requested_at(srv)
        now = recent[key] = self.monotonic()
        recent.move_to_end(key)
        if len(recent) > _DEMAND_KEYS_MAX:  # bounded whatever ids clients send
            recent.popitem(last=False)
        # and forgotten once gone quiet: the oldest that left the window go at each request (each once); no
        # fewer than the server's slots are ever worth counting (switches_coming: none can be coming)
        if len(recent) > len(srv.slots):
            for _ in range(
                decisions.expired_demand(recent.values(), self.costs.server(srv.name).think_s, now)
            ):
                recent.popitem(last=False)

    def requested_at(self, srv: ServerRuntime) -> OrderedDict[str, float]:
        """The server's recent demand: session key -> when it last asked for a slot, oldest first."""
        recent = self._requested.get(srv.name)
        if recent is None:
            recent = self._requested[srv.name] = OrderedDict()
        return recent

    def switches_coming(self, srv: ServerRuntime) -> int:
        """How many more sessions asked this server for a slot lately than it has slots for them
        (decisions.switches_coming); the requests that have left the window are forgotten here."""
        aux = aux_slot_id(srv)
        slots = sum(1 for i in srv.slots if i != aux)
        recent = self.requested_at(srv)
        think_s = self.costs.server(srv.name).think_s
        demand = decisions.switches_coming(recent.values(), slots, think_s, self.monotonic())
        for _ in range(demand.expired):
            recent.popitem(last=False)
        return demand.coming

    async def clean_ahead(self, rt: SessionRuntime) -> bool:
        """Save a dirty, idle session in the background if its server is idle and it is the next victim."""
        srv = self.servers.get(rt.identity.server)
        slot = owner_slot(srv, rt.key) if srv else None
        if srv is None or slot is None or not rt.dirty or not self._cleaning_on():
            return False
        if self._useless(srv, rt, CLEANING):
            return False
        moment = self._moment(srv, coming=self.switches_coming(srv))
        session = facts.session_facts(rt.key, rt, moment.now, cleaning=rt.key in self._cleaning)
        verdict = decisions.clean_ahead(moment.server, slot.id, session, self._costs(srv.name), self._rules())
        if verdict.refused is not None:
            if verdict.refused == decisions.TOO_LONG:
                rt.clean_due_at = None  # no retry at every give-back: its next release re-arms it
            self.telemetry.clean_ahead(srv.name, rt, verdict.refused)
            return False
        rt.clean_due_at = None  # one background save attempt per revision (its next release re-arms it)
        budget_s = verdict.budget_s
        # past the budget, a new session waiting for this slot takes another: dispatch then re-decides
        with self.pool.cleaning(srv, slot, budget_s):
            saved = await self.checkpoint(rt, CLEANING, only_revision=rt.dirty_revision)
        self.telemetry.clean_ahead(srv.name, rt, "saved" if saved else "superseded")
        return saved

    # protect: bound the unsaved work of sessions that keep their slot (issue 26) ---------------------
    def _arm_protect(self, rt: SessionRuntime, now: float) -> None:
        """A timer for when its unsaved age reaches half the time bound, then the bound."""
        bound = self.config.checkpoint.max_unsaved_s
        if rt.protect_timer is not None or not self.active or not bound or rt.dirty_since is None:
            return
        delay_s = decisions.protect_check_in(rt.dirty_since, bound, now)
        if delay_s is None:
            return  # past the bound already: the next idle moment (a give-back) saves it
        key = rt.key
        rt.protect_timer = asyncio.get_running_loop().call_later(delay_s, lambda: self._protect_timer(key))

    def _protect_timer(self, key: str) -> None:
        rt = self.sessions.get(key)
        if rt is None:
            return
        rt.protect_timer = None
        srv = self.servers.get(rt.identity.server)
        if srv is None or not rt.dirty or not self.active:
            return
        if not self.pool.queued(srv):
            self.protect(srv)
        self._arm_protect(rt, self.monotonic())  # the bound itself, if this was half of it

    def protect(self, srv: ServerRuntime, moment: Moment | None = None) -> bool:
        """At an idle moment of the server (no slot held, nobody waiting), start the background save of the
        resident session whose unsaved work is due (decisions.protect_choice). The slot is taken at once, so
        the next request of that session waits for the save and every other slot sees a working server (no
        second background save starts). True if one was started."""
        if not self.active or not srv.available or srv.fingerprint is None:
            return False
        if srv.breaker.state is BreakerState.OPEN or self._useless(srv, None, "protect"):
            return False
        server, owners, now = moment or self._moment(srv)
        choice = decisions.protect_choice(server, owners, self._costs(srv.name), self._rules(), now)
        if choice is None:
            return False
        slot = srv.slots[choice[0]]
        rt = self.sessions.get(slot.owner)
        if rt is None or not self.pool.try_take(srv, slot, choice[1]):
            return False
        rt.protect_tried = rt.dirty_revision
        self.spawn(self._protect_save(srv, slot, rt, choice[1]))
        return True

    async def _protect_save(self, srv: ServerRuntime, slot: Slot, rt: SessionRuntime, trigger: str) -> None:
        try:
            if slot.owner == rt.key:
                with contextlib.suppress(KvError):  # strict mode raises; a background save has no caller
                    await self.saver.save(srv, slot, rt, trigger=trigger)
        finally:
            self.pool.give_back(srv, slot)

    # the decisions' inputs, from live state ----------------------------------------------------------
    def _rules(self) -> Rules:
        cp = self.config.checkpoint
        if self._rules_of is not cp:  # built once per configuration (SIGHUP replaces it)
            self._rules_of, self._rules_now = cp, Rules.of(cp)
        return self._rules_now

    def _costs(self, server: str) -> Costs:
        return self.costs.server(server)  # the live model: read, never written, by the decisions

    def _moment(self, srv: ServerRuntime, *, coming: int = 0) -> Moment:
        wait_s = self.acquire_timeout_s if self.acquire_timeout_s is not None else srv.config.slot_wait_s
        waiting = bool(self.pool.queued(srv))
        return facts.moment(
            srv,
            self.sessions,
            self.monotonic(),
            cleaning=self._cleaning,
            waiting=waiting,
            wait_s=wait_s,
            coming=coming,
        )

    def reconfigure(self, config: Config) -> None:
        """SIGHUP: the live configuration. A new policy: pending clean-ahead checks belong to the old one."""
        policy_changed = config.checkpoint.policy != self.config.checkpoint.policy
        self.config = config
        if policy_changed:
            for rt in self.sessions.by_key.values():
                rt.cancel_clean_ahead()

    def start(self) -> None:
        """From here on timers are armed and background saves may start (the coordinator started)."""
        self.active = True

    def close(self) -> None:
        self.active = False
        for rt in self.sessions.by_key.values():
            rt.cancel_timers()
