"""Prometheus metrics (spec §46), one registry per daemon so tests never share counters.

Naming follows Prometheus' conventions (docs/METRICS.md lists every series): one prefix, `kvsidecar_`;
base units only (`_seconds`, `_bytes`), as the last word of the name; counters end in `_total` (added by
prometheus-client), info metrics in `_info`. Gauges of state (snapshots, leases, breakers, backends, the
cost model) are not held here: collectors registered by the coordinator compute them at scrape time
(kvsidecar/coordinator/gauges.py), so `/metrics` never lags `/v1/status`.

No `_created` series: prometheus-client has no per-registry switch for them (only the process-global
`disable_created_metrics()`), so `render()` drops them from this registry's exposition instead, leaving
any other registry in the process as it is.
"""

from __future__ import annotations

import platform
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram, Info, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from kvsidecar import __version__

PREFIX = "kvsidecar_"

# Durations of restores and saves, in seconds: 1 ms .. 120 s.
DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
# A session's think time, in seconds: 100 ms .. 30 min.
THINK_BUCKETS = (0.1, 0.5, 1, 2, 5, 10, 30, 60, 300, 1800)


class _WithoutCreated(Collector):
    """The registry as exposed: every family, minus its `_created` samples."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterable[Metric]:
        for family in self.registry.collect():
            out = Metric(family.name, family.documentation, family.type, family.unit)
            out.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield out


class Metrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self._exposed = _WithoutCreated(r)
        self.build = Info(PREFIX + "build", "The running kvsidecar: its version and Python's", registry=r)
        self.build.info(
            {
                "version": __version__,
                "python": platform.python_version(),
                "implementation": platform.python_implementation(),
            }
        )
        self._sessions(r)
        self._transfers(r)
        self._events(r)
        self._retention(r)
        self._policy(r)
        self._proxy(r)

    def _sessions(self, r: CollectorRegistry) -> None:
        self.acquire = Counter(PREFIX + "acquire", "Acquires by outcome", ["server", "outcome"], registry=r)
        self.restore = Counter(PREFIX + "restore", "Restore attempts", ["server"], registry=r)
        self.restore_hit = Counter(PREFIX + "restore_hit", "Restores that succeeded", ["server"], registry=r)
        self.restore_miss = Counter(
            PREFIX + "restore_miss", "Non-resident acquires with no usable snapshot", ["server"], registry=r
        )
        self.restore_failure = Counter(
            PREFIX + "restore_failure", "Restores that failed, by error code", ["server", "code"], registry=r
        )
        self.restore_verified = Counter(
            PREFIX + "restore_verified",
            "Restores checked against the engine's reuse (effective or ineffective)",
            ["server", "result"],
            registry=r,
        )
        self.save = Counter(PREFIX + "save", "Saves that succeeded", ["server", "trigger"], registry=r)
        self.save_failure = Counter(
            PREFIX + "save_failure",
            "Saves that failed or were refused, by error code",
            ["server", "code"],
            registry=r,
        )
        self.cold = Counter(
            PREFIX + "cold_prefill",
            "Session acquires that start cold (outcome cold or cold_fallback), by reason",
            ["server", "outcome", "reason"],
            registry=r,
        )
        self.switch = Counter(PREFIX + "slot_switch", "Slot owner changes", ["server"], registry=r)

    def _transfers(self, r: CollectorRegistry) -> None:
        self.restore_bytes = Counter(PREFIX + "restore_bytes", "Bytes restored", ["server"], registry=r)
        self.save_bytes = Counter(PREFIX + "save_bytes", "Bytes saved", ["server"], registry=r)
        self.restore_seconds = Histogram(
            PREFIX + "restore_duration_seconds",
            "Wall time of a successful restore",
            ["server"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.save_seconds = Histogram(
            PREFIX + "save_duration_seconds",
            "Wall time of a successful save, verification included",
            ["server"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )

    def _events(self, r: CollectorRegistry) -> None:
        self.invalidated = Counter(
            PREFIX + "snapshot_invalidated", "Generations marked unusable, by reason", ["reason"], registry=r
        )
        self.circuit_open = Counter(
            PREFIX + "circuit_open", "Times the breaker opened", ["server"], registry=r
        )
        self.server_restarts = Counter(
            PREFIX + "server_restart", "llama-server restarts detected", ["server"], registry=r
        )
        self.carry_over = Counter(
            PREFIX + "carry_over",
            "Snapshots saved under another llama.cpp build, by what happened: converted (state format step), "
            "copied (same format), refused (more than the build differs), different (the new build computes "
            "other KV), failed",
            ["server", "result"],
            registry=r,
        )
        self.backend_exits = Counter(
            PREFIX + "backend_exits",
            "Local llama-server processes seen gone, by the signal that ended them (unknown: not recorded)",
            ["server", "signal"],
            registry=r,
        )
        self.leases_expired = Counter(
            PREFIX + "lease_expired", "Leases that ran past their TTL", ["server"], registry=r
        )

    def _retention(self, r: CollectorRegistry) -> None:
        self.gc_deleted = Counter(PREFIX + "gc_deleted", "Files deleted by retention", ["reason"], registry=r)
        self.gc_deleted_bytes = Counter(
            PREFIX + "gc_deleted_bytes", "Bytes deleted by retention", ["reason"], registry=r
        )

    def _policy(self, r: CollectorRegistry) -> None:
        """The cost-aware checkpoint policy and its cost model (issue 15)."""
        self.save_skipped = Counter(
            PREFIX + "save_skipped",
            "Evictions without a save, by reason (recompute_cheaper: the last snapshot is a prefix of the "
            "slot and recomputing the rest is predicted cheaper than writing it; not_owner: fleet mode, "
            "another host owns the session now; swa_window_not_saved: a sliding-window model without "
            "--swa-full, whose saves no restore could use: any save, unsaved turns written off)",
            ["server", "reason"],
            registry=r,
        )
        self.clean_ahead = Counter(
            PREFIX + "clean_ahead",
            "Background saves of an idle likely-next victim, by result (saved, busy, not_victim, "
            "no_switch, superseded, too_long)",
            ["server", "result"],
            registry=r,
        )
        self.think_seconds = Histogram(
            PREFIX + "think_seconds",
            "Time from a session's release to its next acquire",
            ["server"],
            buckets=THINK_BUCKETS,
            registry=r,
        )

    def _proxy(self, r: CollectorRegistry) -> None:
        # a router's models (docs/SWAPS.md): cause kvsidecar (saved first), router (LRU, operator), crash
        self.router_unloads = Counter(
            PREFIX + "router_unloads",
            "Models of a router seen unloaded, by cause",
            ["server", "cause"],
            registry=r,
        )
        self.proxy_request = Counter(
            PREFIX + "proxy_request",
            "Proxied requests: kind managed/auxiliary/passthrough/refused; result ok/error/aborted/"
            "unavailable or the refusal's error code",
            ["kind", "result"],
            registry=r,
        )
        self.proxy_connect = Counter(
            PREFIX + "proxy_upstream_connect", "Connections the proxy opened to llama-server", registry=r
        )
        # issue 28 (docs/CLIENTS.md)
        self.proxy_session_signal = Counter(
            PREFIX + "proxy_session_signal",
            "Proxied requests by what named their session (a fixed signal name; none: auxiliary)",
            ["signal", "kind"],
            registry=r,
        )
        self.prompt_diverged = Counter(
            PREFIX + "proxy_prompt_diverged",
            "Managed turns whose prompt did not extend their session's last one (when: request, before "
            "the answer, from the messages; reuse, from llama-server's cache_n)",
            ["signal", "when"],
            registry=r,
        )
        self.shared_prefix_tokens = Counter(
            PREFIX + "shared_prefix_tokens",
            "Prompt tokens cold sessions reused from KV another session left in the slot or donated",
            ["server"],
            registry=r,
        )
        self.prefix_donor = Counter(
            PREFIX + "prefix_donor",
            "prefix_from hints of cold starts, by result (restored, resident, none, refused, failed, off)",
            ["server", "result"],
            registry=r,
        )
        self.start_plans = Counter(
            PREFIX + "start_plans",
            "What sessions started from (coordinator/plan.py): the plan's kind (restore, carry_over, donor, "
            "keep, erase), its stable reason and the model's memory class",
            ["server", "kind", "reason", "memory_class"],
            registry=r,
        )
        self.scope_actions = Counter(
            PREFIX + "scope_actions",
            "What kvsidecar did to a slot so that no credential scope runs on another's KV (erase, by why: "
            "other_scope, unknown_scope, ram_cache), or to keep llama-server's RAM cache in use within one "
            "(park, prime); a failed one: erase_failed, park_failed",
            ["server", "action", "why"],
            registry=r,
        )

    def render(self) -> bytes:
        return generate_latest(self._exposed)
