"""`RouterModels`: the models kvsidecar discovers on a llama-server router (`servers.NAME.discover_models`),
and the one writer of the runtimes it adds to the coordinator's servers ([SWAPS.md](../../docs/SWAPS.md)).

At start and at every look (`probe_interval_s` of the router's entry), `GET /models` is read; each model it
lists that the entry admits (`include_models`, `exclude_models`; not named by an entry of its own with
`model:`, which wins) becomes a server of its own: a `ServerRuntime` with a `RouterModelBackend`, the
entry's settings and snapshot directory, named `ENTRY.MODEL`. It is added to the coordinator's map of
servers, which every part reads (the swaps, the checkpoint policy, metrics, status, the proxy's routing by
the body's `model`), and started like a configured one (its probe loop). A model gone from the list stays:
its probe finds it missing and reads it unavailable; its snapshots stay, and restore when it comes back
(the same name: the same runtime, proven again like any restart).

A model id is the router's, hostile until checked: it names a server only when it is 1-64 of
`[A-Za-z0-9._-]` (not `.` or `..`); another printable id of at most 256 characters gets a hashed name
(`ENTRY.cleaned-<sha256 prefix>`); anything else is skipped with a warning. At most `max_models` models per
entry are managed; the rest are left unmanaged, said in a warning and in status (`router_discovery`).
"""

from __future__ import annotations

import asyncio
import fnmatch
import hashlib
import logging
import re
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kvsidecar.backend.base import KvBackend
from kvsidecar.backend.llama_router import RouterModel, RouterModelBackend, parse_models
from kvsidecar.backend.llamacpp import LlamaCppBackend
from kvsidecar.config import Config, ServerConfig
from kvsidecar.coordinator.server import ServerRuntime
from kvsidecar.coordinator.swaps import ModelSwaps
from kvsidecar.coordinator.views import StatusSections
from kvsidecar.errors import KvError
from kvsidecar.logs import event
from kvsidecar.store.snapshots import SnapshotStore

log = logging.getLogger("kvsidecar.router_models")

SAFE_ID = re.compile(r"\A[A-Za-z0-9._-]{1,64}\Z", re.ASCII)
ID_MAX = 256  # what a configured `model:` may be (ServerConfig.model)

Lister = Callable[[str, ServerConfig], Awaitable[Mapping[str, RouterModel]]]
BackendFactory = Callable[[str, ServerConfig], KvBackend]
Maker = Callable[[str, ServerConfig, KvBackend], ServerRuntime]


def derived_name(entry: str, model_id: str) -> str | None:
    """The server name of `model_id` discovered by `entry`: the id itself when it is a safe name, else a
    cleaned prefix and a hash of the whole id; None for an id no call may carry (not printable, too long)."""
    if not 0 < len(model_id) <= ID_MAX or not model_id.isprintable():
        return None
    if SAFE_ID.match(model_id) and model_id not in (".", ".."):
        return f"{entry}.{model_id}"
    cleaned = "".join(c if c.isascii() and (c.isalnum() or c in "-_") else "-" for c in model_id)
    digest = hashlib.sha256(model_id.encode()).hexdigest()[:12]
    return f"{entry}.{cleaned.strip('-')[:40] or 'model'}-{digest}"


async def list_router(entry: str, cfg: ServerConfig) -> Mapping[str, RouterModel]:
    """The router's `GET /models` (`?reload=1` with `reload_models`), read through a backend of the router
    itself (its API key included)."""
    backend = LlamaCppBackend.from_config(cfg, name=entry)
    params = {"reload": "1"} if cfg.reload_models else None
    try:
        return parse_models(await backend._request("GET", "/models", params=params, what="router /models"))
    finally:
        await backend.aclose()


def model_backend(name: str, cfg: ServerConfig) -> KvBackend:
    return RouterModelBackend.from_config(cfg, name=name)


@dataclass(kw_only=True)
class Discovery:
    """One entry that discovers its router's models: what it manages and what it left out, and why."""

    entry: str
    config: ServerConfig
    names: dict[str, str] = field(default_factory=dict)  # model id -> the server it is
    listed: frozenset[str] = frozenset()  # the ids of the last listing
    refused: dict[str, str] = field(default_factory=dict)  # a safe form of an id left out -> why
    over_bound: int = 0  # models listed and admitted but past max_models
    looks: int = 0
    last_error: str | None = None

    def admits(self, model_id: str) -> bool:
        cfg = self.config
        if cfg.include_models and not any(fnmatch.fnmatchcase(model_id, p) for p in cfg.include_models):
            return False
        return not any(fnmatch.fnmatchcase(model_id, p) for p in cfg.exclude_models)


class RouterModels:
    def __init__(
        self,
        *,
        config: Config,
        servers: dict[str, ServerRuntime],
        store: SnapshotStore,
        make: Maker,
        lister: Lister = list_router,
        backend_for: BackendFactory = model_backend,
    ) -> None:
        self.servers = servers  # the coordinator's: this is its one writer after the start
        self.store = store
        self.make, self.lister, self.backend_for = make, lister, backend_for
        self.entries = {
            name: Discovery(entry=name, config=cfg)
            for name, cfg in config.servers.items()
            if cfg.discover_models
        }
        # the ids the entries with `model:` name, per router: theirs, never discovered
        self._named = {
            (cfg.base_url.rstrip("/"), cfg.model) for cfg in config.servers.values() if cfg.model is not None
        }
        self._configured = frozenset(config.servers)  # every entry's name, a discovering one's included
        self._spawn: Callable[[Awaitable[Any]], Any] | None = None
        self._started: Callable[[ServerRuntime], Awaitable[None]] | None = None

    async def start(self) -> None:
        """The first look at every router (before the coordinator starts its servers, these among them)."""
        for entry in self.entries:
            await self.sync(entry)

    def watch(
        self, spawn: Callable[[Awaitable[Any]], Any], started: Callable[[ServerRuntime], Awaitable[None]]
    ) -> None:
        """From now on a model found is started at once (`started`); each entry is looked at again every
        `probe_interval_s` (a task of the coordinator's, `spawn`)."""
        self._spawn, self._started = spawn, started
        for entry in self.entries:
            spawn(self._loop(entry))

    async def _loop(self, entry: str) -> None:
        while True:
            await asyncio.sleep(self.entries[entry].config.probe_interval_s)
            await self.sync(entry)

    async def sync(self, entry: str) -> list[ServerRuntime]:
        """Read the router's models; add a runtime for each new one the entry admits (the added)."""
        d = self.entries[entry]
        try:
            models = await self.lister(entry, d.config)
        except Exception as exc:  # a look that fails, whatever the router answered, is only a failed look
            message = exc.message if isinstance(exc, KvError) else f"router /models: {type(exc).__name__}"
            if d.last_error != message:
                event(log, logging.WARNING, "kv.router.discover_failed", server=entry, error=message)
            d.last_error = message
            return []
        d.last_error, d.looks = None, d.looks + 1
        d.listed = frozenset(models)
        url = d.config.base_url.rstrip("/")
        added: list[ServerRuntime] = []
        over = 0
        for model_id in sorted(models):
            if model_id in d.names or (url, model_id) in self._named or not d.admits(model_id):
                continue
            if len(d.names) >= d.config.max_models:
                over += 1
                continue
            srv = self._add(d, model_id)
            if srv is not None:
                added.append(srv)
        if over != d.over_bound and over:
            event(
                log,
                logging.WARNING,
                "kv.router.discover_bound",
                server=entry,
                max_models=d.config.max_models,
                unmanaged=over,
            )
        d.over_bound = over
        return added

    def _add(self, d: Discovery, model_id: str) -> ServerRuntime | None:
        name = derived_name(d.entry, model_id)
        shown = ascii(model_id[:64])
        # another entry's name (a discovering entry is no server, but its name and directory are its own)
        if name is None or name in self.servers or name in self._configured:
            why = "not a model id (printable, 1-256 characters)" if name is None else f"{name} is taken"
            if shown not in d.refused and len(d.refused) < 64:  # a hostile listing grows nothing unbounded
                d.refused[shown] = why
                event(
                    log, logging.WARNING, "kv.router.discover_skipped", server=d.entry, model=shown, why=why
                )
            return None
        cfg = d.config.model_copy(
            update={"model": model_id, "discover_models": False, "include_models": [], "exclude_models": []}
        )
        srv = self.make(name, cfg, self.backend_for(name, cfg))
        self.store.share_dir(name, d.entry)  # its snapshots in the entry's directory, held since start
        d.names[model_id] = name
        self.servers[name] = srv
        event(log, logging.INFO, "kv.router.model_discovered", server=name, router=d.entry, model=shown)
        if self._spawn is not None and self._started is not None:  # after the start: probed, then looped
            self._spawn(self._started(srv))
        return srv

    def find(
        self, routed: str | None, model: str, *, aliases: ModelSwaps | None = None
    ) -> ServerRuntime | None:
        """The discovered runtime a call naming `model` runs on, for a provider routed to `routed` (the
        discovering entry, or any model's entry on the same router); else the model the router runs under
        the alias `model` (`aliases`, the swaps: a discovered model's aliases included)."""
        cfg = self.entries[routed].config if routed in self.entries else None
        if cfg is None and routed is not None and routed in self.servers:
            cfg = self.servers[routed].config
        url = cfg.base_url.rstrip("/") if cfg is not None else None
        for d in self.entries.values():
            name = d.names.get(model)
            if name is not None and d.config.base_url.rstrip("/") == url:
                return self.servers.get(name)
        if aliases is None:
            return None
        known = aliases.known_as(routed, model)
        if known is None and routed in self.entries:  # the entry is no server: ask through any of its models
            first = next(iter(self.entries[routed].names.values()), None)
            known = aliases.known_as(first, model) if first is not None else None
        return known

    def members(self, entry: str) -> list[str] | None:
        """The servers an entry that discovers its models has found (None: not such an entry)."""
        d = self.entries.get(entry)
        return sorted(d.names.values()) if d is not None else None

    def shown_in(self, sections: StatusSections, swaps: ModelSwaps) -> None:
        """Status: a router's models (`router_models`), and what discovery found (`router_discovery`)."""
        if swaps.managed or self.entries:
            sections.add("router_models", swaps.view)
        if self.entries:
            sections.add("router_discovery", self.view)

    def view(self) -> dict[str, Any]:
        """Status: per discovering entry, the models it manages, those it left out and why."""
        return {
            d.entry: {
                "models": dict(sorted(d.names.items())),
                "missing": sorted(n for m, n in d.names.items() if m not in d.listed),
                "max_models": d.config.max_models,
                "unmanaged_over_max": d.over_bound,
                "skipped": dict(d.refused),
                "looks": d.looks,
                "last_error": d.last_error,
            }
            for d in self.entries.values()
        }
