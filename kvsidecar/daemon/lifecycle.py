"""The daemon's life as systemd sees it: stop signals (`Stopper`, `stop_signals`) and readiness.

Readiness (`Type=notify`): READY=1 once every listener serves, STOPPING=1 when shutdown begins.

The messages go over $NOTIFY_SOCKET through the `sdnotify` library; without that variable (not run by
systemd, or not `Type=notify`) nothing is sent. "Ready" means what a client can rely on: the store is
reconciled, the coordinator started (the API's lifespan startup) and every listener accepts
connections. A llama-server that is down does not hold readiness back: kvsidecar serves (and reports the
backend DOWN) without it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Protocol

import sdnotify
import uvicorn

from kvsidecar.logs import event

log = logging.getLogger("kvsidecar.service")


class Notifier(Protocol):
    def notify(self, state: str) -> None: ...


class SystemdNotifier:
    """sdnotify's notifier, but a failure to send is logged (once) rather than silently dropped."""

    def __init__(self) -> None:
        self.address = os.environ.get("NOTIFY_SOCKET")
        self._notifier: sdnotify.SystemdNotifier | None = None
        self._warned = False
        if self.address:
            try:
                self._notifier = sdnotify.SystemdNotifier(debug=True)
            except OSError as exc:
                self._warn(exc)

    def notify(self, state: str) -> None:
        if self._notifier is None:
            return
        try:
            self._notifier.notify(state)
        except OSError as exc:
            self._warn(exc)

    def _warn(self, exc: OSError) -> None:
        if not self._warned:
            self._warned = True
            event(log, logging.WARNING, "kv.systemd.notify_failed", socket=self.address, error=str(exc))


class ReadyGate:
    """Sends READY=1 when the last of `expected` servers has started, and STOPPING=1 once, at the first
    shutdown (a stop before readiness sends STOPPING=1 only)."""

    def __init__(self, notifier: Notifier, expected: int) -> None:
        self.notifier, self.expected = notifier, expected
        self.started = 0
        self.ready = self.stopping = False

    def server_started(self) -> None:
        self.started += 1
        if self.started == self.expected and not self.ready and not self.stopping:
            self.ready = True
            self.notifier.notify("READY=1\nSTATUS=serving")
            event(log, logging.INFO, "kv.systemd.ready")

    def server_stopping(self) -> None:
        if not self.stopping:
            self.stopping = True
            self.notifier.notify("STOPPING=1\nSTATUS=shutting down: checkpointing sessions")


class NotifyingServer(uvicorn.Server):
    """A uvicorn server that tells `gate` when it has started (lifespan done, sockets listening) and when
    its shutdown begins (before the lifespan shutdown, which runs the checkpoint)."""

    def __init__(self, config: uvicorn.Config, *, gate: ReadyGate | None = None) -> None:
        super().__init__(config)
        self.gate = gate

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=sockets)
        if self.gate is not None and self.started and not self.should_exit:
            self.gate.server_started()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        if self.gate is not None:
            self.gate.server_stopping()
        await super().shutdown(sockets=sockets)


class Stopper:
    """Stops the uvicorn servers on SIGTERM/SIGINT, including one that came before they were added."""

    def __init__(self) -> None:
        self.servers: list[uvicorn.Server] = []
        self.stopped = False

    def add(self, *servers: uvicorn.Server) -> None:
        self.servers += servers
        if self.stopped:
            self.stop()

    def stop(self, _sig: int | None = None, _frame: FrameType | None = None) -> None:
        self.stopped = True
        for server in self.servers:
            server.should_exit = True


@contextlib.contextmanager
def stop_signals() -> Iterator[Stopper]:
    """SIGTERM/SIGINT outside uvicorn's own handling of them.

    While a server runs, uvicorn handles these signals itself; once it has stopped it restores the
    previous handlers and raises the signal again. With the default handler, that would end the process
    right there, before serve() closed the proxy and released the state directory's lock. This handler
    takes that second delivery, so serve() finishes and the process exits 0. A signal that arrives
    before the servers run stops them as soon as they start."""
    stopper = Stopper()
    if threading.current_thread() is not threading.main_thread():  # signal.signal() only works there
        yield stopper
        return
    previous = {sig: signal.signal(sig, stopper.stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield stopper
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
