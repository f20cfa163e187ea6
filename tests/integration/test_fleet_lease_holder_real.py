"""Issue 26 C, item 6, end to end: two real hosts (each a real llama-server and a real `kvsidecar serve`)
on one real redis-server. A forwarded acquire stuck in a SIGSTOPped host is given up by the caller's host,
which serves the session itself; when the stopped host wakes, the stale call must end in no lease anywhere
(before the fix: a lease on the new owner that nobody holds, and after a few such episodes every slot of
that host held)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from kvsidecar.testing.fleet import (
    FleetHost,
    LocalFleet,
    acquire,
    call,
    complete,
    ok,
    release,
    status,
    turn,
)
from kvsidecar.testing.llama import words
from kvsidecar.testing.poll import eventually
from tests.fleet_helpers import RedisServer


@pytest.fixture
def fleet(
    redis_server: RedisServer, llama_bin: Path, tiny_model: Path, tmp_path: Path
) -> Iterator[LocalFleet]:
    with LocalFleet(
        tmp_path / "fleet", redis_server.url, binary=llama_bin, model=tiny_model, n_hosts=2
    ) as running:
        running.wait_live()
        yield running


def settled(woken: FleetHost, owner: FleetHost, abandoned: int) -> None:
    def done() -> bool:
        dropped = woken.daemon.log().count("kv.fleet.acquire_abandoned") > abandoned
        return dropped or status(owner)["leases"] > 0

    eventually(done, what=f"{woken.host_id} to act on the stale forwarded acquire")


def test_a_stale_forwarded_acquire_in_a_woken_host_leaves_no_lease(fleet: LocalFleet) -> None:
    h1, h2 = fleet.hosts
    for episode in range(2):  # before the fix every episode left one more slot of h2 held
        sid = f"stale{episode}"
        first, _ = turn(h1, sid, words(sid, 300))
        assert first["host"] == "h1", first  # the session lives on h1
        unreachable = h2.daemon.log().count("kv.fleet.host_unreachable")
        h1.pause()
        # a harness calling h2 while h2 still sees h1 live: forwarded to h1, where it sticks
        body = {"provider": "local", "model": "tiny"}
        response = call(h2, "POST", f"/v1/sessions/{sid}/acquire", body, timeout_s=60)
        lease = ok(response)  # h2 gave up on the stopped h1 and served the session itself
        assert lease["host"] == "h2", lease
        forwarded = h2.daemon.log().count("kv.fleet.host_unreachable") > unreachable
        assert forwarded, "the acquire was not forwarded to h1"
        timings = complete(lease["base_url"], lease["slot_id"], words(sid, 400))
        release(h2, lease["lease_id"], prompt_tokens=timings["prompt_n"], cached_tokens=timings["cache_n"])

        abandoned = h1.daemon.log().count("kv.fleet.acquire_abandoned")
        h1.resume()  # h1 now reads the forwarded call h2 gave up on (and h2's close of it)
        # either h1 drops the stale call, or (before the fix) it ends in a lease on h2
        settled(h1, h2, abandoned)
        fleet.wait_live()
        assert status(h2)["leases"] == 0, f"episode {episode}: a lease on h2 that nobody holds"
        assert status(h1)["leases"] == 0
        again = acquire(h1, sid)  # routed to h2, where the session now lives: no wait, no 503
        assert again["host"] == "h2" and again["outcome"] == "resident", again
        release(h1, again["lease_id"], status="aborted")
