"""`POST /v1/checkpoint` (`kvsidecar checkpoint`): every dirty slot of a server saved now, before a planned
stop of llama-server, through the shutdown checkpoint's own loop; with `wait`, answered once the saves have
committed, KV_SAVE_FAILED naming what a stop would lose, KV_OPERATION_TIMEOUT past its bound (the saves go
on). Over ASGI with the fake backend; tests/integration/test_checkpoint_real.py stops a real llama-server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from kvsidecar.api.routes import create_app
from kvsidecar.backend.fake import FakeKvBackend
from kvsidecar.client import AsyncKvSidecar, SidecarError
from kvsidecar.coordinator.core import Coordinator
from kvsidecar.store.snapshots import SnapshotStore
from kvsidecar.testing.poll import until
from tests.unit.api.test_routes import TOKEN, http
from tests.unit.coordinator_helpers import Harness, make_config, start_harness


@pytest.fixture
async def pool(tmp_path: Path) -> AsyncIterator[Harness]:
    """Two slots, saves only when asked: idle and switch saves never come first."""
    harness = await start_harness(
        tmp_path, total_slots=2, servers={"local": {"mode": "managed-slots"}}, checkpoint={"idle_s": None}
    )
    yield harness
    await harness.coordinator.aclose()


def unsaved(h: Harness) -> dict[str, int]:
    return {v["session"]: v["unsaved_turns"] for v in h.coordinator.session_views()}


def client(h: Harness) -> AsyncKvSidecar:
    app = create_app(h.coordinator, token=TOKEN)
    return AsyncKvSidecar("http://127.0.0.1:8377", token=TOKEN, transport=httpx.ASGITransport(app=app))


async def test_checkpoint_wait_saves_every_dirty_slot_before_it_answers(pool: Harness) -> None:
    await pool.turn("A")
    await pool.turn("B")
    await pool.turn("B")
    assert sorted(unsaved(pool).values()) == [1, 2]
    async with http(pool) as c:
        r = await c.post("/v1/checkpoint", params={"wait": "true"})
    assert r.status_code == 200, r.text
    assert r.json() == {"servers": ["local"], "dirty": 2, "waited": True, "saved": 2}
    assert set(unsaved(pool).values()) == {0}  # committed: a stop now loses nothing
    stats = pool.coordinator.status()["stats"]
    assert stats["saves"] == 2
    registry = pool.coordinator.metrics.registry
    assert (
        registry.get_sample_value("kvsidecar_save_total", {"server": "local", "trigger": "checkpoint"}) == 2
    )
    async with http(pool) as c:  # nothing dirty: nothing to do, at once
        again = await c.post("/v1/checkpoint", params={"wait": "true", "server": "local"})
    assert again.json() == {"servers": ["local"], "dirty": 0, "waited": True, "saved": 0}


async def test_checkpoint_without_wait_answers_at_once_and_saves(pool: Harness) -> None:
    await pool.turn("A")
    hold = pool.fake.hold("save")
    async with client(pool) as kv:
        answer = await kv.checkpoint()
    assert answer == {"servers": ["local"], "dirty": 1, "waited": False, "saved": None}
    await hold.entered.wait()  # the save runs after the answer
    assert set(unsaved(pool).values()) == {1}
    hold.release()
    await until(lambda: set(unsaved(pool).values()) == {0}, what="the checkpoint's save")


async def test_a_failed_save_is_an_error_naming_the_session(pool: Harness) -> None:
    await pool.turn("A")
    pool.fake.fail_next_save()
    async with client(pool) as kv:
        with pytest.raises(SidecarError) as failed:
            await kv.checkpoint(wait=True)
    assert failed.value.status == 502 and failed.value.code == "KV_SAVE_FAILED"
    (short,) = unsaved(pool)
    assert f"1 of 1 dirty session(s) not saved: {short} (KV_SAVE_FAILED)" in failed.value.message
    assert unsaved(pool) == {short: 1}
    async with client(pool) as kv:  # the next try saves it
        assert (await kv.checkpoint(wait=True))["saved"] == 1


async def test_past_its_timeout_the_wait_ends_and_the_save_goes_on(pool: Harness) -> None:
    await pool.turn("A")
    hold = pool.fake.hold("save")
    async with client(pool) as kv:
        with pytest.raises(SidecarError) as late:
            await kv.checkpoint(wait=True, timeout_s=0.2)
    assert late.value.status == 504 and late.value.code == "KV_OPERATION_TIMEOUT"
    assert "not all saved within 0.2 s" in late.value.message
    hold.release()
    await until(lambda: set(unsaved(pool).values()) == {0}, what="the save the timeout left running")


async def test_checkpoint_refuses_what_it_cannot_do(pool: Harness) -> None:
    await pool.turn("A")
    async with http(pool) as c:
        unknown = await c.post("/v1/checkpoint", params={"server": "elsewhere", "wait": "true"})
        bad_wait = await c.post("/v1/checkpoint", params={"wait": "perhaps"})
        bad_timeout = await c.post("/v1/checkpoint", params={"wait": "true", "timeout_s": "-1"})
        get = await c.get("/v1/checkpoint")
    async with http(pool, token=None) as anonymous:
        no_token = await anonymous.post("/v1/checkpoint")
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "KV_NOT_FOUND"
    assert "Servers: local." in unknown.json()["error"]["hint"]
    for r in (bad_wait, bad_timeout):
        assert r.status_code == 400 and r.json()["error"]["code"] == "KV_BAD_REQUEST", r.text
    assert get.status_code == 405 and no_token.status_code == 401
    assert set(unsaved(pool).values()) == {1}  # none of them saved anything


async def test_a_daemon_that_is_stopping_says_so(tmp_path: Path) -> None:
    h = await start_harness(tmp_path)
    await h.turn("A")
    hold = h.fake.hold("save")
    stop = asyncio.ensure_future(h.coordinator.aclose())  # its own shutdown checkpoint saves A
    try:
        await hold.entered.wait()  # the daemon is in its shutdown checkpoint
        async with http(h) as c:
            r = await c.post("/v1/checkpoint", params={"wait": "true"})
        assert r.status_code == 503 and r.json()["error"]["code"] == "KV_SHUTTING_DOWN"
    finally:
        hold.release()
        await stop
    assert set(unsaved(h).values()) == {0}


async def test_checkpoint_of_one_server_saves_only_its_slots(tmp_path: Path) -> None:
    config = make_config(
        tmp_path,
        servers={"other": {"snapshot_dir": str(tmp_path / "other"), "base_url": "http://127.0.0.1:9"}},
        routes={"local": "local", "other": "other"},
        checkpoint={"idle_s": None},
    )
    fakes = {"local": FakeKvBackend(tmp_path / "snaps"), "other": FakeKvBackend(tmp_path / "other")}
    store = SnapshotStore(
        state_dir=config.state_dir,
        snapshot_dirs={n: tmp_path / ("snaps" if n == "local" else n) for n in fakes},
    )
    store.open()
    coordinator = Coordinator(
        config=config, store=store, backends=dict(fakes), process_finder=lambda _u: None
    )
    await coordinator.start()
    try:
        for provider, fake in fakes.items():
            lease = await coordinator.acquire("S", provider=provider, model="m")
            assert lease.slot_id is not None and lease.lease_id is not None
            prompt_n, cache_n = fake.infer(lease.slot_id, list(range(64)))
            await coordinator.release(
                lease.lease_id, status="ok", prompt_tokens=prompt_n, cached_tokens=cache_n
            )
        answer = await coordinator.checkpoint("other", wait=True, timeout_s=30)
        assert answer == {"servers": ["other"], "dirty": 1, "waited": True, "saved": 1}
        assert {v["server"]: v["unsaved_turns"] for v in coordinator.session_views()} == {
            "local": 1,
            "other": 0,
        }
        answer = await coordinator.checkpoint(None, wait=True, timeout_s=None)
        assert answer == {"servers": ["local", "other"], "dirty": 1, "waited": True, "saved": 1}
    finally:
        await coordinator.aclose()
