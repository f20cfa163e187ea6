"""Fleet mode's coordination plane against a real redis-server: the host registry and its TTL, the
residency map, ownership leases with fencing tokens, leader election."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from kvsidecar.fleet import redacted
from kvsidecar.fleet.ownership import Leases
from kvsidecar.fleet.plane import FleetPlane, HostRecord, ServerRecord, awaited, connect
from kvsidecar.testing.poll import until
from tests.fleet_helpers import RedisServer

K = "0123456789abcdef0123456789abcdef"  # a session key (our identity keys are 128-bit hex)


@pytest.fixture
async def client(redis_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    c = connect(redis_server.url, timeout_s=2.0)
    for host in ("a", "b"):  # live hosts (their records), as registered ones are: see the dead-holder test
        await c.set(f"t:host:{host}", "{}")
    yield c
    await c.aclose()


def record(host: str, *, free: int = 1) -> HostRecord:
    server = ServerRecord(
        name="local",
        base_url="http://127.0.0.1:8080",
        fingerprint="f" * 64,
        slots_total=2,
        slots_free=free,
        slots_clean=0,
    )
    return HostRecord(
        host_id=host, advertise_url=f"http://{host}:8377", version="0.1.0", time=1.0, servers=(server,)
    )


async def test_a_host_disappears_once_it_stops_heartbeating(client: aioredis.Redis) -> None:
    plane = FleetPlane(client, key_prefix="t", host_ttl_s=1.0)
    await plane.register(record("a"))
    await plane.register(record("b", free=0))
    live = await plane.live_hosts()
    assert sorted(live) == ["a", "b"] and live["b"].servers[0].slots_free == 0
    assert live["a"].servers[0].fingerprint == "f" * 64

    async def only_b() -> bool:
        await plane.register(record("b"))  # b keeps heartbeating, a does not
        return sorted(await plane.live_hosts()) == ["b"]

    await until(only_b, what="host a to expire")
    assert await awaited(client.smembers("t:hosts")) == {"b"}  # the dead id was pruned from the set


async def test_a_record_that_is_not_ours_is_not_a_host(client: aioredis.Redis) -> None:
    plane = FleetPlane(client, key_prefix="t", host_ttl_s=5)
    await awaited(client.sadd("t:hosts", "x", "y"))
    await client.set("t:host:x", "not json")
    await client.set("t:host:y", record("z").to_json())  # names another host
    assert await plane.live_hosts() == {}
    assert HostRecord.from_json(record("a").to_json()) == record("a")


async def test_residency_of_a_dead_host_is_ignored(client: aioredis.Redis) -> None:
    plane = FleetPlane(client, key_prefix="t", host_ttl_s=5)
    for host in ("a", "b"):
        await plane.register(record(host))
    await plane.set_resident("a", K, "local", 0)
    [found] = await plane.where(K)
    assert (found.host_id, found.server, found.slot) == ("a", "local", 0)
    await plane.replace_residency("b", {K: ("local", 1)})  # b restored it too (a move in progress)
    assert sorted(r.host_id for r in await plane.where(K)) == ["a", "b"]
    await client.delete("t:host:a")  # a's record expired; its residency hash has not yet
    assert [r.host_id for r in await plane.where(K)] == ["b"]
    await plane.replace_residency("b", {})
    assert await plane.where(K) == [] and await plane.residency("b") == {}


async def test_two_hosts_racing_for_one_session_exactly_one_wins(client: aioredis.Redis) -> None:
    leases = Leases(client, key_prefix="t")
    for round_ in range(20):
        key = f"{round_:032x}"
        a, b = await asyncio.gather(leases.take(key, "a", 5), leases.take(key, "b", 5))
        assert a.granted != b.granted
        winner, loser = (a, b) if a.granted else (b, a)
        assert winner.new and not loser.new
        assert loser.holder == winner.holder and loser.token == winner.token
        assert await leases.is_current(key, winner.holder, winner.token)
        assert not await leases.is_current(key, loser.holder if loser.holder != winner.holder else "x", 1)


async def test_a_holder_whose_lease_expired_is_refused_and_the_new_token_is_higher(
    client: aioredis.Redis,
) -> None:
    leases = Leases(client, key_prefix="t")
    first = await leases.take(K, "a", 0.2)
    assert first.granted and first.new
    await until(lambda: _gone(leases), what="a's lease to expire")  # a is paused past its TTL
    second = await leases.take(K, "b", 30)
    assert second.granted and second.new and second.token > first.token
    assert not await leases.is_current(K, "a", first.token)  # a wakes up: its token is stale
    woke = await leases.take(K, "a", 30)
    assert not woke.granted and woke.holder == "b" and woke.token == second.token
    assert not await leases.release(K, "a", first.token)  # a stale release changes nothing
    assert await leases.is_current(K, "b", second.token)
    assert await leases.release(K, "b", second.token)
    assert await leases.holder(K) is None


async def _gone(leases: Leases) -> bool:
    return await leases.holder(K) is None


async def test_renewing_keeps_the_token_and_extends_the_lease(client: aioredis.Redis) -> None:
    leases = Leases(client, key_prefix="t")
    first = await leases.take(K, "a", 1)
    renewed = await leases.take(K, "a", 60)
    assert renewed.granted and not renewed.new and renewed.token == first.token
    assert await client.pttl(f"t:owner:{K}") > 30_000
    # the same host taking again after its lease ended gets a new, higher token: its old one is stale
    assert await leases.release(K, "a", first.token)
    again = await leases.take(K, "a", 60)
    assert again.new and again.token > first.token
    assert not await leases.is_current(K, "a", first.token)


async def test_tokens_still_grow_after_redis_lost_its_data(
    client: aioredis.Redis, redis_server: RedisServer
) -> None:
    """The counter is floored by Redis' clock: a Redis restarted empty never hands out an old token."""
    leases = Leases(client, key_prefix="t")
    tokens = [(await leases.take(f"{i:032x}", "a", 60)).token for i in range(3)]
    before = max(tokens)
    redis_server.stop()
    redis_server.start()  # same port, every key gone
    after = await Leases(client, key_prefix="t").take(f"{0:032x}", "b", 60)
    assert after.granted and after.new and after.token > before


async def test_one_leader_among_three_and_failover_when_it_stops_renewing(client: aioredis.Redis) -> None:
    leases = Leases(client, key_prefix="t")
    hosts = ("a", "b", "c")
    won = await asyncio.gather(*(leases.campaign(h, 1.0) for h in hosts))
    assert sum(won) == 1
    leader = hosts[won.index(True)]
    assert await leases.leader() == leader
    for _ in range(3):  # renewing keeps it; the others keep losing
        assert [await leases.campaign(h, 1.0) for h in hosts] == [h == leader for h in hosts]
    others = [h for h in hosts if h != leader]

    async def new_leader() -> str | None:  # the leader stopped (no more campaigns); the others go on
        results = [await leases.campaign(h, 1.0) for h in others]
        return others[results.index(True)] if any(results) else None

    successor: str = await until(new_leader, what="a new leader")
    assert successor != leader and await leases.leader() == successor
    assert not await leases.resign(leader) and await leases.resign(successor)
    assert await leases.leader() is None


def test_a_redis_url_is_shown_without_its_password() -> None:
    assert redacted("redis://user:s3cret@h:6379/0") == "redis://user:***@h:6379/0"
    assert redacted("redis://:s3cret@h:6379/0") == "redis://:***@h:6379/0"
    assert redacted("rediss://s3cret@h") == "rediss://***@h"
    assert redacted("redis://h:6379/2") == "redis://h:6379/2"
    assert redacted("unix:///run/redis.sock") == "unix:///run/redis.sock"


async def test_a_dead_holder_loses_the_key_at_once_and_force_takes_it_from_a_live_one(
    client: aioredis.Redis,
) -> None:
    leases = Leases(client, key_prefix="t")
    held = await leases.take(K, "gone", 60)  # "gone" has no host record: its host stopped heartbeating
    taken = await leases.take(K, "a", 60)
    assert taken.granted and taken.new and taken.token > held.token  # without waiting the 60 s out
    refused = await leases.take(K, "b", 60)  # a is live: b is refused ...
    assert not refused.granted and refused.holder == "a"
    forced = await leases.take(K, "b", 60, force=True)  # ... unless a cannot be reached
    assert forced.granted and forced.token > taken.token
    assert not await leases.is_current(K, "a", taken.token)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("advertise_url", "file:///etc/passwd"),
        ("advertise_url", "gopher://evil:70/"),
        ("advertise_url", 12),
        ("advertise_url", "http://" + "x" * 600),
        ("host_id", "a/../b"),
        ("host_id", "a b"),
        ("host_id", ""),
    ],
)
def test_a_record_that_would_send_our_token_elsewhere_is_not_a_host(field: str, value: object) -> None:
    """Routing forwards hook calls (with the fleet's token) to a record's advertise_url: a record with
    anything but an http(s) URL and a valid host id is ignored, whoever wrote it into Redis."""
    data = json.loads(record("a").to_json())
    data[field] = value
    assert HostRecord.from_json(json.dumps(data)) is None


def test_a_bad_proxy_url_refuses_the_whole_record() -> None:
    """No kvsidecar writes a proxy_url that is not an origin (config check refuses it): a record with one
    was written by something else, and nothing of it is believed (issue 26, item 7)."""
    data = json.loads(record("a").to_json())
    data["proxy_url"] = "ftp://x/"
    assert HostRecord.from_json(json.dumps(data)) is None
    data["proxy_url"] = None
    parsed = HostRecord.from_json(json.dumps(data))
    assert parsed is not None and parsed.proxy_url is None  # no proxy on that host
    data["proxy_url"] = "http://10.0.0.5:8378"
    parsed = HostRecord.from_json(json.dumps(data))
    assert parsed is not None and parsed.proxy_url == "http://10.0.0.5:8378"
