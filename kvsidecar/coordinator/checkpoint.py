"""The checkpoint policy: when a session's slot is saved, and what happens to unsaved progress.

The decisions (spec §26-29, §50, §58, §71), each in one method:
- `evict()`: a dirty slot is saved before it is given to another session (Invariant 3), when
  `checkpoint.on_switch` is on; what is not saved then is gone from the slot.
- `touched()` / the idle timer: a dirty session is saved after `idle_s` without requests. One
  `loop.call_later` timer per session; a request only pushes the deadline back, and a timer that fires
  early re-arms itself for the current deadline (spec §71), so the resident hot path does no timer work.
- `on_event()`: lifecycle hints (`flush`, `turn_end`, `step_end`, `disposed`) as configured.
- `checkpoint_all()`: shutdown.

With `checkpoint.policy: cost-aware` (the default; issue 15) two decisions take the save off the switch,
using the cost model learned online (costs.py); each falls back to save-before-evict whenever a figure it
needs is unknown, so its worst case is today's behaviour:
- *clean ahead*: after a release, once the session has been idle for as long as its save is predicted to
  take (ski rental: a request of its own that lands during the save waits at most that long again; at
  once when its recent think times are more than twice its save), and
  while its server is idle (no slot working, nobody waiting) and its slot is the one the next new session
  would take, the slot is saved in the background; the switch then finds it clean. A `turn_end` hint
  starts the check at once. A check that finds the server busy is retried whenever a slot is given back
  and the server is idle (`given_back`). As many slots are kept clean as switches are coming
  (`switches_coming`: the sessions that asked lately beyond the server's slots), none when every active
  session keeps its own slot.
- *skip a save*: at a switch, when the slot still extends the session's newest saved generation (every
  turn since reused all of it: append-only history) and recomputing the tokens since is predicted cheaper
  than writing the whole slot, nothing is saved; the next restore brings the older generation back and
  llama-server recomputes only the difference.

*Protect* (issue 26): a session that keeps its slot (more sessions never want it than there are slots)
and calls more often than `idle_s` would otherwise never be saved, and a llama-server crash would cost it
everything since its last save. Its unsaved work is bounded by `checkpoint.max_unsaved_s` (seconds since
its first unsaved turn) and `checkpoint.max_unsaved_turns` (0 disables either; both 0 turn all of this
off), with background saves
(`protect()`), only ever at an idle moment of its server (no slot working, nobody waiting: llama-server's
save holds its one main loop) and with the session's own slot free:
- past a bound (trigger `max_unsaved`): at the next idle moment, whatever the cost model predicts (its
  own next request may then wait for the save, bounded by the save's time);
- before that (trigger `background`, cost-aware policy): when the save is predicted to end before the
  session's next request (released + median think time, with a margin of twice the save), and it is
  worth it: half a bound has passed, or recomputing the tokens it protects would take longer than the
  save. One attempt per revision; never a save predicted to outlast half an acquire's wait.
A request for another slot that arrives during such a save cannot interrupt it inside llama-server: its
first token is late by at most the rest of that save (the prediction keeps those saves to idle gaps).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvsidecar.config import Config
from kvsidecar.coordinator.breaker import BreakerState
from kvsidecar.coordinator.costs import CostModel, median
from kvsidecar.coordinator.pool import CLEANING, SlotPool, aux_slot_id, owner_slot
from kvsidecar.coordinator.save import Saver
from kvsidecar.coordinator.server import ServerRuntime
from kvsidecar.coordinator.sessions import SessionEvent, SessionTable
from kvsidecar.coordinator.state import AcquireResult, SessionRuntime, Slot
from kvsidecar.coordinator.telemetry import Telemetry
from kvsidecar.errors import KvError

_MIN_CLEAN_AHEAD_S = 0.2
_PROMPT_CLEAN_AHEAD_S = 0.01  # right after the release has been answered
_THINK_SAMPLES_NEEDED = 2
_SERVER_THINK_SAMPLES_NEEDED = 4


_DEMAND_WINDOW_S = 60.0
_DEMAND_THINKS = 4
_DEMAND_KEYS_MAX = 4096  # more sessions than this lately: as good as "always a switch coming"
_AUX_DEMAND_KEY = "\0auxiliary"  # matches no session key
_CLEANING_WAIT_FACTOR = 1.5  # a new session waits for a slot being cleaned up to 1.5x its predicted save
PROTECT_FORCED = "max_unsaved"  # triggers (and slot holders) of protect()'s background saves
PROTECT_PREDICTED = "background"
_PROTECT_MARGIN = 2.0  # a predicted background save must fit twice in what is left of the think time


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
        slot.owner = None
        if rt is None:
            return None
        if rt.dirty and self.config.checkpoint.on_switch and not self._skip_save(srv, rt):
            if before_save is not None:
                before_save()
            # overlap: the commit (checksum, manifest) runs while the slot's next session restores
            await self.saver.save(srv, slot, rt, trigger="switch", actions=result.actions, overlap=True)
        if rt.dirty:  # not saved (policy off or failure): that progress is gone from the slot
            rt.saved_revision = rt.dirty_revision
        self.sessions.apply(rt, SessionEvent.EVICTED)
        return rt.identity.short

    def _skip_save(self, srv: ServerRuntime, rt: SessionRuntime) -> bool:
        """Cost-aware: is recomputing since the newest saved generation cheaper than saving the slot?"""
        if self.config.checkpoint.policy != "cost-aware" or not rt.append_only:
            return False
        base, now, fingerprint = rt.base_tokens, rt.context_tokens, srv.fingerprint
        if base is None or now is None or now <= base or fingerprint is None:
            return False
        # The generation the slot extends must be the newest valid one and restorable on this runtime.
        manifest = self.sessions.store.get(rt.key)
        valid = [(g, r) for g, r in manifest.ordered_generations() if r.valid] if manifest else []
        if not valid or valid[0][0] != rt.base_generation or valid[0][1].tokens != base:
            return False
        if valid[0][1].fingerprint != fingerprint.digest or (valid[0][0], fingerprint.digest) in rt.refused:
            return False
        costs = self.costs.server(srv.name)
        recompute_s, save_s = costs.prefill_s(now - base), costs.save_s(now)
        if recompute_s is None or save_s is None or recompute_s >= save_s:
            return False
        self.telemetry.save_skipped(srv.name, rt, "recompute_cheaper", recompute_s, save_s)
        return True

    async def checkpoint(self, rt: SessionRuntime, trigger: str, *, only_revision: int | None = None) -> bool:
        """Save a session where it is resident, waiting for its slot to be free. False if nothing saved."""
        srv = self.servers.get(rt.identity.server)
        if srv is None or owner_slot(srv, rt.key) is None or not rt.dirty:
            return False
        if only_revision is not None and rt.dirty_revision != only_revision:
            return False  # an old timer: a newer request rescheduled it (spec §71)
        slot = await self.pool.take(srv, rt.key, trigger, srv.config.slot_wait_s)
        try:
            if slot.owner != rt.key:  # ownership moved while we waited; save-before-evict handled it
                return False
            return await self.saver.save(srv, slot, rt, trigger=trigger)
        finally:
            self.pool.give_back(srv, slot)

    async def checkpoint_all(self, trigger: str) -> None:
        for rt in list(self.sessions.by_key.values()):
            await self.saver.wait_commit(rt)  # a switch's commit left running by a cancelled acquire
            if rt.dirty:
                with contextlib.suppress(KvError):
                    await self.checkpoint(rt, trigger)

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
        if rt.dirty_since is None or rt.dirty_since_rev != rt.saved_revision:  # its first unsaved turn
            rt.dirty_since, rt.dirty_since_rev = now, rt.saved_revision
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
        if self.config.checkpoint.policy != "cost-aware" or not self.active or rt.context_tokens is None:
            return
        save_s = self.costs.server(rt.identity.server).save_s(rt.context_tokens)
        if save_s is None:
            return  # nothing learned yet: save-before-evict until the first save has been measured
        # Ski rental: wait as long as the save takes, so a request of its own that lands during the save
        # waits at most that long again. When this session's think times are known to be much longer
        # than its save, its own request is unlikely to land during it: start as soon as it is released.
        delay_s = max(_MIN_CLEAN_AHEAD_S, save_s)
        think = self._thinkmedian(rt)
        if think is not None and think > 2 * save_s:
            delay_s = _PROMPT_CLEAN_AHEAD_S
        key, revision = rt.key, rt.dirty_revision
        rt.clean_due_at = self.monotonic() + delay_s
        rt.clean_timer = asyncio.get_running_loop().call_later(
            delay_s, lambda: self.spawn(self._clean_ahead_timer(key, revision))
        )

    def _thinkmedian(self, rt: SessionRuntime) -> float | None:
        """The session's own median think time once it has a few, else its server's (every session's)."""
        if len(rt.think_s) >= _THINK_SAMPLES_NEEDED:
            return median(rt.think_s)
        server_think = self.costs.server(rt.identity.server).think_s
        return median(server_think) if len(server_think) >= _SERVER_THINK_SAMPLES_NEEDED else None

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
        if not self.active or srv.waiters:
            return
        if not self._clean_next(srv):
            self.protect(srv)

    def _clean_next(self, srv: ServerRuntime) -> bool:
        """given_back's clean ahead: True if one was started (then no protect() save starts now)."""
        if not self._cleaning_on():
            return False
        if not self.config.checkpoint.clean_ahead_while_busy and self._working(srv):
            return False
        now = self.monotonic()
        for slot in self.next_victims(srv):
            rt = self.sessions.get(slot.owner)
            if rt is None or rt.clean_timer is not None or rt.clean_due_at is None:
                continue  # its own timer is still to come (and will check then), or a request voided it
            if rt.key not in self._cleaning and now >= rt.clean_due_at:
                self._cleaning.add(rt.key)
                self.spawn(self._clean_ahead_quietly(rt))
                return True
        return False

    def _cleaning_on(self) -> bool:
        """Clean ahead is in force: cost-aware policy, saves at switches on (SIGHUP may change either)."""
        cp = self.config.checkpoint
        return self.active and cp.policy == "cost-aware" and cp.on_switch

    @staticmethod
    def _working(srv: ServerRuntime, but: Slot | None = None) -> bool:
        """A slot of the server (other than `but`) is held: an inference, or a save of its own."""
        return any(not s.free for s in srv.slots.values() if s is not but)

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
        recent = srv.requested_at
        recent[key] = self.monotonic()
        recent.move_to_end(key)
        if len(recent) > _DEMAND_KEYS_MAX:  # expired ones go first when counted (switches_coming)
            recent.popitem(last=False)

    def _prune(self, srv: ServerRuntime) -> None:
        think = median(self.costs.server(srv.name).think_s)
        window = max(_DEMAND_WINDOW_S, _DEMAND_THINKS * think) if think is not None else _DEMAND_WINDOW_S
        cutoff = self.monotonic() - window
        recent = srv.requested_at
        while recent and next(iter(recent.values())) < cutoff:
            recent.popitem(last=False)

    def switches_coming(self, srv: ServerRuntime) -> int:
        """How many more sessions asked this server for a slot lately than it has slots for them: the slots
        that will change hands, so the number worth keeping clean. At 0 (every active session keeps its own
        slot) a background save is a stall of the other slots for nothing; the idle timer still saves a
        session that went quiet. Lately: the last minute, or four of the server's median think times.
        Auxiliary requests count as one more session when no slot is reserved for them."""
        aux = aux_slot_id(srv)
        slots = sum(1 for i in srv.slots if i != aux)
        if len(srv.requested_at) > slots:  # only a count above the slots can change by expiring
            self._prune(srv)
        return len(srv.requested_at) - slots

    def next_victims(self, srv: ServerRuntime) -> list[Slot]:
        """The dirty slots the coming switches will take, in the order they will take them (least recently
        used first): as many as the switches coming, less the slots already empty, clean or being cleaned."""
        coming = self.switches_coming(srv)
        if coming <= 0:
            return []
        aux = aux_slot_id(srv)
        ready, dirty = 0, []
        for s in srv.slots.values():
            if s.id == aux:
                continue
            if s.holder == CLEANING:
                ready += 1
            elif s.free and s.claimed_by is None:
                if s.owner is not None and self.sessions.is_dirty(s.owner):
                    dirty.append(s)
                else:
                    ready += 1
        dirty.sort(key=lambda s: s.last_used_at)
        return dirty[: max(0, coming - ready)]

    async def clean_ahead(self, rt: SessionRuntime) -> bool:
        """Save a dirty, idle session in the background if its server is idle and it is the next victim."""
        srv = self.servers.get(rt.identity.server)
        slot = owner_slot(srv, rt.key) if srv else None
        if srv is None or slot is None or not rt.dirty or not self._cleaning_on():
            return False
        save_s = self.costs.server(srv.name).save_s(rt.context_tokens or 0)
        wait_s = self.acquire_timeout_s if self.acquire_timeout_s is not None else srv.config.slot_wait_s
        if save_s is None or save_s > wait_s / 2:
            # the session's own request, arriving during the save, must never time out waiting for it
            rt.clean_due_at = None
            self.telemetry.clean_ahead(srv.name, rt, "too_long")
            return False
        if self.switches_coming(srv) <= 0:
            self.telemetry.clean_ahead(srv.name, rt, "no_switch")
            return False
        busy = self._working(srv, but=slot)
        if not slot.free or srv.waiters or (busy and not self.config.checkpoint.clean_ahead_while_busy):
            self.telemetry.clean_ahead(srv.name, rt, "busy")
            return False
        if slot not in self.next_victims(srv):
            self.telemetry.clean_ahead(srv.name, rt, "not_victim")
            return False
        rt.clean_due_at = None  # one background save attempt per revision (its next release re-arms it)
        budget_s = _CLEANING_WAIT_FACTOR * save_s + _MIN_CLEAN_AHEAD_S
        slot.cleaning_until = self.monotonic() + budget_s
        # past the budget, a new session waiting for this slot takes another: dispatch then re-decides
        overran = asyncio.get_running_loop().call_later(budget_s, self.pool.dispatch, srv)
        try:
            saved = await self.checkpoint(rt, CLEANING, only_revision=rt.dirty_revision)
        finally:
            overran.cancel()
            slot.cleaning_until = None
        self.telemetry.clean_ahead(srv.name, rt, "saved" if saved else "superseded")
        return saved

    # protect: bound the unsaved work of sessions that keep their slot (issue 26) ---------------------
    def _arm_protect(self, rt: SessionRuntime, now: float) -> None:
        """A timer for when its unsaved age reaches half the time bound, then the bound: an idle moment
        that comes while nothing is given back (the session thinking, the server idle) is not missed."""
        bound = self.config.checkpoint.max_unsaved_s
        if rt.protect_timer is not None or not self.active or not bound or rt.dirty_since is None:
            return
        due = [t for t in (rt.dirty_since + bound / 2, rt.dirty_since + bound) if t > now]
        if not due:
            return  # past the bound already: the next idle moment (a give-back) saves it
        key = rt.key
        rt.protect_timer = asyncio.get_running_loop().call_later(
            min(due) - now, lambda: self._protect_timer(key)
        )

    def _protect_timer(self, key: str) -> None:
        rt = self.sessions.get(key)
        if rt is None:
            return
        rt.protect_timer = None
        srv = self.servers.get(rt.identity.server)
        if srv is None or not rt.dirty or not self.active:
            return
        if not srv.waiters:
            self.protect(srv)
        self._arm_protect(rt, self.monotonic())  # the bound itself, if this was half of it

    def protect_reason(self, srv: ServerRuntime, rt: SessionRuntime, now: float) -> str | None:
        """Whether a background save of this dirty, idle session is due now, and which (its trigger)."""
        cp = self.config.checkpoint
        if not cp.max_unsaved_s and not cp.max_unsaved_turns:
            return None  # both bounds off: saved only at switches, hints and idle_s (before issue 26)
        costs = self.costs.server(srv.name)
        save_s = costs.save_s(rt.context_tokens) if rt.context_tokens else None
        wait_s = self.acquire_timeout_s if self.acquire_timeout_s is not None else srv.config.slot_wait_s
        if save_s is not None and save_s > wait_s / 2:
            return None  # its own request, arriving during the save, must never time out waiting for it
        age, turns = rt.unsaved_age_s(now), rt.unsaved_turns
        over_s = bool(cp.max_unsaved_s) and age is not None and age >= cp.max_unsaved_s
        if over_s or (cp.max_unsaved_turns and turns >= cp.max_unsaved_turns):
            return PROTECT_FORCED
        if cp.policy != "cost-aware" or save_s is None or rt.released_at is None:
            return None
        think = self._thinkmedian(rt)
        if think is None or _PROTECT_MARGIN * save_s > rt.released_at + think - now:
            return None  # its next request is expected before the save would end
        half = (bool(cp.max_unsaved_s) and age is not None and 2 * age >= cp.max_unsaved_s) or (
            bool(cp.max_unsaved_turns) and 2 * turns >= cp.max_unsaved_turns
        )
        at_risk = rt.unsaved_tokens
        recompute_s = costs.prefill_s(at_risk) if at_risk else None
        if half or (recompute_s is not None and recompute_s >= save_s):
            return PROTECT_PREDICTED
        return None

    def protect(self, srv: ServerRuntime) -> bool:
        """At an idle moment of the server (no slot held, nobody waiting), start the background save of the
        resident session whose unsaved work is due (the oldest first). The slot is taken at once, so the
        next request of that session waits for the save and every other slot sees a working server (no
        second background save starts). True if one was started."""
        if not self.active or srv.waiters or self._working(srv) or not srv.available:
            return False
        if srv.fingerprint is None or srv.breaker.state is BreakerState.OPEN:
            return False
        now = self.monotonic()
        due: list[tuple[float, Slot, SessionRuntime, str]] = []
        for slot in srv.slots.values():
            rt = self.sessions.get(slot.owner)
            if rt is None or not rt.dirty or slot.claimed_by is not None:
                continue
            if rt.protect_tried == rt.dirty_revision or (rt.pending_commit and not rt.pending_commit.done()):
                continue  # tried at this revision already (a failure is not retried in a loop), or committing
            trigger = self.protect_reason(srv, rt, now)
            if trigger is not None:
                due.append((rt.unsaved_age_s(now) or 0.0, slot, rt, trigger))
        if not due:
            return False
        _, slot, rt, trigger = max(due, key=lambda d: d[0])
        if not self.pool.try_take(srv, slot, trigger):
            return False
        rt.protect_tried = rt.dirty_revision
        self.spawn(self._protect_save(srv, slot, rt, trigger))
        return True

    async def _protect_save(self, srv: ServerRuntime, slot: Slot, rt: SessionRuntime, trigger: str) -> None:
        try:
            if slot.owner == rt.key:
                with contextlib.suppress(KvError):  # strict mode raises; a background save has no caller
                    await self.saver.save(srv, slot, rt, trigger=trigger)
        finally:
            self.pool.give_back(srv, slot)

    def policy_changed(self) -> None:
        """SIGHUP changed the policy: pending clean-ahead checks belong to the old one."""
        for rt in self.sessions.by_key.values():
            rt.cancel_clean_ahead()

    def close(self) -> None:
        self.active = False
        for rt in self.sessions.by_key.values():
            rt.cancel_timers()
