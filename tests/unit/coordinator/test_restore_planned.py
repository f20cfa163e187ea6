"""Paths around the start plan that must never restore what it did not prove: a donor with restore off or
an unproven runtime, a donor that saved again between the plan and its restore (SWA with --swa-full: wrong
KV), and a planned restore that failed answers unproven (fake engine, the memory class patched)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvsidecar.backend.prompts import KnownTokens
from kvsidecar.coordinator import coldstart, starts
from kvsidecar.coordinator.state import HOOK_SCOPE, Outcome
from kvsidecar.fingerprint.memory_class import MemoryClass
from kvsidecar.proxy.answers import kv_headers
from tests.unit.coordinator_helpers import Harness, conversation, start_harness

SWA_FULL = MemoryClass(kind="swa", arch="gemma3", n_layer=4, attention_layers=4, n_swa=8, swa_full=True)
SWA_NOFULL = MemoryClass(kind="swa", arch="gemma3", n_layer=4, attention_layers=4, n_swa=8, swa_full=False)


async def _turn(
    h: Harness,
    session: str,
    tokens: list[int],
    *,
    prefix_from: str | None = None,
    prompt: list[int] | None = None,
) -> list[str]:
    r = await h.coordinator.acquire(
        session,
        provider="local",
        model="m",
        scope=HOOK_SCOPE,
        prefix_from=prefix_from,
        prompt=None if prompt is None else KnownTokens(tokens=tuple(prompt), cost_ms=0.0),
    )
    assert r.lease_id is not None and r.slot_id is not None
    p, c = h.fake.infer(r.slot_id, tokens)
    await h.coordinator.release(r.lease_id, status="ok", prompt_tokens=p, cached_tokens=c)
    return [*r.actions, f"plan={r.plan}:{r.plan_reason}"]


@pytest.mark.parametrize("cls", [SWA_FULL, SWA_NOFULL])
async def test_donor_restored_with_restore_disabled_bypasses_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cls: MemoryClass
) -> None:
    monkeypatch.setattr(starts, "memory_of", lambda _srv: cls)
    h = await start_harness(
        tmp_path, total_slots=2, servers={"local": {"mode": "managed-slots"}}, restore={"enabled": False}
    )
    try:
        await _turn(h, "D", conversation("D", 2))
        assert (await h.coordinator.save("D"))["saved"] == 1
        d = conversation("D", 2)
        diverged = d[:20] + [5] * 60  # k = 80 on an SWA model: a restore here is wrong KV / useless
        actions = await _turn(h, "N", diverged, prefix_from="D", prompt=diverged)
        print(actions)
        assert not any(a.startswith("prefix_from") for a in actions), actions
    finally:
        await h.coordinator.aclose()


@pytest.mark.parametrize("cls", [SWA_FULL])
async def test_donor_divergent_with_restore_enabled_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cls: MemoryClass
) -> None:
    """Control: restore enabled, the plan refuses the divergent donor."""
    monkeypatch.setattr(starts, "memory_of", lambda _srv: cls)
    h = await start_harness(tmp_path, total_slots=2, servers={"local": {"mode": "managed-slots"}})
    try:
        await _turn(h, "D", conversation("D", 2))
        assert (await h.coordinator.save("D"))["saved"] == 1
        d = conversation("D", 2)
        diverged = d[:20] + [5] * 60
        actions = await _turn(h, "N", diverged, prefix_from="D", prompt=diverged)
        print(actions)
        assert not any(a.startswith("prefix_from") for a in actions), actions
    finally:
        await h.coordinator.aclose()


SWA_FULL = MemoryClass(kind="swa", arch="gemma3", n_layer=4, attention_layers=4, n_swa=8, swa_full=True)


async def test_donor_saved_between_plan_and_restore(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(starts, "memory_of", lambda _srv: SWA_FULL)
    h = await start_harness(tmp_path, total_slots=2, servers={"local": {"mode": "managed-slots"}})
    try:
        g1 = list(range(100, 200))
        await _turn(h, "D", g1)
        assert (await h.coordinator.save("D"))["saved"] == 1
        g2 = g1[:10] + [7] * 150  # the donor moves on: diverges at token 10
        await _turn(h, "D", g2)  # resident, unsaved
        orig = coldstart.ColdStart._restore_donor
        restored: list[Any] = []

        async def racing(
            self: Any, srv: Any, slot: Any, donor: Any, donor_rt: Any, fp: Any, point: Any
        ) -> Any:
            assert (await h.coordinator.save("D"))["saved"] == 1  # its save commits meanwhile
            out = await orig(self, srv, slot, donor, donor_rt, fp, point)
            restored.append(out)
            return out

        monkeypatch.setattr(coldstart.ColdStart, "_restore_donor", racing)
        prompt = g1 + [9] * 40  # extends g1 exactly: the plan proves the donor (k = 0)
        actions = await _turn(h, "N", prompt, prefix_from="D", prompt=prompt)
        print(actions, restored)
        # g2 (k = 150 against the prompt) was never judged by the plan: it is not restored (the donor
        # moved on; the session starts cold), only the point the plan proved could be
        assert restored and (restored[0] == ("moved", None) or restored[0][1] == len(g1)), restored
        assert not any(a.startswith("prefix_from") for a in actions), actions
    finally:
        await h.coordinator.aclose()


async def test_a_failed_restore_does_not_answer_proved(tmp_path: Path) -> None:
    h = await start_harness(tmp_path)
    try:
        a = conversation("A", 2)
        await _turn(h, "A", a)
        await _turn(h, "B", conversation("B", 2))  # A saved, evicted
        h.fake.fail_next_restore()
        grown = a + [3] * 20
        r = await h.coordinator.acquire(
            "A", provider="local", model="m", prompt=KnownTokens(tokens=tuple(grown), cost_ms=0.0)
        )
        headers = dict(kv_headers(r))
        print(r.outcome, headers)
        assert r.outcome is not Outcome.RESTORED
        assert headers.get(b"x-kv-proved") != b"true" and b"x-kv-expected-reuse" not in headers, headers
    finally:
        await h.coordinator.aclose()
