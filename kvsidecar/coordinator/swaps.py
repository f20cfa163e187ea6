"""`ModelSwaps`: the models of a llama-server router (`servers.NAME.model`), loaded and unloaded without
losing a turn ([SWAPS.md](../../docs/SWAPS.md)).

Owns the one lock per router under which kvsidecar loads and unloads its models, and what it saw of the
unloads (their counts by cause, the last one of each server). It decides nothing about KV itself: a model's
sessions are saved by the checkpoint policy's own loop (`CheckpointPolicy.checkpoint_all`), and a model that
comes back is a new runtime, whose sessions restore lazily on their next acquire (as after a restart).

- **Room before load** (`enter`, at the start of every acquire of a router's model, before it waits for a
  slot; `leave` at its lease's release): an acquire counts as a user of its model (coordinator/rooms.py)
  until its lease ends, and a model with a user is never unloaded by us. An acquire for a model the router
  has not loaded makes room first: when loading it would take the router past `--models-max`, the least
  recently used of the other models kvsidecar manages there that has no user is saved and unloaded (below);
  when every such model has a user, the acquire waits (`model_wait_s`, then `KV_MODEL_BUSY`) until one is
  released, rather than let the router unload a model under a request. An acquire for a model being
  unloaded waits until it is gone, then loads it again the same way. Only models not ours loaded and none of
  ours: the router's own LRU unloads one of those.
- **Save before unload** (`_save_and_unload`): the model's every dirty slot is saved (trigger `unload`),
  then every slot of it is held (a background save the checkpoint loop started, or one a slot's give-back
  started, ends first; none starts after), and only then does kvsidecar unload it (`POST /models/unload`),
  tell the runtime guard it is asleep (its slots hold nothing any more) and give its slots back.
  `load` (the hook `ServerRuntime.refresh` calls before it wakes an unloaded model, after `enter`) makes room
  the same way without waiting.
- **An unload kvsidecar did not cause** (the router's LRU, an operator's `POST /models/unload`, a child that
  crashed: the backend sees each on its look at `GET /models`) is reported by `observe`: a warning
  `kv.router.model_unloaded`, `kvsidecar_router_unloads_total{server,cause}` and the `router_models` section
  of status. Its sessions lose at most what the checkpoint bounds left unsaved.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import Counter as Tally
from collections.abc import Awaitable, Callable
from typing import Any

from kvsidecar.backend.llama_router import RouterModelBackend, RouterState, Unload
from kvsidecar.coordinator.caller import Caller
from kvsidecar.coordinator.checkpoint import CheckpointPolicy
from kvsidecar.coordinator.rooms import Room
from kvsidecar.coordinator.server import ServerRuntime
from kvsidecar.coordinator.state import Slot
from kvsidecar.errors import KvError, ModelBusy
from kvsidecar.logs import event
from kvsidecar.metrics import Metrics

log = logging.getLogger("kvsidecar.swaps")

UNLOAD = "unload"  # the save trigger of a model kvsidecar unloads (kvsidecar_save_total{trigger})
FENCE_LOOK_S = 0.5  # a quiet give-back (the canary's) tells nobody: the fence looks again this often
NOT_LOADED = frozenset({"unloaded", "downloading", "unknown"})


def router_model(srv: ServerRuntime) -> RouterModelBackend | None:
    backend = srv.backend
    return backend if isinstance(backend, RouterModelBackend) else None


class ModelSwaps:
    def __init__(
        self,
        servers: dict[str, ServerRuntime],
        checkpoints: CheckpointPolicy,
        metrics: Metrics,
        *,
        refresh: Callable[[ServerRuntime], Awaitable[object]] | None = None,
    ) -> None:
        self.servers = servers
        self.checkpoints = checkpoints
        self.metrics = metrics
        # the runtime guard's refresh: a model unloaded by us is seen asleep at once (its residency forgotten)
        self.refresh = refresh
        self._rooms: dict[str, Room] = {}
        self._unloads: dict[str, Tally[str]] = {}
        self._last: dict[str, Unload] = {}

    @property
    def managed(self) -> list[ServerRuntime]:
        return [srv for srv in self.servers.values() if router_model(srv) is not None]

    def known_as(self, routed: str | None, name: str) -> ServerRuntime | None:
        """The model of the router `routed` (a server entry) that the router, as last seen, runs under the
        alias `name`: a call naming it runs on that model's child, so it is that entry's."""
        srv = self.servers.get(routed) if routed is not None else None
        if srv is None or router_model(srv) is None:
            return None
        for other in [srv, *self._siblings(srv)]:
            backend = router_model(other)
            if backend is not None and backend.known_as(name):
                return other
        return None

    def _siblings(self, srv: ServerRuntime) -> list[ServerRuntime]:
        """The other models kvsidecar manages on the same router."""
        url = srv.config.base_url.rstrip("/")
        return [o for o in self.managed if o is not srv and o.config.base_url.rstrip("/") == url]

    def _room(self, srv: ServerRuntime) -> Room:
        return self._rooms.setdefault(srv.config.base_url.rstrip("/"), Room())

    async def enter(self, srv: ServerRuntime, caller: Caller | None = None) -> None:
        """Let an acquire on `srv` in, as a user of its model until `leave`: at once when the router has it
        loaded (as last seen: no call), else once room is made and it is loaded; waits while it is being
        unloaded or while every model of ours that could make room has a user. `KV_MODEL_BUSY` past
        `model_wait_s` (the caller gone: its own error)."""
        backend = router_model(srv)
        if backend is None:
            return
        room = self._room(srv)
        if room.max_loaded is None:  # once per router: whether its models will be unloaded
            with contextlib.suppress(KvError):
                self._note_limit(srv, room, await backend.router_state())
        loop = asyncio.get_running_loop()
        deadline, started, waited = loop.time() + srv.config.model_wait_s, loop.time(), False
        while True:
            marker = room.marker()
            if srv.name not in room.leaving:
                if _loaded(backend):
                    room.enter(srv.name)
                    break
                if await self._load_entering(srv, room):
                    break
            waited = True
            if not await room.wait(marker, deadline, caller):
                if caller is not None and caller.gone():
                    raise caller.error(srv.name)
                waited_s = round(loop.time() - started, 3)
                event(log, logging.WARNING, "kv.router.busy", server=srv.name, waited_s=waited_s)
                raise ModelBusy(
                    f"no room on the router for model {backend.model[:64]!r} of server {srv.name} within "
                    f"{srv.config.model_wait_s:.0f}s: every model of ours it keeps loaded is in use"
                )
        if waited:  # for another model's request to end, or for its own unload
            waited_s = round(loop.time() - started, 3)
            event(
                log, logging.INFO, "kv.router.waited", server=srv.name, model=backend.model, waited_s=waited_s
            )

    async def _load_entering(self, srv: ServerRuntime, room: Room) -> bool:
        """Under the router's lock: room made and `srv` loaded, entered as a user (True), or no room yet.
        A router that cannot be asked lets the acquire in: its own path finds the model unavailable."""
        async with room.lock:
            if srv.name in room.leaving:
                return False
            try:
                made = await self._make_room(srv, room)
            except KvError as exc:
                event(log, logging.WARNING, "kv.router.load_failed", server=srv.name, code=exc.code)
                made = True
            if made:
                room.enter(srv.name)
        self.observe(srv)
        return made

    def leave(self, srv: ServerRuntime) -> None:
        """An acquire let in by `enter` has ended (its lease released, or the acquire failed)."""
        if router_model(srv) is not None:
            self._room(srv).leave(srv.name)

    def given_back(self, srv: ServerRuntime) -> None:
        """A slot of `srv` was given back: an unload waiting for its slots looks again."""
        if router_model(srv) is not None:
            self._room(srv).changed()

    async def load(self, srv: ServerRuntime) -> None:
        """The wake hook: make room for `srv`'s model and load it, without waiting (`KV_MODEL_BUSY` when
        every model of ours that could make room has a user)."""
        if router_model(srv) is None:
            return
        room = self._room(srv)
        if srv.name in room.leaving:  # a save of its own before its unload found it gone: not loaded back
            raise ModelBusy(f"server {srv.name} is being unloaded by kvsidecar")
        async with room.lock:
            made = await self._make_room(srv, room)
        self.observe(srv)
        if not made:
            raise ModelBusy(f"no room on the router for server {srv.name}: every model of ours is in use")

    async def _make_room(self, srv: ServerRuntime, room: Room) -> bool:
        """Under the lock: past `--models-max`, save and unload the least recently used models of ours that
        have no user, then load `srv`'s model. False (nothing loaded) while a model of ours with a user
        would be left for the router to unload."""
        backend = router_model(srv)
        assert backend is not None
        state = await backend.router_state()
        self._note_limit(srv, room, state)
        me = state.models.get(backend.model)
        if me is not None and me.status == "unloaded" and state.max_loaded > 0:
            loaded = state.loaded()
            excess = len(loaded) + 1 - state.max_loaded
            ours = [o for o in self._siblings(srv) if _model(o) in loaded]
            free = sorted((o for o in ours if room.free(o.name) and not _busy(o)), key=_last_used)
            for victim in free:
                if excess <= 0:
                    break
                if not room.free(victim.name) or _busy(victim):  # a request came in during an earlier unload
                    continue
                if await self._save_and_unload(victim, room, why=srv.name):
                    excess -= 1
                    ours.remove(victim)
            if excess > 0 and ours:
                return False  # the router would unload one of ours under a request: wait for its release
        await backend.wake()
        return True

    def _note_limit(self, srv: ServerRuntime, room: Room, state: RouterState) -> None:
        """The router's `--models-max`: when it is below the models kvsidecar manages there, each of them
        will be unloaded in turn (`crowded`: its sessions get the save points evicted sessions get)."""
        room.max_loaded = state.max_loaded
        ours = [srv, *self._siblings(srv)]
        for o in ours:
            backend = router_model(o)
            if backend is not None:
                backend.crowded = 0 < state.max_loaded < len(ours)

    async def _save_and_unload(self, victim: ServerRuntime, room: Room, *, why: str) -> bool:
        """Save the victim's dirty slots, hold every slot of it, unload it; False when its slots stayed
        held past the persistence bound (nothing unloaded)."""
        room.leaving.add(victim.name)
        try:
            results = await self.checkpoints.checkpoint_all(UNLOAD, server=victim.name)
            held = await self._fence(victim, room)
            if held is None:
                return False
            try:
                unsaved = [rt.identity.short for rt, code in results if code is not None]
                event(
                    log,
                    logging.WARNING if unsaved else logging.INFO,
                    "kv.router.unload",
                    server=victim.name,
                    model=_model(victim),
                    for_server=why,
                    saved=len(results) - len(unsaved),
                    unsaved=len(unsaved),
                    sessions=",".join(unsaved) or None,
                )
                backend = router_model(victim)
                assert backend is not None
                await backend.unload()
                if self.refresh is not None:
                    await self.refresh(victim)  # seen asleep: nothing of it counts as resident any more
            finally:
                for slot in held:
                    self.checkpoints.pool.give_back(victim, slot, quiet=True)
        finally:
            room.leaving.discard(victim.name)
            room.changed()
        self.observe(victim)
        return True

    async def _fence(self, victim: ServerRuntime, room: Room) -> list[Slot] | None:
        """Hold every slot of the victim, once none is held and nobody queues for one (a save the
        checkpoint loop or a give-back started ends first); None past its persistence bound."""
        pool, loop = self.checkpoints.pool, asyncio.get_running_loop()
        deadline = loop.time() + victim.config.persist_timeout_s
        while True:
            marker = room.marker()
            slots = list(victim.slots.values())
            if all(s.free and s.claimed_by is None for s in slots) and not pool.queued(victim):
                for s in slots:
                    pool.try_take(victim, s, UNLOAD)  # free, unclaimed, nobody queued: each succeeds
                return slots
            if loop.time() >= deadline:
                return None
            await room.wait(marker, min(deadline, loop.time() + FENCE_LOOK_S), None)

    def observe(self, srv: ServerRuntime) -> None:
        """Log, count and keep the unloads `srv`'s backend saw since the last look."""
        backend = router_model(srv)
        if backend is None:
            return
        for unload in backend.take_unloads():
            self._unloads.setdefault(srv.name, Tally())[unload.cause] += 1
            self._last[srv.name] = unload
            self.metrics.router_unloads.labels(srv.name, unload.cause).inc()
            event(
                log,
                logging.INFO if unload.cause == "kvsidecar" else logging.WARNING,
                "kv.router.model_unloaded",
                server=srv.name,
                model=unload.model,
                cause=unload.cause,
                exit_code=unload.exit_code,
            )

    def view(self) -> dict[str, Any]:
        """Status: each model of a router kvsidecar manages, what the router last said of it, its unloads."""
        out: dict[str, Any] = {}
        for srv in self.managed:
            backend = router_model(srv)
            assert backend is not None
            last, room = self._last.get(srv.name), self._room(srv)
            out[srv.name] = {
                "in_use": room.users[srv.name],  # acquires and leases of ours on it now
                "unloading": srv.name in room.leaving,
                "waiting": room.waiting,  # acquires on the router waiting for room or an unload
                "model": backend.model,
                "router_status": backend.last.status if backend.last is not None else None,
                "port": backend.last.port if backend.last is not None else None,
                "unloads": dict(self._unloads.get(srv.name, {})),
                "last_unload": None
                if last is None
                else {"cause": last.cause, "exit_code": last.exit_code, "at": last.at},
            }
        return out


def _model(srv: ServerRuntime) -> str | None:
    backend = router_model(srv)
    return backend.model if backend is not None else None


def _loaded(backend: RouterModelBackend) -> bool:
    """The router, as last seen, has the model loaded (or loading)."""
    return backend.last is not None and backend.last.status not in NOT_LOADED


def _busy(srv: ServerRuntime) -> bool:
    return any(slot.holder is not None for slot in srv.slots.values())


def _last_used(srv: ServerRuntime) -> float:
    return max((slot.last_used_at for slot in srv.slots.values()), default=0.0)
