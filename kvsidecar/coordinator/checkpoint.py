"""The checkpoint policy: when a session's slot is saved, and what happens to unsaved progress.

The decisions (spec §26-29, §50, §58, §71), each in one method:
- `evict()`: a dirty slot is saved before it is given to another session (Invariant 3), when
  `checkpoint.on_switch` is on; what is not saved then is gone from the slot.
- `touched()` / the idle timer: a dirty session is saved after `idle_s` without requests. One
  `loop.call_later` timer per session; a request only pushes the deadline back, and a timer that fires
  early re-arms itself for the current deadline (spec §71), so the resident hot path does no timer work.
- `on_event()`: lifecycle hints (`flush`, `turn_end`, `step_end`, `disposed`) as configured.
- `checkpoint_all()`: shutdown.

This is the seam for cost-aware policies: they change these decisions, not the save mechanics (save.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvsidecar.config import Config
from kvsidecar.coordinator.pool import SlotPool, owner_slot
from kvsidecar.coordinator.save import Saver
from kvsidecar.coordinator.server import ServerRuntime
from kvsidecar.coordinator.sessions import SessionEvent, SessionTable
from kvsidecar.coordinator.state import AcquireResult, SessionRuntime, Slot
from kvsidecar.errors import KvError


class CheckpointPolicy:
    def __init__(
        self,
        *,
        config: Config,
        servers: dict[str, ServerRuntime],
        sessions: SessionTable,
        pool: SlotPool,
        saver: Saver,
        spawn: Callable[[Awaitable[Any]], asyncio.Task[Any]],
        monotonic: Callable[[], float] = time.monotonic,
    ) -> None:
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
        if rt.dirty and self.config.checkpoint.on_switch:
            await self.saver.save(srv, slot, rt, trigger="switch", actions=result.actions)
        if rt.dirty:  # not saved (policy off or failure): that progress is gone from the slot
            rt.saved_revision = rt.dirty_revision
        self.sessions.apply(rt, SessionEvent.EVICTED)
        return rt.identity.short

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
        return bool(wanted) and await self.checkpoint(rt, type_)

    # idle timers --------------------------------------------------------------------------------------
    def touched(self, rt: SessionRuntime) -> None:
        """The session ran: push its idle deadline back; arm a timer only if none is pending."""
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
        if not self.active or rt.idle_due is None:
            return
        remaining = rt.idle_due - self.monotonic()
        if remaining > 0.001:  # a request came in since the timer was armed: wait for the new deadline
            self._arm(rt, remaining)
            return
        rt.idle_due = None
        with contextlib.suppress(KvError):
            await self.checkpoint(rt, "idle", only_revision=rt.dirty_revision)

    def close(self) -> None:
        self.active = False
        for rt in self.sessions.by_key.values():
            if rt.idle_timer is not None:
                rt.idle_timer.cancel()
                rt.idle_timer = None
