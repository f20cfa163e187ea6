"""The Grafana dashboard uses only metrics that exist: every name in every panel expression (and template
query) of docs/grafana/kvsidecar-dashboard.json is exposed by a real daemon on a real llama-server."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from kvsidecar.testing.daemon import DaemonProcess
from kvsidecar.testing.llama import complete, words
from tests.conftest import StartServer

DASHBOARD = Path(__file__).resolve().parents[2] / "docs" / "grafana" / "kvsidecar-dashboard.json"
TOKEN = "dashboard-token-0123456789abcdef"
QUOTA = 2 * 2**30

# PromQL, reduced to its metric names: strings, label matchers, ranges, grouping clauses, Grafana
# variables and number/duration literals go first; then a name followed by "(" is a function.
_NAME_MATCHER = re.compile(r"""__name__\s*=\s*(?:"((?:\\.|[^"\\])*)"|'((?:\\.|[^'\\])*)')""")
_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_MATCHERS = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_CLAUSE = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)", re.I)
_VARIABLE = re.compile(r"\$\{[^}]*\}|\$\w+|\[\[\w+\]\]")
_NUMBER = re.compile(
    r"(?<![\w:.])(?:0x[0-9a-f]+|(?:\d+(?:ms|[smhdwy]))+|(?:\d+\.?\d*|\.\d+)(?:e[+-]?\d+)?)(?![\w:])",
    re.I,
)
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_KEYWORDS = {
    "by",
    "without",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "bool",
    "and",
    "or",
    "unless",
    "offset",
    "inf",
    "nan",
}
_LABEL_VALUES = re.compile(r"label_values\(\s*([^,]*?)\s*,")


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects."""
    names = {a or b for a, b in _NAME_MATCHER.findall(expr)}
    text = _STRING.sub(" ", _VARIABLE.sub(" ", expr))
    text = _MATCHERS.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _CLAUSE.sub(" ", text)
    text = _NUMBER.sub(" ", text)
    for m in _IDENT.finditer(text):
        name = m.group()
        if name.lower() in _KEYWORDS or re.match(r"\s*\(", text[m.end() :]):
            continue
        names.add(name)
    return names


def test_metric_names_of_promql() -> None:
    """The extractor on the shapes the dashboard uses (and a few it may grow into)."""
    cases = {
        'histogram_quantile(0.99, sum by (le) (rate(a_seconds_bucket{server=~"$server", x="by (y)"}'
        "[$__rate_interval])))": {"a_seconds_bucket"},
        "sum(rate(a_total[5m])) by (code) / clamp_min(sum(rate(b_total[1h30m] offset 1d)), 1e-9)": {
            "a_total",
            "b_total",
        },
        "max by (server, state) (c_state) == bool 1 or on(server) vector(0) unless d": {"c_state", "d"},
        '{__name__="e_info", job="x"} * on (instance) group_left (version) f2_info': {"e_info", "f2_info"},
        "rate(g_total[${__range}:30s]) - 0x1F + .5 + 2e3 > Inf": {"g_total"},
        "label_replace(h, 'dst', '$1', 'src', '(.*)')": {"h"},
    }
    for expr, expected in cases.items():
        assert metric_names(expr) == expected, expr


def dashboard_exprs(dashboard: dict[str, Any]) -> Iterator[tuple[str, str]]:
    """(where, PromQL) for every panel target, nested rows included, and every template query."""

    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for p in items:
            yield p
            yield from panels(p.get("panels", []))

    for p in panels(dashboard["panels"]):
        for t in p.get("targets", []):
            yield f"panel {p['title']!r} {t.get('refId')}", t["expr"]
    for var in dashboard["templating"]["list"]:
        if var["type"] != "query":
            continue
        query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
        selector = _LABEL_VALUES.search(query)
        yield f"variable {var['name']}", selector.group(1) if selector else query


def exposed_names(text: str) -> tuple[set[str], set[str]]:
    """(every series name /metrics declares, with its type's suffixes; the names that have samples)."""
    declared: set[str] = set()
    suffixes = {"histogram": ("_bucket", "_sum", "_count"), "summary": ("_sum", "_count", "")}
    for name, kind in re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M):
        declared |= {name + s for s in suffixes.get(kind, ("",))}
    sampled = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    return declared, sampled


async def turn(c: httpx.AsyncClient, llama: str, session: str, n: int) -> str:
    r = await c.post(f"/v1/sessions/{session}/acquire", json={"provider": "local", "model": "tiny"})
    assert r.status_code == 200, r.text
    lease = r.json()
    t = await asyncio.to_thread(complete, llama, words(session, 600 * n), slot_id=lease["slot_id"])
    body = {
        "status": "ok",
        "prompt_tokens": t["prompt_n"],
        "cached_tokens": t["cache_n"],
        "prompt_ms": t["prompt_ms"],
    }
    assert (await c.post(f"/v1/leases/{lease['lease_id']}/release", json=body)).status_code == 200
    return str(lease["outcome"])


async def test_every_dashboard_metric_exists_on_a_real_daemon(
    start_llama: StartServer, tmp_path: Path
) -> None:
    server = start_llama()
    daemon = DaemonProcess(
        tmp_path / "d",
        base_url=server.base_url,
        snapshot_dir=server.save_dir,
        token=TOKEN,
        retention={"max_total_bytes": QUOTA},
    ).start()
    try:
        async with httpx.AsyncClient(base_url=daemon.url, headers=daemon.auth, timeout=60) as c:
            outcomes = [await turn(c, server.base_url, s, n) for s, n in (("A", 1), ("B", 1), ("A", 2))]
            assert outcomes == ["cold", "cold", "restored"]  # B evicted A (a save), A came back (a restore)
            text = (await c.get("/metrics")).text
            status = (await c.get("/v1/status")).json()
    finally:
        daemon.stop()
    declared, sampled = exposed_names(text)
    used: dict[str, set[str]] = {}
    for where, expr in dashboard_exprs(json.loads(DASHBOARD.read_text())):
        names = metric_names(expr)
        assert names, f"{where}: no metric in {expr!r}"
        for name in names:
            used.setdefault(name, set()).add(where)
    # the fleet panels' series exist only in fleet mode: unit/fleet/test_agent checks them on a fleet daemon
    missing = {
        name: sorted(where)
        for name, where in used.items()
        if name not in declared and not name.startswith("kvsidecar_fleet_")
    }
    assert missing == {}, f"the dashboard uses metrics /metrics does not have: {missing}"
    # The save and the restore made the series of the core panels; the gauges are current at once.
    for name in (
        "kvsidecar_restore_duration_seconds_bucket",
        "kvsidecar_save_duration_seconds_bucket",
        "kvsidecar_save_bytes_total",
        "kvsidecar_restore_bytes_total",
        "kvsidecar_restore_hit_total",
        "kvsidecar_acquire_total",
        "kvsidecar_cold_prefill_total",
        "kvsidecar_backend_up",
        "kvsidecar_breaker_state",
        "kvsidecar_snapshot_quota_bytes",
        "kvsidecar_cost_save_bytes_per_second",
        "kvsidecar_cost_restore_bytes_per_second",
        "kvsidecar_build_info",
    ):
        assert name in sampled and name in used, name
    families = {f.name: f for f in text_string_to_metric_families(text)}
    (snapshots,) = families["kvsidecar_snapshots"].samples
    assert snapshots.value == status["snapshots"]["known"] == 2
