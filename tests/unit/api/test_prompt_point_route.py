"""`POST /v1/leases/{lease_id}/prompt-point`: a hook client takes the save point its lease's start plan asked
for (`prompt_point` in the acquire's answer), as the proxy does before it forwards; the client's `acquire`
block takes it by itself when the acquire sent the prompt. Over ASGI with the fake backend and a hybrid
memory class patched in (tests/unit/coordinator/test_savepoints.py covers the point itself)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from kvsidecar.api.routes import create_app
from kvsidecar.client import AsyncKvSidecar, SidecarError
from kvsidecar.coordinator import starts
from kvsidecar.fingerprint.memory_class import HYBRID, MemoryClass
from tests.unit.api.test_routes import TOKEN
from tests.unit.coordinator.test_savepoints import ids_engine
from tests.unit.coordinator_helpers import Harness, conversation, start_harness


@pytest.fixture
async def h(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Harness]:
    cls = MemoryClass(kind=HYBRID, arch="qwen35", n_layer=4, attention_layers=1, recurrent_layers=3)
    monkeypatch.setattr(starts, "memory_of", lambda _srv: cls)
    harness = await start_harness(tmp_path)
    ids_engine(harness)
    yield harness
    await harness.coordinator.aclose()


def client(h: Harness) -> AsyncKvSidecar:
    app = create_app(h.coordinator, token=TOKEN)
    return AsyncKvSidecar("http://127.0.0.1:8377", token=TOKEN, transport=httpx.ASGITransport(app=app))


def generations(h: Harness, session: str) -> list[int]:
    """The tokens of each saved generation of `session`."""
    found = [m for m in h.coordinator.store.all() if m.session_id == session]
    return sorted(g.tokens for m in found for g in m.generations.values() if g is not None)


def points(h: Harness) -> float:
    sample = h.coordinator.metrics.registry.get_sample_value(
        "kvsidecar_save_total", {"server": "local", "trigger": "prompt_point"}
    )
    return sample or 0.0


async def run(h: Harness, kv: AsyncKvSidecar, session: str, prompt: list[int]) -> bool:
    """One turn through the client's acquire block (the engine runs the prompt, the numbers reported)."""
    async with kv.acquire(session, provider="local", model="m", prompt=prompt) as lease:
        assert lease.slot_id is not None
        computed, reused = h.fake.infer(lease.slot_id, prompt)
        lease.report(prompt_tokens=computed, cached_tokens=reused)
    return lease.prompt_point


async def test_the_client_block_takes_the_point_the_plan_asks_for(h: Harness) -> None:
    async with client(h) as kv:
        await run(h, kv, "B", conversation("B", 2))
        before = points(h)
        p1 = conversation("A", 3)
        assert await run(h, kv, "A", p1)  # two sessions, one slot: the plan asks for a point
    assert len(p1) - 1 in generations(h, "A") and points(h) == before + 1


async def test_the_route_answers_what_it_did_and_once_per_lease(h: Harness) -> None:
    async with client(h) as kv:
        await run(h, kv, "B", conversation("B", 2))
        before = points(h)
        p1 = conversation("A", 3)
        lease = await kv.acquire_lease("A", provider="local", model="m", prompt=p1)
        assert lease.prompt_point and lease.lease_id is not None
        first = await kv.prompt_point(lease.lease_id)
        again = await kv.prompt_point(lease.lease_id)
        await kv.release(lease.lease_id, status="ok")
        with pytest.raises(SidecarError) as gone:
            await kv.prompt_point(lease.lease_id)
    assert first["taken"] and first["saved"] and first["tokens"] == len(p1) - 1 and first["error"] is None
    assert first["computed"] == len(p1) - 1  # the slot held B's KV: the whole head was computed
    assert generations(h, "A") == [len(p1) - 1] and points(h) == before + 1
    assert again == {
        "taken": False,
        "tokens": None,
        "computed": None,
        "saved": False,
        "prefill_ms": None,
        "save_ms": None,
        "error": None,
    }
    assert gone.value.code == "KV_LEASE_NOT_FOUND" and gone.value.status == 404


async def test_no_point_without_a_prompt(h: Harness) -> None:
    async with client(h) as kv:
        await run(h, kv, "B", conversation("B", 2))
        before = points(h)
        lease = await kv.acquire_lease("A", provider="local", model="m")
        assert not lease.prompt_point and lease.lease_id is not None
        answer = await kv.prompt_point(lease.lease_id)
        await kv.release(lease.lease_id, status="ok")
    assert answer["taken"] is False and points(h) == before and generations(h, "A") == []
