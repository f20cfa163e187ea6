"""`ServerRuntime`: one llama-server as the coordinator sees it: its backend, breaker, slots, fingerprint.

Different servers never share a lock (spec §38). `refresh()` probes the server and rebuilds its runtime
fingerprint; when the server restarted (local process identity changed, or it was unreachable) the
coordinator is told to drop its belief that any session is resident, so the next request restores
instead of trusting an empty slot.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvsidecar.backend.base import BackendCapabilities, KvBackend
from kvsidecar.config import Mode, ServerConfig
from kvsidecar.coordinator.breaker import CircuitBreaker
from kvsidecar.coordinator.state import Slot
from kvsidecar.errors import KvError
from kvsidecar.logs import event
from kvsidecar.store.fingerprint import FileDigestCache, ProcessInfo, RuntimeFingerprint, build_fingerprint

log = logging.getLogger("kvsidecar.server")

ProcessFinder = Callable[[str], ProcessInfo | None]


@dataclass(frozen=True, kw_only=True)
class RefreshResult:
    available: bool
    restarted: bool
    reason: str | None = None


class ServerRuntime:
    def __init__(
        self,
        *,
        name: str,
        config: ServerConfig,
        backend: KvBackend,
        breaker: CircuitBreaker,
        process_finder: ProcessFinder | None,
        digests: FileDigestCache | None,
    ) -> None:
        self.name = name
        self.config = config
        self.backend = backend
        self.breaker = breaker
        self.process_finder = process_finder
        self.digests = digests
        self.caps: BackendCapabilities | None = None
        self.fingerprint: RuntimeFingerprint | None = None
        self.process: ProcessInfo | None = None
        self.available = False
        self.last_error: str | None = None
        # Requests waiting for a slot, in arrival order: (session key or None, holder, future of the slot).
        # Only the coordinator's _dispatch hands slots to them, on the event loop.
        self.waiters: deque[tuple[str | None, Any, asyncio.Future[Slot]]] = deque()
        first = config.slot_id if config.mode is Mode.SINGLE_SLOT else 0
        self.slots: dict[int, Slot] = {first: Slot(id=first)}

    @property
    def slot_n_ctx(self) -> int | None:
        if self.caps is None or self.caps.n_ctx is None:
            return None
        return self.caps.n_ctx

    def _sync_slots(self, total: int) -> None:
        if self.config.mode is Mode.SINGLE_SLOT:
            return
        for i in range(total):
            self.slots.setdefault(i, Slot(id=i))
        for i in [i for i, s in self.slots.items() if i >= total and s.free]:
            del self.slots[i]

    async def refresh(self) -> RefreshResult:
        """Probe the server; say whether it is up and whether it restarted since the last look."""
        was_available, old_process = self.available, self.process
        try:
            caps = await self.backend.probe()
        except KvError as exc:
            self.available = False
            self.last_error = exc.message
            return RefreshResult(available=False, restarted=was_available, reason="unreachable")
        process = (
            await asyncio.to_thread(self.process_finder, self.config.base_url)
            if self.process_finder
            else None
        )
        restarted = not was_available and self.caps is not None
        reason = "was unreachable" if restarted else None
        if old_process is not None and process is not None and old_process.identity != process.identity:
            restarted, reason = True, "process changed"
        if self.caps is not None and caps.model_path != self.caps.model_path:
            restarted, reason = True, "model changed"
        self.caps, self.process, self.available, self.last_error = caps, process, True, None
        if restarted or self.fingerprint is None or (process is not None and old_process is None):
            self.fingerprint = await asyncio.to_thread(
                build_fingerprint,
                caps=caps,
                process=process,
                runtime_key=self.config.runtime_key,
                digests=self.digests,
            )
        self._sync_slots(caps.total_slots)
        if not was_available:
            event(
                log,
                logging.INFO,
                "kv.backend.ready",
                server=self.name,
                slots=caps.total_slots,
                n_ctx=caps.n_ctx,
                fingerprint=self.fingerprint.digest[:12] if self.fingerprint else None,
                local_process=process.pid if process else None,
            )
        return RefreshResult(available=True, restarted=restarted, reason=reason)

    def select_slot(self, key: str | None, is_dirty: Callable[[str], bool]) -> Slot | None:
        """Spec §64: the slot the session owns; else an empty one; else LRU clean; else LRU dirty.

        Only free slots are candidates. A session whose own slot is held waits for it (returns None)
        rather than taking a second slot: one session, one slot.
        """
        slots = list(self.slots.values())
        aux = self.aux_slot_id
        if key is None and aux is not None:
            return self.slots[aux] if self.slots[aux].free else None
        if key is not None:
            for s in slots:
                if s.owner == key or s.claimed_by == key:
                    return s if s.free else None
        free = [s for s in slots if s.free and s.id != aux]
        if not free:
            return None
        free = [s for s in free if s.claimed_by is None]
        empty = [s for s in free if s.owner is None]
        clean = [s for s in free if s.owner is not None and not is_dirty(s.owner)]
        for group in (empty, clean, free):
            if group:
                return min(group, key=lambda s: s.last_used_at)
        return None

    @property
    def aux_slot_id(self) -> int | None:
        """The slot kept for auxiliary requests, when configured and there is more than one."""
        if (
            self.config.mode is not Mode.MANAGED_SLOTS
            or not self.config.reserve_aux_slot
            or len(self.slots) < 2
        ):
            return None
        return max(self.slots)

    def owner_slot(self, key: str) -> Slot | None:
        for s in self.slots.values():
            if s.owner == key:
                return s
        return None
