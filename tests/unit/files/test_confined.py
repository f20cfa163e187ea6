"""Issue 16 part B, items 5 and 6: names read from disk are hostile; nothing is followed through a link.

Every test plants something in or around the store's directories, then drives every path that touches
files (purge, delete_generation, retention, reconcile, restore checks, save) and checks that nothing
outside the snapshot directory, and nothing of another session, was deleted, opened through or chmod-ed.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvsidecar.config import RetentionConfig
from kvsidecar.errors import KvError, SaveFailed, SnapshotCorrupt
from kvsidecar.metrics import Metrics
from kvsidecar.retention.job import RetentionJob
from kvsidecar.retention.plan import Disk
from kvsidecar.store.naming import SnapshotIdentity
from kvsidecar.store.snapshots import SnapshotStore
from tests.unit.store.test_snapshots import FP, ID, make_store, save, server_writes

UNSAFE = "SNAPSHOT_FILE_UNSAFE"
OTHER = SnapshotIdentity(server="local", provider="p", model="m", session_id="someone-else")
ROOMY = Disk(total_bytes=10**12, free_bytes=10**12)


def save_other(store: SnapshotStore, tokens: int = 10) -> Path:
    plan = store.begin_save(OTHER)
    store.commit_save(plan, server_writes(plan, tokens), fingerprint=FP, revision=1)
    return store.snapshot_dirs["local"] / OTHER.filename("a")


def tamper(store: SnapshotStore, key: str, change: Callable[[dict[str, Any]], object]) -> None:
    """Rewrite a manifest on disk the way an attacker with access to the state directory would."""
    path = store.manifests_dir / f"{key}.json"
    data = json.loads(path.read_bytes())
    change(data)
    path.write_text(json.dumps(data))


def reopen(store: SnapshotStore) -> SnapshotStore:
    again = SnapshotStore(state_dir=store.state_dir, snapshot_dirs=dict(store.configured_dirs))
    again.open()
    return again


async def every_deleting_path(store: SnapshotStore, *, spare: str | None = None) -> None:
    """purge, delete_generation and a retention pass that wants everything gone (but `spare`)."""
    for key in ({m.key for m in store.all()} | {ID.key}) - {spare}:
        for gen in ("a", "b"):
            with contextlib.suppress(KvError):
                store.delete_generation(key, gen)
        with contextlib.suppress(KvError):
            store.purge(key)
    retention = RetentionJob(
        store=store,
        config=RetentionConfig(max_total_bytes=1, max_age_days=None, min_free_percent=None),
        metrics=Metrics(),
        protected_keys=lambda: {spare} if spare else set(),
        clock=lambda: 10**12,  # every orphan is past its grace period
        disk_usage=lambda _p: ROOMY,
    )
    await retention.run()


def hostile_names(tmp_path: Path) -> list[str]:
    key = ID.key
    return [
        "../victim.txt",
        "../../victim.txt",
        str(tmp_path / "victim.txt"),  # absolute
        "..\\victim.txt",
        f"{key}.a.bin/../../victim.txt",
        f"{key}.a.bin\x00",
        f"{key}.a.bin\n",
        f"{key.upper()}.a.bin",
        f"{key[:-1]}\uff10.a.bin",  # fullwidth zero
        f"{key}.a.bin" + "x" * 5000,  # very long
        "",
        ".",
        "..",
        OTHER.filename("a"),  # a valid name, but another session's file
        ID.filename("b"),  # its own key, but the other generation's name
    ]


@pytest.mark.parametrize("index", range(15))
async def test_manifest_filename_is_never_a_path(tmp_path: Path, index: int) -> None:
    store = make_store(tmp_path)
    save(store, 10)
    other_file = save_other(store)
    other_bytes = other_file.read_bytes()
    victim = tmp_path / "victim.txt"  # the snapshot directory's parent
    victim.write_text("not yours")
    (store.state_dir / "victim.txt").write_text("not yours either")  # the manifests directory's parent
    name = hostile_names(tmp_path)[index]
    tamper(store, ID.key, lambda d: d["generations"]["a"].__setitem__("filename", name))

    again = reopen(store)
    await every_deleting_path(again, spare=OTHER.key)
    assert victim.read_text() == "not yours"
    assert (store.state_dir / "victim.txt").read_text() == "not yours either"
    assert other_file.read_bytes() == other_bytes and again.find_restorable(OTHER, FP)[0] is not None
    bad = again.bad_manifests()  # one bad manifest is one bad session (until purged above)
    assert again.get(ID.key) is None and (bad == {} or "MANIFEST" in bad[f"{ID.key}.json"])
    third = reopen(store)
    assert third.get(OTHER.key) is not None and third.get(ID.key) is None


async def test_purge_of_a_session_never_deletes_another_sessions_file(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    save(store, 10)
    other_file = save_other(store)
    tamper(store, ID.key, lambda d: d["generations"]["a"].__setitem__("filename", OTHER.filename("a")))
    again = reopen(store)
    again.purge(ID.key)
    assert other_file.exists() and again.find_restorable(OTHER, FP)[0] is not None
    assert not (again.manifests_dir / f"{ID.key}.json").exists()  # the refused manifest is purged too


async def test_names_in_listings_must_be_exactly_ours(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    save(store, 10)
    snaps = store.snapshot_dirs["local"]
    near_misses = [
        f"{'e' * 32}.a.bin.",
        f"{'E' * 32}.a.bin",
        f"{'e' * 32}.c.bin",
        f"{'e' * 31}\uff45.a.bin",
        f"{'e' * 32}.a.bin~",
        f"x{'e' * 32}.a.bin",
    ]
    for name in near_misses:
        (snaps / name).write_bytes(b"not ours")
        os.utime(snaps / name, (1, 1))
    again = reopen(store)
    assert again.reconcile().orphans == []
    await every_deleting_path(again)
    assert sorted(p.name for p in snaps.iterdir() if p.name in near_misses) == sorted(near_misses)


def test_path_for_refuses_names_not_ours(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    for name in hostile_names(tmp_path)[:-2]:
        with pytest.raises(SnapshotCorrupt):
            store.path_for("local", name)
    assert store.path_for("local", ID.filename("a")) == store.snapshot_dirs["local"] / ID.filename("a")


async def test_snapshot_dir_swapped_for_a_symlink_deletes_nothing_outside(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    save(store, 10)
    snaps = store.snapshot_dirs["local"]
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / ID.filename("a")  # same name as ours, in someone else's directory
    victim.write_bytes(b"precious")
    snaps.rename(tmp_path / "moved")
    snaps.symlink_to(outside, target_is_directory=True)
    await every_deleting_path(store)
    assert victim.read_bytes() == b"precious"


def test_configured_symlinked_dir_is_resolved_once(tmp_path: Path) -> None:
    real = tmp_path / "real-snaps"
    real.mkdir()
    link = tmp_path / "snaps-link"
    link.symlink_to(real, target_is_directory=True)
    store = SnapshotStore(state_dir=tmp_path / "state", snapshot_dirs={"local": link})
    store.open()
    assert store.snapshot_dirs["local"] == real
    plan = store.begin_save(ID)
    store.commit_save(plan, server_writes(plan, 10), fingerprint=FP, revision=1)
    assert (real / ID.filename("a")).is_file()


# item 6: planted entries at a generation's name -------------------------------------------------------


def plant(kind: str, at: Path, victim: Path) -> None:
    if kind == "symlink":
        at.symlink_to(victim)
    elif kind == "dangling symlink":
        at.symlink_to(victim.parent / "does-not-exist")
    elif kind == "symlink to a directory":
        at.symlink_to(victim.parent, target_is_directory=True)
    elif kind == "hard link":
        os.link(victim, at)
    elif kind == "fifo":
        os.mkfifo(at)
    else:
        raise AssertionError(kind)


PLANTED = ["symlink", "dangling symlink", "symlink to a directory", "hard link", "fifo"]


@pytest.mark.parametrize("kind", PLANTED)
def test_entry_planted_before_a_save_is_removed_itself(tmp_path: Path, kind: str) -> None:
    store = make_store(tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    victim.chmod(0o644)
    target = store.snapshot_dirs["local"] / ID.filename("a")
    plant(kind, target, victim)
    plan = store.begin_save(ID)
    assert plan.filename == ID.filename("a")
    assert not os.path.lexists(target)  # the entry itself is gone: the server will create a new file
    m = store.commit_save(plan, server_writes(plan, 10), fingerprint=FP, revision=1)
    assert m.current == "a"
    assert victim.read_bytes() == b"precious" and stat.S_IMODE(victim.stat().st_mode) == 0o644
    st = os.lstat(target)
    assert stat.S_ISREG(st.st_mode) and st.st_nlink == 1


def test_directory_at_the_target_name_refuses_the_save(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    target = store.snapshot_dirs["local"] / ID.filename("a")
    target.mkdir()
    (target / "keep").write_text("x")
    with pytest.raises(SaveFailed):
        store.begin_save(ID)
    assert (target / "keep").exists() and store.inflight() == set()


@pytest.mark.parametrize("kind", ["symlink", "hard link"])
def test_server_writing_through_a_link_planted_after_begin_is_refused(tmp_path: Path, kind: str) -> None:
    store = make_store(tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    victim.chmod(0o644)
    plan = store.begin_save(ID)
    plant(kind, plan.path, victim)  # the race: planted between our check and the server's open
    result = server_writes(plan, 10)  # llama-server follows the link (its damage; we can only refuse)
    with pytest.raises(SnapshotCorrupt):
        store.commit_save(plan, result, fingerprint=FP, revision=1)
    assert stat.S_IMODE(victim.stat().st_mode) == 0o644  # never chmod-ed through the link
    assert store.get(ID.key) is None  # never recorded
    assert not os.path.lexists(plan.path)  # the planted entry is removed, not its target
    assert victim.exists() and store.inflight() == set()


@pytest.mark.parametrize("kind", ["symlink", "hard link", "fifo", "foreign owner"])
def test_restore_never_goes_through_a_planted_entry(tmp_path: Path, kind: str) -> None:
    store = make_store(tmp_path)
    save(store, 10)
    path = store.snapshot_dirs["local"] / ID.filename("a")
    copy = tmp_path / "copy.bin"
    copy.write_bytes(path.read_bytes())  # same bytes: only the entry type betrays it
    path.unlink()
    if kind == "foreign owner":
        path.write_bytes(copy.read_bytes())
        os.chown(path, 12345, 12345)
    else:
        plant(kind, path, copy)
    cand, rej = store.find_restorable(ID, FP)
    assert cand is None and [r.reason for r in rej] == [UNSAFE]
    m = store.get(ID.key)
    assert m is not None and m.generations["a"].invalid_reason == UNSAFE
    assert store.recheck_file("local", ID.filename("a")) is None  # already marked


def test_watcher_recheck_sees_a_swapped_in_symlink(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    save(store, 10)
    path = store.snapshot_dirs["local"] / ID.filename("a")
    copy = tmp_path / "copy.bin"
    copy.write_bytes(path.read_bytes())
    path.unlink()
    path.symlink_to(copy)
    assert store.recheck_file("local", ID.filename("a")) == UNSAFE


def test_confirm_unchanged_detects_a_swap_after_verification(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    save(store, 10)
    cand, _ = store.find_restorable(ID, FP)
    assert cand is not None and store.confirm_unchanged(cand)
    path = store.snapshot_dirs["local"] / ID.filename("a")
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data)  # same bytes, another inode
    assert not store.confirm_unchanged(cand)


async def test_planted_symlink_orphan_is_removed_itself_by_retention(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    victim = tmp_path / "victim.txt"
    victim.write_bytes(b"precious")
    orphan = store.snapshot_dirs["local"] / ("e" * 32 + ".a.bin")
    orphan.symlink_to(victim)
    os.utime(orphan, (1, 1), follow_symlinks=False)
    await every_deleting_path(store)
    assert victim.read_bytes() == b"precious" and not os.path.lexists(orphan)
