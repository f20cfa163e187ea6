"""What each reader's caller does with a document the one reader refuses: every kind in `KINDS` has an
outcome here (a new kind without one fails `test_every_kind_has_a_callers_outcome`), fed every attack of
test_documents.py. A bad file of ours costs a cold start, a proof run again, a record written again or a
clear config error; it never raises past its caller, never deletes a good snapshot, and the caller works
again once the file is repaired."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.responses import Response

from kvsidecar.cli import main
from kvsidecar.config import load_config
from kvsidecar.coordinator.carry import CarryOver
from kvsidecar.coordinator.costs import CostModel
from kvsidecar.coordinator.telemetry import Telemetry
from kvsidecar.daemon.statelock import LOCK_NAME, Holder, StateLock
from kvsidecar.errors import ConfigError, NotFound
from kvsidecar.files import documents
from kvsidecar.files.confined import DirAnchor
from kvsidecar.files.documents import KINDS
from kvsidecar.fingerprint.file_digests import FileDigestCache, load_digest_cache
from kvsidecar.fleet.plane import HostRecord, awaited
from kvsidecar.fleet.routing import FleetRouter
from kvsidecar.metrics import Metrics
from kvsidecar.store.carryover import RowsProof, Verdicts
from tests.fleet_helpers import stop
from tests.unit.coordinator_helpers import make_config
from tests.unit.files.test_documents import ATTACKS
from tests.unit.fleet.test_gate import Host, key_of, start_host
from tests.unit.store.test_snapshots import FP, make_store, save

__all__ = ["start_host"]  # the fixture, shared with fleet/test_gate.py

Outcome = Callable[[Path, bytes], None]
FleetOutcome = Callable[[Host, bytes], Awaitable[None]]


def manifest(tmp_path: Path, bad: bytes) -> None:
    """Refused and kept (its key's files are nobody's orphans), never deleted with its good snapshot."""
    store = make_store(tmp_path)
    m = save(store, 100)
    path = tmp_path / "state" / "manifests" / f"{m.key}.json"
    good, snapshots = path.read_bytes(), sorted((tmp_path / "snaps").iterdir())
    path.write_bytes(bad)
    store = make_store(tmp_path)  # a restart: every manifest read again
    assert store.bad_manifests()[path.name].startswith("MANIFEST_")
    assert store.get(m.key) is None and not store.loose_files()
    assert sorted((tmp_path / "snaps").iterdir()) == snapshots and path.read_bytes() == bad
    path.write_bytes(good)
    assert make_store(tmp_path).get(m.key) == m


def fingerprint_record(tmp_path: Path, bad: bytes) -> None:
    """Unknown (a less specific mismatch reason); the next registration writes it again."""
    store = make_store(tmp_path)
    save(store, 100)
    path = tmp_path / "state" / "fingerprints" / f"{FP.digest}.json"
    assert path.exists()
    path.write_bytes(bad)
    assert store.fingerprint_components(FP.digest) is None
    store.register_fingerprint(FP)
    assert store.fingerprint_components(FP.digest) == FP.components


def digest_cache(tmp_path: Path, bad: bytes) -> None:
    """An empty cache (a re-hash); the next digest writes a good one."""
    path, model = tmp_path / "digests.json", tmp_path / "model.gguf"
    model.write_bytes(b"weights" * 100)
    path.write_bytes(bad)
    cache = FileDigestCache(path, racy_window_s=0)
    assert load_digest_cache(path) == {} and cache.digest(model) is not None and cache.computed == 1
    assert len(load_digest_cache(path)) == 1


def carry_over_verdicts(tmp_path: Path, bad: bytes) -> None:
    """No verdict: the carry-over's proof runs again (never the 500 of a RecursionError on every acquire
    that needs one); the verdict it records replaces the file."""
    config = make_config(tmp_path)
    store = make_store(tmp_path)
    (tmp_path / "state" / Verdicts.NAME).write_bytes(bad)
    carry = CarryOver(config=config, store=store, telemetry=Telemetry(Metrics(), CostModel()))
    table = carry._table()  # what an acquire that needs a carry-over reads first
    assert table.get("old", "new") is None
    table.record("old", "new", RowsProof(equal=True, rows=256, detail=""))
    assert Verdicts(DirAnchor(tmp_path / "state", area="state")).get("old", "new") is True


def lock_record(tmp_path: Path, bad: bytes) -> None:
    """A record that cannot be read, with nobody holding the lock: taken over, and ours written."""
    state = tmp_path / "state"
    state.mkdir()
    (state / LOCK_NAME).write_bytes(bad)
    with StateLock.acquire(state) as lock:
        assert Holder.model_validate_json((state / LOCK_NAME).read_bytes()) == lock.holder


def config(tmp_path: Path, bad: bytes) -> None:
    """A clear config error from `config check` and `serve` alike (exit 2), never a traceback."""
    path = tmp_path / "config.yaml"
    path.write_bytes(bad)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.code == "KV_CONFIG_INVALID"  # naming the file, or each duplicate key
    assert main(["-c", str(path), "config", "check"]) == 2
    path.write_text(f"state_dir: {tmp_path / 'state'}\n")
    assert main(["-c", str(path), "config", "check"]) == 0


OUTCOMES: dict[str, Outcome] = {
    documents.MANIFEST.name: manifest,
    documents.FINGERPRINT_RECORD.name: fingerprint_record,
    documents.DIGEST_CACHE.name: digest_cache,
    documents.CARRY_VERDICTS.name: carry_over_verdicts,
    documents.LOCK_RECORD.name: lock_record,
    documents.CONFIG.name: config,
}


@pytest.mark.parametrize(
    ("kind", "attack"),
    [
        pytest.param(kind, attack, id=f"{kind.name}-{attack}")
        for kind in KINDS
        if kind.name in OUTCOMES
        for attack in ATTACKS
    ],
)
def test_each_readers_caller_survives_every_attack(
    kind: documents.DocumentKind, attack: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad, _reasons = ATTACKS[attack](kind)
    OUTCOMES[kind.name](tmp_path, bad)
    assert "Traceback" not in capsys.readouterr().err


# fleet mode: values read back from Redis, answers of peers -------------------------------------------
async def host_record(host: Host, bad: bytes) -> None:
    """Refused and counted (not a record of ours): the host is not live; a good record brings it back."""
    agent = host.agent
    await agent.client.set("t:host:h8", bad, px=60_000)
    await awaited(agent.client.sadd("t:hosts", "h8"))
    refused = agent.plane.refused_records
    assert "h8" not in await agent.plane.live_hosts() and agent.plane.refused_records == refused + 1
    good = HostRecord(host_id="h8", advertise_url="http://192.0.2.8:8377", version="x", time=time.time())
    await agent.client.set("t:host:h8", good.to_json(), px=60_000)
    await awaited(agent.client.sadd("t:hosts", "h8"))
    assert "h8" in await agent.plane.live_hosts()
    await agent.client.delete("t:host:h8")


async def residency(host: Host, bad: bytes) -> None:
    """Not resident anywhere (a route by lease or placement instead); a good entry is found again."""
    plane, k = host.agent.plane, key_of("R")
    await awaited(host.agent.client.hset("t:res:h7", k, bad))  # type: ignore[arg-type]
    assert await plane.where(k, ["h7"]) == [] and k not in await plane.residency("h7")
    await awaited(host.agent.client.hset("t:res:h7", k, '{"server":"local","slot":0,"t":1.0}'))
    assert [r.host_id for r in await plane.where(k, ["h7"])] == ["h7"]


async def queued_release(host: Host, bad: bytes) -> None:
    """Skipped (the lease ends at its TTL); a good release beside it is applied."""
    lease = await host.coordinator.acquire("Q", provider="local", model="m")
    assert lease.lease_id is not None
    await awaited(host.agent.client.rpush("t:releases:h1", bad))
    await awaited(host.agent.client.rpush("t:releases:h1", f'{{"status":"ok","lease":"{lease.lease_id}"}}'))
    assert await host.agent.apply_releases() == 1
    assert lease.lease_id not in host.coordinator.leases


async def peer_answer(host: Host, bad: bytes) -> None:
    """A fan-out counts the peer as knowing nothing; a lease it granted for a caller gone is left to its TTL."""
    record = HostRecord(host_id="h9", advertise_url="http://192.0.2.9:8377", version="x", time=time.time())
    await host.agent.client.set("t:host:h9", record.to_json(), px=60_000)
    await awaited(host.agent.client.sadd("t:hosts", "h9"))
    await host.agent.heartbeat()
    answers: list[bytes] = [bad]

    def answer(_request: httpx.Request) -> httpx.Response:
        return httpx.Response(200, content=answers[0], headers={"content-type": "application/json"})

    router = FleetRouter(host.agent, host.coordinator, token=None, transport=httpx.MockTransport(answer))
    try:
        with pytest.raises(NotFound):
            await router._peer("h9", "POST", "/v1/sessions/A/events", {})
        await router._drop_granted("h9", Response(bad, status_code=200))
        answers[0] = b'{"saved": 1}'
        assert await router._peer("h9", "POST", "/v1/sessions/A/events", {}) == {"saved": 1}
    finally:
        await router.aclose()


FLEET_OUTCOMES: dict[str, FleetOutcome] = {
    documents.HOST_RECORD.name: host_record,
    documents.RESIDENCY.name: residency,
    documents.QUEUED_RELEASE.name: queued_release,
    documents.PEER_ANSWER.name: peer_answer,
}


@pytest.mark.parametrize("name", list(FLEET_OUTCOMES))
async def test_each_fleet_readers_caller_survives_every_attack(
    name: str, start_host: Callable[..., Awaitable[Host]]
) -> None:
    kind = next(k for k in KINDS if k.name == name)
    host = await start_host("h1")
    for task in host.agent._tasks:  # no heartbeat reads or prunes meanwhile: each call here does
        await stop(task)
    failed: dict[str, Any] = {}
    for attack in ATTACKS:
        bad, _reasons = ATTACKS[attack](kind)
        try:
            await FLEET_OUTCOMES[name](host, bad)
        except Exception as exc:  # collected: every attack is tried, and named if it fails
            failed[attack] = repr(exc)[:200]
    assert failed == {}


def test_every_kind_has_a_callers_outcome() -> None:
    assert set(OUTCOMES) | set(FLEET_OUTCOMES) == {k.name for k in KINDS}
    assert not set(OUTCOMES) & set(FLEET_OUTCOMES)
