"""Issue 15: a save's target generation's old file is moved aside and deleted beside the server's write.

Freeing a large file's blocks takes time in proportion to its size (ext4 here: ~70 ms at 380 MB), and a
switch used to pay it between the evicted session's save and the incoming session's restore. Now the old
file is renamed to a fresh name of ours (claimed, so nobody's orphan) and deleted off the path; without
room on the disk for two, or when the rename fails, it is removed in place as before. Planted entries are
never renamed: they are removed themselves, as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import threading
from collections import namedtuple
from pathlib import Path
from typing import Any

import pytest

from kvsidecar.config import RetentionConfig
from kvsidecar.coordinator.state import SessionState
from kvsidecar.errors import SaveFailed
from kvsidecar.metrics import Metrics
from kvsidecar.retention.job import RetentionJob
from kvsidecar.retention.plan import Disk
from kvsidecar.store import saving
from kvsidecar.store.naming import SnapshotIdentity, parse_snapshot_name
from kvsidecar.store.snapshots import SavePlan, SnapshotStore
from kvsidecar.testing.poll import until
from tests.unit.coordinator_helpers import Harness
from tests.unit.store.test_snapshots import FP, ID, make_store, save, server_writes


def key(session: str) -> str:
    return SnapshotIdentity(server="local", provider="local", model="m", session_id=session).key


def two_generations(tmp_path: Path) -> SnapshotStore:
    store = make_store(tmp_path)
    save(store, 10)  # a
    save(store, 20, revision=2)  # b, current: the next save targets a
    return store


def snap_names(store: SnapshotStore) -> set[str]:
    return {p.name for p in store.snapshot_dirs["local"].iterdir()}


def test_the_old_file_is_moved_aside_claimed_and_dropped(tmp_path: Path) -> None:
    store = two_generations(tmp_path)
    d = store.snapshot_dirs["local"]
    old_inode = (d / ID.filename("a")).stat().st_ino
    plan = store.begin_save(ID)
    assert plan.generation == "a" and plan.retired is not None
    assert not (d / ID.filename("a")).exists()  # the server creates a fresh file
    assert (d / plan.retired).stat().st_ino == old_inode  # the very old file, by another name of ours
    assert parse_snapshot_name(plan.retired) == (ID.key, "a")
    assert plan.retired not in {f.name for f in store.loose_files()}  # claimed: nobody's orphan
    store.drop_retired(plan)
    assert not (d / plan.retired).exists()
    store.commit_save(plan, server_writes(plan, 30), fingerprint=FP, revision=3)
    assert snap_names(store) == {ID.filename("a"), ID.filename("b")}
    assert store.loose_files() == []


def test_the_commit_drops_it_if_nobody_did(tmp_path: Path) -> None:
    store = two_generations(tmp_path)
    plan = store.begin_save(ID)
    assert plan.retired is not None
    m = store.commit_save(plan, server_writes(plan, 30), fingerprint=FP, revision=3)
    assert m.current == "a" and m.generations["a"].tokens == 30
    assert snap_names(store) == {ID.filename("a"), ID.filename("b")}
    store.drop_retired(plan)  # idempotent
    assert snap_names(store) == {ID.filename("a"), ID.filename("b")}


def test_a_failed_save_drops_it_and_keeps_the_newer_generation(tmp_path: Path) -> None:
    store = two_generations(tmp_path)
    plan = store.begin_save(ID)
    assert plan.retired is not None
    plan.path.write_bytes(b"ggsq partial")
    store.abort_save(plan, discard=True)
    assert snap_names(store) == {ID.filename("b")}
    cand, _ = store.find_restorable(ID, FP)
    assert cand is not None and cand.generation == "b" and cand.record.tokens == 20
    assert store.loose_files() == []


def test_without_room_for_two_the_old_file_is_removed_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = two_generations(tmp_path)
    size = (store.snapshot_dirs["local"] / ID.filename("a")).stat().st_size
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(10 * size, 8 * size, 2 * size - 1))  # 2x: no
    plan = store.begin_save(ID)
    assert plan.retired is None
    assert snap_names(store) == {ID.filename("b")}  # freed before the server writes


def test_a_disk_usage_error_removes_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = two_generations(tmp_path)

    def broken(_p: Any) -> Any:
        raise OSError(5, "EIO")

    monkeypatch.setattr(shutil, "disk_usage", broken)
    plan = store.begin_save(ID)
    assert plan.retired is None and snap_names(store) == {ID.filename("b")}


def test_exactly_twice_the_size_is_room(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = two_generations(tmp_path)
    size = (store.snapshot_dirs["local"] / ID.filename("a")).stat().st_size
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(10 * size, 8 * size, 2 * size))
    assert store.begin_save(ID).retired is not None


def test_files_still_being_deleted_count_against_the_room(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several saves at once on one disk: each writes its new file while its old one may not be freed
    yet, so the room asked of the next one includes what the others moved aside and did not delete."""
    store = two_generations(tmp_path)
    other = SnapshotIdentity(server="local", provider="p", model="m", session_id="s2")
    for revision, tokens in ((1, 10), (2, 20)):
        plan = store.begin_save(other)
        store.commit_save(plan, server_writes(plan, tokens), fingerprint=FP, revision=revision)
    d = store.snapshot_dirs["local"]
    size_a = (d / ID.filename("a")).stat().st_size
    size_b = (d / other.filename("a")).stat().st_size
    usage = namedtuple("usage", "total used free")
    free = 2 * (size_a + size_b) - 1  # room for either alone, not for the second while the first is pending
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(100 * free, 50 * free, free))
    first = store.begin_save(ID)
    assert first.retired is not None
    second = store.begin_save(other)
    assert second.retired is None and not (d / other.filename("a")).exists()  # deleted in place instead
    store.commit_save(second, server_writes(second, 15), fingerprint=FP, revision=3)
    store.drop_retired(first)  # the first one's old file is gone: its bytes no longer count
    third = store.begin_save(other)
    assert third.retired is not None
    store.abort_save(third)
    store.abort_save(first)
    assert store.inflight() == set()


def test_the_drop_releases_its_claim_even_when_the_delete_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = two_generations(tmp_path)
    plan = store.begin_save(ID)
    assert plan.retired is not None and ("local", plan.retired) in store.inflight()
    real_unlink = os.unlink

    def eio(name: Any, *a: Any, **kw: Any) -> None:
        if name == plan.retired:
            raise OSError(5, "EIO")
        real_unlink(name, *a, **kw)

    monkeypatch.setattr(os, "unlink", eio)
    store.drop_retired(plan)
    store.commit_save(plan, server_writes(plan, 30), fingerprint=FP, revision=3)  # drops again: EIO again
    monkeypatch.setattr(os, "unlink", real_unlink)
    assert store.inflight() == set()
    assert [f.name for f in store.loose_files()] == [plan.retired]  # retention's to collect, not lost


def test_the_fresh_name_is_claimed_before_it_exists(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = two_generations(tmp_path)
    real_rename = os.rename
    claimed_then: list[bool] = []

    def rename(src: Any, dst: Any, **kw: Any) -> None:
        claimed_then.append(("local", dst) in store.inflight())
        real_rename(src, dst, **kw)

    monkeypatch.setattr(os, "rename", rename)
    plan = store.begin_save(ID)
    assert plan.retired is not None and claimed_then == [True]


def test_the_kept_generation_is_never_moved(tmp_path: Path) -> None:
    store = two_generations(tmp_path)
    d = store.snapshot_dirs["local"]
    kept_inode = (d / ID.filename("b")).stat().st_ino
    plan = store.begin_save(ID)
    assert plan.kept == "b" and plan.generation == "a" and plan.retired is not None
    assert (d / ID.filename("b")).stat().st_ino == kept_inode


@pytest.mark.parametrize("swapped", ["directory", "symlink", "fifo"])
def test_an_entry_swapped_in_after_the_check_is_not_moved_aside(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swapped: str
) -> None:
    """The check saw our file; by the rename something else stands at the name. It is put back and
    handled as a planted entry: a directory refuses the save, a link or FIFO is removed itself."""
    store = two_generations(tmp_path)
    d = store.snapshot_dirs["local"]
    target = d / ID.filename("a")
    outside = tmp_path / "victim"
    outside.write_bytes(b"precious")
    real_room = saving._room_for

    def swap(path: Path, nbytes: int) -> bool:  # runs between the lstat and the rename
        target.unlink()
        if swapped == "directory":
            target.mkdir()
            (target / "inside").write_bytes(b"x")
        elif swapped == "symlink":
            target.symlink_to(outside)
        else:
            os.mkfifo(target)
        return real_room(path, nbytes)

    monkeypatch.setattr(saving, "_room_for", swap)
    if swapped == "directory":
        with pytest.raises(SaveFailed):
            store.begin_save(ID)
        assert (target / "inside").read_bytes() == b"x"  # put back, nothing deleted inside
    else:
        plan = store.begin_save(ID)
        assert plan.retired is None and not os.path.lexists(target)
        store.abort_save(plan)
    assert outside.read_bytes() == b"precious"
    assert snap_names(store) - {ID.filename("a")} == {ID.filename("b")}  # no entry left at a fresh name
    assert store.inflight() == set()


def test_a_failed_rename_falls_back_to_removal_and_claims_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = two_generations(tmp_path)

    def no_rename(*_a: Any, **_k: Any) -> None:
        raise OSError(18, "EXDEV")

    monkeypatch.setattr(os, "rename", no_rename)
    plan = store.begin_save(ID)
    assert plan.retired is None and snap_names(store) == {ID.filename("b")}
    assert {name for _server, name in store.table.inflight()} == {plan.filename}  # the target only


@pytest.mark.parametrize("kind", ["symlink", "hardlink"])
def test_a_planted_entry_is_removed_itself_never_moved(tmp_path: Path, kind: str) -> None:
    store = two_generations(tmp_path)
    d = store.snapshot_dirs["local"]
    outside = tmp_path / "victim"
    outside.write_bytes(b"precious")
    (d / ID.filename("a")).unlink()
    if kind == "symlink":
        (d / ID.filename("a")).symlink_to(outside)
    else:
        os.link(outside, d / ID.filename("a"))
    plan = store.begin_save(ID)
    assert plan.retired is None
    assert snap_names(store) == {ID.filename("b")}
    assert outside.read_bytes() == b"precious"


def test_a_fresh_name_already_taken_is_never_renamed_over(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = two_generations(tmp_path)
    d = store.snapshot_dirs["local"]
    taken = f"{ID.key}.a.0badc0de.bin"
    (d / taken).write_bytes(b"someone else's")
    monkeypatch.setattr(saving, "staging_filename", lambda _k, _g: taken)
    plan = store.begin_save(ID)
    assert plan.retired is None and (d / taken).read_bytes() == b"someone else's"
    assert not (d / ID.filename("a")).exists()


async def test_a_crash_between_the_rename_and_the_drop_leaves_an_orphan_retention_deletes(
    tmp_path: Path,
) -> None:
    store = two_generations(tmp_path)
    plan = store.begin_save(ID)  # ... and the daemon dies here
    assert plan.retired is not None
    d = store.snapshot_dirs["local"]
    os.utime(d / plan.retired, (1, 1))  # an old file's mtime, past the orphan grace
    again = SnapshotStore(state_dir=store.state_dir, snapshot_dirs=dict(store.snapshot_dirs))
    again.open()
    assert [(f.name, f.kind) for f in again.loose_files()] == [(plan.retired, "orphan")]
    job = RetentionJob(
        store=again,
        config=RetentionConfig(max_age_days=None),  # the test clock made the manifests decades old
        metrics=Metrics(),
        protected_keys=set,
        disk_usage=lambda _: Disk(total_bytes=10**12, free_bytes=10**12),
    )
    report = await job.run()
    assert [(d["reason"]) for d in report["deletions"]] == ["orphan"]
    assert not (d / plan.retired).exists()
    cand, _ = again.find_restorable(ID, FP)
    assert cand is not None and cand.generation == "b"  # the newer generation untouched


def test_fleet_layout_never_retires(tmp_path: Path) -> None:
    """Shared snapshot dirs write under a staging name and rename at the commit: nothing to move aside."""
    store = two_generations(tmp_path)
    store.layout.shared = True
    plan = SavePlan(identity=ID, generation="a", filename=ID.filename("a"), path=Path("/nonexistent"))
    assert store.saves._clear_target(ID, "a", plan.filename) is None
    assert snap_names(store) == {ID.filename("b")}


async def test_the_deletion_runs_beside_the_servers_write_and_is_over_when_the_save_is(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    for s in ("A", "B", "A", "B", "A"):  # A has two generations, A resident
        await h.turn(s)
    store = h.coordinator.store
    original_drop = store.drop_retired
    release, dropping = threading.Event(), threading.Event()

    def slow_drop(plan: SavePlan) -> None:
        if plan.identity.session_id == "A" and plan.retired is not None:
            dropping.set()
            assert release.wait(timeout=10)
        original_drop(plan)

    monkeypatch.setattr(store, "drop_retired", slow_drop)
    original_save = h.fake.save_slot
    seen: list[bool] = []

    async def save_slot(slot_id: int, filename: str) -> Any:
        if filename.startswith(key("A")):
            started = await asyncio.to_thread(dropping.wait, 10)
            seen.append(started and not release.is_set())  # written while the old file is being freed
            release.set()
        return await original_save(slot_id, filename)

    monkeypatch.setattr(h.fake, "save_slot", save_slot)
    result, _, _, _ = await h.turn("B")  # A's save at this switch targets its older generation
    assert result.outcome == "restored" and seen == [True]
    recorded = set()
    for k in (key("A"), key("B")):
        m = store.get(k)
        assert m is not None
        recorded |= {rec.filename for rec in m.generations.values() if rec is not None}
    assert {p.name for p in store.snapshot_dirs["local"].iterdir()} == recorded  # nothing left over
    assert store.loose_files() == []
    result, _, _, cache_n = await h.turn("A")
    assert result.outcome == "restored" and cache_n == result.restored_tokens


async def test_a_save_cancelled_while_its_plan_is_made_leaves_no_old_file_behind(h: Harness) -> None:
    """Cancelling the save's task does not stop the thread making its plan, which claims names and moves
    the old file aside: the plan is ended when it comes (names unclaimed, old file deleted)."""
    for s in ("A", "B", "A", "B", "A"):  # A has two generations, A resident
        await h.turn(s)
    store = h.coordinator.store
    original = store.begin_save
    entered, release = threading.Event(), threading.Event()
    plans: list[SavePlan] = []

    def slow_begin(identity: Any, **kw: Any) -> SavePlan:
        entered.set()
        assert release.wait(10)
        plan = original(identity, **kw)
        plans.append(plan)
        return plan

    store.begin_save = slow_begin  # type: ignore[method-assign]
    turn = asyncio.ensure_future(h.coordinator.acquire("B", provider="local", model="m"))
    assert await asyncio.to_thread(entered.wait, 10)
    turn.cancel()  # shutdown's bound on checkpoints, or the server cancelling a request
    with pytest.raises(asyncio.CancelledError):
        await turn
    release.set()
    d = store.snapshot_dirs["local"]

    def ended() -> bool:
        return bool(plans) and not (d / str(plans[0].retired)).exists() and store.inflight() == set()

    with contextlib.suppress(AssertionError):  # up to 5 s; the asserts below say what was left
        await until(ended, timeout_s=5.0, interval_s=0.01, what="the moved-aside file dropped")
    assert plans and plans[0].retired is not None
    assert ended(), f"left behind: {sorted(p.name for p in d.iterdir())}, claimed {store.inflight()}"


async def test_a_save_whose_old_file_is_slow_to_delete_still_ends_saved(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The commit does not wait for the deletion started beside the write (the commit deletes the file
    itself if need be): nothing between the manifest write and the SAVED state can be interrupted by it."""
    for s in ("A", "B", "A", "B", "A"):
        await h.turn(s)
    store = h.coordinator.store
    rt = h.coordinator.sessions.get(key("A"))
    assert rt is not None and rt.dirty
    release = threading.Event()
    original_drop = store.drop_retired

    def stuck_drop(plan: SavePlan) -> None:  # a 30 GB file: seconds
        release.wait(10)
        original_drop(plan)

    monkeypatch.setattr(store, "drop_retired", stuck_drop)
    try:
        assert await asyncio.wait_for(h.coordinator.checkpoints.checkpoint(rt, "flush"), 5)
        assert rt.state is SessionState.ACTIVE_CLEAN and not rt.dirty  # saved, still resident
        m = store.get(key("A"))
        assert m is not None and m.current is not None
        assert {p.name for p in store.snapshot_dirs["local"].iterdir()} >= {m.generations[m.current].filename}
        assert not [f for f in store.loose_files()]  # the old file was deleted by the commit itself
    finally:
        release.set()


def test_a_fresh_name_someone_claims_is_never_used(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A fleet save's staging name, or retention's, is claimed before its file exists: moving the old file
    onto it would let the other party delete or end the claim of what it then finds there."""
    store = two_generations(tmp_path)
    taken = f"{ID.key}.a.0badc0de.bin"
    store.table.writing_started("local", taken)
    monkeypatch.setattr(saving, "staging_filename", lambda _k, _g: taken)
    plan = store.begin_save(ID)
    assert plan.retired is None and snap_names(store) == {ID.filename("b")}  # removed in place instead
    assert ("local", taken) in store.inflight()
    store.abort_save(plan)
    assert store.inflight() == {("local", taken)}  # the other party's claim stands


def test_fleet_a_save_never_stages_under_a_name_someone_claims(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Fleet saves write under a fresh staging name; retention's and the moved-aside names are drawn from
    the same ones: a claimed name is never the save's (its owner would delete or unclaim the file)."""
    store = SnapshotStore(
        state_dir=tmp_path / "state",
        snapshot_dirs={"local": tmp_path / "snaps"},
        shared_dir=tmp_path / "meta",
    )
    store.open()
    store.fence_with(lambda _key: 1)
    taken = f"{ID.key}.a.0badc0de.bin"
    store.table.writing_started("local", taken)
    names = iter([taken, f"{ID.key}.a.0000beef.bin"])
    monkeypatch.setattr(saving, "staging_filename", lambda _k, _g: next(names))
    plan = store.begin_save(ID)
    assert plan.staged and plan.filename == f"{ID.key}.a.0000beef.bin"
    store.commit_save(plan, server_writes(plan, 10), fingerprint=FP, revision=1)
    assert store.inflight() == {("local", taken)}  # the other party's claim stands, ours ended
    monkeypatch.setattr(saving, "staging_filename", lambda _k, _g: taken)
    with pytest.raises(SaveFailed):
        store.begin_save(ID)  # every draw taken: refused, nothing claimed
    assert store.inflight() == {("local", taken)}
