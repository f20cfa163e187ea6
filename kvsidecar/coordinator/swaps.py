"""`ModelSwaps`: the models of a llama-server router (`servers.NAME.model`), loaded and unloaded without
losing a turn ([SWAPS.md](../../docs/SWAPS.md)).

Owns the one lock per router under which kvsidecar loads and unloads its models, and what it saw of the
unloads (their counts by cause, the last one of each server). It decides nothing about KV itself: a model's
sessions are saved by the checkpoint policy's own loop (`CheckpointPolicy.checkpoint_all`), and a model that
comes back is a new runtime, whose sessions restore lazily on their next acquire (as after a restart).

- **Save before unload** (`load`, the hook `ServerRuntime.refresh` calls before it wakes an unloaded model):
  when loading the model would take the router past `--models-max`, the least recently used of the other
  models kvsidecar manages on that router have every dirty slot saved (trigger `unload`), then are unloaded
  by kvsidecar itself (`POST /models/unload`), so the router has room and unloads nothing of its own; then
  the model is loaded. A model the router loaded that kvsidecar does not manage is left to the router.
- **An unload kvsidecar did not cause** (the router's LRU, an operator's `POST /models/unload`, a child that
  crashed: the backend sees each on its look at `GET /models`) is reported by `observe`: a warning
  `kv.router.model_unloaded`, `kvsidecar_router_unloads_total{server,cause}` and the `router_models` section
  of status. Its sessions lose at most what the checkpoint bounds left unsaved.
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter as Tally
from typing import Any

from kvsidecar.backend.llama_router import RouterModelBackend, Unload
from kvsidecar.coordinator.checkpoint import CheckpointPolicy
from kvsidecar.coordinator.server import ServerRuntime
from kvsidecar.logs import event
from kvsidecar.metrics import Metrics

log = logging.getLogger("kvsidecar.swaps")

UNLOAD = "unload"  # the save trigger of a model kvsidecar unloads (kvsidecar_save_total{trigger})


def router_model(srv: ServerRuntime) -> RouterModelBackend | None:
    backend = srv.backend
    return backend if isinstance(backend, RouterModelBackend) else None


class ModelSwaps:
    def __init__(
        self, *, servers: dict[str, ServerRuntime], checkpoints: CheckpointPolicy, metrics: Metrics
    ) -> None:
        self.servers = servers
        self.checkpoints = checkpoints
        self.metrics = metrics
        self._locks: dict[str, asyncio.Lock] = {}
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

    async def load(self, srv: ServerRuntime) -> None:
        """Make room for `srv`'s model on its router (save, then unload, the least recently used of ours
        past `--models-max`) and load it; one load or unload of ours at a time per router."""
        backend = router_model(srv)
        if backend is None:
            return
        lock = self._locks.setdefault(srv.config.base_url.rstrip("/"), asyncio.Lock())
        async with lock:
            state = await backend.router_state()
            me = state.models.get(backend.model)
            if me is not None and me.status == "unloaded" and state.max_loaded > 0:
                loaded = state.loaded()
                excess = len(loaded) + 1 - state.max_loaded
                # a model with a request running on one of its slots is never unloaded under it
                ours = [o for o in self._siblings(srv) if _model(o) in loaded and not _busy(o)]
                ours.sort(key=_last_used)
                for victim in ours[: max(excess, 0)]:
                    await self._save_and_unload(victim, why=srv.name)
            await backend.wake()
        self.observe(srv)

    async def _save_and_unload(self, victim: ServerRuntime, *, why: str) -> None:
        results = await self.checkpoints.checkpoint_all(UNLOAD, server=victim.name)
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
        self.observe(victim)

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
            last = self._last.get(srv.name)
            out[srv.name] = {
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


def _busy(srv: ServerRuntime) -> bool:
    return any(slot.holder is not None for slot in srv.slots.values())


def _last_used(srv: ServerRuntime) -> float:
    return max((slot.last_used_at for slot in srv.slots.values()), default=0.0)
