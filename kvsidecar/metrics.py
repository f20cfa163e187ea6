"""Prometheus metrics (spec §46), one registry per daemon so tests never share counters."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_MS_BUCKETS = (1, 2, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000, 30000, 60000, 120000)


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.acquire = Counter("kv_acquire", "Acquires by outcome", ["server", "outcome"], registry=r)
        self.restore = Counter("kv_restore", "Restore attempts", ["server"], registry=r)
        self.restore_hit = Counter("kv_restore_hit", "Restores that succeeded", ["server"], registry=r)
        self.restore_miss = Counter(
            "kv_restore_miss", "Non-resident acquires with no usable snapshot", ["server"], registry=r
        )
        self.restore_failure = Counter(
            "kv_restore_failure", "Restores that failed", ["server", "code"], registry=r
        )
        self.restore_verified = Counter(
            "kv_restore_verified",
            "Restores checked against the engine's reuse",
            ["server", "result"],
            registry=r,
        )
        self.save = Counter("kv_save", "Saves that succeeded", ["server", "trigger"], registry=r)
        self.save_failure = Counter("kv_save_failure", "Saves that failed", ["server", "code"], registry=r)
        self.restore_bytes = Counter("kv_restore_bytes", "Bytes restored", ["server"], registry=r)
        self.save_bytes = Counter("kv_save_bytes", "Bytes saved", ["server"], registry=r)
        self.restore_ms = Histogram(
            "kv_restore_duration_ms", "Restore wall time", ["server"], buckets=_MS_BUCKETS, registry=r
        )
        self.save_ms = Histogram(
            "kv_save_duration_ms",
            "Save wall time incl. verification",
            ["server"],
            buckets=_MS_BUCKETS,
            registry=r,
        )
        self.cold = Counter(
            "kv_cold_prefill", "Session acquires that start cold", ["server", "outcome", "reason"], registry=r
        )
        self.switch = Counter("kv_slot_switch", "Slot owner changes", ["server"], registry=r)
        self.invalidated = Counter(
            "kv_snapshot_invalidated", "Generations marked unusable", ["reason"], registry=r
        )
        self.circuit_open = Counter("kv_circuit_open", "Times the breaker opened", ["server"], registry=r)
        self.server_restarts = Counter(
            "kv_server_restart", "llama-server restarts detected", ["server"], registry=r
        )
        self.leases_expired = Counter(
            "kv_lease_expired", "Leases that ran past their TTL", ["server"], registry=r
        )
        self._retention(r)
        self._policy(r)
        self._proxy(r)

    def _retention(self, r: CollectorRegistry) -> None:
        self.snapshot_count = Gauge("kv_snapshot_count", "Known snapshot identities", registry=r)
        self.snapshot_bytes = Gauge("kv_snapshot_bytes", "Bytes of known snapshot files", registry=r)
        self.gc_deleted = Counter("kv_gc_deleted", "Files deleted by retention", ["reason"], registry=r)
        self.gc_deleted_bytes = Counter(
            "kv_gc_deleted_bytes", "Bytes deleted by retention", ["reason"], registry=r
        )

    def _policy(self, r: CollectorRegistry) -> None:
        """The cost-aware checkpoint policy and its cost model (issue 15)."""
        self.save_skipped = Counter(
            "kv_save_skipped",
            "Evictions without a save, by reason (recompute_cheaper: the last snapshot is a prefix of the "
            "slot and recomputing the rest is predicted cheaper than writing it)",
            ["server", "reason"],
            registry=r,
        )
        self.clean_ahead = Counter(
            "kv_clean_ahead",
            "Background saves of an idle likely-next victim, by result (saved, busy, not_victim, superseded)",
            ["server", "result"],
            registry=r,
        )
        self.think_seconds = Histogram(
            "kv_think_seconds",
            "Time from a session's release to its next acquire",
            ["server"],
            buckets=(0.1, 0.5, 1, 2, 5, 10, 30, 60, 300, 1800),
            registry=r,
        )

    def _proxy(self, r: CollectorRegistry) -> None:
        self.proxy_request = Counter(
            "kv_proxy_request",
            "Proxied requests: kind managed/passthrough/refused; result ok/error/aborted/unavailable or "
            "the refusal's error code",
            ["kind", "result"],
            registry=r,
        )
        self.proxy_connect = Counter(
            "kv_proxy_upstream_connect", "Connections the proxy opened to llama-server", registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)
