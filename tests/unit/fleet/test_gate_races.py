"""Hostile and racing cases of fleet mode (issue 18), from its adversarial review: each test states a
behaviour the fleet design promises, against a way an earlier version broke it (fence locks dropped by a
sibling thread or held by a stopped host, malformed Redis values, the leader's retention taking warm
sessions over, a stale commit's discard, another host's canary, racing claims, a stopped peer, invalidate).

They run against the same two-host setup as fleet/test_gate.py (two coordinators on the fake backend, one
shared snapshot and metadata directory, a real redis-server), or against the fence files alone."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from kvsidecar.errors import MetadataIO
from kvsidecar.fleet.gate import FleetGate, LeaderRetention
from kvsidecar.fleet.plane import HostRecord, awaited
from kvsidecar.fleet.routing import FleetRouter
from kvsidecar.metrics import Metrics
from kvsidecar.retention.job import RetentionJob
from kvsidecar.store.fence import FenceFiles
from kvsidecar.testing.poll import until
from tests.unit.fleet.test_gate import Host, key_of, start_host

__all__ = ["start_host"]  # the fixture, shared with fleet/test_gate.py

K = "0123456789abcdef0123456789abcdef"

_PROBE = """
import fcntl, os, sys
fd = os.open(sys.argv[1], os.O_RDWR)
try:
    fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    print("got")
except OSError:
    print("blocked")
"""

_HOLD_AND_STOP = """
import fcntl, os, signal, sys
fd = os.open(sys.argv[1], os.O_RDWR)
fcntl.lockf(fd, fcntl.LOCK_EX)
print("locked", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


def _other_host_can_lock(path: Path) -> bool:
    """What another host (another process) finds when it tries the fence lock now."""
    out = subprocess.run([sys.executable, "-c", _PROBE, str(path)], capture_output=True, check=True)
    return out.stdout.strip() == b"got"


# the fence primitive ----------------------------------------------------------------------------------
def test_a_sibling_threads_fence_read_does_not_unlock_a_guarded_write(tmp_path: Path) -> None:
    """POSIX record locks belong to the process: a second fence call of the same host (a claim's
    `recorded`, on another thread) unlocks and closes its own descriptor, and that drops the lock the
    guarded commit is holding; another host's `advance` can then land in the middle of the commit."""
    f = FenceFiles(tmp_path, {K: 10}.get)
    f.advance(K, 10)
    inside, leave = threading.Event(), threading.Event()

    def commit() -> None:
        with f.guard(K, "manifest write"):
            inside.set()
            leave.wait(10)

    writer = threading.Thread(target=commit)
    writer.start()
    try:
        assert inside.wait(10)
        assert not _other_host_can_lock(tmp_path / K)  # the commit holds the fence
        f.lock_wait_s = 0.2
        with pytest.raises(MetadataIO):  # a sibling waits its turn (then gives up), never unlocks the commit
            f.recorded(K)  # e.g. FleetGate._still_mine of a checkpoint of the same key, on another thread
        assert not _other_host_can_lock(tmp_path / K), "the commit's fence lock was dropped by a sibling"
    finally:
        leave.set()
        writer.join()


async def test_a_fence_held_by_a_stopped_host_does_not_hang_a_claim(tmp_path: Path) -> None:
    """A host SIGSTOPped (or partitioned, on NFS) inside a guarded write keeps the fence lock; a claim on
    another host must not wait on it without bound (it runs on the default executor: a handful of such
    claims would also starve every other to_thread of the daemon)."""
    none: dict[str, int] = {}
    FenceFiles(tmp_path, none.get).advance(K, 10)
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLD_AND_STOP, str(tmp_path / K)], stdout=subprocess.PIPE
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == b"locked"
        agent = cast(Any, SimpleNamespace(redis_up=False))
        gate = FleetGate(agent, lambda token_for: FenceFiles(tmp_path, token_for))
        gate.tokens[K] = 10
        claim = await asyncio.wait_for(gate.claim(K), timeout=5)  # TimeoutError today: it never returns
        assert not claim.write  # cannot prove ownership now: fail closed, but answer
    finally:
        child.send_signal(signal.SIGKILL)  # frees the lock: the blocked thread can finish
        child.wait()
        if child.stdout is not None:
            child.stdout.close()


# hostile Redis contents -------------------------------------------------------------------------------
@pytest.mark.parametrize("value", ["garbage", "h1|abc"])
async def test_a_malformed_owner_value_neither_raises_nor_takes_redis_down(
    start_host: Callable[..., Awaitable[Host]], value: str
) -> None:
    """One bad `P:owner:<key>` (no `|`: the Lua script errors; a non-numeric token: int() raises) must
    cost that one key, not the acquire (500) nor the host's view of Redis (every host that touches the
    key would flip to 'Redis down' and stop routing)."""
    h1 = await start_host("h1")
    k = key_of("A")
    await h1.agent.client.set(f"t:owner:{k}", value)
    router = FleetRouter(h1.agent, h1.coordinator, token=None)
    try:
        claim = await h1.gate.claim(k)  # ValueError ("h1|abc") / Redis marked down ("garbage") today
        assert h1.agent.redis_up, "one malformed key took this host's whole fleet view down"
        assert claim.write or claim.holder is not None
        await router.owner_of(k)  # ValueError today for both
    finally:
        await router.aclose()


def test_a_host_record_with_non_numeric_slot_counts_is_refused() -> None:
    """`ServerRecord(**s)` takes any JSON types; `place()` then computes `slots_free - n` (TypeError: the
    acquire answers 500 on every host that places a new session)."""
    text = (
        '{"v":1,"host_id":"h9","advertise_url":"http://127.0.0.1:1","version":"x","time":1,'
        '"servers":[{"name":"local","base_url":"http://x","fingerprint":"f","slots_total":"many",'
        '"slots_free":"many","slots_clean":null}]}'
    )
    assert HostRecord.from_json(text) is None


# the leader's retention -------------------------------------------------------------------------------
def _retention(host: Host) -> RetentionJob:
    config = host.coordinator.config.retention.model_copy(update={"max_age_days": None})
    leader = LeaderRetention(
        host.agent, host.gate, host.store.reload_all, ownership=host.coordinator.ownership
    )
    return RetentionJob(
        store=host.store,
        config=config,
        metrics=Metrics(),
        protected_keys=host.coordinator.protected_keys,
        fleet=leader,
    )


async def _leader_and_other(start_host: Callable[..., Awaitable[Host]]) -> tuple[Host, Host]:
    h1, h2 = await start_host("h1"), await start_host("h2")
    await until(lambda: h1.agent.is_leader or h2.agent.is_leader, what="a leader")
    return (h1, h2) if h1.agent.is_leader else (h2, h1)


async def test_the_leader_does_not_take_a_resident_session_over_to_delete_an_orphan_of_it(
    tmp_path: Path, start_host: Callable[..., Awaitable[Host]]
) -> None:
    """An orphan's key is claimed without looking at residency: the leader takes the ownership of a
    session that is warm in another host's slot (its lease ran out between turns), so that host's next
    turn finds the session owned elsewhere, drops its warm copy (and any unsaved turns) and restores."""
    leader, other = await _leader_and_other(start_host)
    k = key_of("A")
    await other.h.turn("A")
    assert (await other.coordinator.save("A"))["saved"] == 1
    assert await other.agent.leases.release(k, other.name, other.gate.tokens[k])  # idle past its lease
    orphan = tmp_path / "shared" / "snaps" / f"{k}.b.bin"  # e.g. left by a stale host's llama-server
    orphan.write_bytes(b"x" * 64)
    old = time.time() - 3600
    os.utime(orphan, (old, old))

    async def published() -> bool:
        return k in await leader.agent.plane.residency(other.name)

    await until(published, what="A resident on the other host, as the leader reads it")
    await _retention(leader).run()
    holder = await leader.agent.leases.holder(k)
    assert holder is None or holder.holder != leader.name, "retention took a resident session over"
    result, *_ = await other.h.turn("A")
    assert result.outcome.value == "resident"


async def test_the_leader_lets_go_of_a_session_once_it_deleted_it(
    start_host: Callable[..., Awaitable[Host]],
) -> None:
    """The leader claims a key to delete it and keeps the lease (owner_lease_ttl_s): for that long every
    host forwards the session's next acquire to the leader instead of placing it."""
    leader, other = await _leader_and_other(start_host)
    k = key_of("B")
    await other.h.turn("B")
    assert (await other.coordinator.save("B"))["saved"] == 1
    await other.h.turn("C")  # evicts B (one slot)
    assert await other.agent.leases.release(k, other.name, other.gate.tokens[k])
    job = _retention(leader)
    job.policy = type(job.policy)(max_total_bytes=1)
    report = await job.run()
    assert any(d["snapshot"] == k[:8] and d["deleted"] for d in report["deletions"])
    assert await leader.agent.leases.holder(k) is None


# writes that skip the fence ---------------------------------------------------------------------------
async def test_a_stale_commit_never_deletes_the_new_owners_file(
    tmp_path: Path, start_host: Callable[..., Awaitable[Host]]
) -> None:
    """commit_save's UnsafeFile branch unlinks the target name without the fence. The new owner's file at
    that name only has to look unsafe to the stale host: a second link (a hard-link backup such as
    `cp -al` / `rsync --link-dest`), or another uid for llama-server on the other host."""
    h1, h2 = await start_host("h1"), await start_host("h2")
    k = key_of("A")
    await h1.h.turn("A")
    hold = h1.h.fake.hold("save")
    saving = asyncio.create_task(h1.coordinator.save("A"))
    await hold.entered.wait()  # h1 is past every check; its llama-server is about to write "a"
    await h2.coordinator.ownership.claim(k, force=True)
    await h2.h.turn("A")
    assert (await h2.coordinator.save("A"))["saved"] == 1
    target = tmp_path / "shared" / "snaps" / f"{k}.a.bin"
    assert target.exists()
    os.link(target, tmp_path / "backup-of-a.bin")
    hold.release()
    assert (await saving)["saved"] == 0
    assert target.exists(), "the stale host deleted the file the new owner's manifest references"


async def test_a_host_start_leaves_another_hosts_fresh_canary_file_alone(
    tmp_path: Path, start_host: Callable[..., Awaitable[Host]]
) -> None:
    """Coordinator.start sweeps every canary file of the (shared) snapshot directory, including the one
    another host's llama-server has just written and that host is about to hash."""
    await start_host("h1")
    canary = tmp_path / "shared" / "snaps" / "kvsidecar-canary.0123456789abcdef.bin"
    canary.write_bytes(b"kv")
    await start_host("h2")
    assert canary.exists()


# the gate's token bookkeeping -------------------------------------------------------------------------
async def test_a_save_claim_does_not_erase_the_token_a_concurrent_acquire_claim_took(
    start_host: Callable[..., Awaitable[Host]],
) -> None:
    """`_still_mine` reads `tokens[key]` before its thread hop and pops it after: a claim that took a new
    token meanwhile loses it, the host then refuses its own writes and the next claim calls the copy
    stale (its warm slot and unsaved turns are dropped)."""
    h1, h2 = await start_host("h1"), await start_host("h2")
    k = key_of("A")
    await h1.h.turn("A")
    await h2.coordinator.ownership.claim(k, force=True)
    assert await h2.agent.leases.release(k, "h2", h2.gate.tokens[k])
    entered, go = threading.Event(), threading.Event()
    fence = h1.gate.fence
    original = fence.recorded

    def slow_recorded(key: str) -> int:
        entered.set()
        go.wait(10)
        return original(key)

    fence.recorded = slow_recorded  # type: ignore[method-assign]
    keep = asyncio.create_task(h1.gate.claim(k, keep=True))  # a checkpoint of A
    await until(entered.is_set, what="the save's claim to read the fence")
    taken = await h1.gate.claim(k)  # an acquire of A meanwhile: a new token
    assert taken.write
    token = h1.gate.tokens[k]
    go.set()
    await keep
    fence.recorded = original  # type: ignore[method-assign]
    assert h1.gate.tokens.get(k) == token, "the acquire's fresh token was erased by the save's claim"


# forwarding to a host that stopped --------------------------------------------------------------------
async def test_a_forward_to_a_host_that_stopped_answering_does_not_hang(
    start_host: Callable[..., Awaitable[Host]],
) -> None:
    """A SIGSTOPped peer still completes TCP handshakes (the kernel's backlog): a forwarded hook call
    then waits `forward_timeout_s` (600 s by default) even though the peer drops out of the live hosts
    after `host_ttl_s`. Expected: once the peer is no longer live, the call is taken over here."""
    h1 = await start_host("h1", forward_timeout_s=120)
    k = key_of("A")
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen(16)  # never accepted: a stopped process
    port = silent.getsockname()[1]
    record = HostRecord(host_id="h9", advertise_url=f"http://127.0.0.1:{port}", version="x", time=time.time())
    await h1.agent.client.set("t:host:h9", record.to_json(), px=1500)  # h9 stops heartbeating now
    await awaited(h1.agent.client.sadd("t:hosts", "h9"))
    await h1.agent.client.set(f"t:owner:{k}", "h9|5", px=60_000)
    await until(lambda: "h9" in h1.agent.hosts, what="h1 to see h9 live")
    router = FleetRouter(h1.agent, h1.coordinator, token=None)

    async def serve() -> dict[str, Any]:
        return {"outcome": "cold", "lease_id": "x"}

    try:
        answer = await asyncio.wait_for(
            router.acquire(k, "local", "/v1/sessions/A/acquire", {}, 0, serve), timeout=15
        )
        assert isinstance(answer, dict) and answer["host"] == "h1"
    finally:
        await router.aclose()
        silent.close()


# calls that report what they did not persist ----------------------------------------------------------
async def test_an_invalidate_is_persisted_or_not_reported(
    start_host: Callable[..., Awaitable[Host]],
) -> None:
    """`invalidate` marks generations without a claim: on a host that holds no token for the key (it
    restarted, or another host wrote the key last and then died), `mark_invalid`'s put is fenced and the
    mark stays in memory only, yet the answer counts it; the next claim re-reads the shared manifest and
    the session is restored from the snapshot the client asked to invalidate."""
    h1 = await start_host("h1")
    k = key_of("A")
    await h1.h.turn("A")
    assert (await h1.coordinator.save("A"))["saved"] == 1
    h1.gate.tokens.clear()  # as after a restart of this kvsidecar (or: the last writer died)
    answer = await h1.coordinator.invalidate("A")
    on_disk = h1.store.reload(k)
    assert on_disk is not None
    persisted = sum(1 for r in on_disk.generations.values() if not r.valid)
    assert answer["invalidated"] == persisted, f"answered {answer}, persisted {persisted}"
