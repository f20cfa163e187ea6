"""Fencing on the shared store (kvsidecar.store.fence, kvsidecar.fleet.gate): a host that lost a session to
another host writes and deletes nothing of it, whenever it learns it (before its save, during it, after a
pause); a host that owned the key since forgets its stale copy; without Redis only provable owners write.
Two coordinators on the fake backend share one snapshot directory and one metadata directory, with a real
redis-server between them."""

from __future__ import annotations

import asyncio
import os
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvsidecar.backend.fake import FakeKvBackend
from kvsidecar.coordinator.core import Coordinator
from kvsidecar.coordinator.ownership import Claim
from kvsidecar.errors import Fenced, MetadataIO
from kvsidecar.fleet.agent import FleetAgent
from kvsidecar.fleet.gate import FleetGate, LeaderRetention
from kvsidecar.metrics import Metrics
from kvsidecar.retention.job import RetentionJob
from kvsidecar.store.fence import FenceFiles
from kvsidecar.store.naming import HOOK_SCOPE, SnapshotIdentity
from kvsidecar.store.snapshots import SnapshotStore
from kvsidecar.testing.poll import until
from tests.fleet_helpers import RedisServer
from tests.unit.coordinator_helpers import Harness, make_config

K = "0123456789abcdef0123456789abcdef"


# the fence files alone --------------------------------------------------------------------------------
def fence(tmp_path: Path, tokens: dict[str, int]) -> FenceFiles:
    tmp_path.mkdir(parents=True, exist_ok=True)
    return FenceFiles(tmp_path, tokens.get)


def test_advance_records_the_highest_token_and_returns_the_one_before(tmp_path: Path) -> None:
    f = fence(tmp_path, {})
    assert f.advance(K, 10) == 0
    assert f.advance(K, 7) == 10  # a lower token never lowers the record
    assert f.recorded(K) == 10
    assert f.advance(K, 12) == 10 and f.recorded(K) == 12


def test_a_write_under_a_lower_or_missing_token_is_refused_and_counted(tmp_path: Path) -> None:
    tokens: dict[str, int] = {}
    f = fence(tmp_path, tokens)
    f.advance(K, 10)
    done: list[int] = []
    for mine in (None, 9):
        if mine is not None:
            tokens[K] = mine
        with pytest.raises(Fenced), f.guard(K, "manifest write"):
            done.append(1)
    assert done == [] and f.refused == 2
    tokens[K] = 10
    with f.guard(K, "manifest write"):
        done.append(1)
    tokens[K] = 11  # a higher token is recorded as it writes
    with f.guard(K, "manifest write"):
        done.append(2)
    assert done == [1, 2] and f.recorded(K) == 11


@pytest.mark.parametrize("content", [b"12abc", b"-5", b"9" * 40, b"\x00\x01"])
def test_a_fence_file_that_does_not_parse_lets_nobody_write(tmp_path: Path, content: bytes) -> None:
    f = fence(tmp_path, {K: 10**15})
    (tmp_path / K).write_bytes(content)
    with pytest.raises(Fenced), f.guard(K, "manifest write"):
        pass
    assert (tmp_path / K).read_bytes() == content  # left for an operator to look at


def test_a_planted_link_at_a_fence_name_is_not_followed(tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("precious")
    f = fence(tmp_path / "fences", {K: 5})
    (tmp_path / "fences" / K).symlink_to(target)
    with pytest.raises(MetadataIO), f.guard(K, "manifest write"):
        pass
    assert target.read_text() == "precious"


@pytest.mark.parametrize("name", ["../x", "0123", K.upper(), K + "\n", ""])
def test_only_store_keys_name_a_fence_file(tmp_path: Path, name: str) -> None:
    f = fence(tmp_path / "fences", {name: 5})
    with pytest.raises(Fenced), f.guard(name, "manifest write"):
        pass
    assert os.listdir(tmp_path / "fences") == []


# two hosts on one shared store -------------------------------------------------------------------------
@dataclass
class Host:
    name: str
    h: Harness
    agent: FleetAgent
    gate: FleetGate
    store: SnapshotStore

    @property
    def coordinator(self) -> Coordinator:
        return self.h.coordinator


@pytest.fixture
async def start_host(
    tmp_path: Path, redis_server: RedisServer
) -> AsyncIterator[Callable[..., Awaitable[Host]]]:
    started: list[Host] = []
    shared = tmp_path / "shared"

    async def start(name: str, **fleet: Any) -> Host:
        settings = {
            "enabled": True,
            "redis_url": redis_server.url,
            "host_id": name,
            "key_prefix": "t",
            "heartbeat_s": 0.05,
            "host_ttl_s": 1.0,
            "shared_dir": str(shared / "meta"),
            **fleet,
        }
        config = make_config(
            tmp_path / name, servers={"local": {"snapshot_dir": str(shared / "snaps")}}, fleet=settings
        )
        store = SnapshotStore(
            state_dir=config.state_dir,
            snapshot_dirs={"local": shared / "snaps"},
            shared_dir=shared / "meta",
        )
        store.open()
        fake = FakeKvBackend(shared / "snaps")
        metrics = Metrics()
        agent = FleetAgent(config, fence_for=store.fence_with, metrics=metrics)  # as the daemon builds it
        gate = agent.gate
        coordinator = Coordinator(
            config=config,
            store=store,
            backends={"local": fake},
            metrics=metrics,
            gate=gate,
            observers=(agent,),
            fleet_view=agent.view,
        )
        await coordinator.start()
        agent.start(coordinator)
        await until(lambda: agent.redis_up, what=f"{name} to register")
        host = Host(
            name=name, h=Harness(coordinator=coordinator, fake=fake), agent=agent, gate=gate, store=store
        )
        started.append(host)
        return host

    yield start
    for host in started:
        await host.agent.aclose()
        await host.coordinator.aclose()


def key_of(session: str, scope: str = HOOK_SCOPE) -> str:
    return SnapshotIdentity(server="local", provider="local", model="m", session_id=session, scope=scope).key


def manifest_bytes(tmp_path: Path, key: str) -> bytes | None:
    path = tmp_path / "shared" / "meta" / "manifests" / f"{key}.json"
    return path.read_bytes() if path.exists() else None


async def test_a_host_that_lost_the_session_before_its_save_writes_nothing(
    tmp_path: Path, start_host: Callable[..., Awaitable[Host]]
) -> None:
    h1, h2 = await start_host("h1"), await start_host("h2")
    k = key_of("A")
    await h1.h.turn("A")  # A is dirty on h1
    await h2.coordinator.ownership.claim(
        k, force=True
    )  # h1 stops answering; h2 takes A over (higher token, fence advanced)
    await h2.h.turn("A")
    assert (await h2.coordinator.save("A"))["saved"] == 1
    committed = manifest_bytes(tmp_path, k)
    files = {p.name: p.stat().st_ino for p in (tmp_path / "shared" / "snaps").glob(f"{k}.*")}
    assert committed is not None and files

    # h1 wakes up believing it still owns A (it claimed just before its pause): its save is refused
    async def stale_claim(key: str, *, force: bool = False, keep: bool = False) -> Claim:
        return Claim(write=True)

    h1.gate.claim = stale_claim  # type: ignore[method-assign]
    saved = await h1.coordinator.save("A")
    assert saved["saved"] == 0
    assert manifest_bytes(tmp_path, k) == committed  # h2's commit stands
    assert {p.name: p.stat().st_ino for p in (tmp_path / "shared" / "snaps").glob(f"{k}.*")} == files
    assert h1.gate.fence.refused >= 1


async def test_a_takeover_during_the_save_leaves_the_new_owners_files_alone(
    tmp_path: Path, start_host: Callable[..., Awaitable[Host]]
) -> None:
    h1, h2 = await start_host("h1"), await start_host("h2")
    k = key_of("A")
    await h1.h.turn("A")
    hold = h1.h.fake.hold("save")
    saving = asyncio.create_task(h1.coordinator.save("A"))
    await hold.entered.wait()  # llama-server is writing h1's file: h1 passed every check already
    await h2.coordinator.ownership.claim(k, force=True)
    hold.release()
    assert (await saving)["saved"] == 0  # the commit is refused
    assert manifest_bytes(tmp_path, k) is None  # nothing of h1's reached the shared manifest
    assert h1.gate.fence.refused >= 1
    assert h1.coordinator.servers["local"].slots[0].owner is None  # its copy is forgotten
    # h2 serves A from here: its own save commits
    await h2.h.turn("A")
    assert (await h2.coordinator.save("A"))["saved"] == 1
    assert manifest_bytes(tmp_path, k) is not None


async def test_a_host_that_owned_the_key_since_drops_its_stale_copy_and_restores_the_newer_state(
    start_host: Callable[..., Awaitable[Host]],
) -> None:
    h1, h2 = await start_host("h1"), await start_host("h2")
    k = key_of("A")
    await h1.h.turn("A")
    assert (await h1.coordinator.save("A"))["saved"] == 1  # turn 1 saved by h1
    await h2.coordinator.ownership.claim(k, force=True)
    h2.h.turns["A"] = 1
    result, *_ = await h2.h.turn("A")  # turn 2 on h2, restored from h1's save in the shared directory
    assert result.outcome.value == "restored"
    assert (await h2.coordinator.save("A"))["saved"] == 1
    newer = h2.store.get(k)
    assert newer is not None and newer.current is not None
    newer_tokens = newer.generations[newer.current].tokens
    # back to h1 (its lease ran out; h2 is done with A): h1's slot still holds turn 1, which is stale
    assert await h2.agent.leases.release(k, "h2", h2.gate.tokens[k])
    assert h1.coordinator.servers["local"].slots[0].owner == k
    h1.h.turns["A"] = 2
    result, *_ = await h1.h.turn("A")
    assert result.outcome.value == "restored"  # not "resident": the slot's turn-1 KV was not trusted
    assert result.restored_tokens == newer_tokens


async def test_without_redis_a_host_writes_only_the_keys_it_still_provably_owns(
    redis_server: RedisServer, start_host: Callable[..., Awaitable[Host]]
) -> None:
    h1 = await start_host("h1")
    k = key_of("A")
    await h1.h.turn("A")
    assert k in h1.gate.tokens
    redis_server.stop()
    await until(lambda: not h1.agent.redis_up, what="h1 to see Redis down")
    assert (await h1.gate.claim(k)).write  # its token is the recorded one
    other = await h1.gate.claim(key_of("B"))
    assert not other.write  # never a new key without Redis: another host may be taking it
    assert (await h1.coordinator.save("A"))["saved"] == 1


async def test_only_the_leader_runs_retention_and_it_skips_what_another_host_owns(
    tmp_path: Path, start_host: Callable[..., Awaitable[Host]]
) -> None:
    h1, h2 = await start_host("h1"), await start_host("h2")
    await until(lambda: h1.agent.is_leader or h2.agent.is_leader, what="a leader")
    leader, other = (h1, h2) if h1.agent.is_leader else (h2, h1)
    for session in ("A", "B"):
        await other.h.turn(session)
        assert (await other.coordinator.save(session))["saved"] == 1
    await other.h.turn("C")  # evicts B (one slot): A and B are saved and not resident
    kb = key_of("B")
    assert await other.agent.leases.release(
        kb, other.name, other.gate.tokens[kb]
    )  # B's lease ran out; A's not
    jobs = {}
    limits = {"max_total_bytes": 1, "max_age_days": None, "min_free_percent": None}
    for host in (leader, other):
        config = host.coordinator.config.retention.model_copy(update=limits)
        job = RetentionJob(
            store=host.store,
            config=config,
            metrics=Metrics(),
            protected_keys=host.coordinator.protected_keys,
            fleet=LeaderRetention(
                host.agent, host.gate, host.store.reload_all, ownership=host.coordinator.ownership
            ),
        )
        jobs[host.name] = job
    skipped = await jobs[other.name].run()
    assert skipped["fleet"] == "not leader" and skipped["deletions"] == []
    report = await jobs[leader.name].run()
    assert report["fleet"] == "leader"
    by_key = {d["snapshot"]: d for d in report["deletions"]}
    a, b = key_of("A")[:8], key_of("B")[:8]
    assert by_key[a]["deleted"] is False and by_key[a]["skipped"] == "owned by another host"
    assert by_key[b]["deleted"] is True
    assert manifest_bytes(tmp_path, key_of("A")) is not None and manifest_bytes(tmp_path, key_of("B")) is None


async def test_a_stale_hosts_save_never_writes_over_the_new_owners_file(
    tmp_path: Path, start_host: Callable[..., Awaitable[Host]]
) -> None:
    """A save llama-server finishes after its kvsidecar lost the session goes to a staging name of its own:
    the new owner's committed file (same generation name) keeps its bytes, and nothing is left behind."""
    h1, h2 = await start_host("h1"), await start_host("h2")
    k = key_of("A")
    await h1.h.turn("A")
    hold = h1.h.fake.hold("save")
    saving = asyncio.create_task(h1.coordinator.save("A"))
    await hold.entered.wait()  # h1 asked its llama-server for the save, then stopped (paused, partitioned)
    await h2.coordinator.ownership.claim(k, force=True)
    await h2.h.turn("A")
    assert (await h2.coordinator.save("A"))["saved"] == 1
    snaps = tmp_path / "shared" / "snaps"
    committed = h2.store.get(k)
    assert committed is not None and committed.current is not None
    final = snaps / committed.generations[committed.current].filename
    before = final.read_bytes()
    hold.release()  # h1's llama-server writes now: the same generation name h2 just committed
    assert (await saving)["saved"] == 0
    assert final.read_bytes() == before
    assert sorted(p.name for p in snaps.glob(f"{k}.*")) == [final.name]  # h1's staging file is gone
    assert h2.store.reload(k) == committed  # h2's commit stands
    result, *_ = await h2.h.turn("A")
    assert result.outcome.value == "resident"
