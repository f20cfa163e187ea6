"""Cost of the runtime fingerprint's whole-file model digest (issue 16 item 3).

A multi-GB model file (4 GiB of incompressible data by default) is hashed with xxh3-128 as
`kvsidecar.fingerprint.file_digests.file_digest` does it: with the page cache dropped for the file
(POSIX_FADV_DONTNEED after an fsync; on a VM the host may still cache it), with the file in the page cache,
and, for the CPU bound, a sparse file of the same size (holes read as zeros without I/O). Each figure is
set beside a plain read of the same file in the same run. Then `FileDigestCache.digest()` on the unchanged
file (the call every later fingerprint makes: one stat and a dict lookup), and after a daemon restart
(the cache file read back). Finally, how late a 1 ms asyncio timer fires while the file is hashed in a
worker thread (`asyncio.to_thread`, as the coordinator calls it): xxhash and os.readv release the GIL.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import summary, write

from kvsidecar.fingerprint.file_digests import FileDigestCache, file_digest
from kvsidecar.testing.poll import eventually

_CHUNK = 64 << 20


def write_random(path: Path, size: int) -> None:
    block = bytearray(os.urandom(_CHUNK))
    with path.open("wb") as f:
        for i in range(size // _CHUNK):
            block[:8] = i.to_bytes(8, "little")  # every chunk different
            f.write(block)
        f.flush()
        os.fsync(f.fileno())


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def plain_read_gbps(path: Path) -> float:
    buf = bytearray(16 << 20)
    fd = os.open(path, os.O_RDONLY)
    started = time.perf_counter()
    total = 0
    try:
        while n := os.readv(fd, [buf]):
            total += n
    finally:
        os.close(fd)
    return total / (time.perf_counter() - started) / 1e9


def digest_gbps(path: Path) -> float:
    started = time.perf_counter()
    _, st = file_digest(path)
    return st.st_size / (time.perf_counter() - started) / 1e9


def bench_throughput(path: Path, runs: int) -> dict[str, Any]:
    cold, warm, read_cold, read_warm = [], [], [], []
    for _ in range(runs):
        drop_cache(path)
        cold.append(digest_gbps(path))
        warm.append(digest_gbps(path))  # the file is now in the page cache
        drop_cache(path)
        read_cold.append(plain_read_gbps(path))
        read_warm.append(plain_read_gbps(path))
    size = path.stat().st_size
    return {
        "cold_gbps": summary(cold),
        "warm_gbps": summary(warm),
        "plain_read_cold_gbps": summary(read_cold),
        "plain_read_warm_gbps": summary(read_warm),
        "cold_s_p50": size / statistics.median(cold) / 1e9,
        "warm_s_p50": size / statistics.median(warm) / 1e9,
    }


def bench_cached(path: Path, state: Path, calls: int) -> dict[str, Any]:
    eventually(  # out of the 2 s "just changed" window
        lambda: time.time_ns() - path.stat().st_ctime_ns >= 2_500_000_000,
        timeout_s=10.0,
        interval_s=0.1,
        what="the file to be older than the just-changed window",
    )
    cache = FileDigestCache(state / "digests.json")
    started = time.perf_counter()
    first = cache.digest(path)
    first_ms = (time.perf_counter() - started) * 1000
    again = []
    for _ in range(calls):
        started = time.perf_counter()
        assert cache.digest(path) == first
        again.append((time.perf_counter() - started) * 1e6)
    reopened_us = []
    for _ in range(20):
        started = time.perf_counter()
        restarted = FileDigestCache(state / "digests.json")  # a daemon restart: the cache file read back
        assert restarted.digest(path) == first and restarted.computed == 0
        reopened_us.append((time.perf_counter() - started) * 1e6)
    return {
        "first_call_ms": first_ms,
        "cached_call_us": summary(again),
        "after_restart_us": summary(reopened_us),
    }


async def _tick_lags(until: Any) -> list[float]:
    lags: list[float] = []
    while not until():
        started = time.perf_counter()
        await asyncio.sleep(0.001)
        lags.append((time.perf_counter() - started) * 1000 - 1.0)
    return lags


async def loop_lag_while_hashing(path: Path) -> dict[str, Any]:
    """Timer lateness while a worker thread hashes the file, and for as long with nothing else running."""
    job = asyncio.ensure_future(asyncio.to_thread(file_digest, path))
    started = time.perf_counter()
    busy = await _tick_lags(job.done)
    await job
    took = time.perf_counter() - started
    deadline = time.perf_counter() + took
    idle = await _tick_lags(lambda: time.perf_counter() >= deadline)
    return {"timer_late_ms": summary(busy), "timer_late_idle_ms": summary(idle)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--gib", type=int, default=4)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--calls", type=int, default=10_000)
    args = parser.parse_args()
    size = args.gib << 30
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as tmp:
        root = Path(tmp)
        model = root / "model.gguf"
        started = time.perf_counter()
        write_random(model, size)
        print(f"wrote {args.gib} GiB in {time.perf_counter() - started:.1f} s", file=sys.stderr)
        result: dict[str, Any] = {"bytes": size, "block_bytes": 16 << 20, "runs": args.runs}
        result["random"] = bench_throughput(model, args.runs)
        plain_read_gbps(model)  # in the page cache for the loop-lag run
        result["event_loop"] = asyncio.run(loop_lag_while_hashing(model))
        result["cache"] = bench_cached(model, root, args.calls)
        model.unlink()
        sparse = root / "sparse.gguf"
        with sparse.open("wb") as f:
            f.truncate(size)
        result["sparse_gbps"] = summary([digest_gbps(sparse) for _ in range(args.runs)])
    print(write("digest", result))
    r, c = result["random"], result["cache"]
    print(
        f"{args.gib} GiB: cold {r['cold_gbps']['p50']:.2f} GB/s ({r['cold_s_p50']:.1f} s; plain read "
        f"{r['plain_read_cold_gbps']['p50']:.2f}), warm {r['warm_gbps']['p50']:.2f} GB/s ({r['warm_s_p50']:.2f} s; "
        f"plain read {r['plain_read_warm_gbps']['p50']:.2f}), sparse {result['sparse_gbps']['p50']:.2f} GB/s; "
        f"cached call p50 {c['cached_call_us']['p50']:.1f} us, after restart {c['after_restart_us']['p50']:.0f} us; "
        f"event-loop timer late by p99 {result['event_loop']['timer_late_ms']['p99']:.2f} ms while hashing, "
        f"{result['event_loop']['timer_late_idle_ms']['p99']:.2f} ms idle"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
