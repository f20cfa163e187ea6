"""Fleet mode end to end (issue 18): three hosts on one machine, each a real llama-server and a real
`kvsidecar serve`, sharing one snapshot directory and one real redis-server (kvsidecar.testing.fleet).

Whether a turn reused its history is read from llama-server's own timings: `cache_n` (tokens kept in the
slot) against `prompt_n` (tokens computed).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest
import xxhash

from kvsidecar.config import load_config
from kvsidecar.fleet.status import gather
from kvsidecar.testing.fleet import (
    FleetHost,
    LocalFleet,
    acquire,
    call,
    complete,
    event,
    live_hosts,
    ok,
    release,
    release_call,
    status,
    turn,
)
from kvsidecar.testing.llama import vocab_dir, words
from kvsidecar.testing.models import ModelShape, generate_llama_model
from kvsidecar.testing.poll import eventually
from tests.fleet_helpers import RedisServer

MakeFleet = Callable[..., LocalFleet]
# Another tiny model: the same geometry, other weights. Its snapshots must never be restored by a TINY host.
ODD = ModelShape(seed=4321)


@pytest.fixture
def make_fleet(
    redis_server: RedisServer, llama_bin: Path, tiny_model: Path, tmp_path: Path
) -> Iterator[MakeFleet]:
    """Start a 3-host fleet (LocalFleet keyword arguments) and wait until every host sees all three."""
    with ExitStack() as stack:

        def make(**kwargs: Any) -> LocalFleet:
            fleet = LocalFleet(
                tmp_path / "fleet", redis_server.url, binary=llama_bin, model=tiny_model, **kwargs
            )
            stack.enter_context(fleet)
            fleet.wait_live()
            return fleet

        yield make


def acquire_retrying(host: FleetHost, sid: str, *, timeout_s: float = 20.0) -> dict[str, Any]:
    """An acquire as a harness makes it: a 503 (Retry-After: a dead owner's lease has not run out) is retried."""
    body = {"provider": "local", "model": "tiny"}

    def attempt() -> httpx.Response | None:
        response = call(host, "POST", f"/v1/sessions/{sid}/acquire", body)
        return None if response.status_code == 503 else response

    return ok(
        eventually(attempt, timeout_s=timeout_s, what=f"an acquire of {sid} at {host.host_id}, not 503")
    )


def manifest_of(fleet: LocalFleet, sid: str) -> dict[str, Any]:
    """The session's manifest in the shared metadata directory, as JSON."""
    for path in (fleet.meta_dir / "manifests").glob("*.json"):
        data = json.loads(path.read_text())
        if data.get("session_id") == sid:
            assert isinstance(data, dict)
            return data
    raise AssertionError(f"no manifest of {sid} in {fleet.meta_dir / 'manifests'}")


def current_generation(fleet: LocalFleet, sid: str) -> dict[str, Any]:
    manifest = manifest_of(fleet, sid)
    assert manifest["current"] in ("a", "b"), manifest
    record = manifest["generations"][manifest["current"]]
    assert isinstance(record, dict)
    return record


def file_checksum(fleet: LocalFleet, record: dict[str, Any]) -> str:
    return "xxh3-128:" + xxhash.xxh3_128_hexdigest((fleet.slots_dir / record["filename"]).read_bytes())


def redis_view(fleet: LocalFleet) -> dict[str, Any]:
    """The fleet as Redis holds it (what `kvsidecar fleet status --json` prints)."""
    return asyncio.run(gather(load_config(fleet.hosts[0].daemon.config_path).fleet))


def the_leader(fleet: LocalFleet) -> FleetHost | None:
    leaders = [h for h in fleet.hosts if status(h)["fleet"]["leader"]]
    return leaders[0] if len(leaders) == 1 else None


def error_code(response: httpx.Response) -> str:
    code = response.json()["error"]["code"]
    assert isinstance(code, str)
    return code


def test_a_session_is_routed_to_the_host_where_it_is_resident(make_fleet: MakeFleet) -> None:
    fleet = make_fleet()
    h1, h2, h3 = fleet.hosts
    first, t1 = turn(h1, "route", words("route", 400))
    assert first["host"] == "h1" and first["outcome"] == "cold", first
    assert first["base_url"] == h1.llama.base_url and first["lease_id"].startswith("h1~"), first
    assert t1["cache_n"] == 0
    for n, at in ((600, h2), (800, h3)):
        lease = acquire(at, "route")
        assert lease["host"] == "h1" and lease["outcome"] == "resident", (at.host_id, lease)
        assert lease["base_url"] == h1.llama.base_url, lease
        timings = complete(lease["base_url"], lease["slot_id"], words("route", n))
        assert timings["cache_n"] > timings["prompt_n"], timings  # the history stayed in h1's slot
        # the release goes to the host that was asked; it follows the lease to h1
        assert release(at, lease["lease_id"], prompt_tokens=timings["prompt_n"])["released"] is True


def test_new_sessions_are_placed_on_hosts_with_free_slots(make_fleet: MakeFleet) -> None:
    fleet = make_fleet()  # 2 slots per host
    h1 = fleet.hosts[0]
    served = [turn(h1, f"spread{i}", words(f"spread{i}", 200))[0] for i in range(6)]
    hosts = [a["host"] for a in served]
    assert all(a["outcome"] == "cold" for a in served), served
    assert hosts[:2] == ["h1", "h1"], hosts  # this host's free slots first
    assert set(hosts) == {"h1", "h2", "h3"}, hosts  # then the other hosts' free slots, not an eviction at h1
    assert hosts.count("h1") == 2, hosts
    for answer in served:
        assert answer["base_url"] == fleet.host(answer["host"]).llama.base_url, answer


def test_release_and_events_sent_elsewhere_follow_the_session(make_fleet: MakeFleet) -> None:
    fleet = make_fleet()
    h1, h2, h3 = fleet.hosts
    lease = acquire(h1, "fwd")
    assert lease["host"] == "h1", lease
    timings = complete(lease["base_url"], lease["slot_id"], words("fwd", 400))
    released = release(
        h2, lease["lease_id"], prompt_tokens=timings["prompt_n"], cached_tokens=timings["cache_n"]
    )
    assert released["released"] is True and released["dirty"] is True, released
    again = release_call(h3, lease["lease_id"])
    assert again.status_code == 404 and error_code(again) == "KV_LEASE_NOT_FOUND", again.text
    assert status(h1)["leases"] == 0  # the lease really ended where it was held
    flushed = event(h3, "fwd", "flush")  # h3 has no copy: the event is h1's to act on
    assert flushed == {"type": "flush", "saved": 1}, flushed
    record = current_generation(fleet, "fwd")
    assert record["tokens"] >= timings["prompt_n"] and file_checksum(fleet, record) == record["checksum"]


def test_a_dead_hosts_session_is_restored_from_the_shared_directory(make_fleet: MakeFleet) -> None:
    fleet = make_fleet()
    h1, h2, _ = fleet.hosts
    assert turn(h1, "dead", words("dead", 400))[0]["host"] == "h1"
    assert event(h1, "dead", "flush")["saved"] == 1
    saved = current_generation(fleet, "dead")
    h1.kill()
    lease = acquire_retrying(h2, "dead")
    assert lease["host"] == "h2" and lease["outcome"] == "restored", lease
    assert lease["restored_tokens"] == saved["tokens"], (lease, saved)
    assert lease["base_url"] == h2.llama.base_url
    timings = complete(lease["base_url"], lease["slot_id"], words("dead", 600))
    assert timings["cache_n"] > timings["prompt_n"], timings  # the restored history was reused
    release(h2, lease["lease_id"], prompt_tokens=timings["prompt_n"], cached_tokens=timings["cache_n"])
    fleet.wait_live(["h2", "h3"])
    again = acquire(fleet.hosts[2], "dead")  # h3: the session lives at h2 now
    assert again["host"] == "h2" and again["outcome"] == "resident", again
    release(fleet.hosts[2], again["lease_id"])


def race(hosts: tuple[FleetHost, FleetHost], sid: str) -> dict[str, dict[str, Any]]:
    """Both hosts are asked for a new session at the same moment (threads); each lease is released where it
    was asked for. Returns each host's answer."""
    answers: dict[str, dict[str, Any]] = {}
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(hosts))

    def one(host: FleetHost) -> None:
        try:
            barrier.wait(timeout=10)
            answer = acquire(host, sid)
            answers[host.host_id] = answer
            release(host, answer["lease_id"])
        except BaseException as exc:  # reported by the test's thread below
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(h,)) for h in hosts]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    return answers


def free_slots(fleet: LocalFleet) -> dict[str, int]:
    """Free slots per host, as the hosts' last heartbeats told Redis."""
    return {h["host_id"]: sum(s["slots_free"] for s in h["servers"]) for h in redis_view(fleet)["hosts"]}


def test_two_hosts_racing_for_one_new_session_agree_on_its_host(make_fleet: MakeFleet) -> None:
    fleet = make_fleet()
    h1, h2, _ = fleet.hosts
    # h1 full, h2 one free slot, h3 two: h1 places a new session on h3, h2 keeps it (its own free slot
    # first), so the race is between h2 and a third host, not only between the two that were asked
    for sid, at in (("fill1", h1), ("fill2", h1), ("fill3", h2)):
        turn(at, sid, words(sid, 100), hop=True)
    for i in range(8):
        sid = f"race{i}"
        eventually(lambda: free_slots(fleet) == {"h1": 0, "h2": 1, "h3": 2}, what="the slots free again")
        answers = race((h1, h2), sid)
        assert answers["h1"]["host"] == answers["h2"]["host"], answers
        serving = fleet.host(answers["h1"]["host"])
        assert {a["base_url"] for a in answers.values()} == {serving.llama.base_url}, answers
        assert sorted(a["outcome"] for a in answers.values()) == ["cold", "resident"], answers
        assert ok(call(h1, "DELETE", f"/v1/sessions/{sid}"))["purged"] >= 1  # its slot is free again


def test_a_paused_host_is_fenced_off_the_session_it_lost(make_fleet: MakeFleet) -> None:
    fleet = make_fleet()
    h1, h2, h3 = fleet.hosts
    assert turn(h1, "fence", words("fence", 400))[0]["host"] == "h1"
    assert event(h1, "fence", "flush")["saved"] == 1
    flushed = current_generation(fleet, "fence")
    second, _ = turn(h1, "fence", words("fence", 600))  # h1's copy is dirty again, not saved
    assert second["host"] == "h1" and second["outcome"] == "resident", second

    h1.pause()
    eventually(lambda: live_hosts(h2) == ["h2", "h3"], what="h2 to see h1 gone")
    lease = acquire_retrying(h2, "fence")
    assert lease["host"] == "h2" and lease["outcome"] == "restored", lease
    assert lease["restored_tokens"] == flushed["tokens"], (lease, flushed)
    timings = complete(lease["base_url"], lease["slot_id"], words("fence", 800))
    assert timings["cache_n"] > 0, timings
    release(h2, lease["lease_id"], prompt_tokens=timings["prompt_n"], cached_tokens=timings["cache_n"])
    assert ok(call(h2, "POST", "/v1/sessions/fence/save"))["saved"] == 1
    before = manifest_of(fleet, "fence")
    newest = before["generations"][before["current"]]
    assert newest["saved_at"] > flushed["saved_at"] and file_checksum(fleet, newest) == newest["checksum"]

    h1.resume()
    refused = call(h1, "POST", "/v1/sessions/fence/save", hop=True)  # h1's stale, dirty copy
    after = manifest_of(fleet, "fence")
    assert after["current"] == before["current"] and after["generations"] == before["generations"], (
        before,
        after,
    )
    assert file_checksum(fleet, newest) == newest["checksum"]  # h2's newest file was not overwritten
    # and h1 says so: nothing saved, or the fencing refusal itself
    if refused.status_code == 200:
        assert refused.json()["saved"] == 0, refused.text
    else:
        assert refused.status_code == 409 and error_code(refused) == "KV_FLEET_FENCED", refused.text
        assert "KV_FLEET_FENCED" in h1.daemon.log()
    fleet.wait_live()
    for at in (h3, h1):  # h1 forgot its stale copy: the session is h2's
        routed = acquire(at, "fence")
        assert routed["host"] == "h2" and routed["outcome"] == "resident", (at.host_id, routed)
        release(at, routed["lease_id"])


def test_redis_restarted_mid_run(make_fleet: MakeFleet, redis_server: RedisServer) -> None:
    fleet = make_fleet()
    h1, h2, h3 = fleet.hosts
    assert turn(h1, "kept", words("kept", 400))[0]["host"] == "h1"

    redis_server.stop()
    eventually(
        lambda: not any(status(h)["fleet"]["redis_up"] for h in fleet.hosts),
        what="every host to see Redis down",
    )
    lease, timings = turn(h1, "kept", words("kept", 600))  # still served, from h1's own slot
    assert (
        lease["host"] == "h1" and lease["outcome"] == "resident" and timings["cache_n"] > timings["prompt_n"]
    )
    alone, _ = turn(h2, "alone", words("alone", 200))  # a new session, served by the host that was asked
    assert alone["host"] == "h2" and alone["base_url"] == h2.llama.base_url, alone

    redis_server.start()
    eventually(
        lambda: all(
            status(h)["fleet"]["redis_up"] and live_hosts(h) == ["h1", "h2", "h3"] for h in fleet.hosts
        ),
        what="every host registered again",
    )
    # Redis came back empty: each host's next heartbeats write its residency again
    eventually(
        lambda: (
            {h["host_id"]: h["sessions"] for h in redis_view(fleet)["hosts"]} == {"h1": 1, "h2": 1, "h3": 0}
        ),
        what="the residency of h1 and h2 in Redis again",
    )
    for sid, owner in (("kept", "h1"), ("alone", "h2")):
        answer = acquire(h3, sid)
        assert answer["host"] == owner and answer["outcome"] == "resident", (sid, answer)
        release(h3, answer["lease_id"])


def test_one_leader_runs_retention_over_the_shared_directory(make_fleet: MakeFleet) -> None:
    fleet = make_fleet()
    leader = eventually(lambda: the_leader(fleet), what="exactly one host to report itself leader")
    cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "kvsidecar",
            "-c",
            str(leader.daemon.config_path),
            "fleet",
            "status",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    report = json.loads(cli.stdout)
    assert cli.returncode == 0 and report["leader"] == leader.host_id, cli.stdout + cli.stderr
    assert [h["host_id"] for h in report["hosts"]] == ["h1", "h2", "h3"]
    # an orphan in the shared directory, past the grace period: retention over the shared dir deletes it
    orphan = fleet.slots_dir / f"{'7' * 32}.a.bin"
    orphan.write_bytes(b"\0" * 4096)
    old = time.time() - 7 * 24 * 3600
    os.utime(orphan, (old, old))
    others = [h for h in fleet.hosts if h is not leader]
    for host in others:  # served where it lands (hop header): a host that is not the leader leaves it alone
        call(host, "POST", "/v1/gc", hop=True)
        assert orphan.exists(), host.host_id
    result = ok(call(leader, "POST", "/v1/gc"))
    orphans = [d for d in result["deletions"] if d["file"] == orphan.name]
    assert orphans and orphans[0]["reason"] == "orphan" and orphans[0].get("deleted") is True, result
    assert not orphan.exists()
    assert all(f"file={orphan.name[:12]}" not in h.daemon.log() for h in others)
    assert the_leader(fleet) is leader


def test_a_host_with_another_model_never_restores_the_others_snapshots(
    make_fleet: MakeFleet, llama_bin: Path
) -> None:
    odd = generate_llama_model(ODD, vocab_dir=vocab_dir(llama_bin))
    fleet = make_fleet(models=[None, None, odd])
    h1, h2, h3 = fleet.hosts
    assert turn(h1, "model", words("model", 400))[0]["host"] == "h1"
    assert event(h1, "model", "flush")["saved"] == 1
    same = acquire(h2, "model", hop=True)  # the control: a host with the same model restores it
    assert same["host"] == "h2" and same["outcome"] == "restored", same
    release(h2, same["lease_id"])
    other = acquire(h3, "model", hop=True)
    assert other["host"] == "h3" and other["outcome"] in ("cold", "cold_fallback"), other
    timings = complete(other["base_url"], other["slot_id"], words("model", 600))
    assert timings["cache_n"] == 0, timings  # nothing of the other model's KV reached h3's slot
    release(h3, other["lease_id"], prompt_tokens=timings["prompt_n"])
