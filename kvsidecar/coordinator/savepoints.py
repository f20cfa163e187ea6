"""Save points at the prompt's end: `SavePoints.take(lease_id)` runs, for a lease whose start plan asked for
one (`StartPlan.take_prompt_point`, plan.py), a prefill-only call of the prompt's tokens but the last on the
lease's slot (`/completion`, `n_predict` 0: the slot then holds exactly those tokens), then saves the slot
into the session's next generation through the Saver (the manifest and the generations stay its), before
the proxy forwards the real request.

That point is what a hybrid (or SWA with --swa-full) session's next turn extends strictly whenever the chat
template renders its history stably up to the end of this prompt, even when it drops the reasoning or
re-renders the last assistant message (the divergence is past the point's end); the end-of-turn save is
extended only when the next prompt re-renders the answer token for token. The real request then extends
the point by one token (no rollback, so llama-server needs no checkpoint). The lease holds the slot
throughout. Nothing here fails the request: a prefill or a save that fails is logged and the request is
forwarded as it came. It writes nothing but through the Saver, the session table (`ran`: the slot moved past
the snapshot) and the pool (`touched`: the slot's size).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from kvsidecar.coordinator.acquire import Acquirer
from kvsidecar.coordinator.save import Saver
from kvsidecar.coordinator.server import ServerRuntime
from kvsidecar.errors import KvError
from kvsidecar.logs import event

log = logging.getLogger("kvsidecar.coordinator")
TRIGGER = "prompt_point"


@dataclass(frozen=True, kw_only=True)
class PointTaken:
    """What taking a prompt point did: the tokens the slot holds after the prefill, what the prefill
    computed, whether the save was committed, and what each step cost (ms)."""

    tokens: int
    computed: int | None
    saved: bool
    prefill_ms: float
    save_ms: float
    error: str | None = None


class SavePoints:
    def __init__(
        self, acquirer: Acquirer, saver: Saver, clock: Callable[[], float] = time.perf_counter
    ) -> None:
        self.servers, self.leases, self.sessions = acquirer.servers, acquirer.leases, acquirer.sessions
        self.pool, self.saver, self.clock = acquirer.pool, saver, clock

    async def take(self, lease_id: str) -> PointTaken | None:
        """The lease's prompt point, when its plan asked for one (None: not asked, or the slot is not the
        session's). Never raises a KvError: a failure is in the answer and the log."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.prompt_point is None or lease.key is None:
            return None
        tokens, lease.prompt_point = lease.prompt_point, None  # once per lease
        srv = self.servers.get(lease.server)
        rt = self.sessions.get(lease.key)
        slot = None if srv is None else srv.slots.get(lease.slot_id)
        if srv is None or rt is None or slot is None or slot.owner != rt.key or slot.holder is not lease:
            return None
        head = list(tokens[:-1])
        started = self.clock()
        computed = None
        try:
            done = await srv.backend.run_prompt(slot.id, head, n_predict=0)
            computed = done.computed
        except KvError as exc:
            return self._told(srv, rt.identity.short, len(head), None, started, None, exc.code)
        prefilled = self.clock()
        if slot.holder is not lease or slot.owner != rt.key:  # the lease ended meanwhile: not ours to save
            return self._told(srv, rt.identity.short, len(head), computed, started, prefilled, "lease_ended")
        self.sessions.ran(rt)  # the slot moved past the session's snapshot: dirty, so the save runs
        self.sessions.track_context(rt, done.computed, done.reused)
        self.pool.touched(slot, len(head))
        try:
            saved = await self.saver.save(srv, slot, rt, trigger=TRIGGER)
        except KvError as exc:  # strict mode raises what a save failed with: the request still runs
            return self._told(srv, rt.identity.short, len(head), computed, started, prefilled, exc.code)
        return self._told(
            srv, rt.identity.short, len(head), computed, started, prefilled, None if saved else "not_saved"
        )

    def _told(
        self,
        srv: ServerRuntime,
        short: str,
        tokens: int,
        computed: int | None,
        started: float,
        prefilled: float | None,
        error: str | None,
    ) -> PointTaken:
        now = self.clock()
        prefill_ms = ((prefilled if prefilled is not None else now) - started) * 1000
        save_ms = (now - prefilled) * 1000 if prefilled is not None else 0.0
        taken = PointTaken(
            tokens=tokens,
            computed=computed,
            saved=error is None,
            prefill_ms=round(prefill_ms, 3),
            save_ms=round(save_ms, 3),
            error=error,
        )
        event(
            log,
            logging.INFO if error is None else logging.WARNING,
            "kv.session.prompt_point" if error is None else "kv.session.prompt_point.failed",
            server=srv.name,
            session=short,
            tokens=tokens,
            computed=computed,
            prefill_ms=taken.prefill_ms,
            save_ms=taken.save_ms,
            error=error,
        )
        return taken
