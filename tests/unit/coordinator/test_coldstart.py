"""coordinator/coldstart.py: a prefix donor (`prefix_from`) only of the session's own credential scope, as its
manifest records it, across a restart of kvsidecar too (the real llama-server's side:
tests/integration/test_scope_real.py)."""

from __future__ import annotations

import json
from pathlib import Path

from kvsidecar.coordinator.state import HOOK_SCOPE, Outcome
from tests.unit.coordinator_helpers import Harness, conversation, start_harness


async def turn(h: Harness, session: str, scope: str, *, prefix_from: str | None = None) -> list[str]:
    r = await h.coordinator.acquire(
        session, provider="local", model="m", scope=scope, prefix_from=prefix_from
    )
    assert r.lease_id is not None and r.slot_id is not None
    prompt_n, cache_n = h.fake.infer(r.slot_id, conversation(session, 1))
    await h.coordinator.release(r.lease_id, status="ok", prompt_tokens=prompt_n, cached_tokens=cache_n)
    return r.actions


def donated(h: Harness) -> bool:
    return bool(h.coordinator.status()["stats"]["prefix_donor_restores"] > 0)


async def test_a_donor_of_another_scope_is_refused_after_a_restart_as_before(tmp_path: Path) -> None:
    """The hook API's `prefix_from` naming a proxy client's session: the same id in the operator's scope is
    another session (no snapshot), before and after kvsidecar restarts (what is on disk decides, not what
    the daemon remembers); a client's `prefix_from` of another client's session likewise."""
    h = await start_harness(tmp_path, total_slots=2, servers={"local": {"mode": "managed-slots"}})
    try:
        await turn(h, "alice-s", "kalice")
        assert (await h.coordinator.save("alice-s"))["saved"] == 1
        for session, scope in (("H1", HOOK_SCOPE), ("B1", "kbob")):
            actions = await turn(h, session, scope, prefix_from="alice-s")
            assert not any(a.startswith("prefix_from") for a in actions) and not donated(h)
    finally:
        await h.coordinator.aclose()
    h = await start_harness(tmp_path, total_slots=2, servers={"local": {"mode": "managed-slots"}})
    try:
        assert h.coordinator.store.all(), "the snapshot is still there"
        for session, scope in (("H2", HOOK_SCOPE), ("B2", "kbob")):
            actions = await turn(h, session, scope, prefix_from="alice-s")
            assert not any(a.startswith("prefix_from") for a in actions) and not donated(h)
    finally:
        await h.coordinator.aclose()
    h = await start_harness(tmp_path, total_slots=2, servers={"local": {"mode": "managed-slots"}})
    try:  # a scope of its own: her snapshot is her own sessions' donor (no other scope ran yet)
        actions = await turn(h, "A2", "kalice", prefix_from="alice-s")
        assert any(a.startswith("prefix_from") for a in actions) and donated(h)
    finally:
        await h.coordinator.aclose()


async def test_a_manifest_without_a_recorded_scope_is_the_operators_and_no_donor(tmp_path: Path) -> None:
    """A manifest written before scopes were recorded: its key is the operator's, so the hook API restores
    it as that session's own (the upgrade keeps the operator's snapshots); its scope is unknown, so it is
    nobody's donor; no proxy client's session can reach it (their keys hold their scope)."""
    h = await start_harness(tmp_path, total_slots=2, servers={"local": {"mode": "managed-slots"}})
    try:
        await turn(h, "old", HOOK_SCOPE)
        assert (await h.coordinator.save("old"))["saved"] == 1
        [manifest] = h.coordinator.store.all()
    finally:
        await h.coordinator.aclose()
    path = h.coordinator.store.manifests_dir / f"{manifest.key}.json"
    data = json.loads(path.read_bytes())
    del data["scope"]
    path.write_text(json.dumps(data))
    h = await start_harness(tmp_path, total_slots=2, servers={"local": {"mode": "managed-slots"}})
    try:
        actions = await turn(h, "new", HOOK_SCOPE, prefix_from="old")
        assert not any(a.startswith("prefix_from") for a in actions) and not donated(h)
        r = await h.coordinator.acquire("old", provider="local", model="m", scope="kalice")
        assert r.outcome is Outcome.COLD  # another session: the client's key holds its scope
        await h.coordinator.release(r.lease_id or "", status="aborted")
        r = await h.coordinator.acquire("old", provider="local", model="m")
        assert r.outcome is Outcome.RESTORED
        await h.coordinator.release(r.lease_id or "", status="aborted")
    finally:
        await h.coordinator.aclose()
