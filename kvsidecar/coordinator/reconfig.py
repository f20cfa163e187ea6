"""SIGHUP's live reconfiguration: what is safe to change while running is applied to the parts that read it;
the restart-only keys that changed are kept as they were and named."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Protocol

from kvsidecar.config import RESTART_ONLY, Config
from kvsidecar.coordinator.server import ServerRuntime


class Reconfigurable(Protocol):
    def reconfigure(self, config: Config) -> None: ...


def applied(
    current: Config, new: Config, parts: Iterable[Reconfigurable], servers: Mapping[str, ServerRuntime]
) -> tuple[Config, list[str]]:
    """The configuration now in force (`new`, but the restart-only keys of `current`) and those of them that
    `new` changes; each part and each server's breaker is given it."""
    needs_restart = [k for k in RESTART_ONLY if getattr(new, k) != getattr(current, k)]
    live = new.model_copy(update={k: getattr(current, k) for k in needs_restart})
    for part in parts:
        part.reconfigure(live)
    for srv in servers.values():
        srv.breaker.configure(
            max_consecutive_failures=live.failure.max_consecutive_failures,
            cooldown_s=live.failure.cooldown_s,
        )
    return live, needs_restart
