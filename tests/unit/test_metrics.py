"""`/metrics` follows Prometheus' naming conventions, and its gauges are current at scrape time.

The exposition is read back with prometheus-client's own parser: every family documented and typed,
counters in `_total`, no `_created` twins, base units (`_seconds`, `_bytes`) and only as the name's last
word; the state gauges (snapshots, leases, waiters, breakers, backends) follow a change with no job run.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from kvsidecar import __version__
from kvsidecar.api.routes import create_app
from kvsidecar.coordinator.costs import ServerCosts
from kvsidecar.coordinator.gauges import COST_GAUGES
from kvsidecar.metrics import DURATION_BUCKETS
from kvsidecar.testing.poll import until
from tests.unit.coordinator_helpers import Harness, start_harness

TOKEN = "m" * 32
QUOTA = 5 * 2**30
# Words that name a unit. Base units may end a name; the others may not appear at all.
BASE_UNITS = {"seconds", "bytes"}
OTHER_UNITS = {
    "ms",
    "msec",
    "millis",
    "milliseconds",
    "us",
    "microseconds",
    "ns",
    "nanoseconds",
    "sec",
    "secs",
    "minutes",
    "hours",
    "days",
    "kb",
    "kib",
    "mb",
    "mib",
    "gb",
    "gib",
    "percent",
}
# A name's unit tail: a base unit, optionally per something (`_bytes_per_second`, `_bytes_per_token`).
UNIT_TAIL = re.compile(r"_(?:seconds|bytes|tokens)(?:_per_[a-z]+)?$")
TYPE_SUFFIXES = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "summary": ("_sum", "_count"),
    "gauge": ("",),
}


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    harness = await start_harness(tmp_path, retention={"max_total_bytes": QUOTA})
    yield harness
    await harness.coordinator.aclose()


async def scrape_text(h: Harness) -> str:
    app = create_app(h.coordinator, token=TOKEN)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://127.0.0.1:8377",
        headers={"Authorization": f"Bearer {TOKEN}"},
    ) as c:
        r = await c.get("/metrics")
    assert r.status_code == 200
    return r.text


async def scrape(h: Harness) -> dict[str, Metric]:
    return {f.name: f for f in text_string_to_metric_families(await scrape_text(h))}


def value(families: dict[str, Metric], name: str, **labels: str) -> float | None:
    for family in families.values():
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return float(s.value)
    return None


def naming_problems(families: dict[str, Metric], text: str) -> list[str]:
    """Every way the exposition breaks Prometheus' naming conventions (empty: none)."""
    problems: list[str] = []
    helped = set(re.findall(r"^# HELP (\S+) \S", text, re.M))
    typed = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
    for family in families.values():
        problems += _family_problems(family, helped, typed)
    return problems


def _family_problems(family: Metric, helped: set[str], typed: dict[str, str]) -> list[str]:
    name, kind = family.name, family.type
    out: list[str] = []
    exposed = name + "_total" if kind == "counter" else name
    if exposed not in helped or not family.documentation:
        out.append(f"{exposed}: no HELP")
    if typed.get(exposed) != kind or kind not in TYPE_SUFFIXES:
        out.append(f"{exposed}: TYPE {typed.get(exposed)!r}, parsed as {kind!r}")
    if not name.startswith("kvsidecar_"):
        out.append(f"{name}: not under the project's prefix kvsidecar_")
    for s in family.samples:
        if s.name.endswith("_created"):
            out.append(f"{s.name}: a _created series")
        elif not any(s.name == name + suffix for suffix in TYPE_SUFFIXES.get(kind, ())):
            out.append(f"{s.name}: not a {kind} sample of {name}")
    if kind in ("histogram", "summary") and not name.endswith(("_seconds", "_bytes")):
        out.append(f"{name}: a {kind} not in base units (_seconds or _bytes)")
    words = name.split("_")
    for word in OTHER_UNITS & set(words):
        out.append(f"{name}: non-base unit {word!r}")
    tail = UNIT_TAIL.search(name)
    head = name[: tail.start()] if tail else name
    for word in BASE_UNITS & set(head.split("_")):
        out.append(f"{name}: unit {word!r} is not the name's last word")
    if kind == "gauge" and name.endswith("_count"):
        out.append(f"{name}: a gauge named like a histogram's _count")
    return out


async def busy(h: Harness) -> None:
    """Enough traffic that every kind of series has samples: cold starts, a save, a restore."""
    for session in ("A", "B", "A"):
        await h.turn(session)


async def test_metrics_follow_prometheus_naming(h: Harness) -> None:
    await busy(h)
    text = await scrape_text(h)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert naming_problems(families, text) == []
    assert "_created" not in text and "_ms" not in text
    assert families["kvsidecar_restore_duration_seconds"].type == "histogram"
    assert families["kvsidecar_acquire"].type == "counter"
    build = value(families, "kvsidecar_build_info", version=__version__)
    assert build == 1.0


def test_the_checker_catches_what_the_old_names_did() -> None:
    """The rules themselves: a ms histogram, a _created twin, a unit mid-name and a bare counter fail."""
    text = (
        "# HELP kv_restore_duration_ms t\n# TYPE kv_restore_duration_ms histogram\n"
        'kv_restore_duration_ms_bucket{le="+Inf"} 1.0\nkv_restore_duration_ms_count 1.0\n'
        "kv_restore_duration_ms_sum 3.0\nkv_restore_duration_ms_created 1.7e9\n"
        "# HELP kvsidecar_bytes_saved_total b\n# TYPE kvsidecar_bytes_saved_total counter\n"
        "kvsidecar_bytes_saved_total 1.0\n"
        "# HELP kvsidecar_snapshot_count c\n# TYPE kvsidecar_snapshot_count gauge\nkvsidecar_snapshot_count 2\n"
    )
    families = {f.name: f for f in text_string_to_metric_families(text)}
    problems = "\n".join(naming_problems(families, text))
    for expected in (
        "not under the project's prefix",
        "_created series",
        "not in base units",
        "non-base unit 'ms'",
        "unit 'bytes' is not the name's last word",
        "named like a histogram's _count",
    ):
        assert expected in problems, expected


def test_duration_buckets_span_a_millisecond_to_two_minutes() -> None:
    assert DURATION_BUCKETS[0] == 0.001 and DURATION_BUCKETS[-1] == 120
    assert list(DURATION_BUCKETS) == sorted(set(DURATION_BUCKETS))


def test_every_cost_figure_is_published() -> None:
    assert set(ServerCosts().view()) == set(COST_GAUGES)


async def test_snapshot_gauges_follow_a_save_with_no_job_run(h: Harness) -> None:
    assert not hasattr(h.coordinator, "scheduler")  # no retention job here (the daemon owns the scheduler)
    before = await scrape(h)
    assert value(before, "kvsidecar_snapshots", server="local") == 0
    assert value(before, "kvsidecar_snapshot_quota_bytes") == QUOTA
    await h.turn("A")
    await h.turn("B")  # evicts A: A is saved
    after = await scrape(h)
    stored = h.coordinator.store.all()
    assert value(after, "kvsidecar_snapshots", server="local") == len(stored) == 1
    assert value(after, "kvsidecar_snapshot_bytes", server="local") == stored[0].total_bytes > 0
    await h.coordinator.purge("A")
    assert value(await scrape(h), "kvsidecar_snapshots", server="local") == 0


async def test_lease_and_waiter_gauges_follow_the_queue(h: Harness) -> None:
    srv = h.coordinator.servers["local"]
    first = await h.coordinator.acquire("A", provider="local", model="m")
    assert first.lease_id is not None
    second = asyncio.ensure_future(h.coordinator.acquire("B", provider="local", model="m"))
    # the second acquire queues behind the first (one slot)
    await until(lambda: h.coordinator.pool.queued(srv), interval_s=0, what="B's acquire to queue")
    now = await scrape(h)
    assert value(now, "kvsidecar_leases_open", server="local") == 1
    assert value(now, "kvsidecar_acquires_waiting", server="local") == 1
    await h.coordinator.release(first.lease_id, status="ok")
    result = await second
    now = await scrape(h)
    assert value(now, "kvsidecar_acquires_waiting", server="local") == 0
    assert value(now, "kvsidecar_leases_open", server="local") == 1
    assert result.lease_id is not None
    await h.coordinator.release(result.lease_id, status="ok")
    assert value(await scrape(h), "kvsidecar_leases_open", server="local") == 0


async def test_breaker_and_backend_gauges_follow_the_server(h: Harness) -> None:
    srv = h.coordinator.servers["local"]
    now = await scrape(h)
    assert value(now, "kvsidecar_backend_up", server="local") == 1
    assert value(now, "kvsidecar_backend_info", server="local", build="fake-1") == 1
    assert value(now, "kvsidecar_breaker_state", server="local", state="healthy") == 1
    for _ in range(srv.breaker.max_consecutive_failures):
        srv.breaker.failure("KV_BACKEND_UNAVAILABLE")
    now = await scrape(h)
    assert value(now, "kvsidecar_breaker_state", server="local", state="open") == 1
    assert value(now, "kvsidecar_breaker_state", server="local", state="healthy") == 0
    h.fake.set_unavailable(True)
    await h.coordinator.guard.refresh(srv)  # one probe, as the probe loop makes
    assert value(await scrape(h), "kvsidecar_backend_up", server="local") == 0
