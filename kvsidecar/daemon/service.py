"""The composition root: builds the daemon from a config, once, and serves it.

`Daemon(config)` builds every part with what it needs at construction, so nothing is wired in afterwards:
the store, the backends, fleet mode's agent (its write gate, residency observer and status section go into
the coordinator), the coordinator, retention on the daemon's own scheduler, the API listener's state, and in
fleet mode the leader's retention and the router. `Daemon.start()` / `Daemon.aclose()` are symmetric:
whatever one starts the other stops (the shutdown checkpoint included), and the state directory's lock
(`statelock`) is held in between. `serve()` takes that lock before it binds anything (the sockets:
kvsidecar.daemon.listen), runs the daemon under uvicorn on loopback TCP and/or a 0600 unix socket, with the
proxy beside it; SIGTERM and SIGINT end it through the same path; SIGHUP reloads the config
(`Daemon.reload`; the sections in `RESTART_ONLY` keep their running values until a restart).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import AsyncIterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import uvicorn
from apscheduler.schedulers.asyncio import AsyncIOScheduler
from fastapi import FastAPI
from starlette.types import ASGIApp

from kvsidecar.api.routes import create_app
from kvsidecar.backend.base import KvBackend
from kvsidecar.backend.llama_router import backend_for
from kvsidecar.config import RESTART_ONLY, Config, is_loopback, load_config
from kvsidecar.coordinator.core import Coordinator
from kvsidecar.coordinator.server import ProcessFinder
from kvsidecar.daemon.lifecycle import NotifyingServer, ReadyGate, Stopper, SystemdNotifier, stop_signals
from kvsidecar.daemon.listen import check_bind, ensure_fd_budget, listen_sockets, read_token, tcp_socket
from kvsidecar.daemon.statelock import StateLock
from kvsidecar.errors import ConfigError
from kvsidecar.fingerprint.file_digests import FileDigestCache
from kvsidecar.fingerprint.llama_process import find_llama_process
from kvsidecar.fingerprint.savepath import SetupWarning, log_save_path_warnings
from kvsidecar.http.guards import bearer_credential
from kvsidecar.http.limits import Limits, ListenerState
from kvsidecar.http.listener import protocol_for
from kvsidecar.logs import event, reconfigure
from kvsidecar.metrics import Metrics
from kvsidecar.proxy.app import Proxy
from kvsidecar.retention.job import FleetRetention, RetentionJob
from kvsidecar.store.snapshots import SnapshotStore
from kvsidecar.store.watcher import SnapshotWatcher

if TYPE_CHECKING:
    from kvsidecar.fleet.agent import FleetAgent
    from kvsidecar.fleet.routing import FleetRouter

log = logging.getLogger("kvsidecar.service")


class Daemon:
    def __init__(
        self,
        config: Config,
        *,
        backends: dict[str, KvBackend] | None = None,
        process_finder: ProcessFinder | None = find_llama_process,
        watch: bool = True,
        config_path: Path | None = None,
        state_lock: StateLock | None = None,
    ) -> None:
        self.config = config
        self.config_path = config_path
        # Taken by start() unless the caller (serve) already holds it; released by aclose() if ours.
        self.state_lock = state_lock
        self._owns_lock = state_lock is None
        # Restart-only keys a reload found changed: reload() alone writes this list; the coordinator's
        # status shows it (the same list, given to it below).
        self.pending_restart: list[str] = []
        self._reload_lock = asyncio.Lock()
        self._reload_task: asyncio.Task[None] | None = None  # the last SIGHUP's, kept referenced
        self.metrics = Metrics()
        self.store = SnapshotStore.from_config(config)
        self.token = read_token(config)
        expected = f"Bearer {self.token}".encode() if self.token else None
        # the API listener's connection state (limits, the bearer check); build_server serves with it
        self.listener = ListenerState("api", Limits.of(config.api), credential=bearer_credential(expected))
        self.scheduler = AsyncIOScheduler(timezone="UTC")  # the retention timer: start() and aclose()
        self._gc_pending = False
        self.watch = watch
        self.watcher: SnapshotWatcher | None = None
        self.setup_warnings: list[SetupWarning] = []  # found at start (a snapshot_dir llama-server ignores)
        self.fleet: FleetAgent | None = _fleet_agent(config, self.store, self.metrics)  # docs/FLEET.md
        self.coordinator = self._coordinator(backends, process_finder)
        self.retention = RetentionJob(
            store=self.store,
            config=config.retention,
            metrics=self.metrics,
            protected_keys=self.coordinator.protected_keys,
            fleet=self._leader_retention(),
        )
        self.fleet_router: FleetRouter | None = self._fleet_router()  # hook calls between hosts

    def _coordinator(
        self, backends: dict[str, KvBackend] | None, process_finder: ProcessFinder | None
    ) -> Coordinator:
        config, fleet = self.config, self.fleet
        if backends is None:
            backends = {n: backend_for(s, name=n) for n, s in config.servers.items() if not s.discover_models}
        return Coordinator(
            config=config,
            store=self.store,
            backends=backends,
            metrics=self.metrics,
            process_finder=process_finder,
            digests=FileDigestCache(
                config.state_dir / "file-digests.json", anchor=self.store.layout.anchors["state"]
            ),
            after_save=self._after_save,
            pending_restart=self.pending_restart,
            # fleet mode, from the first write on (the proxy may take requests while `start` runs): every
            # write of a key's files is fenced, and only keys this host provably owns are written
            gate=fleet.gate if fleet is not None else None,
            observers=(fleet,) if fleet is not None else (),
            fleet_view=fleet.view if fleet is not None else None,
        )

    def _leader_retention(self) -> FleetRetention | None:
        if self.fleet is None:
            return None
        from kvsidecar.fleet.gate import LeaderRetention

        ownership = self.coordinator.ownership
        return LeaderRetention(self.fleet, self.fleet.gate, self.store.reload_all, ownership=ownership)

    def _fleet_router(self) -> FleetRouter | None:
        if self.fleet is None:
            return None
        from kvsidecar.fleet.routing import FleetRouter

        return FleetRouter(self.fleet, self.coordinator, token=self.token)

    async def start(self) -> None:
        if self.state_lock is None:
            self.state_lock = await asyncio.to_thread(StateLock.acquire, self.config.state_dir)
        try:
            await self._start()
        except BaseException:
            self._release_lock()  # aclose() is not called after a failed start
            raise

    def _release_lock(self) -> None:
        if self._owns_lock and self.state_lock is not None:
            self.state_lock.release()
            self.state_lock = None

    async def _start(self) -> None:
        report = await asyncio.to_thread(self.store.open)
        event(
            log,
            logging.INFO,
            "kv.store.reconciled",
            manifests=report.manifests,
            invalidated=len(report.invalidated),
            bad_manifests=len(report.bad_manifests),
            orphans=len(report.orphans),
            temp_removed=report.temp_files_removed,
            ms=round(report.elapsed_ms, 1),
        )
        self.setup_warnings = await asyncio.to_thread(self._check_save_paths)  # before the canary's save
        await self.coordinator.start()
        if self.fleet is not None:
            self.fleet.start(self.coordinator)  # returns at once: a Redis that is down is retried
        with contextlib.suppress(NotImplementedError, RuntimeError):  # not on the main thread (tests)
            asyncio.get_running_loop().add_signal_handler(signal.SIGHUP, self._on_sighup)
        self.scheduler.add_job(
            self._gc,
            "interval",
            seconds=self.config.retention.interval_s,
            id="retention",
            max_instances=1,
            coalesce=True,
        )
        self.scheduler.start()
        if self.watch:
            self.watcher = SnapshotWatcher(
                self.store,
                asyncio.get_running_loop(),
                on_invalid=lambda _s, _f, reason: self.metrics.invalidated.labels(reason).inc(),
            )
            self.watcher.start()

    def _load(self) -> Config | None:
        try:
            return load_config(self.config_path)
        except ConfigError as exc:
            event(log, logging.ERROR, "kv.config.reload_failed", error=exc.message)
            return None

    def _on_sighup(self) -> None:
        """SIGHUP on the loop: the file is read and parsed on a thread (a large file must not stall the
        hooks), then applied on the loop by `reload`, one reload at a time."""

        async def reload() -> None:
            async with self._reload_lock:
                if (config := await asyncio.to_thread(self._load)) is not None:
                    self.reload(config)

        self._reload_task = asyncio.get_running_loop().create_task(reload())

    def reload(self, config: Config | None = None) -> list[str]:
        """SIGHUP: re-read the config file (`config`: already read) and apply every live key, even when
        restart-only keys (RESTART_ONLY) changed too: those keep their running values and are logged, and
        kept in `pending_restart`, as needing a restart. A file that does not load changes nothing."""
        if config is None and (config := self._load()) is None:
            return list(self.pending_restart)
        log_deprecations(config)
        running = self.config
        pending = changed_keys(_sections(running, RESTART_ONLY), _sections(config, RESTART_ONLY))
        live = config.model_copy(update={k: getattr(running, k) for k in RESTART_ONLY})
        changed = changed_keys(running.model_dump(mode="json"), live.model_dump(mode="json"))
        # Its restart-only sections are the running ones, so the coordinator takes it whole.
        refused = self.coordinator.reconfigure(live)
        self._apply_live(running, live)
        self.pending_restart[:] = sorted(set(pending) | set(refused))  # shown in /v1/status
        event(
            log,
            logging.WARNING if self.pending_restart else logging.INFO,
            "kv.config.reloaded",
            changed=",".join(changed) or "nothing",
            needs_restart=",".join(self.pending_restart) or None,
        )
        return list(self.pending_restart)

    def _apply_live(self, running: Config, live: Config) -> None:
        """The live keys the daemon itself (not the coordinator) holds copies of."""
        self.config = live
        self.retention.reconfigure(live.retention)
        if live.retention.interval_s != running.retention.interval_s:
            self.scheduler.reschedule_job("retention", trigger="interval", seconds=live.retention.interval_s)
        self.store.reconfigure(verify_checksum=live.restore.verify_checksum)  # the store's one live setting
        reconfigure(live.logging.level, live.logging.format)

    def _check_save_paths(self) -> list[SetupWarning]:
        servers = self.coordinator.servers.values()
        found = {s.name: s.process_finder(s.config.base_url) if s.process_finder else None for s in servers}
        return log_save_path_warnings({s.name: (s.config, found[s.name]) for s in servers})

    async def _gc(self) -> None:
        try:
            await self.retention.run()  # the snapshot gauges are read from the store at scrape time
        except Exception:  # a failed pass must not kill the timer; the next one retries
            log.exception("kv.gc.failed")

    def _after_save(self) -> None:
        """A save may have pushed usage over a limit: check now rather than at the next interval."""
        if self._gc_pending:
            return
        self._gc_pending = True

        async def check() -> None:
            try:
                if await asyncio.to_thread(self.retention.needs_run):
                    await self._gc()
            finally:
                self._gc_pending = False

        self.coordinator.spawn(check())

    async def aclose(self) -> None:
        try:
            if self._reload_task is not None:  # a SIGHUP still reading: not applied to a closing daemon
                self._reload_task.cancel()
            if self.watcher is not None:
                self.watcher.stop()
            if self.scheduler.running:  # no timed retention pass starts from here on (one after a save may)
                self.scheduler.shutdown(wait=False)
                await asyncio.sleep(0)  # AsyncIOScheduler finishes its shutdown in a loop callback
            if self.fleet_router is not None:
                await self.fleet_router.aclose()
                self.fleet_router = None
            await self.coordinator.aclose()  # its shutdown checkpoints still claim their keys on Redis
            if self.fleet is not None:
                await self.fleet.aclose()
        finally:
            self._release_lock()

    def app(self) -> ASGIApp:
        @contextlib.asynccontextmanager
        async def lifespan(_: FastAPI) -> AsyncIterator[None]:
            await self.start()
            try:
                yield
            finally:
                await self.aclose()

        return create_app(
            self.coordinator,
            retention=self.retention,
            token=self.token,
            max_body_bytes=self.config.api.max_body_bytes,
            check_host=is_loopback(self.config.api.host),
            lifespan=lifespan,
            fleet=lambda: self.fleet_router,
        )


def _fleet_agent(config: Config, store: SnapshotStore, metrics: Metrics) -> FleetAgent | None:
    """Fleet mode's agent (its gate fences the store's writes; it reaches Redis only once started), when
    fleet.enabled. Imported only here: single-host mode never loads redis."""
    if not config.fleet.enabled:
        return None
    from kvsidecar.fleet.agent import FleetAgent

    return FleetAgent(config, fence_for=store.fence_with, metrics=metrics)


def log_deprecations(config: Config) -> None:
    for key, note in zip(config.ignored_keys, config.deprecations(), strict=True):
        event(log, logging.WARNING, "kv.config.deprecated", key=key, detail=note)


def _sections(config: Config, keys: tuple[str, ...]) -> dict[str, Any]:
    return config.model_dump(mode="json", include=set(keys))


_ABSENT = object()


def changed_keys(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted paths of the leaves that differ between two config dumps (`api.listen`, `servers.b`)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out: list[str] = []
        for key in sorted(old.keys() | new.keys(), key=str):
            path = f"{prefix}.{key}" if prefix else str(key)
            out += changed_keys(old.get(key, _ABSENT), new.get(key, _ABSENT), path)
        return out
    return [] if old == new else [prefix]


def _uvicorn(
    app: Any, *, lifespan: Literal["on", "off"], listener: ListenerState, gate: ReadyGate | None = None
) -> NotifyingServer:
    return NotifyingServer(
        uvicorn.Config(
            app,
            http=protocol_for(listener),
            ws="none",  # no WebSocket upgrade path around the listener's limits and the app's checks
            log_config=None,
            access_log=False,
            timeout_graceful_shutdown=5,
            lifespan=lifespan,
        ),
        gate=gate,
    )


def build_server(
    config: Config, *, gate: ReadyGate | None = None, **daemon_kwargs: Any
) -> tuple[NotifyingServer, list[socket.socket], Daemon]:
    """The daemon and its API server, with its sockets bound (not yet serving). `gate`: told when it runs."""
    daemon = Daemon(config, **daemon_kwargs)
    socks = listen_sockets(config)
    return _uvicorn(daemon.app(), lifespan="on", listener=daemon.listener, gate=gate), socks, daemon


def build_proxy(
    config: Config, daemon: Daemon, *, gate: ReadyGate | None = None
) -> tuple[NotifyingServer, list[socket.socket], Proxy] | None:
    if not config.proxy.enabled:
        return None
    check_bind(config, "proxy")
    sock = tcp_socket("proxy.listen", config.proxy.host, config.proxy.port)
    proxy = Proxy(
        daemon.coordinator,
        config,
        token=daemon.token,
        check_host=is_loopback(config.proxy.host),
        fleet=lambda: daemon.fleet_router,  # fleet mode: sessions follow their KV to another host's proxy
    )
    server = _uvicorn(proxy, lifespan="off", listener=proxy.listener, gate=gate)
    return server, [sock], proxy


async def serve(config: Config, **daemon_kwargs: Any) -> None:
    """Run until SIGTERM/SIGINT; the API's lifespan shutdown checkpoints dirty slots before exit.

    The state directory's lock is taken first (`StateLocked`: another daemon has it) and released last.
    With proxy mode on, a second listener runs beside the API; when either stops, both do.
    """
    fds = ensure_fd_budget(config)
    log_deprecations(config)
    with stop_signals() as stopper, StateLock.acquire(config.state_dir) as lock:
        await _serve(config, fds, stopper, state_lock=lock, **daemon_kwargs)


async def _serve(config: Config, fds: int, stopper: Stopper, **daemon_kwargs: Any) -> None:
    # Type=notify: READY=1 once every listener runs, STOPPING=1 at the first shutdown
    gate = ReadyGate(SystemdNotifier(), expected=2 if config.proxy.enabled else 1)
    server, socks, daemon = build_server(config, gate=gate, **daemon_kwargs)
    proxy = build_proxy(config, daemon, gate=gate)
    stopper.add(server, *([proxy[0]] if proxy else []))
    event(
        log,
        logging.INFO,
        "kv.api.listening",
        listen=config.api.listen,
        unix_socket=config.api.unix_socket,
        proxy=config.proxy.listen if proxy else None,
        fd_limit=fds,
    )
    tasks = [asyncio.ensure_future(server.serve(sockets=socks))]
    if proxy is not None:
        tasks.append(asyncio.ensure_future(proxy[0].serve(sockets=proxy[1])))
    try:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        server.should_exit = True
        if proxy is not None:
            proxy[0].should_exit = True
        await asyncio.gather(*tasks)
    finally:
        for s in socks + (proxy[1] if proxy else []):
            s.close()
        if proxy is not None:
            await proxy[2].aclose()
