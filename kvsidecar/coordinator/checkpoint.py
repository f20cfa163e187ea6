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
  starts the check at once.
- *skip a save*: at a switch, when the slot still extends the session's newest saved generation (every
  turn since reused all of it: append-only history) and recomputing the tokens since is predicted cheaper
  than writing the whole slot, nothing is saved; the next restore brings the older generation back and
  llama-server recomputes only the difference.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvsidecar.config import Config
from kvsidecar.coordinator.costs import CostModel, median
from kvsidecar.coordinator.pool import SlotPool, owner_slot
from kvsidecar.coordinator.save import Saver
from kvsidecar.coordinator.server import ServerRuntime
from kvsidecar.coordinator.sessions import SessionEvent, SessionTable
from kvsidecar.coordinator.state import AcquireResult, Lease, SessionRuntime, Slot
from kvsidecar.coordinator.telemetry import Telemetry
from kvsidecar.errors import KvError

_MIN_CLEAN_AHEAD_S = 0.2
_PROMPT_CLEAN_AHEAD_S = 0.01  # right after the release has been answered
_THINK_SAMPLES_NEEDED = 2
_SERVER_THINK_SAMPLES_NEEDED = 4


_PROBE_KEY = "\0next-session"  # matches no session: pool.select() with it picks the next victim


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

    async def evict(self, srv: ServerRuntime, slot: Slot, result: AcquireResult) -> str | None:
        """The slot goes to another session (or an auxiliary request): checkpoint its owner first."""
        rt = self.sessions.get(slot.owner)
        slot.owner = None
        if rt is None:
            return None
        if rt.dirty and self.config.checkpoint.on_switch and not self._skip_save(srv, rt):
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
            self.spawn(self.clean_ahead(rt))
            return False
        return bool(wanted) and await self.checkpoint(rt, type_)

    # idle timers --------------------------------------------------------------------------------------
    def touched(self, rt: SessionRuntime) -> None:
        """The session ran: push its idle deadline back (a timer only if none is pending), and under the
        cost-aware policy arm its clean-ahead check for when it has been idle as long as a save takes."""
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

    async def clean_ahead(self, rt: SessionRuntime) -> bool:
        """Save a dirty, idle session in the background if its server is idle and it is the next victim."""
        srv = self.servers.get(rt.identity.server)
        slot = owner_slot(srv, rt.key) if srv else None
        cost_aware = self.config.checkpoint.policy == "cost-aware"  # SIGHUP may have turned it off
        if srv is None or slot is None or not rt.dirty or not self.active or not cost_aware:
            return False
        save_s = self.costs.server(srv.name).save_s(rt.context_tokens or 0)
        wait_s = self.acquire_timeout_s if self.acquire_timeout_s is not None else srv.config.slot_wait_s
        if save_s is None or save_s > wait_s / 2:
            # the session's own request, arriving during the save, must never time out waiting for it
            self.telemetry.clean_ahead(srv.name, rt, "too_long")
            return False
        busy = any(isinstance(s.holder, Lease | str) for s in srv.slots.values() if s is not slot)
        if not slot.free or srv.waiters or (busy and not self.config.checkpoint.clean_ahead_while_busy):
            self.telemetry.clean_ahead(srv.name, rt, "busy")
            return False
        if self.pool.select(srv, _PROBE_KEY) is not slot:
            self.telemetry.clean_ahead(srv.name, rt, "not_victim")
            return False
        saved = await self.checkpoint(rt, "clean_ahead", only_revision=rt.dirty_revision)
        self.telemetry.clean_ahead(srv.name, rt, "saved" if saved else "superseded")
        return saved

    def policy_changed(self) -> None:
        """SIGHUP changed the policy: pending clean-ahead checks belong to the old one."""
        for rt in self.sessions.by_key.values():
            rt.cancel_clean_ahead()

    def close(self) -> None:
        self.active = False
        for rt in self.sessions.by_key.values():
            rt.cancel_timers()
