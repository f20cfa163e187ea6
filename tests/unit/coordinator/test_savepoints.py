"""Save points at the prompt's end (kvsidecar/coordinator/savepoints.py) on the fake engine with a hybrid
memory class patched in: the plan asks for one when sessions outnumber slots, the prefill-only call and the
save make a generation that holds the prompt but its last token, and the next turn, whose prompt re-renders
the last answer, restores it; a prefill or a save that fails never fails the turn."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsidecar.backend.base import PromptResult
from kvsidecar.backend.prompts import KnownTokens
from kvsidecar.coordinator import plan, starts
from kvsidecar.coordinator.state import AcquireResult, Outcome
from kvsidecar.errors import BackendUnavailable
from kvsidecar.fingerprint.memory_class import HYBRID, MemoryClass
from tests.unit.coordinator_helpers import Harness, conversation, start_harness


@pytest.fixture(autouse=True)
def hybrid(monkeypatch: pytest.MonkeyPatch) -> None:
    cls = MemoryClass(kind=HYBRID, arch="qwen35", n_layer=4, attention_layers=1, recurrent_layers=3)
    monkeypatch.setattr(starts, "memory_of", lambda _srv: cls)


def ids_engine(h: Harness) -> None:
    """The fake's prompt call keeps the token ids as given (llama-server's slot holds the prompt's ids)."""

    async def run_prompt(slot_id: int, prompt: str | list[int], *, n_predict: int = 0) -> PromptResult:
        assert isinstance(prompt, list) and n_predict == 0
        h.fake.calls.append(("prompt", slot_id, None))
        computed, reused = h.fake.infer(slot_id, prompt)
        return PromptResult(slot_id=slot_id, computed=computed, reused=reused)

    h.fake.run_prompt = run_prompt  # type: ignore[method-assign]


async def acquire(h: Harness, session: str, prompt: list[int]) -> AcquireResult:
    r = await h.coordinator.acquire(
        session, provider="local", model="m", prompt=KnownTokens(tokens=tuple(prompt), cost_ms=0.0)
    )
    assert r.lease_id is not None and r.slot_id is not None
    return r


async def finish(h: Harness, r: AcquireResult, tokens: list[int]) -> None:
    assert r.lease_id is not None and r.slot_id is not None
    p, c = h.fake.infer(r.slot_id, tokens)
    await h.coordinator.release(r.lease_id, status="ok", prompt_tokens=p, cached_tokens=c)


async def turn_two(h: Harness, *, take: bool) -> AcquireResult:
    """B runs (two sessions, one slot); A's turn 1 (prompt P1, its point taken when `take`, an answer
    generated); B evicts A; A's turn 2 re-renders the answer differently and adds a message."""
    ids_engine(h)
    await finish(h, await acquire(h, "B", conversation("B", 2)), conversation("B", 2))
    p1 = conversation("A", 3)
    r = await acquire(h, "A", p1)
    assert r.prompt_point
    if take:
        assert r.lease_id is not None
        taken = await h.coordinator.savepoints.take(r.lease_id)
        assert taken is not None and taken.saved and taken.tokens == len(p1) - 1, taken
        assert taken.error is None and taken.prefill_ms >= 0 and taken.save_ms >= 0
        m = next(m for m in h.coordinator.store.all() if m.session_id == "A")
        assert m.current is not None and m.generations[m.current].tokens == len(p1) - 1
    await finish(h, r, p1 + [21] * 30)  # the answer, as generated
    await finish(h, await acquire(h, "B", conversation("B", 3)), conversation("B", 3))  # A evicted, saved
    p2 = p1 + [22] * 30 + [23] * 40  # the answer re-rendered (reasoning dropped), then a new message
    r2 = await acquire(h, "A", p2)
    await finish(h, r2, p2)
    return r2


async def test_the_next_turn_restores_the_prompt_point(tmp_path: Path) -> None:
    h = await start_harness(tmp_path)
    try:
        r = await turn_two(h, take=True)
        assert r.outcome is Outcome.RESTORED and r.proved and r.plan_reason == plan.R_PROVEN, r
        assert r.expected_reuse == len(conversation("A", 3)) - 1
    finally:
        await h.coordinator.aclose()


async def test_without_the_prompt_point_the_next_turn_restores_nothing(tmp_path: Path) -> None:
    """The control: only the end-of-turn point, which the re-rendered answer diverges from."""
    h = await start_harness(tmp_path)
    try:
        r = await turn_two(h, take=False)
        assert r.outcome is not Outcome.RESTORED and r.plan_reason == plan.R_HYBRID_DIVERGENCE, r
    finally:
        await h.coordinator.aclose()


async def test_every_session_has_a_slot_a_point_only_when_its_save_is_cheap(tmp_path: Path) -> None:
    """No eviction to come: a point is still taken (a restart may come) while the save's cost is unknown or
    small against the prefill it spares, and not once the figures say the save is dear."""
    h = await start_harness(tmp_path, total_slots=2, servers={"local": {"mode": "managed-slots"}})
    try:
        ids_engine(h)
        await finish(h, await acquire(h, "B", conversation("B", 2)), conversation("B", 2))
        r = await acquire(h, "A", conversation("A", 3))
        assert r.prompt_point  # figures unknown: cheap
        await finish(h, r, conversation("A", 3))
        costs = h.coordinator.costs
        for _ in range(30):  # learned figures (moving averages) that say the save is dear
            costs.observe_prefill("local", tokens=1000, ms=100.0)  # 10,000 tokens/s: 0.1 ms a token
            costs.observe_transfer(  # 1 MB a token written at 100 MB/s: 10 ms a token
                "local", kind="save", nbytes=10**9, tokens=1000, server_ms=10_000.0, measured_ms=1.0
            )
        r = await acquire(h, "A", conversation("A", 4))  # A's next turn, resident
        assert not r.prompt_point and r.lease_id is not None
        h.calls()
        assert await h.coordinator.savepoints.take(r.lease_id) is None
        assert h.calls() == []
        await finish(h, r, conversation("A", 4))
    finally:
        await h.coordinator.aclose()


@pytest.mark.parametrize("fails", ["prefill", "save"])
async def test_a_failed_prompt_point_never_fails_the_turn(tmp_path: Path, fails: str) -> None:
    h = await start_harness(tmp_path)
    try:
        ids_engine(h)
        await finish(h, await acquire(h, "B", conversation("B", 2)), conversation("B", 2))
        p1 = conversation("A", 3)
        r = await acquire(h, "A", p1)
        assert r.prompt_point and r.lease_id is not None
        if fails == "prefill":

            async def down(slot_id: int, prompt: str | list[int], *, n_predict: int = 0) -> PromptResult:
                raise BackendUnavailable("fake prefill failed")

            h.fake.run_prompt = down  # type: ignore[method-assign]
        else:
            h.fake.fail_next_save(1)
        taken = await h.coordinator.savepoints.take(r.lease_id)
        assert taken is not None and not taken.saved and taken.error is not None, taken
        assert await h.coordinator.savepoints.take(r.lease_id) is None  # once per lease
        await finish(h, r, p1 + [21] * 30)  # the lease is still the turn's
        m = next((m for m in h.coordinator.store.all() if m.session_id == "A"), None)
        assert m is None or m.current is None  # no generation recorded for a point that failed
    finally:
        await h.coordinator.aclose()


async def test_a_lease_that_ends_during_the_prefill_is_not_saved(tmp_path: Path) -> None:
    """The slot may be handed on while the prefill runs (the lease expired or was released): what it holds
    then is not the session's to save."""
    h = await start_harness(tmp_path)
    try:
        ids_engine(h)
        await finish(h, await acquire(h, "B", conversation("B", 2)), conversation("B", 2))
        r = await acquire(h, "A", conversation("A", 3))
        assert r.prompt_point and r.lease_id is not None
        lease_id = r.lease_id
        run = h.fake.run_prompt

        async def released_meanwhile(
            slot_id: int, prompt: str | list[int], *, n_predict: int = 0
        ) -> PromptResult:
            done = await run(slot_id, prompt, n_predict=n_predict)
            await h.coordinator.release(lease_id, status="aborted")
            return done

        h.fake.run_prompt = released_meanwhile  # type: ignore[method-assign]
        h.calls()
        taken = await h.coordinator.savepoints.take(lease_id)
        assert taken is not None and taken.error == "lease_ended" and not taken.saved, taken
        assert "save" not in h.calls()
    finally:
        await h.coordinator.aclose()


async def test_a_resident_turn_takes_its_prompt_point_too(tmp_path: Path) -> None:
    """A session that stays in its slot for a turn is still likely to be evicted later: its turn saves the
    prompt's end too (the rule is the plan's, from the class already read: no I/O at the acquire)."""
    h = await start_harness(tmp_path)
    try:
        ids_engine(h)
        await finish(h, await acquire(h, "B", conversation("B", 2)), conversation("B", 2))
        p1 = conversation("A", 3)
        await finish(h, await acquire(h, "A", p1), p1 + [21] * 30)
        p2 = p1 + [22] * 30 + [23] * 40
        h.calls()
        r = await acquire(h, "A", p2)
        assert r.outcome is Outcome.RESIDENT and r.prompt_point, r
        assert h.calls() == []  # the acquire itself made no call
        assert r.lease_id is not None
        taken = await h.coordinator.savepoints.take(r.lease_id)
        assert taken is not None and taken.saved and taken.tokens == len(p2) - 1, taken
        await finish(h, r, p2)
    finally:
        await h.coordinator.aclose()
