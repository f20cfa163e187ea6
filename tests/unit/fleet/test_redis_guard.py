"""The one guarded Redis call (`RedisGuard.guarded`): a Redis that stalls, a real redis-server stopped with
SIGSTOP (its kernel still accepts connections and takes commands, nothing answers), bounds every call fleet
mode makes in that one place, and each call goes on without Redis as it did before. The clients' sockets
here would wait 30 s: only the guard can end a call within its round trips' bound. And the structure that
keeps it one place: no other module of fleet mode bounds a Redis call, sees redis-py's errors or builds a
key name."""

from __future__ import annotations

import ast
import signal
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from kvsidecar.config import FleetConfig
from kvsidecar.coordinator.ownership import Claim
from kvsidecar.errors import LeaseNotFound
from kvsidecar.fleet import agent as agent_module
from kvsidecar.fleet import status
from kvsidecar.fleet.gate import LeaderRetention
from kvsidecar.fleet.redis_guard import RedisDown, RedisGuard
from kvsidecar.fleet.routing import FleetRouter
from kvsidecar.testing.poll import until
from tests.fleet_helpers import RedisServer, stop
from tests.unit.fleet.test_gate import Host, key_of, start_host

__all__ = ["start_host"]  # the fixture, shared with fleet/test_gate.py

ROUND_TRIP_S = 0.2  # the guard's bound per round trip here
SLOW_SOCKETS_S = 30.0  # what the clients' own socket timeouts would wait
SLACK_S = 1.5  # a loaded test machine's scheduling, never near SLOW_SOCKETS_S
FLEET = Path(__file__).resolve().parents[3] / "kvsidecar" / "fleet"


@contextmanager
def stalled(redis: RedisServer) -> Iterator[None]:
    assert redis.proc is not None
    redis.proc.send_signal(signal.SIGSTOP)
    try:
        yield
    finally:
        redis.proc.send_signal(signal.SIGCONT)


@pytest.fixture
async def host(
    start_host: Callable[..., Awaitable[Host]], monkeypatch: pytest.MonkeyPatch
) -> AsyncIterator[Host]:
    monkeypatch.setattr(agent_module, "OP_TIMEOUT_S", SLOW_SOCKETS_S)  # the sockets' bound, at construction
    h1 = await start_host("h1")
    h1.agent.redis.timeout_s = ROUND_TRIP_S
    yield h1


async def _bounded(guard: RedisGuard, trips: int, call: Callable[[], Awaitable[Any]]) -> tuple[Any, float]:
    """Run `call` against the stalled Redis: it ends within its trips' bound, through the guard (one
    failed guarded call); returns its result (or the exception it raised) and how long it took."""
    failed = guard.failed
    started = time.monotonic()
    try:
        result: Any = await call()
    except (RedisDown, LeaseNotFound) as exc:
        result = exc
    took = time.monotonic() - started
    assert guard.failed == failed + 1, "the call did not end in the one guard"
    assert trips * ROUND_TRIP_S * 0.9 <= took <= trips * ROUND_TRIP_S + SLACK_S, took
    return result, took


async def test_a_stalled_redis_bounds_every_call_of_the_gate_router_and_leader(
    host: Host, redis_server: RedisServer
) -> None:
    agent, k = host.agent, key_of("A")
    await host.h.turn("A")  # A is claimed here: the gate holds its token
    token = agent.gate.tokens[k]
    for task in agent._tasks:  # the loops are the other test's: here each call is made by hand
        await stop(task)
    router = FleetRouter(agent, host.coordinator, token=None)
    retention = LeaderRetention(
        agent, agent.gate, reload_all=lambda: None, ownership=host.coordinator.ownership
    )
    agent.seen.add("h9")  # a host seen live once: a release for it is queued in Redis

    def up() -> None:  # Redis answered the last heartbeat; it stalls from the next call on
        agent.redis_up, agent.hosts_fresh, agent.is_leader = True, True, True

    calls: list[tuple[str, int, Callable[[], Awaitable[Any]], Callable[[Any], bool]]] = [
        ("claim", 2, lambda: agent.gate.claim(k), lambda r: r == Claim(write=True)),  # still its token
        ("owner", 2, lambda: router.owner_of(k), lambda r: r == "h1"),  # served here
        ("fan-out", 2, lambda: router._holding("A"), lambda r: r == set()),
        ("queued release", 2, lambda: router._queue_release("h9", "l1", {}), lambda r: "not live" in str(r)),
        ("leader's view", 4, retention.prepare, lambda r: r is None),  # no retention this round
        ("releases", 1, agent.apply_releases, lambda r: isinstance(r, RedisDown)),
        ("let go", 2, lambda: agent.gate.let_go(k, token, unless=lambda: False), lambda r: r is None),
    ]
    try:
        with stalled(redis_server):
            for name, trips, call, expected in calls:
                up()
                result, _took = await _bounded(agent.redis, trips, call)
                assert expected(result), (name, result)
                assert not agent.redis_up, name  # reported: serving as a single host
            up()
            started = time.monotonic()
            await agent.aclose()  # leaving the fleet: bounded too, and not reported as an outage
            assert time.monotonic() - started <= 3 * ROUND_TRIP_S + SLACK_S
    finally:
        await router.aclose()


async def test_a_stalled_redis_bounds_the_heartbeat_and_the_publisher(
    host: Host, redis_server: RedisServer
) -> None:
    agent, guard = host.agent, host.agent.redis
    failed = guard.failed
    with stalled(redis_server):
        started = time.monotonic()
        await until(lambda: not agent.redis_up, timeout_s=10, what="the heartbeat to find Redis stalled")
        bound = agent.settings.heartbeat_s + agent_module.HEARTBEAT_TRIPS * ROUND_TRIP_S + SLACK_S
        assert time.monotonic() - started <= bound and guard.failed > failed
        await stop(agent._tasks[0])  # the heartbeat: now only the publisher calls Redis
        agent.redis_up, failed = True, guard.failed
        started = time.monotonic()
        agent.slot_loaded("local", 0, key_of("B"))  # an acquire's residency event
        await until(lambda: not agent.redis_up, timeout_s=10, what="the publisher to find Redis stalled")
        assert time.monotonic() - started <= ROUND_TRIP_S + SLACK_S and guard.failed == failed + 1
        assert agent.queue  # kept for the heartbeat that finds Redis back


async def test_fleet_status_is_bounded_by_the_guard(redis_server: RedisServer) -> None:
    fleet = FleetConfig.model_validate({"enabled": True, "redis_url": redis_server.url, "key_prefix": "t"})
    with stalled(redis_server):
        started = time.monotonic()
        report = await status.gather(fleet, timeout_s=ROUND_TRIP_S)
    assert report["redis"]["up"] is False and report["redis"]["error"] == "TimeoutError"
    assert time.monotonic() - started <= 5 * ROUND_TRIP_S + SLACK_S


# the structure ---------------------------------------------------------------------------------------
def _fleet_modules() -> dict[str, ast.Module]:
    return {p.name: ast.parse(p.read_text()) for p in sorted(FLEET.glob("*.py"))}


def _functions_with(tree: ast.Module, found: Callable[[ast.AST], bool]) -> set[str]:
    out = set()
    scopes: list[ast.Module | ast.ClassDef] = [tree, *[n for n in tree.body if isinstance(n, ast.ClassDef)]]
    for scope in scopes:
        for fn in scope.body:
            if isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef) and any(map(found, ast.walk(fn))):
                out.add(fn.name)
    return out


def _is_timeout(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Attribute)
        and node.attr in ("timeout", "wait_for")
        and (isinstance(node.value, ast.Name) and node.value.id == "asyncio")
    )


def test_no_fleet_module_bounds_a_redis_call_or_sees_its_errors_but_the_guard() -> None:
    """Outside redis_guard.py, `asyncio.timeout` bounds only a forward to a peer's HTTP API (its own budget)
    and the heartbeat's sleep; and no module names redis-py's errors or the outage tuple."""
    timeouts = {name: _functions_with(tree, _is_timeout) for name, tree in _fleet_modules().items()}
    timeouts = {name: fns for name, fns in timeouts.items() if fns and name != "redis_guard.py"}
    assert timeouts == {"routing.py": {"forward"}, "agent.py": {"_heartbeat_loop"}}
    for name, tree in _fleet_modules().items():
        if name == "redis_guard.py":
            continue
        names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
        names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names}
        assert not names & {"DOWN", "RedisError"}, name


def _strings(tree: ast.Module) -> list[str]:
    out = [n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    return out + ["{}".join(_strings_of(n)) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr)]


def _strings_of(node: ast.JoinedStr) -> list[str]:
    return [v.value for v in node.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]


def test_every_redis_key_name_is_built_in_keys_py() -> None:
    parts = ("hosts", "host", "res", "owner", "fence", "leader", "releases")
    for name, tree in _fleet_modules().items():
        if name == "keys.py":
            continue
        for text in _strings(tree):
            if text.startswith('"""') or "\n" in text:
                continue  # a docstring or a Lua script (its keys come in KEYS[])
            assert not any(f":{p}:" in text or text.endswith(f":{p}") for p in parts), (name, text)
        joins = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and n.attr == "join"]
        assert not any(isinstance(j.value, ast.Constant) and j.value.value == ":" for j in joins), name
        assert not any(isinstance(n, ast.Attribute) and n.attr == "key_prefix" for n in ast.walk(tree)) or (
            name in ("agent.py", "status.py")  # handed to the plane and the leases, which build FleetKeys
        ), name
