"""What the coordinator tells the outside: structured log events and Prometheus metrics, in one place.

Each method is one thing that happened; it logs it (spec §45: session ids abbreviated at info level) and
counts it. The counters are the only record: `stats()` (shown by `status`) reads them back, so the status
page and `/metrics` can never disagree.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from kvsidecar.coordinator.costs import CostModel
from kvsidecar.coordinator.gauges import CostCollector, StateCollector, UnsavedCollector
from kvsidecar.coordinator.server import ServerRuntime
from kvsidecar.coordinator.state import Lease, Outcome, SessionRuntime
from kvsidecar.coordinator.telemetry_servers import ResidencyObserver, ServerEvents
from kvsidecar.errors import KvError
from kvsidecar.logs import event
from kvsidecar.metrics import Metrics
from kvsidecar.store.naming import short_id
from kvsidecar.store.snapshots import Candidate, Rejection, SnapshotStore

log = logging.getLogger("kvsidecar.coordinator")
__all__ = ["ResidencyObserver", "Telemetry"]


def _total(metric: Any, **labels: str) -> int:
    """Sum of a counter's `_total` samples whose labels include `labels`."""
    total = 0.0
    for family in metric.collect():
        for sample in family.samples:
            if sample.name.endswith("_total") and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return int(total)


class Telemetry(ServerEvents):
    def __init__(self, metrics: Metrics, costs: CostModel) -> None:
        self.metrics = metrics
        metrics.registry.register(CostCollector(costs))
        self.observers: list[ResidencyObserver] = []  # fleet mode's agent, when enabled

    def _tell(self, call: Callable[[ResidencyObserver], None]) -> None:
        for observer in self.observers:
            try:
                call(observer)
            except Exception:  # an observer's bug must never fail an acquire
                log.exception("kv.telemetry.observer_failed")

    def watch(
        self,
        *,
        servers: dict[str, ServerRuntime],
        leases: Iterable[Lease],
        waiting: Callable[[ServerRuntime], int],
        store: SnapshotStore,
        quota_bytes: Callable[[], int | None],
    ) -> None:
        """Publish the state gauges (backends, breakers, leases, waiters, snapshots), read at scrape."""
        collector = StateCollector(
            servers=servers, leases=leases, waiting=waiting, store=store, quota_bytes=quota_bytes
        )
        self.metrics.registry.register(collector)

    def watch_unsaved(
        self,
        *,
        servers: Iterable[str],
        sessions: Callable[[], Iterable[SessionRuntime]],
        monotonic: Callable[[], float],
    ) -> None:
        """Publish the unsaved-work gauges (issue 26), read at scrape."""
        collector = UnsavedCollector(servers=servers, sessions=sessions, monotonic=monotonic)
        self.metrics.registry.register(collector)

    def stats(self) -> dict[str, int]:
        m = self.metrics
        return {
            "acquires": _total(m.acquire),
            "resident": _total(m.acquire, outcome=Outcome.RESIDENT.value),
            "restores": _total(m.restore),
            "restore_hits": _total(m.restore_hit),
            "restore_failures": _total(m.restore_failure),
            "restore_ineffective": _total(m.restore_verified, result="ineffective"),
            "cold_starts": _total(m.cold, outcome=Outcome.COLD.value),
            "cold_fallbacks": _total(m.cold, outcome=Outcome.COLD_FALLBACK.value),
            "saves": _total(m.save),
            "save_failures": _total(m.save_failure),
            "switches": _total(m.switch),
            "server_restarts": _total(m.server_restarts),
            "leases_expired": _total(m.leases_expired),
            # issue 29: snapshots of another llama.cpp build carried over (converted or copied), or not
            "carried_over": _total(m.carry_over, result="converted") + _total(m.carry_over, result="copied"),
            "carry_over_refused": _total(m.carry_over, result="refused")
            + _total(m.carry_over, result="different")
            + _total(m.carry_over, result="failed"),
            # issue 25: local llama-server processes seen gone, and those a crash signal ended
            "backend_exits": _total(m.backend_exits),
            "shared_prefix_tokens": _total(m.shared_prefix_tokens),
            "prefix_donor_restores": _total(m.prefix_donor, result="restored"),
            "scope_erases": _total(m.scope_actions, action="erase"),
        }

    # acquire and release ------------------------------------------------------------------------------
    def acquired(self, server: str, slot: int, outcome: Outcome, session_id: str | None) -> None:
        self.metrics.acquire.labels(server, outcome.value).inc()
        # debug level: the full id is allowed here
        event(
            log,
            logging.DEBUG,
            "kv.slot.acquire",
            server=server,
            slot=slot,
            outcome=outcome.value,
            session=session_id,
        )

    def switch(self, server: str, slot: int, rt: SessionRuntime, evicted: str | None) -> None:
        self.metrics.switch.labels(server).inc()
        event(
            log,
            logging.INFO,
            "kv.session.switch",
            server=server,
            slot=slot,
            to=rt.identity.short,
            **rt.named,
            evicted=evicted,
        )

    def loaded(self, server: str, slot: int, rt: SessionRuntime, result: Any) -> None:
        name = "kv.session.restore.success" if result.outcome is Outcome.RESTORED else "kv.session.cold"
        event(
            log,
            logging.INFO,
            name,
            server=server,
            slot=slot,
            session=rt.identity.short,
            **rt.named,
            tokens=result.restored_tokens,
            restore_ms=result.restore_ms,
            reason=result.reason,
            evicted=result.evicted,
        )
        self._tell(lambda o: o.slot_loaded(server, slot, rt.key))

    def released(
        self, lease: Lease, status: str, prompt_tokens: int | None, cached_tokens: int | None
    ) -> None:
        event(
            log,
            logging.DEBUG,
            "kv.slot.release",
            server=lease.server,
            slot=lease.slot_id,
            status=status,
            prompt_tokens=prompt_tokens,
            cached_tokens=cached_tokens,
            session=lease.session_id,
        )

    def lease_expired(self, lease: Lease, *, unclaimed: bool = False) -> None:
        """`unclaimed`: ended at its claim TTL, never seen in use (issue 26 C), not at its full TTL."""
        self.metrics.leases_expired.labels(lease.server).inc()
        session = short_id(lease.session_id) if lease.session_id else None
        name = "kv.lease.unclaimed" if unclaimed else "kv.lease.expired"
        event(log, logging.WARNING, name, server=lease.server, slot=lease.slot_id, session=session)

    def acquire_abandoned(
        self, server: str, slot: int | None, session_id: str | None, why: str | None
    ) -> None:
        """An acquire whose caller was gone before its lease was granted: no lease, the slot given back."""
        session = short_id(session_id) if session_id else None
        event(log, logging.INFO, "kv.acquire.abandoned", server=server, slot=slot, session=session, why=why)

    # restore ------------------------------------------------------------------------------------------
    def rejected(self, rt: SessionRuntime, rejection: Rejection) -> None:
        self.metrics.invalidated.labels(rejection.reason).inc()
        event(
            log,
            logging.WARNING,
            "kv.snapshot.rejected",
            session=rt.identity.short,
            generation=rejection.generation,
            reason=rejection.reason,
            detail=rejection.detail,
        )

    def unreadable(self, rt: SessionRuntime, exc: KvError) -> None:
        event(log, logging.WARNING, "kv.snapshot.unreadable", session=rt.identity.short, code=exc.code)

    def restore_miss(self, server: str) -> None:
        self.metrics.restore_miss.labels(server).inc()

    def restore_start(self, server: str, slot: int, rt: SessionRuntime, candidate: Candidate) -> None:
        self.metrics.restore.labels(server).inc()
        event(
            log,
            logging.INFO,
            "kv.session.restore.start",
            session=rt.identity.short,
            **rt.named,
            slot=slot,
            generation=candidate.generation,
            tokens=candidate.record.tokens,
            bytes=candidate.record.bytes,
        )

    def restored(self, server: str, nbytes: int, ms: float) -> None:
        self.metrics.restore_hit.labels(server).inc()
        self.metrics.restore_bytes.labels(server).inc(nbytes)
        self.metrics.restore_seconds.labels(server).observe(ms / 1000)

    def restore_failed(self, server: str, rt: SessionRuntime, exc: KvError) -> None:
        self.metrics.restore_failure.labels(server, exc.code).inc()
        event(
            log,
            logging.WARNING,
            "kv.session.restore.failed",
            session=rt.identity.short,
            **rt.named,
            code=exc.code,
            error=exc.message,
        )

    def restore_voided(self, rt: SessionRuntime) -> None:
        event(log, logging.WARNING, "kv.session.restore.voided", session=rt.identity.short)

    def restore_verified(
        self,
        server: str,
        rt: SessionRuntime,
        result: str,
        restored: int,
        reused: int | None,
        computed: int | None,
    ) -> None:
        self.metrics.restore_verified.labels(server, result).inc()
        if result == "ineffective":
            event(
                log,
                logging.ERROR,
                "kv.session.restore.ineffective",
                session=rt.identity.short,
                **rt.named,
                restored=restored,
                reused=reused,
                computed=computed,
                hint="the engine recomputed the prompt after a restore: SWA/hybrid model without --swa-full?",
            )

    def cold(self, server: str, outcome: Outcome, reason: str | None) -> None:
        """A session's slot erased for a cold prefill (auxiliary requests are not counted here)."""
        self.metrics.cold.labels(server, outcome.value, reason or "no snapshot").inc()

    def shared_prefix(self, server: str, tokens: int) -> None:
        """A cold session's turn reused `tokens` of KV another session left or donated (issue 28)."""
        self.metrics.shared_prefix_tokens.labels(server).inc(tokens)

    def planned(self, server: str, rt: SessionRuntime, plan: Any, memory_class: str) -> None:
        """A start plan (plan.py `StartPlan`): counted by kind, reason and class, and logged."""
        self.metrics.start_plans.labels(server, plan.kind, plan.reason, memory_class).inc()
        event(
            log,
            logging.INFO,
            "kv.session.plan",
            server=server,
            session=rt.identity.short,
            **rt.named,
            kind=plan.kind,
            reason=plan.reason,
            memory_class=memory_class,
            rule=plan.rule,
            expected_reuse=plan.expected_reuse,
            proved=plan.proved,
            divergence=plan.divergence,
            point=plan.point,
            donor=None if plan.donor is None else short_id(plan.donor),
        )

    def prefix_donated(
        self, server: str, rt: SessionRuntime, donor: str, tokens: int | None, why: str
    ) -> None:
        """The `prefix_from` hint of a cold start: used (`restored`, `resident`) or not (why)."""
        self.metrics.prefix_donor.labels(server, why).inc()
        event(
            log,
            logging.INFO,
            "kv.session.prefix_from",
            session=rt.identity.short,
            **rt.named,
            donor=donor,
            result=why,
            tokens=tokens,
        )

    def erase_failed(self, slot: int, exc: KvError) -> None:
        event(log, logging.WARNING, "kv.slot.erase.failed", slot=slot, code=exc.code)

    def isolation(self, server: str, slot: int, action: str, why: str) -> None:
        """What scope.py did to a slot: `erase` (why: its verdict), `park` or `prime`, or one that failed."""
        self.metrics.scope_actions.labels(server, action, why).inc()
        level = (
            logging.WARNING if "failed" in action else logging.INFO if action == "erase" else logging.DEBUG
        )
        event(log, level, "kv.slot.scope", server=server, slot=slot, action=action, why=why)

    # save ---------------------------------------------------------------------------------------------
    def save_start(self, rt: SessionRuntime, trigger: str, slot: int) -> None:
        event(
            log,
            logging.INFO,
            "kv.session.save.start",
            session=rt.identity.short,
            **rt.named,
            trigger=trigger,
            slot=slot,
        )

    def save_useless(self, server: str, rt: SessionRuntime, trigger: str, reason: str) -> None:
        """A save not made because nothing could restore it (`decisions.save_useless`): counted; logged only
        at debug (the server's class and the fix are said once, `kv.backend.memory`)."""
        self.metrics.save_skipped.labels(server, reason).inc()
        event(
            log,
            logging.DEBUG,
            "kv.session.save.skipped",
            session=rt.identity.short,
            trigger=trigger,
            reason=reason,
        )

    def save_not_owner(self, server: str, rt: SessionRuntime, trigger: str, holder: str | None) -> None:
        """Fleet mode: a save not made because another host owns the session now (its copy is newer)."""
        self.metrics.save_skipped.labels(server, "not_owner").inc()
        event(
            log,
            logging.INFO,
            "kv.fleet.save_skipped",
            session=rt.identity.short,
            trigger=trigger,
            reason="another host owns the session",
            holder=holder,
        )

    def save_refused(self, server: str, code: str) -> None:
        """A save that was not attempted (persistence unavailable, the server restarted, ...)."""
        self.metrics.save_failure.labels(server, code).inc()

    def saved(
        self,
        server: str,
        rt: SessionRuntime,
        trigger: str,
        tokens: int,
        nbytes: int,
        ms: float,
        *,
        slot_ms: float,
        server_ms: float | None,
    ) -> None:
        """`ms`: the whole save (the slot's save call, then checksum and manifest); `slot_ms`: the save call
        to llama-server alone, which holds its main loop (`server_ms`: its own figure, when it gives one)."""
        self.metrics.save.labels(server, trigger).inc()
        self.metrics.save_bytes.labels(server).inc(nbytes)
        self.metrics.save_seconds.labels(server).observe(ms / 1000)
        event(
            log,
            logging.INFO,
            "kv.session.save.success",
            session=rt.identity.short,
            **rt.named,
            trigger=trigger,
            tokens=tokens,
            bytes=nbytes,
            save_ms=round(ms, 1),
            slot_ms=round(slot_ms, 1),
            server_ms=None if server_ms is None else round(server_ms, 1),
        )

    def think(self, server: str, seconds: float) -> None:
        self.metrics.think_seconds.labels(server).observe(seconds)

    def save_skipped(
        self, server: str, rt: SessionRuntime, reason: str, recompute_s: float, save_s: float
    ) -> None:
        self.metrics.save_skipped.labels(server, reason).inc()
        event(
            log,
            logging.INFO,
            "kv.session.save.skipped",
            session=rt.identity.short,
            **rt.named,
            reason=reason,
            recompute_ms=round(recompute_s * 1000, 1),
            save_ms=round(save_s * 1000, 1),
        )

    def clean_ahead(self, server: str, rt: SessionRuntime, result: str) -> None:
        self.metrics.clean_ahead.labels(server, result).inc()
        event(log, logging.DEBUG, "kv.session.clean_ahead", session=rt.identity.short, result=result)

    def save_failed(self, server: str, rt: SessionRuntime, trigger: str, exc: KvError) -> None:
        self.metrics.save_failure.labels(server, exc.code).inc()
        event(
            log,
            logging.WARNING,
            "kv.session.save.failed",
            session=rt.identity.short,
            **rt.named,
            trigger=trigger,
            code=exc.code,
            error=exc.message,
        )
