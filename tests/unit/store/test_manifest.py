"""Issue 16 item 7: manifests and fingerprint records are hostile input, parsed behind caps and a schema.

One bad file is one bad session: the store opens, the others work, the bad one is reported with a stable
reason, and its snapshot files are held (never collected as orphans). The daemon answers JSON, never 500.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsidecar.backend.fake import FakeKvBackend
from kvsidecar.config import RetentionConfig
from kvsidecar.daemon.service import Daemon
from kvsidecar.metrics import Metrics
from kvsidecar.retention.job import RetentionJob
from kvsidecar.retention.plan import Disk
from kvsidecar.store.naming import SnapshotIdentity
from kvsidecar.store.snapshots import SnapshotStore
from tests.unit.coordinator_helpers import conversation, make_config
from tests.unit.store.test_snapshots import FP, FP2, ID, make_store, save, server_writes

GOOD = SnapshotIdentity(server="local", provider="p", model="m", session_id="good")


def good_manifest(tmp_path: Path) -> tuple[SnapshotStore, dict[str, Any]]:
    store = make_store(tmp_path)
    save(store, 10)
    plan = store.begin_save(GOOD)
    store.commit_save(plan, server_writes(plan, 20), fingerprint=FP, revision=1)
    return store, json.loads((store.manifests_dir / f"{ID.key}.json").read_bytes())


def set_gen(field: str, value: object) -> Callable[[dict[str, Any]], object]:
    return lambda d: d["generations"]["a"].__setitem__(field, value)


# (label, what to write at <key>.json: bytes, or a function of the valid manifest, or a planted entry)
Poison = bytes | str | Callable[[dict[str, Any]], object]
POISON: list[tuple[str, Poison, str]] = [
    ("deep array", b"[" * 50_000 + b"]" * 50_000, "MANIFEST_TOO_LARGE"),
    ("deep array small", b"[" * 30_000, "MANIFEST_TOO_DEEP"),
    (
        "deep inside a valid object",
        lambda d: d.__setitem__("x", json.loads("[" * 50 + "]" * 50)),
        "MANIFEST_TOO_DEEP",
    ),
    ("deep object", b'{"a":' * 10_000 + b"1" + b"}" * 10_000, "MANIFEST_TOO_DEEP"),
    ("tokens as a string", set_gen("tokens", "958"), "MANIFEST_SCHEMA"),
    ("tokens as a bool", set_gen("tokens", True), "MANIFEST_SCHEMA"),
    ("tokens as a float", set_gen("tokens", 1.5), "MANIFEST_SCHEMA"),
    ("bytes negative", set_gen("bytes", -1), "MANIFEST_SCHEMA"),
    ("bytes huge", set_gen("bytes", 10**30), "MANIFEST_SCHEMA"),
    ("checksum as a number", set_gen("checksum", 5), "MANIFEST_SCHEMA"),
    ("fingerprint as a path", set_gen("fingerprint", "../../etc/passwd"), "MANIFEST_SCHEMA"),
    ("generations as a list", lambda d: d.__setitem__("generations", []), "MANIFEST_SCHEMA"),
    ("generation c", lambda d: d["generations"].__setitem__("c", d["generations"]["a"]), "MANIFEST_SCHEMA"),
    ("record as null", lambda d: d["generations"].__setitem__("a", None), "MANIFEST_SCHEMA"),
    ("unknown field", lambda d: d.__setitem__("extra", 1), "MANIFEST_SCHEMA"),
    ("last_used_at as a string", lambda d: d.__setitem__("last_used_at", "x"), "MANIFEST_SCHEMA"),
    ("NaN time", b"", "MANIFEST_SCHEMA"),  # filled in below: json.dumps writes NaN
    ("current without record", lambda d: d.__setitem__("current", "b"), "MANIFEST_SCHEMA"),
    ("session id with a newline", lambda d: d.__setitem__("session_id", "s1\n"), "MANIFEST_SCHEMA"),
    # the credential scope is part of the key: a manifest cannot claim another scope for its files
    ("scope of another credential", lambda d: d.__setitem__("scope", "kabc"), "MANIFEST_KEY_MISMATCH"),
    ("scope as a path", lambda d: d.__setitem__("scope", "../x"), "MANIFEST_SCHEMA"),
    ("scope upper case", lambda d: d.__setitem__("scope", "HOOK"), "MANIFEST_SCHEMA"),
    ("scope as a number", lambda d: d.__setitem__("scope", 1), "MANIFEST_SCHEMA"),
    ("not utf-8", b"\xff\xfe\x00{", "MANIFEST_NOT_JSON"),
    ("truncated", b'{"schema": 1, "key": ', "MANIFEST_NOT_JSON"),
    ("empty", b"", "MANIFEST_NOT_JSON"),
    ("top-level array", b"[]", "MANIFEST_SCHEMA"),
    ("large", b" " * (1 << 20) + b"{}", "MANIFEST_TOO_LARGE"),
    ("fifo", "fifo", "MANIFEST_NOT_REGULAR"),
    ("symlink to a good manifest", "symlink", "MANIFEST_NOT_REGULAR"),
    ("directory", "directory", "MANIFEST_NOT_REGULAR"),
]


def write_poison(store: SnapshotStore, valid: dict[str, Any], label: str, poison: Poison) -> None:
    path = store.manifests_dir / f"{ID.key}.json"
    path.unlink()
    if label == "NaN time":
        path.write_text(json.dumps({**valid, "created_at": float("nan")}))
    elif isinstance(poison, bytes):
        path.write_bytes(poison)
    elif poison == "fifo":
        os.mkfifo(path)
    elif poison == "symlink":
        path.symlink_to(store.manifests_dir / f"{GOOD.key}.json")
    elif poison == "directory":
        path.mkdir()
    else:
        assert callable(poison), poison
        data = json.loads(json.dumps(valid))
        poison(data)
        path.write_text(json.dumps(data))


@pytest.mark.parametrize(("label", "poison", "reason"), POISON, ids=[p[0] for p in POISON])
async def test_one_bad_manifest_is_one_bad_session(
    tmp_path: Path, label: str, poison: Poison, reason: str
) -> None:
    store, valid = good_manifest(tmp_path)
    write_poison(store, valid, label, poison)
    again = SnapshotStore(state_dir=store.state_dir, snapshot_dirs=dict(store.snapshot_dirs))
    report = again.open()  # never RecursionError, never a hang on a FIFO
    assert again.get(ID.key) is None and again.get(GOOD.key) is not None
    assert report.bad_manifests[f"{ID.key}.json"].startswith(reason)
    assert again.find_restorable(GOOD, FP)[0] is not None
    # The bad session's file is held: not an orphan, not collected, whatever the policy says.
    held = again.snapshot_dirs["local"] / ID.filename("a")
    assert held in report.held and held not in report.orphans
    retention = RetentionJob(
        store=again,
        config=RetentionConfig(max_age_days=None, min_free_percent=None),
        metrics=Metrics(),
        protected_keys=set,
        clock=lambda: 10**12,
        disk_usage=lambda _p: Disk(total_bytes=10**12, free_bytes=10**12),
    )
    result = await retention.run()
    assert result["deletions"] == [] and held.exists()


def test_the_scope_is_recorded_at_each_save_and_old_manifests_are_the_operators(tmp_path: Path) -> None:
    """A save records its session's credential scope; a manifest of before scopes were recorded (no
    `scope`) keeps the operator's key and identity, its scope unknown, and the next save records it."""
    store, valid = good_manifest(tmp_path)
    assert valid["scope"] == "hook"
    client = SnapshotIdentity(server="local", provider="p", model="m", session_id="good", scope="kalice")
    plan = store.begin_save(client)
    store.commit_save(plan, server_writes(plan, 20), fingerprint=FP, revision=1)
    recorded = store.get(client.key)
    assert recorded is not None and recorded.scope == "kalice" and recorded.identity == client
    assert client.key != GOOD.key
    path = store.manifests_dir / f"{ID.key}.json"
    path.write_text(json.dumps({k: v for k, v in valid.items() if k != "scope"}))
    again = SnapshotStore(state_dir=store.state_dir, snapshot_dirs=dict(store.snapshot_dirs))
    again.open()
    old = again.get(ID.key)
    assert old is not None and old.scope is None and old.identity == ID
    plan = again.begin_save(ID)
    again.commit_save(plan, server_writes(plan, 30), fingerprint=FP, revision=2)
    saved = again.get(ID.key)
    assert saved is not None and saved.scope == "hook"


def test_a_save_replaces_the_bad_manifest(tmp_path: Path) -> None:
    store, _ = good_manifest(tmp_path)
    (store.manifests_dir / f"{ID.key}.json").write_text('{"schema": 1, "tokens": "958"}')
    again = SnapshotStore(state_dir=store.state_dir, snapshot_dirs=dict(store.snapshot_dirs))
    again.open()
    plan = again.begin_save(ID)
    m = again.commit_save(plan, server_writes(plan, 30), fingerprint=FP, revision=2)
    assert again.bad_manifests() == {} and again.get(ID.key) == m


@pytest.mark.parametrize(
    "content",
    [b"[" * 60_000, b'{"model_path": ["x"]}', b'{"model_path": 5}', b"\xff", b"[]", b'"x"', b"{" * 5],
)
def test_poisoned_fingerprint_record_only_loses_the_explanation(tmp_path: Path, content: bytes) -> None:
    store = make_store(tmp_path)
    save(store, 10, fp=FP)
    (store.fingerprints_dir / f"{FP.digest}.json").write_bytes(content)
    cand, rej = store.find_restorable(ID, FP2)  # a mismatch looks the old components up
    assert cand is None and [r.reason for r in rej] == ["FINGERPRINT_CHANGED"]
    assert store.fingerprint_components(FP.digest) is None


def test_fingerprint_record_behind_a_symlink_is_not_read(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    save(store, 10, fp=FP)
    path = store.fingerprints_dir / f"{FP.digest}.json"
    real = tmp_path / "elsewhere.json"
    real.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(real)
    assert store.fingerprint_components(FP.digest) is None
    assert store.fingerprint_components("../../elsewhere") is None


# the daemon over HTTP ----------------------------------------------------------------------------------


async def daemon_turn(d: Daemon, session: str) -> None:
    r = await d.coordinator.acquire(session, provider="local", model="m")
    assert r.lease_id is not None and r.slot_id is not None
    fake = d.coordinator.servers["local"].backend
    assert isinstance(fake, FakeKvBackend)
    pn, cn = fake.infer(r.slot_id, conversation(session, 1))
    await d.coordinator.release(r.lease_id, status="ok", prompt_tokens=pn, cached_tokens=cn)


def make_daemon(tmp_path: Path) -> Daemon:
    config = make_config(tmp_path, servers={"local": {"slot_wait_s": 5}})
    return Daemon(
        config, backends={"local": FakeKvBackend(tmp_path / "snaps")}, process_finder=None, watch=False
    )


async def test_daemon_with_poisoned_manifests_answers_json(tmp_path: Path) -> None:
    first = make_daemon(tmp_path)
    await first.start()
    for s in ("good1", "good2", "victim"):
        await daemon_turn(first, s)
    await first.aclose()  # the shutdown checkpoint saves them
    manifests = tmp_path / "state" / "manifests"
    victim_key = SnapshotIdentity(server="local", provider="local", model="m", session_id="victim").key
    (manifests / f"{victim_key}.json").write_bytes(b"[" * 30_000)
    raw = json.loads(
        (
            manifests
            / f"{SnapshotIdentity(server='local', provider='local', model='m', session_id='good2').key}.json"
        ).read_bytes()
    )
    raw["generations"][raw["current"]]["tokens"] = "958"
    (manifests / ("e" * 32 + ".json")).write_text(json.dumps(raw))  # wrong type, and not its own key

    d = make_daemon(tmp_path)
    await d.start()
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=d.app()), base_url="http://127.0.0.1"
        ) as c:

            async def acquire(session: str) -> httpx.Response:
                body = {"provider": "local", "model": "m"}
                r = await c.post(f"/v1/sessions/{session}/acquire", json=body)
                if r.status_code == 200:
                    lease = r.json()["lease_id"]
                    await c.post(f"/v1/leases/{lease}/release", json={"status": "aborted"})
                return r

            answers = [
                await acquire("good1"),
                await acquire("victim"),
                await c.get("/v1/status"),
                await c.get("/v1/sessions"),
                await c.get("/v1/sessions/good2"),
                await c.post("/v1/gc", params={"dry_run": "true"}),
                await c.post("/v1/gc"),
                await c.delete("/v1/sessions/victim"),
            ]
        for r in answers:
            assert r.headers["content-type"].startswith("application/json"), r.text
            assert r.status_code in (200, 404), r.text
        assert answers[0].json()["outcome"] == "restored"
        assert answers[1].json()["outcome"] == "cold"
        assert answers[2].json()["snapshots"]["bad_manifests"] == 2
    finally:
        await d.aclose()
