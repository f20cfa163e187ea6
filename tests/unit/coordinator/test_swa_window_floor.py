"""SWA with --swa-full: a restore holds the SWA cells of only the window before its end, so a later prompt on
that KV (the session resident, or kept KV another session is given) must extend the restored tokens; one that
diverges inside them would be reused by llama-server over an incomplete window: the slot is erased first
(`swa_window_incomplete`). Fake engine, the class patched in."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsidecar.coordinator import plan, starts
from kvsidecar.coordinator.state import Outcome
from kvsidecar.fingerprint.memory_class import MemoryClass
from tests.unit.coordinator.test_savepoints import acquire, finish, ids_engine
from tests.unit.coordinator_helpers import Harness, conversation, start_harness

SWA_FULL = MemoryClass(kind="swa", arch="gemma3", n_layer=4, attention_layers=4, n_swa=8, swa_full=True)
PLAIN = MemoryClass(kind="plain", arch="llama", n_layer=4, attention_layers=4)


async def restored_a(h: Harness) -> list[int]:
    """A runs, B evicts it (A saved), A comes back with a prompt extending its save: restored. Returns the
    prompt A's restored turn sent."""
    ids_engine(h)
    a1 = conversation("A", 2)
    await finish(h, await acquire(h, "A", a1), a1)
    b1 = conversation("B", 2)
    await finish(h, await acquire(h, "B", b1), b1)
    a2 = conversation("A", 3)
    r = await acquire(h, "A", a2)
    assert r.outcome is Outcome.RESTORED and r.proved, r
    await finish(h, r, a2)
    return a2


@pytest.mark.parametrize("extends", [True, False])
async def test_a_resident_prompt_must_extend_what_was_restored(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, extends: bool
) -> None:
    monkeypatch.setattr(starts, "memory_of", lambda _srv: SWA_FULL)
    h = await start_harness(tmp_path, checkpoint={"policy": "save-before-evict"})
    try:
        a2 = await restored_a(h)
        # the next prompt extends the restored turn, or rewrites its history 30 tokens in
        a3 = a2 + [7] * 20 if extends else a2[:30] + [9] * 80
        h.calls()
        r = await acquire(h, "A", a3)
        if extends:
            assert r.outcome is Outcome.RESIDENT and "erase" not in r.actions
        else:
            assert r.outcome is Outcome.COLD and r.reason == plan.R_SWA_WINDOW, r
            assert "erase" in r.actions and "erase" in h.calls()
        await finish(h, r, a3)
    finally:
        await h.coordinator.aclose()


async def test_no_floor_on_a_class_whose_restore_holds_every_position(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Control: plain attention restores every position, so a resident prompt may diverge anywhere."""
    monkeypatch.setattr(starts, "memory_of", lambda _srv: PLAIN)
    h = await start_harness(tmp_path, checkpoint={"policy": "save-before-evict"})
    try:
        a2 = await restored_a(h)
        r = await acquire(h, "A", a2[:30] + [9] * 80)
        assert r.outcome is Outcome.RESIDENT, r
        await finish(h, r, a2[:30] + [9] * 80)
    finally:
        await h.coordinator.aclose()


async def test_kept_kv_of_a_restore_is_erased_for_a_prompt_that_leaves_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another session of the same scope, whose prompt shares the restored KV's first 30 tokens, would be
    given that KV kept (llama-server reusing the 30 over the incomplete window): erased first."""
    monkeypatch.setattr(starts, "memory_of", lambda _srv: SWA_FULL)
    h = await start_harness(tmp_path, checkpoint={"policy": "save-before-evict"})
    try:
        a2 = await restored_a(h)
        c1 = a2[:30] + [9] * 80
        h.calls()
        r = await acquire(h, "C", c1)
        assert r.outcome is Outcome.COLD and "erase" in r.actions, r
        assert "erase" in h.calls()
        await finish(h, r, c1)
    finally:
        await h.coordinator.aclose()
