"""The slot pool: who may use which slot, in what order, and whose KV each slot holds (spec §19, §38, §63-65).

A slot is used (restore, erase, save, inference) only by its `holder`; `take()` waits, bounded, in the
server's FIFO queue for the slot `select()` picks, and `give_back()` hands it to the next waiter. Hand-over
is done by `dispatch()`, synchronously and in queue order: a request that arrives while others wait cannot
overtake them (a client that releases and re-acquires at once would otherwise starve everyone else), but a
waiter that can be served is never stuck behind one that cannot.

Owners: `SlotPool` is the only code that writes a `Slot` and the only holder of the waiter queues:
- `holder`, `claimed_by`, `last_used_at`: `take()`/`try_take()`/`dispatch()` hand a slot over, `give_back()`
  ends the hold;
- `owner`, `holds_aux`, `scope`: `assign()` (a session's KV is in it), `lend_to_aux()` (an auxiliary request
  runs on it), `vacate()` (no session's KV counts as in it any more), `forget_content()` (the server lost
  it);
- `tokens`, `foreign_kv`: `loaded()` (a restore), `started_cold()` (a cold start), `owner_ran()` (a turn of
  its owner), `erased()` (an erase: the canary's, scope.py's), `touched()` (a request ran on it),
  `forget_content()`; `loaded()` and `started_cold()` also set `scope` (whose KV it holds now);
- `cleaning_until`: `cleaning()`, while the checkpoint policy saves the slot ahead of its switch;
- the queue of requests waiting for a slot, per server (`queued()`, `waiting()`).
Everything here runs on the event loop; `dispatch()` has no await, so nothing interleaves with it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Iterator
from typing import Any

from kvsidecar.config import Mode
from kvsidecar.coordinator.caller import Caller
from kvsidecar.coordinator.server import ServerRuntime
from kvsidecar.coordinator.state import Lease, Slot
from kvsidecar.errors import InvariantViolation, ShuttingDown, SlotBusy

CLEANING = "clean_ahead"  # the holder of a slot being saved ahead of its switch (checkpoint.py)

# A request waiting for a slot: (session key or None, holder, future of the slot).
Waiter = tuple[str | None, Lease | str, asyncio.Future[Slot]]


class SlotPool:
    def __init__(
        self,
        *,
        is_dirty: Callable[[str], bool],
        monotonic: Callable[[], float],
        on_given_back: Callable[[ServerRuntime], None] | None = None,
    ) -> None:
        self.is_dirty = is_dirty
        self.monotonic = monotonic
        self.preparing: set[str] = set()  # lease ids holding a slot while it is being prepared
        self.closing = False
        # Told after every give-back, once waiters have been served (the checkpoint policy's idle check).
        self.on_given_back = on_given_back
        self._queues: dict[str, deque[Waiter]] = {}  # by server name, in arrival order

    # the queue: Invariant 8 ------------------------------------------------------------------------------
    # Invariant 8 (all backend mutation operations are serialized per physical slot) is owned here: a slot
    # has at most one holder, and only `dispatch()` and `try_take()` make one, and only of a free slot. Every
    # restore, erase, save and canary runs through the persistence guard (guard.py), which refuses a call on
    # a slot nobody holds; an inference runs under the lease that holds its slot.
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
        entry: Waiter = (key, holder, waiter)
        queue = self._queue(srv)
        queue.append(entry)
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
                queue.remove(entry)
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
        if not slot.free or slot.claimed_by is not None or self._queue(srv):
            return False
        slot.holder = holder
        return True

    def dispatch(self, srv: ServerRuntime) -> None:
        queue = self._queue(srv)
        for entry in list(queue):
            key, holder, waiter = entry
            if waiter.done():
                queue.remove(entry)
                continue
            slot = self.select(srv, key)
            if slot is None:
                continue
            slot.holder, slot.claimed_by = holder, key
            if isinstance(holder, Lease):
                holder.slot_id = slot.id
                self.preparing.add(holder.id)
            queue.remove(entry)
            waiter.set_result(slot)

    def give_back(self, srv: ServerRuntime, slot: Slot, *, quiet: bool = False) -> None:
        """End the hold and serve the waiters. `quiet`: given back from inside another operation (the runtime
        canary inside a save's or a restore's runtime check): the checkpoint policy is not told, as this is
        no idle moment of the server (it would start a background save while that operation runs)."""
        slot.holder = None
        slot.claimed_by = None
        slot.last_used_at = self.monotonic()
        self.dispatch(srv)
        if self.on_given_back is not None and not quiet:
            self.on_given_back(srv)

    def close(self) -> None:
        """Shutdown: no slot is taken from here on (`take` answers KV_SHUTTING_DOWN)."""
        self.closing = True

    def wake_all(self, srv: ServerRuntime) -> None:
        """Shutdown: every waiter gives up now (they answer KV_SHUTTING_DOWN)."""
        for _key, _holder, waiter in list(self._queue(srv)):
            waiter.cancel()

    def queued(self, srv: ServerRuntime) -> int:
        """Requests in the server's queue (a background save starts only when none is)."""
        return len(self._queue(srv))

    def waiting(self, srv: ServerRuntime) -> int:
        """Requests still waiting for a slot of the server (the acquires_waiting gauge)."""
        return sum(1 for _key, _holder, waiter in self._queue(srv) if not waiter.done())

    def _queue(self, srv: ServerRuntime) -> deque[Waiter]:
        queue = self._queues.get(srv.name)
        if queue is None:
            queue = self._queues[srv.name] = deque()
        return queue

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
        queued = {key for key, _holder, _waiter in self._queue(srv)}
        return any(s.owner not in queued for s in cleaning)

    @contextlib.contextmanager
    def cleaning(self, srv: ServerRuntime, slot: Slot, budget_s: float) -> Iterator[None]:
        """While the slot is saved ahead of its switch: for `budget_s` a new session waits for it rather
        than evict another dirty slot; past that the save overran its prediction, and `dispatch()`
        re-decides for whoever waits (nobody waits for it any longer)."""
        slot.cleaning_until = self.monotonic() + budget_s
        overran = asyncio.get_running_loop().call_later(budget_s, self.dispatch, srv)
        try:
            yield
        finally:
            overran.cancel()
            slot.cleaning_until = None

    # whose KV a slot holds: Invariants 2 and 3 ---------------------------------------------------------
    # Invariant 2 (at most one owner controls a physical slot at a time) is owned here: `owner` is set only
    # by `assign()`, by the request that holds the slot, and never to a session that owns another slot (one
    # session, one slot: `select()` has a session wait for its own slot, and `claimed_by` marks the slot a
    # session is being prepared on). Invariant 3 (a dirty slot is checkpointed before reassignment unless
    # policy disables it): a slot goes to another session (`assign`) or an auxiliary request (`lend_to_aux`)
    # only once vacated, and a switch vacates it only through `CheckpointPolicy.evict()`, which saves a
    # dirty owner first (`checkpoint.on_switch`) or gives up its unsaved turns (`SessionTable`).
    def assign(self, srv: ServerRuntime, slot: Slot, key: str, scope: str | None) -> None:
        """The session `key` is resident: its KV is in the slot (restored, or its cold start's)."""
        _check_held(srv, slot, "assigned")
        if slot.owner not in (None, key):
            raise InvariantViolation(
                f"slot {slot.id} of server {srv.name} is given to another session before its owner was "
                "evicted (Invariants 2 and 3)"
            )
        if any(s.owner == key for s in srv.slots.values() if s is not slot):
            raise InvariantViolation(f"a session would own two slots of server {srv.name} (Invariant 2)")
        slot.owner, slot.holds_aux, slot.scope = key, False, scope

    def lend_to_aux(self, srv: ServerRuntime, slot: Slot, scope: str | None) -> None:
        """Spec §72: an auxiliary request runs on the slot; it belongs to no session (Invariant 7)."""
        _check_held(srv, slot, "lent to an auxiliary request")
        if slot.owner is not None:
            raise InvariantViolation(
                f"slot {slot.id} of server {srv.name} is lent out before its owner was evicted (Invariant 3)"
            )
        slot.owner, slot.holds_aux, slot.scope = None, True, scope

    @staticmethod
    def vacate(slot: Slot) -> None:
        """No session's KV counts as in the slot any more (evicted, disposed of, a copy another host moved
        on from, or a cold start's kept KV no turn of its session ran on): its old owner's next request
        restores instead of running on it."""
        slot.owner = None

    @staticmethod
    def forget_content(slot: Slot) -> None:
        """The server lost (or may have lost) what the slot held: a restart, or the canary's slot."""
        slot.owner, slot.holds_aux, slot.tokens, slot.window_floor = None, False, None, None

    @staticmethod
    def loaded(slot: Slot, tokens: int, scope: str) -> None:
        """A restore put exactly `tokens` of its session's own snapshot (of `scope`) into the slot."""
        slot.tokens, slot.foreign_kv, slot.scope, slot.window_floor = tokens, False, scope, None

    @staticmethod
    def floored(slot: Slot, floor: tuple[int, ...]) -> None:
        """SWA with --swa-full: the restore just made holds the SWA cells of only the window before its end,
        so a prompt on this KV must extend `floor` (the restored tokens but the last)."""
        slot.window_floor = floor

    @staticmethod
    def started_cold(slot: Slot, tokens: int | None, *, foreign: bool, scope: str | None) -> None:
        """A cold start: the slot was erased (0), or kept its KV (`tokens`, None: unknown), which is not
        its new owner's own when `foreign` (left by another session, or a donor's snapshot): until a turn of
        the owner succeeds on it, the slot is not the owner's to come back to. `scope`: whose KV it holds
        now (None: as before, e.g. an erase that failed)."""
        slot.tokens, slot.foreign_kv = tokens, foreign
        if scope is not None:
            slot.scope = scope

    @staticmethod
    def owner_ran(slot: Slot) -> None:
        """A turn of the owner succeeded on the slot: the engine replaced what it did not reuse."""
        slot.foreign_kv = False

    @staticmethod
    def erased(slot: Slot) -> None:
        slot.tokens, slot.window_floor = 0, None

    @staticmethod
    def touched(slot: Slot, tokens: int | None = None) -> None:
        """A request ran on the slot (a lease ended, or kvsidecar's own token, `park`): it is not known to be
        empty any more (`tokens`: its size when known)."""
        slot.tokens = tokens or None


def _check_held(srv: ServerRuntime, slot: Slot, what: str) -> None:
    if slot.free:
        raise InvariantViolation(f"slot {slot.id} of server {srv.name} is {what} while nobody holds it")


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
