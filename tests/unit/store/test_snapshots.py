"""SnapshotStore: A/B generations, integrity before restore, fingerprints, reconcile, deletion."""

from __future__ import annotations

import json
import struct
from collections.abc import Callable
from pathlib import Path

import pytest

from kvsidecar.backend.base import SaveResult
from kvsidecar.errors import ManifestInvalid, SnapshotCorrupt
from kvsidecar.fingerprint.runtime import RuntimeFingerprint
from kvsidecar.store.integrity import MAGIC
from kvsidecar.store.manifest import Manifest, read_manifest
from kvsidecar.store.naming import SnapshotIdentity
from kvsidecar.store.snapshots import (
    CORRUPT,
    FILE_MISSING,
    SIZE_MISMATCH,
    STATE_FORMAT_CHANGED,
    TOO_LARGE,
    SavePlan,
    SnapshotStore,
)

FP = RuntimeFingerprint(components={"backend": "llama.cpp", "model_path": "/m.gguf", "runtime_key": ""})
FP2 = RuntimeFingerprint(components={"backend": "llama.cpp", "model_path": "/other.gguf", "runtime_key": ""})
ID = SnapshotIdentity(server="local", provider="p", model="m", session_id="s1")


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        self.t += 1
        return self.t


def make_store(tmp_path: Path, *, verify_checksum: bool = True) -> SnapshotStore:
    store = SnapshotStore(
        state_dir=tmp_path / "state",
        snapshot_dirs={"local": tmp_path / "snaps"},
        clock=Clock(),
        verify_checksum=verify_checksum,
    )
    store.open()
    return store


def server_writes(
    plan: SavePlan, tokens: int, *, version: int = 4, payload: bytes | None = None
) -> SaveResult:
    """What llama-server does on save: write the file, answer with n_saved / n_written."""
    body = payload if payload is not None else bytes(range(256)) * (tokens + 1)
    data = struct.pack("<III", MAGIC, version, tokens + 4) + body
    plan.path.write_bytes(data)
    return SaveResult(
        slot_id=0,
        filename=plan.filename,
        tokens=tokens,
        bytes_written=len(data),
        server_ms=1.0,
        measured_ms=1.0,
    )


def flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def save(store: SnapshotStore, tokens: int, *, fp: RuntimeFingerprint = FP, revision: int = 1) -> Manifest:
    plan = store.begin_save(ID)
    return store.commit_save(plan, server_writes(plan, tokens), fingerprint=fp, revision=revision)


def test_first_save_goes_to_a_then_alternates(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    m1 = save(store, 10)
    assert m1.current == "a" and set(m1.generations) == {"a"}
    m2 = save(store, 20, revision=2)
    assert m2.current == "b" and set(m2.generations) == {"a", "b"}
    m3 = save(store, 30, revision=3)
    assert m3.current == "a" and m3.generations["a"].tokens == 30 and m3.generations["b"].tokens == 20
    assert read_manifest(store.manifests_dir / f"{ID.key}.json") == m3


def test_manifest_flips_only_after_verification(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    save(store, 10)
    plan = store.begin_save(ID)
    plan.path.write_bytes(b"garbage, not a state file")
    result = SaveResult(
        slot_id=0, filename=plan.filename, tokens=5, bytes_written=10, server_ms=None, measured_ms=1
    )
    with pytest.raises(SnapshotCorrupt):
        store.commit_save(plan, result, fingerprint=FP, revision=2)
    m = store.get(ID.key)
    assert m is not None and m.current == "a" and set(m.generations) == {"a"}
    assert store.inflight() == set()


def test_begin_save_stops_vouching_for_the_generation_it_overwrites(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    save(store, 10)
    save(store, 20, revision=2)  # a=10 (previous), b=20 (current)
    plan = store.begin_save(ID)
    assert plan.generation == "a"
    on_disk = read_manifest(store.manifests_dir / f"{ID.key}.json")
    assert set(on_disk.generations) == {"b"}  # a crash during the save cannot leave "a" trusted
    assert (ID.server, plan.filename) in store.inflight()


def test_restore_prefers_current_then_falls_back_to_previous(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    save(store, 10)
    save(store, 20, revision=2)
    cand, rej = store.find_restorable(ID, FP)
    assert cand is not None and cand.generation == "b" and not cand.fallback and rej == []
    (store.snapshot_dirs["local"] / ID.filename("b")).write_bytes(b"trunc")
    cand, rej = store.find_restorable(ID, FP)
    assert cand is not None and cand.generation == "a" and cand.fallback
    assert [r.reason for r in rej] == [CORRUPT]
    m = store.get(ID.key)
    assert m is not None and m.generations["b"].invalid_reason == CORRUPT
    assert (store.snapshot_dirs["local"] / ID.filename("b")).exists()  # marked, never deleted


@pytest.mark.parametrize(
    ("damage", "reason"),
    [
        (lambda p: p.unlink(), FILE_MISSING),
        (lambda p: p.write_bytes(p.read_bytes()[:-100]), CORRUPT),  # truncated: would crash llama-server
        (lambda p: p.write_bytes(b""), CORRUPT),
        (flip_last_byte, CORRUPT),  # same size, one byte flipped: only the checksum sees it
        (lambda p: p.write_bytes(b"XXXX" + p.read_bytes()[4:]), CORRUPT),  # bad magic
    ],
)
def test_damaged_files_never_reach_the_server(
    tmp_path: Path, damage: Callable[[Path], object], reason: str
) -> None:
    store = make_store(tmp_path)
    save(store, 10)
    damage(store.snapshot_dirs["local"] / ID.filename("a"))
    cand, rej = store.find_restorable(ID, FP)
    assert cand is None
    assert [r.reason for r in rej] == [reason]


def test_flipped_byte_passes_when_checksums_are_off(tmp_path: Path) -> None:
    store = make_store(tmp_path, verify_checksum=False)
    save(store, 10)
    flip_last_byte(store.snapshot_dirs["local"] / ID.filename("a"))
    assert store.find_restorable(ID, FP)[0] is not None
    m = store.get(ID.key)
    assert m is not None and m.generations["a"].checksum is None


def test_fingerprint_mismatch_is_invisible_not_deleted(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    save(store, 10)
    cand, rej = store.find_restorable(ID, FP2)
    assert cand is None
    assert [r.reason for r in rej] == ["MODEL_FINGERPRINT_CHANGED"]
    assert not rej[0].persistent
    m = store.get(ID.key)
    assert m is not None and m.generations["a"].invalid_reason is None
    assert store.find_restorable(ID, FP)[0] is not None  # back on the old model: usable again


def test_save_under_new_runtime_keeps_old_generation_for_the_old_runtime(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    save(store, 10, fp=FP)
    save(store, 20, fp=FP2, revision=2)
    new, _ = store.find_restorable(ID, FP2)
    old, _ = store.find_restorable(ID, FP)
    assert new is not None and new.generation == "b"
    assert old is not None and old.generation == "a"


def test_state_format_change_and_context_fit(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    plan = store.begin_save(ID)
    store.commit_save(plan, server_writes(plan, 10, version=3), fingerprint=FP, revision=1)
    plan = store.begin_save(SnapshotIdentity(server="local", provider="p", model="m", session_id="other"))
    store.commit_save(plan, server_writes(plan, 10, version=4), fingerprint=FP, revision=1)
    cand, rej = store.find_restorable(ID, FP)
    assert cand is None and [r.reason for r in rej] == [STATE_FORMAT_CHANGED]
    other = SnapshotIdentity(server="local", provider="p", model="m", session_id="other")
    cand, rej = store.find_restorable(other, FP, max_tokens=5)
    assert cand is None and [r.reason for r in rej] == [TOO_LARGE]


def test_reconcile_at_startup(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    save(store, 10)
    save(store, 20, revision=2)
    snaps = store.snapshot_dirs["local"]
    (snaps / ID.filename("a")).unlink()
    (snaps / ID.filename("b")).write_bytes(b"x" * 7)
    orphan = snaps / ("f" * 32 + ".a.bin")
    orphan.write_bytes(b"x")
    (snaps / "not-ours.bin").write_bytes(b"x")
    (store.manifests_dir / ("0" * 32 + ".json")).write_text("{ truncated")
    (store.manifests_dir / f".{ID.key}.json.tmp-dead").write_text("half")

    again = SnapshotStore(state_dir=tmp_path / "state", snapshot_dirs={"local": snaps})
    report = again.open()
    assert sorted((g, r) for _, g, r in report.invalidated) == [("a", FILE_MISSING), ("b", SIZE_MISMATCH)]
    assert report.orphans == [orphan]
    assert list(report.bad_manifests) == ["0" * 32 + ".json"]
    assert report.temp_files_removed == 1
    m = again.get(ID.key)
    assert m is not None and not m.has_valid
    assert (snaps / "not-ours.bin").exists() and orphan.exists()  # reconcile deletes nothing


@pytest.mark.parametrize(
    "raw",
    [b"", b"{", b"[]", b'{"schema": 99}', b'{"schema": 1}', b'{"schema": 1, "generations": {"c": {}}}'],
)
def test_malformed_manifests_are_invalid_not_crashes(raw: bytes) -> None:
    with pytest.raises(ManifestInvalid):
        Manifest.from_json(raw)


def test_manifest_with_wrong_key_is_refused(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    m = save(store, 10)
    bad = json.loads(m.to_json())
    bad["session_id"] = "someone-else"
    with pytest.raises(ManifestInvalid, match="key"):
        Manifest.from_json(json.dumps(bad).encode())


def test_delete_generation_and_purge(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    save(store, 10)
    save(store, 20, revision=2)
    snaps = store.snapshot_dirs["local"]
    freed = store.delete_generation(ID.key, "a")
    assert freed > 0 and not (snaps / ID.filename("a")).exists()
    m = store.get(ID.key)
    assert m is not None and set(m.generations) == {"b"} and m.current == "b"
    assert store.purge(ID.key) > 0
    assert store.get(ID.key) is None
    assert list(snaps.iterdir()) == [] and not (store.manifests_dir / f"{ID.key}.json").exists()


def test_recheck_file_marks_deleted_generation(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    save(store, 10)
    name = ID.filename("a")
    assert store.recheck_file("local", name) is None
    (store.snapshot_dirs["local"] / name).unlink()
    assert store.recheck_file("local", name) == FILE_MISSING
    m = store.get(ID.key)
    assert m is not None and m.generations["a"].invalid_reason == FILE_MISSING
    assert store.recheck_file("local", "unrelated.bin") is None


def _save_tokens(store: SnapshotStore, ids: list[int]) -> Manifest:
    plan = store.begin_save(ID)
    data = struct.pack(f"<{3 + len(ids)}i", MAGIC, 4, len(ids), *ids) + b"\x00" * 64
    plan.path.write_bytes(data)
    result = SaveResult(
        slot_id=0,
        filename=plan.filename,
        tokens=len(ids),
        bytes_written=len(data),
        server_ms=1.0,
        measured_ms=1.0,
    )
    return store.commit_save(plan, result, fingerprint=FP, revision=1)


def test_point_tokens_are_read_from_the_verified_file_only(tmp_path: Path) -> None:
    """The planner's proof (the snapshot's tokens) comes from the very file the candidate's checks verified:
    a file replaced since (same name, same size, other tokens) proves nothing and reads as unknown."""
    store = make_store(tmp_path)
    _save_tokens(store, [7, 8, 9, 10])
    candidate, _ = store.find_restorable(ID, FP)
    assert candidate is not None
    assert store.point_tokens(candidate) == (7, 8, 9, 10)
    other = tmp_path / "other.bin"
    other.write_bytes(struct.pack("<7i", MAGIC, 4, 4, 1, 2, 3, 4) + b"\x00" * 64)
    other.replace(candidate.path)  # another inode under the verified name
    assert store.point_tokens(candidate) is None
