"""The slot pool of one server: who may use which slot, and in what order (spec §19, §38, §63-65).

A slot is used (restore, erase, save, inference) only by its `holder`; `take()` waits, bounded, in the
server's FIFO queue for the slot `select()` picks, and `give_back()` hands it to the next waiter. Hand-over
is done by `dispatch()`, synchronously and in queue order: a request that arrives while others wait cannot
overtake them (a client that releases and re-acquires at once would otherwise starve everyone else), but a
waiter that can be served is never stuck behind one that cannot.

Everything here runs on the event loop; `dispatch()` has no await, so nothing interleaves with it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Any

from kvsidecar.config import Mode
from kvsidecar.coordinator.caller import Caller
from kvsidecar.coordinator.server import ServerRuntime
from kvsidecar.coordinator.state import Lease, Slot
from kvsidecar.errors import ShuttingDown, SlotBusy

CLEANING = "clean_ahead"  # the holder of a slot being saved ahead of its switch (checkpoint.py)


class SlotPool:
    def __init__(self, *, is_dirty: Callable[[str], bool], monotonic: Callable[[], float]) -> None:
        self.is_dirty = is_dirty
        self.monotonic = monotonic
        self.preparing: set[str] = set()  # lease ids holding a slot while it is being prepared
        self.closing = False
        # Told after every give-back, once waiters have been served (the checkpoint policy's idle check).
        self.on_given_back: Callable[[ServerRuntime], None] | None = None

    async def take(
        self,
        srv: ServerRuntime,
        key: str | None,
        holder: Lease | str,
        timeout_s: float,
        caller: Caller | None = None,
    ) -> Slot:
        """Wait in the server's queue for a slot and hold it (KV_SLOT_BUSY past `timeout_s`). With a
        `caller`, the wait also ends as soon as the caller is gone (KV_SLOT_BUSY; a slot handed over at
        that moment is given back to the next waiter)."""
        if self.closing:
            raise ShuttingDown("kvsidecar is shutting down")
        if caller is not None and caller.gone():
            raise caller.error(srv.name)
        waiter: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        entry = (key, holder, waiter)
        srv.waiters.append(entry)
        self.dispatch(srv)
        try:
            async with asyncio.timeout(timeout_s):
                if caller is None:
                    return await asyncio.shield(waiter)
                if not waiter.done():  # handed over at once: no wait (and no yield to the loop)
                    gone = asyncio.ensure_future(caller.wait())
                    either: set[asyncio.Future[Any]] = {waiter, gone}
                    try:
                        await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        gone.cancel()
                if caller.gone():  # also when the slot came in the same instant: nobody would hold it
                    raise caller.error(srv.name)
                return waiter.result()
        except BaseException as exc:
            with contextlib.suppress(ValueError):
                srv.waiters.remove(entry)
            if waiter.done() and not waiter.cancelled():  # handed a slot just as we gave up: give it back
                self.give_back(srv, waiter.result())
            waiter.cancel()
            if isinstance(exc, TimeoutError):
                raise SlotBusy(f"no slot of server {srv.name} became free within {timeout_s:.0f}s") from None
            if isinstance(exc, asyncio.CancelledError) and self.closing:
                raise ShuttingDown("kvsidecar is shutting down") from None
            raise

    def try_take(self, srv: ServerRuntime, slot: Slot, holder: str) -> bool:
        """Hold `slot` now if it is free and nobody waits (never jumps the queue)."""
        if not slot.free or slot.claimed_by is not None or srv.waiters:
            return False
        slot.holder = holder
        return True

    def dispatch(self, srv: ServerRuntime) -> None:
        for entry in list(srv.waiters):
            key, holder, waiter = entry
            if waiter.done():
                srv.waiters.remove(entry)
                continue
            slot = self.select(srv, key)
            if slot is None:
                continue
            slot.holder, slot.claimed_by = holder, key
            if isinstance(holder, Lease):
                holder.slot_id = slot.id
                self.preparing.add(holder.id)
            srv.waiters.remove(entry)
            waiter.set_result(slot)

    def give_back(self, srv: ServerRuntime, slot: Slot) -> None:
        slot.holder = None
        slot.claimed_by = None
        slot.last_used_at = self.monotonic()
        self.dispatch(srv)
        if self.on_given_back is not None:
            self.on_given_back(srv)

    def wake_all(self, srv: ServerRuntime) -> None:
        """Shutdown: every waiter gives up now (they answer KV_SHUTTING_DOWN)."""
        for _key, _holder, waiter in list(srv.waiters):
            waiter.cancel()

    def select(self, srv: ServerRuntime, key: str | None) -> Slot | None:
        """Spec §64: the slot the session owns; else an empty one; else LRU clean; else LRU dirty.

        Only free slots are candidates. A session whose own slot is held waits for it (None) rather than
        taking a second slot: one session, one slot.
        """
        slots = list(srv.slots.values())
        aux = aux_slot_id(srv)
        if key is None and aux is not None:
            return srv.slots[aux] if srv.slots[aux].free else None
        if key is not None:
            for s in slots:
                if s.owner == key or s.claimed_by == key:
                    return s if s.free else None
        free = [s for s in slots if s.free and s.id != aux and s.claimed_by is None]
        empty = [s for s in free if s.owner is None]
        clean = [s for s in free if s.owner is not None and not self.is_dirty(s.owner)]
        for group in (empty, clean):
            if group:
                return min(group, key=lambda s: s.last_used_at)
        if key is not None and self._cleaning_for_new(srv):
            # a slot is being saved ahead for the next session: wait for it (its save holds llama-server's
            # one loop either way) rather than evict another dirty slot and pay a second save
            return None
        return min(free, key=lambda s: s.last_used_at) if free else None

    def _cleaning_for_new(self, srv: ServerRuntime) -> bool:
        """A slot being saved ahead that a new session should wait for: within its predicted time, and not
        asked for by its own session (which gets it back: a new session waiting for it would then evict
        another slot anyway)."""
        now = self.monotonic()
        cleaning = [s for s in srv.slots.values() if s.holder == CLEANING and (s.cleaning_until or 0.0) > now]
        if not cleaning:
            return False
        queued = {key for key, _holder, _waiter in srv.waiters}
        return any(s.owner not in queued for s in cleaning)


def aux_slot_id(srv: ServerRuntime) -> int | None:
    """The slot kept for auxiliary requests, when configured and there is more than one."""
    if srv.config.mode is not Mode.MANAGED_SLOTS or not srv.config.reserve_aux_slot or len(srv.slots) < 2:
        return None
    return max(srv.slots)


def owner_slot(srv: ServerRuntime, key: str) -> Slot | None:
    for s in srv.slots.values():
        if s.owner == key:
            return s
    return None
