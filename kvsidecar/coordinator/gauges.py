"""Gauges computed when `/metrics` is scraped, from the state the coordinator already holds.

Nothing here is set by a job or kept in step by hand: each collector reads the live tables (the store's
in-memory manifest table, the lease table, each server's breaker, probe result and waiting queue, the cost
model) at scrape time, on the event loop that owns them. docs/METRICS.md describes every family.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable, Iterator

from prometheus_client.metrics_core import GaugeMetricFamily, InfoMetricFamily, Metric
from prometheus_client.registry import Collector

from kvsidecar.coordinator.breaker import BreakerState
from kvsidecar.coordinator.costs import CostModel
from kvsidecar.coordinator.server import ServerRuntime
from kvsidecar.coordinator.state import Lease, SessionRuntime
from kvsidecar.fingerprint.savepath import llama_save_dir
from kvsidecar.metrics import PREFIX
from kvsidecar.store.snapshots import SnapshotStore

# The cost model's figures (CostModel.view()) and the gauge each one is published as.
COST_GAUGES: dict[str, tuple[str, str]] = {
    "save_bytes_per_s": ("cost_save_bytes_per_second", "Learned save throughput"),
    "restore_bytes_per_s": ("cost_restore_bytes_per_second", "Learned restore throughput"),
    "prefill_tokens_per_s": ("cost_prefill_tokens_per_second", "Learned prefill speed"),
    "kv_bytes_per_token": ("cost_kv_bytes_per_token", "Learned size of one token's KV in a snapshot"),
    "think_median_s": (
        "cost_think_median_seconds",
        "Median think time (a release to that session's next acquire) over the server's recent sessions",
    ),
}
_BUILD_LABEL_MAX = 120  # llama-server's build string is the server's to choose: keep the label bounded


class CostCollector(Collector):
    """`kvsidecar_cost_*{server}`: the learned cost model, read when /metrics is scraped (every figure as
    learned now; a figure not learned yet has no sample)."""

    def __init__(self, costs: CostModel) -> None:
        self.costs = costs

    def collect(self) -> Iterator[Metric]:
        families = {
            figure: GaugeMetricFamily(
                PREFIX + name, f"{help_} (the cost-aware checkpoint policy's model)", labels=["server"]
            )
            for figure, (name, help_) in COST_GAUGES.items()
        }
        for server, figures in self.costs.view().items():
            for figure, value in figures.items():
                if value is not None and figure in families:
                    families[figure].add_metric([server], value)
        yield from families.values()


class UnsavedCollector(Collector):
    """`kvsidecar_unsaved_*{server}` (issue 26): what a llama-server crash would cost the sessions resident
    now, across sessions (no session id as a label): how many have unsaved turns, the oldest unsaved age,
    the most unsaved tokens of one session and their sum. Every configured server has a sample (0)."""

    def __init__(
        self,
        *,
        servers: Iterable[str],
        sessions: Callable[[], Iterable[SessionRuntime]],
        monotonic: Callable[[], float],
    ) -> None:
        self.servers = servers  # the coordinator's own map: a router's model discovered later is in it
        self.sessions = sessions
        self.monotonic = monotonic

    def collect(self) -> Iterator[Metric]:
        def family(name: str, help_: str) -> GaugeMetricFamily:
            return GaugeMetricFamily(PREFIX + name, help_, labels=["server"])

        count = family("unsaved_sessions", "Resident sessions with turns no saved generation holds")
        age = family(
            "unsaved_max_age_seconds", "The oldest unsaved work: seconds since a session's first unsaved turn"
        )
        most = family("unsaved_max_tokens", "The most tokens a crash would cost one session now")
        total = family("unsaved_tokens", "Tokens a crash would cost all resident sessions now")
        now = self.monotonic()
        rows: dict[str, list[float]] = {name: [0, 0.0, 0, 0] for name in self.servers}
        for rt in self.sessions():
            if not rt.dirty:
                continue
            row = rows.setdefault(rt.identity.server, [0, 0.0, 0, 0])
            tokens = rt.unsaved_tokens or 0
            row[0] += 1
            row[1] = max(row[1], rt.unsaved_age_s(now) or 0.0)
            row[2] = max(row[2], tokens)
            row[3] += tokens
        for server in sorted(rows):
            for fam, v in zip((count, age, most, total), rows[server], strict=True):
                fam.add_metric([server], v)
        return iter((count, age, most, total))


class StateCollector(Collector):
    """Per-server state gauges and the snapshot store's size, computed at scrape time."""

    def __init__(
        self,
        *,
        servers: dict[str, ServerRuntime],
        leases: Iterable[Lease],
        waiting: Callable[[ServerRuntime], int],
        store: SnapshotStore,
        quota_bytes: Callable[[], int | None],
    ) -> None:
        self.servers = servers
        self.leases = leases
        self.waiting = waiting  # acquires queued for a slot of a server (pool.py)
        self.store = store
        self.quota_bytes = quota_bytes

    def collect(self) -> Iterator[Metric]:
        yield from self._servers()
        yield from self._snapshots()

    def _servers(self) -> Iterator[Metric]:
        up = GaugeMetricFamily(
            PREFIX + "backend_up", "1 if the server answered its last probe, else 0", labels=["server"]
        )
        info = InfoMetricFamily(
            PREFIX + "backend", "The server's kind and build, as its last probe reported", labels=["server"]
        )
        breaker = GaugeMetricFamily(
            PREFIX + "breaker_state",
            "The persistence circuit breaker's state: 1 on the current state, 0 on the others",
            labels=["server", "state"],
        )
        leases = GaugeMetricFamily(
            PREFIX + "leases_open", "Leases granted and not released", labels=["server"]
        )
        waiting = GaugeMetricFamily(
            PREFIX + "acquires_waiting", "Acquires queued for a slot of the server", labels=["server"]
        )
        moved = GaugeMetricFamily(
            PREFIX + "snapshot_dir_moved",
            "1 while the server's snapshot_dir (or llama-server's --slot-save-path) no longer leads to the "
            "directory kvsidecar opened at start (SNAPSHOT_DIR_MOVED: nothing saved or restored), else 0",
            labels=["server"],
        )
        per_server = Counter(lease.server for lease in self.leases)
        for name, srv in self.servers.items():
            fault = self.store.snapshot_dir_fault(name, llama_save_dir(srv.process))
            moved.add_metric([name], 0.0 if fault is None else 1.0)
            up.add_metric([name], 1.0 if srv.available else 0.0)
            if srv.caps is not None:
                build = (srv.caps.build_info or "unknown")[:_BUILD_LABEL_MAX]
                info.add_metric([name], {"kind": srv.caps.kind, "build": build})
            current = srv.breaker.state
            for state in BreakerState:
                breaker.add_metric([name, state.value], 1.0 if state is current else 0.0)
            leases.add_metric([name], per_server.get(name, 0))
            waiting.add_metric([name], self.waiting(srv))
        return iter((up, info, breaker, leases, waiting, moved))

    def _snapshots(self) -> Iterator[Metric]:
        count = GaugeMetricFamily(
            PREFIX + "snapshots", "Snapshot identities known to the store", labels=["server"]
        )
        size = GaugeMetricFamily(
            PREFIX + "snapshot_bytes", "Bytes of the snapshot files the store knows", labels=["server"]
        )
        quota = GaugeMetricFamily(
            PREFIX + "snapshot_quota_bytes",
            "retention.max_total_bytes, the limit retention keeps all snapshots under (no sample if unset)",
        )
        counts: dict[str, int] = dict.fromkeys(self.servers, 0)
        sizes: dict[str, int] = dict.fromkeys(self.servers, 0)
        for m in self.store.all():
            counts[m.server] = counts.get(m.server, 0) + 1
            sizes[m.server] = sizes.get(m.server, 0) + m.total_bytes
        for server in sorted(counts):
            count.add_metric([server], counts[server])
            size.add_metric([server], sizes[server])
        limit = self.quota_bytes()
        if limit is not None:
            quota.add_metric([], limit)
        return iter((count, size, quota))
