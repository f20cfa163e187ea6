"""The facts a start is planned from, and the acquire path acting on the plan (kvsidecar/coordinator/starts.py,
restore.py), on the fake engine: its state files hold real token headers, so the point's tokens are read as
on llama-server."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsidecar.backend.prompts import KnownTokens, UnknownTokens
from kvsidecar.coordinator import plan, starts
from kvsidecar.coordinator.state import HOOK_SCOPE, AcquireResult, Outcome
from kvsidecar.fingerprint.memory_class import HYBRID, MemoryClass
from kvsidecar.store.naming import SnapshotIdentity
from tests.unit.coordinator.test_scope import process
from tests.unit.coordinator_helpers import Harness, conversation, start_harness


async def _run(h: Harness, session: str, tokens: list[int], prompt: list[int] | None = None) -> AcquireResult:
    r = await h.coordinator.acquire(
        session,
        provider="local",
        model="m",
        prompt=None if prompt is None else KnownTokens(tokens=tuple(prompt), cost_ms=0.0),
    )
    assert r.lease_id is not None and r.slot_id is not None
    prompt_n, cache_n = h.fake.infer(r.slot_id, tokens)
    await h.coordinator.release(r.lease_id, status="ok", prompt_tokens=prompt_n, cached_tokens=cache_n)
    return r


def _hybrid(monkeypatch: pytest.MonkeyPatch) -> None:
    cls = MemoryClass(kind=HYBRID, arch="qwen35", n_layer=4, attention_layers=1, recurrent_layers=3)
    monkeypatch.setattr(starts, "memory_of", lambda _srv: cls)


async def test_the_fake_engine_is_plain_and_its_ram_cache_unknown(tmp_path: Path) -> None:
    h = await start_harness(tmp_path)
    try:
        srv = h.coordinator.servers["local"]
        assert starts.memory_of(srv).kind == "plain"
        assert starts.ram_cache_of(srv) == "unknown"
    finally:
        await h.coordinator.aclose()


async def test_hybrid_divergent_prompt_is_not_restored_and_an_extension_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hybrid model: a prompt that diverges from A's saved point is not restored (llama-server would
    throw the restore away); one that extends it strictly is, proven, with the reuse it expects."""
    _hybrid(monkeypatch)
    h = await start_harness(tmp_path)
    try:
        a = conversation("A", 2)
        await _run(h, "A", a)
        await _run(h, "B", conversation("B", 2))  # A saved, evicted
        h.calls()
        diverged = a[:-10] + [7] * 30
        r = await _run(h, "A", diverged, diverged)
        assert r.outcome is not Outcome.RESTORED
        assert r.plan_reason == plan.R_HYBRID_DIVERGENCE
        assert "restore" not in h.calls()
        await _run(h, "B", conversation("B", 3))  # A saved again (its diverged turn)
        h.calls()
        extends = diverged + [9] * 20
        r = await _run(h, "A", extends, extends)
        assert r.outcome is Outcome.RESTORED and r.proved
        assert r.expected_reuse == len(diverged)
        assert "restore" in h.calls()
    finally:
        await h.coordinator.aclose()


async def test_hybrid_unknown_prompt_restores_when_the_ram_cache_cannot_hold_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Unknown tokens on a hybrid model: the fake engine's RAM cache is unknown (cannot be shown to hold the
    session), so the newest point is restored, unproven, as before."""
    _hybrid(monkeypatch)
    h = await start_harness(tmp_path)
    try:
        await _run(h, "A", conversation("A", 1))
        await _run(h, "B", conversation("B", 1))
        r = await h.coordinator.acquire(
            "A", provider="local", model="m", prompt=UnknownTokens(reason="multimodal", detail="")
        )
        assert r.outcome is Outcome.RESTORED and r.proved is False
        assert r.plan_reason == plan.R_UNPROVEN_NO_RAM
        assert r.lease_id is not None
        await h.coordinator.release(r.lease_id, status="aborted")
    finally:
        await h.coordinator.aclose()


async def test_a_donor_that_shares_few_tokens_is_not_restored(tmp_path: Path) -> None:
    """A donor is chosen by the tokens it shares with the prompt: a long one that shares 32 is not restored
    (its read is worth less than the prefill it spares), one that the prompt extends is."""
    h = await start_harness(tmp_path, total_slots=2)
    try:
        donor = conversation("D", 40)  # 2,000 tokens
        await _run(h, "D", donor)
        assert (await h.coordinator.save("D"))["saved"] == 1
        few = donor[:32] + [5] * 500
        r = await h.coordinator.acquire(
            "N",
            provider="local",
            model="m",
            prefix_from="D",
            prompt=KnownTokens(tokens=tuple(few), cost_ms=0),
        )
        assert not any(a.startswith("prefix_from") for a in r.actions)
        assert r.plan_reason == plan.R_DONOR_NOT_WORTH
        assert r.lease_id is not None
        await h.coordinator.release(r.lease_id, status="aborted")
        more = donor + [5] * 10
        r = await h.coordinator.acquire(
            "M",
            provider="local",
            model="m",
            prefix_from="D",
            prompt=KnownTokens(tokens=tuple(more), cost_ms=0),
        )
        assert any(a.startswith("prefix_from") for a in r.actions), r
        assert r.plan == plan.DONOR and r.expected_reuse == len(donor)
        assert r.lease_id is not None
        await h.coordinator.release(r.lease_id, status="aborted")
    finally:
        await h.coordinator.aclose()


async def test_planner_remembers_the_instance_a_session_ran_on(tmp_path: Path) -> None:
    h = await start_harness(tmp_path)
    try:
        await _run(h, "A", conversation("A", 1))
        srv = h.coordinator.servers["local"]
        planner = h.coordinator.restorer.planner
        identity = SnapshotIdentity(
            server="local", provider="local", model="m", session_id="A", scope=HOOK_SCOPE
        )
        rt = h.coordinator.sessions.get(identity.key)
        assert rt is not None
        assert planner._ran.get(rt.key) == ("local", planner.guard.epoch(srv))
        h.fake.restart()  # a new llama-server process: its identity counts the restart at the next look
        await h.coordinator.guard.refresh(srv)
        assert planner._ran.get(rt.key) != ("local", planner.guard.epoch(srv))
    finally:
        await h.coordinator.aclose()


@pytest.mark.parametrize("hybrid", [True, False])
async def test_a_switch_hands_a_non_plain_sessions_kv_to_the_ram_cache_only_when_it_replaces_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, hybrid: bool
) -> None:
    """llama-server alone copies a slot's KV (with its checkpoints) into its RAM cache when a prompt that
    keeps less than half of it takes the slot. On a hybrid model kvsidecar hands the session it evicts to
    that cache (one token of its own, `park`) only when a restore is about to replace it: a session that
    starts from the slot's KV (B, new) leaves that to llama-server, as alone, and costs nothing. On plain
    attention the snapshot serves, nothing is parked."""
    if hybrid:
        _hybrid(monkeypatch)
    h = await start_harness(tmp_path)
    try:
        h.process[0] = process()  # seen: its settings say the RAM cache is on
        await h.coordinator.guard.refresh(h.coordinator.servers["local"], force=True)
        await _run(h, "A", conversation("A", 1))
        h.calls()
        b = conversation("B", 1)
        r = await _run(h, "B", b, b)
        assert r.plan == plan.KEEP and h.calls() == ["save"]  # the slot kept: no park
        a = conversation("A", 2)  # extends A's point strictly: restored (B saved and evicted first)
        r = await _run(h, "A", a, a)
        calls = h.calls()
        assert r.outcome is Outcome.RESTORED, r
        assert ("prompt" in calls) is hybrid, calls
        if hybrid:
            assert calls.index("prompt") < calls.index("restore"), calls
    finally:
        await h.coordinator.aclose()


async def test_a_hybrid_sessions_kv_is_handed_to_the_ram_cache_before_an_erase_replaces_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """With `restore.share_prefix` off a new session starts on an erased slot: the evicted session's KV is
    parked first (one token), then erased; nothing is primed (sharing is off)."""
    _hybrid(monkeypatch)
    h = await start_harness(tmp_path, restore={"share_prefix": False})
    try:
        h.process[0] = process()  # seen: its settings say the RAM cache is on
        await h.coordinator.guard.refresh(h.coordinator.servers["local"], force=True)
        await _run(h, "A", conversation("A", 1))
        h.calls()
        b = conversation("B", 1)
        r = await _run(h, "B", b, b)
        assert r.plan == plan.ERASE and h.calls() == ["save", "prompt", "erase"], r
    finally:
        await h.coordinator.aclose()


async def test_hybrid_restores_the_older_point_that_the_prompt_extends(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both generations are points: A's older one (turn 1) is strictly extended by a prompt that diverges from
    its newer one (turn 2's tail re-rendered), so the older one is restored, proven, and not as a fallback."""
    _hybrid(monkeypatch)
    h = await start_harness(tmp_path)
    try:
        a1 = conversation("A", 2)
        await _run(h, "A", a1)
        await _run(h, "B", conversation("B", 2))  # A's first point saved (a1)
        a2 = a1 + [11] * 40
        r = await _run(h, "A", a2, a2)
        assert r.outcome is Outcome.RESTORED
        await _run(h, "B", conversation("B", 3))  # A's second point saved (a2), the first kept
        h.calls()
        rerendered = a1 + [12] * 40 + [13] * 20  # diverges inside a2's tail, extends a1
        r = await _run(h, "A", rerendered, rerendered)
        assert r.outcome is Outcome.RESTORED and r.proved, r
        assert r.plan_reason == plan.R_PROVEN
        assert r.expected_reuse == len(a1)
        assert "restore" in h.calls()
        assert not (r.reason or "").startswith("previous generation"), r.reason
    finally:
        await h.coordinator.aclose()


async def test_a_plain_prompt_restores_the_point_it_shares_most_with(tmp_path: Path) -> None:
    """Plain attention reuses any common prefix: of two points, the one sharing more tokens is restored."""
    h = await start_harness(tmp_path)
    try:
        a1 = conversation("A", 2)
        await _run(h, "A", a1)
        await _run(h, "B", conversation("B", 2))
        a2 = a1[:60] + [11] * 100  # a newer point that shares only 60 tokens with what comes next
        await _run(h, "A", a2, a2)
        await _run(h, "B", conversation("B", 3))
        nxt = a1 + [14] * 10
        r = await _run(h, "A", nxt, nxt)
        assert r.outcome is Outcome.RESTORED and r.expected_reuse == len(a1), r
    finally:
        await h.coordinator.aclose()


async def test_a_plain_sessions_kv_that_no_save_holds_is_handed_to_the_ram_cache_before_a_restore(
    tmp_path: Path,
) -> None:
    """On plain attention the evicted session's snapshot is its hand-off; when its save fails (or the
    cost-aware policy skips it) no snapshot holds its last turn, and the restore of the incoming session
    replaces that KV: without a park it is gone, where llama-server alone would have kept it in its RAM
    cache. It is parked first (one token), as a hybrid session's is."""
    h = await start_harness(tmp_path)
    try:
        h.process[0] = process()  # seen: its settings say the RAM cache is on
        await h.coordinator.guard.refresh(h.coordinator.servers["local"], force=True)
        await _run(h, "A", conversation("A", 1))
        b = conversation("B", 1)
        await _run(h, "B", b, b)  # A saved and evicted; B runs on the slot
        h.calls()
        h.fake.fail_next_save()  # B's save at the switch fails: B's turn is in the slot only
        a = conversation("A", 2)
        r = await _run(h, "A", a, a)
        calls = h.calls()
        assert r.outcome is Outcome.RESTORED, r
        assert "prompt" in calls and calls.index("prompt") < calls.index("restore"), calls
    finally:
        await h.coordinator.aclose()


async def test_the_tokenizer_and_a_resident_point_follow_the_class_of_the_instance_running_now(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The class is read once per instance (`ServerRuntime.refresh`; unknown, the strict rule, until it is):
    whether a request's tokens are read (the proxy asks before the acquire) and whether a resident turn takes
    its prompt point follow that read, not the class the server's last plan used. Before, after a restart
    into a hybrid model (or while the new instance's class was unread) the planner still said plain: no
    tokens, so no proof and no prompt point for the first turns."""
    plain = MemoryClass(kind="plain", arch="llama", n_layer=4, attention_layers=4)
    hybrid = MemoryClass(kind=HYBRID, arch="qwen35", n_layer=4, attention_layers=1, recurrent_layers=3)
    unknown = MemoryClass(kind="unknown", arch="", n_layer=0, attention_layers=0, why="not read")
    now = {"class": plain}
    monkeypatch.setattr(starts, "memory_of", lambda _srv: now["class"])
    h = await start_harness(tmp_path)
    try:
        await _run(h, "A", conversation("A", 1))  # planned as plain
        srv = h.coordinator.servers["local"]
        planner = h.coordinator.restorer.planner
        prompt = KnownTokens(tokens=tuple(range(64)), cost_ms=0.0)
        assert planner.tokenizer_for(srv) is None
        for read in (unknown, hybrid):  # a restart: not read yet, then read
            now["class"] = read
            assert planner.tokenizer_for(srv) is srv.backend, read.kind
        assert planner.resident_point(srv, prompt, restore_enabled=True, oversubscribed=True)
    finally:
        await h.coordinator.aclose()


async def test_swa_full_kv_is_never_handed_to_nor_primed_from_the_ram_cache(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On SWA with `--swa-full` llama-server's RAM cache keeps only the window's last positions of the SWA
    layers (a slot save's copy, docs/MODELS.md), and reuses a prefix from it wherever a prompt diverges less
    than n_swa tokens before its end: the tokens it then recomputes attend over an incomplete window, the
    wrong KV that the plan refuses to restore (`swa_window_incomplete`). kvsidecar must not lead a request
    there: no park of a session's KV before a restore replaces it, no prime of an empty slot."""
    cls = MemoryClass(kind="swa", arch="gemma3", n_layer=6, attention_layers=6, n_swa=128, swa_full=True)
    monkeypatch.setattr(starts, "memory_of", lambda _srv: cls)
    h = await start_harness(tmp_path)
    try:
        h.process[0] = process()  # seen: its settings say the RAM cache is on
        await h.coordinator.guard.refresh(h.coordinator.servers["local"], force=True)
        await _run(h, "A", conversation("A", 1))
        b = conversation("B", 1)
        await _run(h, "B", b, b)
        h.calls()
        a = conversation("A", 2)  # extends A's point strictly: restored (B saved and evicted first)
        r = await _run(h, "A", a, a)
        assert r.outcome is Outcome.RESTORED and "prompt" not in h.calls(), r
        await h.coordinator.guard.refresh(h.coordinator.servers["local"], force=True)  # the canary empties it
        h.calls()
        r3 = await h.coordinator.acquire(None, provider="local", model="m", purpose="title")
        assert r3.slot_id is not None and h.fake.slot_tokens(r3.slot_id) == [], h.calls()
        assert "prompt" not in h.calls()  # an empty slot stays empty: llama-server does not look there
        await h.coordinator.release(r3.lease_id or "", status="aborted")
    finally:
        await h.coordinator.aclose()
