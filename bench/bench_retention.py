"""Retention benchmarks (issue 5): plan computation over 10,000 snapshots; a GC pass deleting 1,000 files."""

from __future__ import annotations

import asyncio
import os
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_store import populate
from common import summary, write

from kvsidecar.config import RetentionConfig
from kvsidecar.metrics import Metrics
from kvsidecar.retention.job import RetentionJob
from kvsidecar.retention.plan import Disk, FileInfo, Kind, Policy, plan
from kvsidecar.store.snapshots import SnapshotStore

ROOMY = Disk(total_bytes=10**13, free_bytes=10**13)


def synthetic(n: int) -> list[FileInfo]:
    rng = random.Random(7)
    files = []
    for i in range(n):
        key = f"{i:032x}"
        used = 1.8e9 - rng.uniform(0, 40 * 86400)
        pairs: tuple[tuple[str, Kind], ...] = (("a", "current"), ("b", "previous"))
        for gen, kind in pairs:
            files.append(
                FileInfo(
                    name=f"{key}.{gen}.bin",
                    server="local",
                    bytes=rng.randint(10**8, 4 * 10**9),
                    kind=kind,
                    last_used_at=used,
                    key=key,
                    generation=gen,
                    protected=i < 4,
                )
            )
    return files


def bench_plan(n: int, runs: int) -> dict[str, Any]:
    files = synthetic(n)
    total = sum(f.bytes for f in files)
    policy = Policy(max_total_bytes=int(total * 0.7), max_sessions=int(n * 0.8), max_age_s=30 * 86400)
    times, deletions = [], 0
    for _ in range(runs):
        started = time.perf_counter()
        result = plan(files, policy, {"local": ROOMY}, 1.8e9)
        times.append((time.perf_counter() - started) * 1000)
        deletions = len(result.deletions)
    return {
        "snapshots": n,
        "files": len(files),
        "deletions_planned": deletions,
        "ms": summary(times),
        "target_ms": 200,
    }


def bench_pass(n_snapshots: int, delete: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        root = Path(tmp)
        populate(root, n_snapshots)
        store = SnapshotStore(state_dir=root / "state", snapshot_dirs={"local": root / "snaps"})
        store.open()
        job = RetentionJob(
            store=store,
            config=RetentionConfig(
                max_sessions=n_snapshots - delete, low_watermark=1.0, max_age_days=None, min_free_percent=None
            ),
            metrics=Metrics(),
            protected_keys=set,
            disk_usage=lambda _p: ROOMY,
        )
        started = time.perf_counter()
        report = asyncio.run(job.run())
        ms = (time.perf_counter() - started) * 1000
        deleted = sum(1 for d in report["deletions"] if d.get("deleted"))
    return {
        "snapshots": n_snapshots,
        "files_deleted": deleted,
        "snapshots_deleted": delete,
        "ms": ms,
        "ms_per_file": ms / max(1, deleted),
    }


def main() -> int:
    result = {"plan": bench_plan(10_000, 7), "gc_pass": bench_pass(2_000, 500)}
    print(write("retention", result))
    p, g = result["plan"], result["gc_pass"]
    print(f"plan over {p['snapshots']:,} snapshots: p50 {p['ms']['p50']:.0f} ms")
    print(f"gc pass deleting {g['files_deleted']:,} files: {g['ms']:.0f} ms ({g['ms_per_file']:.2f} ms/file)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
