"""Snapshot store benchmarks (issue 3): startup reconcile of 10,000 manifests, checksum throughput on a
1 GiB file from the page cache (vs a plain read of the same file, same run), manifest write latency with
fsync."""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import summary, write

from kvsidecar.store.integrity import MAGIC, file_checksum
from kvsidecar.store.manifest import GenerationRecord, Manifest, write_manifest
from kvsidecar.store.naming import SnapshotIdentity
from kvsidecar.store.snapshots import SnapshotStore


def populate(root: Path, n: int) -> None:
    manifests, snaps = root / "state" / "manifests", root / "snaps"
    manifests.mkdir(parents=True)
    snaps.mkdir()
    header = MAGIC.to_bytes(4, "little") + (4).to_bytes(4, "little") + (104).to_bytes(4, "little")
    for i in range(n):
        ident = SnapshotIdentity(server="local", provider="p", model="m", session_id=f"session-{i}")
        data = header + b"\0" * 500
        gens = {}
        for g in ("a", "b"):
            (snaps / ident.filename(g)).write_bytes(data)
            gens[g] = GenerationRecord(
                filename=ident.filename(g),
                tokens=100,
                header_tokens=104,
                bytes=len(data),
                checksum=None,
                format_version=4,
                fingerprint="f" * 32,
                saved_at=1.0,
                revision=1,
            )
        m = Manifest.new(ident, 1.0)
        write_manifest(
            manifests, Manifest(**{**m.__dict__, "generations": gens, "current": "b"}), durable=False
        )


def bench_reconcile(n: int, runs: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        root = Path(tmp)
        populate(root, n)
        times = []
        for _ in range(runs):
            store = SnapshotStore(state_dir=root / "state", snapshot_dirs={"local": root / "snaps"})
            started = time.perf_counter()
            report = store.open()
            times.append((time.perf_counter() - started) * 1000)
            assert report.manifests == n and not report.invalidated
    return {"manifests": n, "files": 2 * n, "ms": summary(times), "target_ms": 2000}


def raw_read_gbps(path: Path) -> float:
    buf = bytearray(8 << 20)
    fd = os.open(path, os.O_RDONLY)
    started = time.perf_counter()
    total = 0
    try:
        while n := os.readv(fd, [buf]):
            total += n
    finally:
        os.close(fd)
    return total / (time.perf_counter() - started) / 1e9


def bench_checksum(size: int, runs: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        path = Path(tmp) / "big.bin"
        with path.open("wb") as f:
            block = os.urandom(1 << 20)
            for _ in range(size >> 20):
                f.write(block)
        raw_read_gbps(path)  # warm the page cache
        hashed, raw = [], []
        for _ in range(runs):
            started = time.perf_counter()
            file_checksum(path)
            hashed.append(size / (time.perf_counter() - started) / 1e9)
            raw.append(raw_read_gbps(path))
    return {
        "bytes": size,
        "xxh3_gbps": summary(hashed),
        "plain_read_gbps": summary(raw),
        "ratio_hash_vs_read_p50": statistics.median(hashed) / statistics.median(raw),
        "target_gbps": 5.0,
    }


def bench_manifest_writes(n: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        d = Path(tmp)
        ident = SnapshotIdentity(server="local", provider="p", model="m", session_id="s")
        m = Manifest.new(ident, 1.0)
        durable, fast = [], []
        for _ in range(n):
            started = time.perf_counter()
            write_manifest(d, m, durable=True)
            durable.append((time.perf_counter() - started) * 1000)
            started = time.perf_counter()
            write_manifest(d, m, durable=False)
            fast.append((time.perf_counter() - started) * 1000)
    return {"writes": n, "fsync_ms": summary(durable), "no_fsync_ms": summary(fast)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--manifests", type=int, default=10_000)
    parser.add_argument("--checksum-mib", type=int, default=1024)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    result = {
        "reconcile": bench_reconcile(args.manifests, args.runs),
        "checksum": bench_checksum(args.checksum_mib << 20, args.runs),
        "manifest_write": bench_manifest_writes(500),
    }
    print(write("store", result))
    r, c, w = result["reconcile"], result["checksum"], result["manifest_write"]
    print(f"reconcile {r['manifests']} manifests: p50 {r['ms']['p50']:.0f} ms")
    print(
        f"checksum 1 GiB: p50 {c['xxh3_gbps']['p50']:.2f} GB/s (plain read {c['plain_read_gbps']['p50']:.2f})"
    )
    print(
        f"manifest write: p50 {w['fsync_ms']['p50']:.2f} ms with fsync, "
        f"{w['no_fsync_ms']['p50']:.3f} ms without"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
