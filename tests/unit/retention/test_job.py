"""The retention job: inventory from the store, deletion order, dry run, the switch, crash safety."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from pyfakefs.fake_filesystem_unittest import Patcher

from kvsidecar.config import RetentionConfig
from kvsidecar.errors import MetadataIO
from kvsidecar.metrics import Metrics
from kvsidecar.retention.job import RetentionJob
from kvsidecar.retention.plan import Disk
from kvsidecar.store.naming import SnapshotIdentity
from kvsidecar.store.snapshots import SnapshotStore
from tests.unit.store.test_snapshots import FP, make_store, server_writes

ROOMY = Disk(total_bytes=10**12, free_bytes=10**12)


def ident(n: int) -> SnapshotIdentity:
    return SnapshotIdentity(server="local", provider="p", model="m", session_id=f"s{n}")


def save(store: SnapshotStore, n: int, tokens: int = 100) -> None:
    plan = store.begin_save(ident(n))
    store.commit_save(plan, server_writes(plan, tokens), fingerprint=FP, revision=1)


def job(store: SnapshotStore, *, protected: set[str] | None = None, **cfg: object) -> RetentionJob:
    cfg = {"max_age_days": None, "min_free_percent": None, **cfg}  # the store's test clock is in 1970
    return RetentionJob(
        store=store,
        config=RetentionConfig.model_validate(cfg),
        metrics=Metrics(),
        protected_keys=lambda: protected or set(),
        disk_usage=lambda _p: ROOMY,
    )


def file_size(store: SnapshotStore, n: int) -> int:
    return (store.snapshot_dirs["local"] / ident(n).filename("a")).stat().st_size


async def test_lru_snapshot_goes_first_and_its_files_and_manifest_are_removed(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    for n in range(3):
        save(store, n)
    size = file_size(store, 0)
    j = job(store, max_total_bytes=2 * size, low_watermark=1.0)
    report = await j.run()
    assert [(d["snapshot"], d["reason"], d["deleted"]) for d in report["deletions"]] == [
        (ident(0).key[:8], "lru", True)
    ]
    assert store.get(ident(0).key) is None
    assert not (store.snapshot_dirs["local"] / ident(0).filename("a")).exists()
    assert not (store.manifests_dir / f"{ident(0).key}.json").exists()
    assert report["freed_bytes"] == size and report["bytes_after"] == 2 * size


async def test_dry_run_and_the_switch_delete_nothing(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    for n in range(3):
        save(store, n)
    size = file_size(store, 0)
    for j, kwargs in (
        (job(store, max_total_bytes=size), {"dry_run": True}),
        (job(store, max_total_bytes=size, delete=False), {}),
    ):
        report = await j.run(**kwargs)
        assert report["dry_run"] is True and len(report["deletions"]) == 3 and report["freed_bytes"] == 0
        assert all("deleted" not in d for d in report["deletions"])
    assert len(store.all()) == 3 and len(list(store.snapshot_dirs["local"].iterdir())) == 3


async def test_resident_snapshot_is_never_deleted_even_alone_over_quota(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    save(store, 0, tokens=5000)
    report = await job(store, protected={ident(0).key}, max_total_bytes=10).run()
    assert report["deletions"] == [] and report["unmet"] == ["max_total_bytes"]
    assert store.get(ident(0).key) is not None


async def test_session_that_became_active_after_planning_is_skipped(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    save(store, 0)
    calls = {"n": 0}

    def protected() -> set[str]:
        calls["n"] += 1
        return set() if calls["n"] == 1 else {ident(0).key}  # free at planning time, busy at deletion time

    j = RetentionJob(
        store=store,
        config=RetentionConfig(max_total_bytes=1),
        metrics=Metrics(),
        protected_keys=protected,
        disk_usage=lambda _p: ROOMY,
    )
    report = await j.run()
    assert report["deletions"][0]["skipped"] == "became active" and store.get(ident(0).key) is not None


async def test_orphans_and_invalid_generations_are_collected(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    save(store, 0)
    save(store, 1)
    orphan = store.snapshot_dirs["local"] / ("e" * 32 + ".a.bin")
    orphan.write_bytes(b"x" * 10)
    old = time.time() - 3600
    os.utime(orphan, (old, old))
    young = store.snapshot_dirs["local"] / ("d" * 32 + ".a.bin")
    young.write_bytes(b"x")
    foreign = store.snapshot_dirs["local"] / "someone-elses.bin"
    foreign.write_bytes(b"x")
    store.mark_invalid(ident(1).key, "a", "SNAPSHOT_CORRUPT")
    report = await job(store).run()
    assert sorted(d["reason"] for d in report["deletions"]) == ["invalid", "orphan"]
    assert not orphan.exists() and young.exists() and foreign.exists()
    assert store.get(ident(1).key) is None and store.get(ident(0).key) is not None


async def test_file_being_written_is_never_an_orphan(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    plan = store.begin_save(ident(0))
    plan.path.write_bytes(b"half written")
    old = time.time() - 3600
    os.utime(plan.path, (old, old))
    report = await job(store).run()
    assert report["deletions"] == [] and plan.path.exists()


async def test_crash_between_record_and_file_leaves_an_orphan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_store(tmp_path)
    save(store, 0)
    path = store.snapshot_dirs["local"] / ident(0).filename("a")

    def dies(_store: SnapshotStore, _server: str, _name: str) -> int:
        raise MetadataIO("process killed here")

    monkeypatch.setattr(SnapshotStore, "_unlink", dies)
    report = await job(store, max_total_bytes=1).run()
    assert report["deletions"][0]["deleted"] is False
    monkeypatch.undo()
    assert path.exists() and store.get(ident(0).key) is None  # no manifest vouches for it any more
    again = SnapshotStore(state_dir=store.state_dir, snapshot_dirs=store.snapshot_dirs)
    assert again.open().orphans == [path]  # the next start sees an orphan, which retention collects


def test_job_on_a_fake_filesystem() -> None:
    with Patcher() as patcher:
        assert patcher.fs is not None
        patcher.fs.create_dir("/var/lib/kvsidecar")
        store = SnapshotStore(
            state_dir=Path("/var/lib/kvsidecar/state"),
            snapshot_dirs={"local": Path("/var/lib/kvsidecar/snaps")},
        )
        store.open()
        for n in range(4):
            save(store, n)
        size = file_size(store, 0)
        j = job(store, max_sessions=2, low_watermark=1.0)

        import asyncio

        report = asyncio.run(j.run())
        assert [d["snapshot"] for d in report["deletions"]] == [ident(0).key[:8], ident(1).key[:8]]
        assert sorted(p.name for p in Path("/var/lib/kvsidecar/snaps").iterdir()) == sorted(
            ident(n).filename("a") for n in (2, 3)
        )
        assert report["freed_bytes"] == 2 * size


async def test_free_disk_floor_triggers(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    save(store, 0)
    save(store, 1)
    j = RetentionJob(
        store=store,
        config=RetentionConfig(min_free_bytes=10**6),
        metrics=Metrics(),
        protected_keys=set,
        disk_usage=lambda _p: Disk(total_bytes=10**7, free_bytes=10**6 - 1),
    )
    assert j.needs_run()
    report = await j.run()
    assert [d["snapshot"] for d in report["deletions"]][:1] == [ident(0).key[:8]]
