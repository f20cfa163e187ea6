"""`FleetAgent` beside a real coordinator (the fake backend) and a real redis-server: residency published
from loads and evictions, hosts that come and go, Redis hung, killed and restarted under traffic, the
status section and the metrics, and single-host mode untouched."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvsidecar.api.models import FleetView
from kvsidecar.api.routes import create_app
from kvsidecar.backend.fake import FakeKvBackend
from kvsidecar.config import config_from_mapping
from kvsidecar.coordinator.core import Coordinator
from kvsidecar.coordinator.ownership import LocalGate
from kvsidecar.daemon.service import Daemon
from kvsidecar.fingerprint.llama_process import ProcessInfo
from kvsidecar.fleet import REDIS_DOWN
from kvsidecar.fleet import agent as agent_module
from kvsidecar.fleet.agent import FleetAgent
from kvsidecar.fleet.gate import LeaderRetention
from kvsidecar.fleet.plane import FleetPlane, connect
from kvsidecar.metrics import Metrics
from kvsidecar.store.snapshots import SnapshotStore
from kvsidecar.testing.poll import until
from tests.fleet_helpers import RedisServer, stop
from tests.integration.test_dashboard_real import DASHBOARD, dashboard_exprs, exposed_names, metric_names
from tests.unit.coordinator_helpers import Harness, make_config, start_harness
from tests.unit.test_metrics import naming_problems

TOKEN = "f" * 32
Started = tuple[Harness, FleetAgent]


def fleet(redis: RedisServer, host: str, **overrides: Any) -> dict[str, Any]:
    return {
        "enabled": True,
        "redis_url": redis.url,
        "host_id": host,
        "key_prefix": "t",
        "heartbeat_s": 0.05,
        "host_ttl_s": 1.0,
        **overrides,
    }


async def fleet_harness(tmp_path: Path, settings: dict[str, Any]) -> Started:
    """`start_harness`'s coordinator, built as the daemon builds it in fleet mode (the agent first: the
    coordinator takes its residency observer and status section, the metrics show its series), without the
    write gate: these tests are about residency and Redis health, not ownership."""
    config = make_config(tmp_path, fleet=settings)
    fake = FakeKvBackend(tmp_path / "snaps")
    store = SnapshotStore(state_dir=config.state_dir, snapshot_dirs={"local": tmp_path / "snaps"})
    store.open()
    metrics = Metrics()
    agent = FleetAgent(config, fence_for=store.fence_with, metrics=metrics)
    process: list[ProcessInfo | None] = [None]
    coordinator = Coordinator(
        config=config,
        store=store,
        backends={"local": fake},
        metrics=metrics,
        process_finder=lambda _url: process[0],
        process_check=lambda p: process[0] is not None and process[0].identity == p.identity,
        observers=(agent,),
        fleet_view=agent.view,
    )
    await coordinator.start()
    fake.calls.clear()  # the runtime canary measured at start
    return Harness(coordinator=coordinator, fake=fake, process=process), agent


@pytest.fixture
async def start_host(tmp_path: Path, redis_server: RedisServer) -> AsyncIterator[Callable[..., Any]]:
    """Factory: a coordinator on the fake backend with its agent started, as host `host`."""
    started: list[Started] = []

    async def start(host: str, **overrides: Any) -> Started:
        overrides.setdefault("shared_dir", str(tmp_path / "shared"))
        h, agent = await fleet_harness(tmp_path / host, fleet(redis_server, host, **overrides))
        agent.start(h.coordinator)
        started.append((h, agent))
        await until(lambda: agent.redis_up, what=f"{host} to register")
        return h, agent

    yield start
    for h, agent in started:
        await agent.aclose()
        await h.coordinator.aclose()


@pytest.fixture
async def plane(redis_server: RedisServer) -> AsyncIterator[FleetPlane]:
    client = connect(redis_server.url, timeout_s=2.0)
    yield FleetPlane(client, key_prefix="t", host_ttl_s=1.0)
    await client.aclose()


def owner(h: Harness, slot: int = 0) -> str:
    key = h.coordinator.servers["local"].slots[slot].owner
    assert key is not None
    return key


async def where(plane: FleetPlane, key: str) -> list[str]:
    return [r.host_id for r in await plane.where(key)]


async def test_residency_follows_loads_and_evictions(start_host: Any, plane: FleetPlane) -> None:
    # heartbeats far apart: after the first one, only the load/evict events can publish anything
    h, agent = await start_host("h1", heartbeat_s=30, host_ttl_s=90, owner_lease_ttl_s=120)
    beats = agent.heartbeats
    await h.turn("A")
    a = owner(h)
    await until(lambda: _is(where(plane, a), ["h1"]), what="A resident on h1")
    await h.turn("B")  # one slot: B evicts A
    b = owner(h)
    await until(lambda: _is(where(plane, b), ["h1"]), what="B resident on h1")
    assert await where(plane, a) == []
    assert agent.heartbeats == beats  # the events did it, not a heartbeat
    record = (await plane.live_hosts())["h1"]
    assert record.servers[0].slots_total == 1 and record.advertise_url == "http://127.0.0.1:8377"


async def _is(found: Any, expected: list[str]) -> bool:
    return bool(await found == expected)


async def test_hosts_see_each_other_and_a_dead_host_expires(start_host: Any, plane: FleetPlane) -> None:
    _, a1 = await start_host("h1", host_ttl_s=2.0)
    h2, a2 = await start_host("h2", host_ttl_s=2.0)
    await h2.turn("B")
    b = owner(h2)
    await until(lambda: set(a1.hosts) == {"h1", "h2"}, what="h1 to see h2")
    await until(lambda: _is(where(plane, b), ["h2"]), what="B resident on h2")
    for task in a2._tasks:  # h2 dies: no more heartbeats, no goodbye
        await stop(task)
    await until(lambda: set(a1.hosts) == {"h1"}, what="h2 to expire")
    assert await where(plane, b) == []
    assert sorted(await plane.live_hosts()) == ["h1"]


async def test_redis_hung_killed_and_restarted_under_traffic(
    start_host: Any,
    plane: FleetPlane,
    redis_server: RedisServer,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(agent_module, "QUEUE_MAX", 2)
    h, agent = await start_host("h1")
    caplog.set_level(logging.WARNING, logger="kvsidecar.fleet")
    assert redis_server.proc is not None
    redis_server.proc.send_signal(signal.SIGSTOP)  # hung: connections open, nothing answers
    outcomes = [(await h.turn(s))[0].outcome for s in ("A", "B", "A", "B")]
    assert all(o is not None for o in outcomes)
    assert agent.queue or agent.dropped  # the acquires returned while their events were unpublished
    redis_server.stop()  # killed while hung: every key is lost
    await until(lambda: not agent.redis_up, what="the agent to notice")
    for s in ("C", "A", "C"):  # acquires keep working as a single host
        await h.turn(s)
    assert agent.dropped > 0
    families = await scrape(h)
    assert families["kvsidecar_fleet_redis_up"] == 0 and families["kvsidecar_fleet_publish_dropped_total"] > 0
    redis_server.start()  # back, empty
    current = owner(h)
    await until(lambda: _is(where(plane, current), ["h1"]), what="h1 to register again")
    assert "h1" in await plane.live_hosts()
    downs = [r for r in caplog.records if REDIS_DOWN in r.getMessage()]
    assert len(downs) == 1 and downs[0].levelno == logging.WARNING  # logged once for the whole outage
    families = await scrape(h)
    assert families["kvsidecar_fleet_redis_up"] == 1 and families["kvsidecar_fleet_leader"] == 1


async def metrics_text(h: Harness) -> str:
    app = create_app(h.coordinator, token=TOKEN)
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app=app),
        base_url="http://127.0.0.1:8377",
        headers={"Authorization": f"Bearer {TOKEN}"},
    ) as c:
        return (await c.get("/metrics")).text


async def scrape(h: Harness) -> dict[str, float]:
    text = await metrics_text(h)
    families = {f.name: f for f in text_string_to_metric_families(text)}
    assert naming_problems(families, text) == []
    return {
        s.name: s.value for f in families.values() for s in f.samples if s.name.startswith("kvsidecar_fleet")
    }


async def test_status_has_a_fleet_section_that_matches_its_model(start_host: Any) -> None:
    h, agent = await start_host("h1")
    await h.turn("A")
    await until(lambda: agent.heartbeats >= 2, what="a heartbeat after the turn")
    view = h.coordinator.status()["fleet"]
    assert set(view) == set(FleetView.model_fields)
    parsed = FleetView.model_validate(view)
    assert parsed.host_id == "h1" and parsed.redis_up and parsed.leader and parsed.hosts == ["h1"]
    assert parsed.resident_sessions == 1 and parsed.publish_dropped == 0
    families = await scrape(h)
    assert families["kvsidecar_fleet_hosts"] == 1 and families["kvsidecar_fleet_leader"] == 1


async def test_every_fleet_metric_of_the_dashboard_exists_in_fleet_mode(start_host: Any) -> None:
    h, agent = await start_host("h1")
    await until(lambda: agent.heartbeats >= 1, what="a heartbeat")
    declared, _ = exposed_names(await metrics_text(h))
    fleet_names = {
        name
        for _, expr in dashboard_exprs(json.loads(DASHBOARD.read_text()))
        for name in metric_names(expr)
        if name.startswith("kvsidecar_fleet_")
    }
    assert len(fleet_names) >= 5  # the Fleet row's series
    assert fleet_names <= declared, sorted(fleet_names - declared)


@pytest.fixture
def password_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis-pw", password="pw-" + "s3cret" * 3).start()
    yield server
    server.stop()


async def test_the_daemon_runs_the_agent_and_leaves_the_fleet_at_stop(
    tmp_path: Path, password_redis: RedisServer, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="kvsidecar")
    config = config_from_mapping(
        {
            "state_dir": str(tmp_path / "state"),
            "servers": {"local": {"snapshot_dir": str(tmp_path / "snaps"), "probe_interval_s": 3600}},
            "fleet": fleet(password_redis, "d1", shared_dir=str(tmp_path / "shared")),
        }
    )
    d = Daemon(
        config, backends={"local": FakeKvBackend(tmp_path / "snaps")}, process_finder=None, watch=False
    )
    await d.start()
    client = connect(password_redis.url, timeout_s=2.0)
    try:
        p = FleetPlane(client, key_prefix="t", host_ttl_s=1.0)
        assert d.fleet is not None
        await until(lambda: d.fleet is not None and d.fleet.redis_up, what="the daemon's agent")
        assert "d1" in await p.live_hosts()
        assert d.coordinator.status()["fleet"]["redis"].endswith(f":***@127.0.0.1:{password_redis.port}/0")
        await d.aclose()
        assert await p.live_hosts() == {} and await client.get("t:leader") is None
    finally:
        await client.aclose()
    assert password_redis.password is not None
    assert all(password_redis.password not in r.getMessage() for r in caplog.records)


def _daemon(tmp_path: Path, fleet_section: dict[str, Any]) -> Daemon:
    config = config_from_mapping(
        {
            "state_dir": str(tmp_path / "state"),
            "servers": {"local": {"snapshot_dir": str(tmp_path / "snaps"), "probe_interval_s": 3600}},
            "fleet": fleet_section,
        }
    )
    return Daemon(
        config, backends={"local": FakeKvBackend(tmp_path / "snaps")}, process_finder=None, watch=False
    )


async def test_the_daemon_builds_fleet_mode_once_at_construction(tmp_path: Path) -> None:
    """One composition root: each part gets its collaborators when it is built, nothing is installed into
    it later (the coordinator's gate, observer and status section are the agent's; retention's leader and
    the router get the coordinator). Building reaches no Redis: redis-py connects on first use."""
    section = {"redis_url": "redis://127.0.0.1:9/0", "host_id": "h1", "shared_dir": str(tmp_path / "shared")}
    d = _daemon(tmp_path / "fleet", {"enabled": True, **section})
    agent, router = d.fleet, d.fleet_router
    assert agent is not None and router is not None
    try:
        assert agent.coordinator is None  # given at start
        assert d.coordinator.ownership.gate is agent.gate
        assert d.coordinator.telemetry.observers == [agent]
        assert d.coordinator.sections.get("fleet") == agent.view
        assert isinstance(d.retention.fleet, LeaderRetention)
        assert d.retention.fleet.gate is agent.gate and d.retention.fleet.ownership is d.coordinator.ownership
        assert router.agent is agent and router.coordinator is d.coordinator
        assert d.coordinator.pending_restart is d.pending_restart  # the daemon writes it, status reads it
        assert "kvsidecar_fleet_redis_up" in {m.name for m in d.metrics.registry.collect()}
    finally:
        await router.aclose()
        await agent.client.aclose()
    single = _daemon(tmp_path / "single", section)  # fleet.enabled false: nothing of it is built
    assert single.fleet is None and single.fleet_router is None and single.retention.fleet is None
    assert isinstance(single.coordinator.ownership.gate, LocalGate)
    assert single.coordinator.telemetry.observers == [] and single.coordinator.sections.get("fleet") is None


async def test_single_host_mode_has_no_fleet_anything(tmp_path: Path) -> None:
    h = await start_harness(tmp_path)
    try:
        assert "fleet" not in h.coordinator.status()
        assert await scrape(h) == {}
        assert h.coordinator.telemetry.observers == []
    finally:
        await h.coordinator.aclose()


def test_single_host_mode_never_imports_redis() -> None:
    code = (
        "import sys, kvsidecar.daemon.service, kvsidecar.cli, kvsidecar.api.routes, kvsidecar.proxy.app\n"
        "from kvsidecar.cli import build_parser\n"
        "build_parser()\n"
        "loaded = sorted(m for m in sys.modules if m == 'redis' or m.startswith(('redis.', 'kvsidecar.fleet')))\n"
        "print(loaded)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, env={**os.environ}
    )
    assert out.stdout.strip() == "[]"
