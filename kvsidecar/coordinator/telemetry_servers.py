"""The coordinator's log events and metrics about a llama-server's life (restarts, exits, carry-over, the
canary, the circuit breaker): `Telemetry`'s base, so each is still a method of the one telemetry object; and
`ResidencyObserver`, who is told when a slot's content changes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

from kvsidecar.coordinator.state import SessionRuntime
from kvsidecar.errors import KvError
from kvsidecar.fingerprint.llama_exit import ExitEvidence, crash_hint
from kvsidecar.logs import event
from kvsidecar.metrics import Metrics

log = logging.getLogger("kvsidecar.coordinator")


class ResidencyObserver(Protocol):
    """Told when a slot's content changes (fleet mode publishes residency from it). Called on the event
    loop in the middle of an acquire: it must return at once and never raise (it queues its own I/O)."""

    def slot_loaded(self, server: str, slot: int, key: str) -> None:
        """Slot `slot` of `server` now holds session key `key` (restored or cold; its previous owner left)."""

    def server_emptied(self, server: str) -> None:
        """Every slot of `server` lost its content (llama-server restarted)."""


class ServerEvents:
    metrics: Metrics

    def _tell(self, call: Callable[[ResidencyObserver], None]) -> None:
        raise NotImplementedError

    # servers ------------------------------------------------------------------------------------------
    def server_restarted(self, server: str, reason: str) -> None:
        self.metrics.server_restarts.labels(server).inc()
        event(log, logging.WARNING, "kv.backend.restarted", server=server, reason=reason)
        self._tell(lambda o: o.server_emptied(server))

    def server_exited(self, server: str, evidence: ExitEvidence, crash_loop: str | None) -> None:
        """A local llama-server process went away (coordinator/exits.py): how, and whether it keeps dying."""
        self.metrics.backend_exits.labels(server, evidence.signal or "unknown").inc()
        event(
            log,
            logging.WARNING,
            "kv.backend.exited",
            server=server,
            pid=evidence.pid,
            signal=evidence.signal,
            status=evidence.status,
            source=evidence.source,
            detail=evidence.describe(),
        )
        if crash_loop is not None:
            event(
                log,
                logging.ERROR,
                "kv.backend.crash_loop",
                server=server,
                signal=crash_loop,
                hint=crash_hint(crash_loop),
            )

    def carry_over(self, server: str, rt: SessionRuntime, result: str, detail: str) -> None:
        """A snapshot saved under another llama.cpp build: carried over (converted, copied), or why not."""
        self.metrics.carry_over.labels(server, result).inc()
        level = logging.INFO if result in ("converted", "copied") else logging.WARNING
        event(
            log,
            level,
            "kv.snapshot.carry_over",
            server=server,
            session=rt.identity.short,
            result=result,
            detail=detail,
        )

    def server_unavailable(self, server: str, error: str | None) -> None:
        event(log, logging.WARNING, "kv.backend.unavailable", server=server, error=error)

    def canary(self, server: str, digest: str) -> None:
        event(log, logging.INFO, "kv.backend.canary", server=server, digest=digest[:12])

    def canary_failed(self, server: str, exc: KvError) -> None:
        event(
            log, logging.WARNING, "kv.backend.canary.failed", server=server, code=exc.code, error=exc.message
        )

    def circuit_open(self, server: str, code: str, cooldown_s: float) -> None:
        self.metrics.circuit_open.labels(server).inc()
        event(
            log, logging.ERROR, "kv.persistence.circuit_open", server=server, code=code, cooldown_s=cooldown_s
        )

    def circuit_recovered(self, server: str) -> None:
        event(log, logging.INFO, "kv.persistence.circuit_recovered", server=server)
