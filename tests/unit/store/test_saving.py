"""Issue 16 item 8: a save never overwrites the newest generation that still verifies.

The A/B rule used to be "write the generation the manifest does not point at". With the current
generation corrupt and the previous one restored, that targeted the good one, dropped its record and, on a
failed save (disk full), deleted its file: the session was cold for good.
"""

from __future__ import annotations

from pathlib import Path

from kvsidecar.store.manifest import read_manifest
from kvsidecar.store.snapshots import SnapshotStore
from tests.unit.store.test_snapshots import FP, FP2, ID, flip_last_byte, make_store, save, server_writes


def two_generations(tmp_path: Path) -> SnapshotStore:
    store = make_store(tmp_path)
    save(store, 10)  # a
    save(store, 20, revision=2)  # b, current
    return store


def failed_save(store: SnapshotStore) -> str:
    """begin, the server writes part of the file and reports ENOSPC, the coordinator discards."""
    plan = store.begin_save(ID)
    plan.path.write_bytes(b"ggsq partial")
    store.abort_save(plan, discard=True)
    return plan.generation


def assert_still_restores(store: SnapshotStore, gen: str, tokens: int) -> None:
    cand, _ = store.find_restorable(ID, FP)
    assert cand is not None and cand.generation == gen and cand.record.tokens == tokens
    on_disk = read_manifest(store.manifests_dir / f"{ID.key}.json")
    assert gen in on_disk.generations and on_disk.generations[gen].valid


def test_failed_save_after_a_fallback_restore_keeps_the_good_generation(tmp_path: Path) -> None:
    store = two_generations(tmp_path)
    (store.snapshot_dirs["local"] / ID.filename("b")).write_bytes(b"trunc")
    cand, _ = store.find_restorable(ID, FP)
    assert cand is not None and cand.generation == "a" and cand.fallback  # restored the previous one
    assert failed_save(store) == "b"  # the corrupt one is the target, never "a"
    assert_still_restores(store, "a", 10)
    m = store.get(ID.key)
    assert m is not None and m.current == "a"  # the manifest points at what is left, loads after restart
    again = SnapshotStore(state_dir=store.state_dir, snapshot_dirs=dict(store.snapshot_dirs))
    again.open()
    assert_still_restores(again, "a", 10)


def test_undetected_corruption_of_the_current_generation_is_found_before_the_save(tmp_path: Path) -> None:
    store = two_generations(tmp_path)
    (store.snapshot_dirs["local"] / ID.filename("b")).write_bytes(b"x" * 7)  # nobody looked yet
    assert failed_save(store) == "b"
    assert_still_restores(store, "a", 10)


def test_current_file_missing_is_found_before_the_save(tmp_path: Path) -> None:
    store = two_generations(tmp_path)
    (store.snapshot_dirs["local"] / ID.filename("b")).unlink()
    assert failed_save(store) == "b"
    assert_still_restores(store, "a", 10)


def test_current_marked_invalid_is_the_target(tmp_path: Path) -> None:
    store = two_generations(tmp_path)
    store.mark_invalid(ID.key, "b", "RESTORE_FAILED")
    assert failed_save(store) == "b"
    assert_still_restores(store, "a", 10)


def test_both_good_overwrites_the_older_and_a_failure_keeps_the_newer(tmp_path: Path) -> None:
    store = two_generations(tmp_path)
    assert failed_save(store) == "a"
    assert_still_restores(store, "b", 20)


def test_success_after_the_fallback_flips_to_the_new_file(tmp_path: Path) -> None:
    store = two_generations(tmp_path)
    flip_last_byte(store.snapshot_dirs["local"] / ID.filename("b"))  # only the checksum sees it
    cand, _ = store.find_restorable(ID, FP)
    assert cand is not None and cand.generation == "a"
    plan = store.begin_save(ID)
    assert plan.generation == "b" and plan.kept == "a"
    m = store.commit_save(plan, server_writes(plan, 30), fingerprint=FP, revision=3)
    assert m.current == "b" and m.generations["a"].tokens == 10 and m.generations["b"].tokens == 30


def test_the_generation_of_the_running_runtime_is_kept(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    save(store, 10, fp=FP)  # a under FP
    save(store, 20, fp=FP2, revision=2)  # b under FP2, current
    cand, _ = store.find_restorable(ID, FP)  # the server runs FP again: "a" is what it can restore
    assert cand is not None and cand.generation == "a"
    assert failed_save(store) == "b"
    assert_still_restores(store, "a", 10)


def test_explicit_fingerprint_decides_what_is_kept(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    save(store, 10, fp=FP)
    save(store, 20, fp=FP2, revision=2)
    plan = store.begin_save(ID, fingerprint=FP2)
    assert plan.generation == "a" and plan.kept == "b"
    store.abort_save(plan, discard=True)
    assert_still_restores_under = store.find_restorable(ID, FP2)[0]
    assert assert_still_restores_under is not None and assert_still_restores_under.generation == "b"
