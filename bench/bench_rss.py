"""Daemon memory (issue 10): RSS of a kvsidecar process that knows 10,000 snapshots, vs one that knows none.

Runs `Daemon.start()` in a child process over a state directory populated with N manifests (and their
files), and reports its RSS after start-up (reconcile included)."""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_store import populate
from common import write

CHILD = r"""
import asyncio, sys, psutil
from pathlib import Path
from kvsidecar.config import config_from_mapping
from kvsidecar.daemon.service import Daemon
root = Path(sys.argv[1])
cfg = config_from_mapping({"state_dir": str(root / "state"), "logging": {"level": "error"},
    "servers": {"local": {"base_url": "http://127.0.0.1:9", "snapshot_dir": str(root / "snaps")}}})
async def main():
    d = Daemon(cfg, process_finder=None)
    await d.start()
    print(len(d.store.all()), psutil.Process().memory_info().rss)
    await d.aclose()
asyncio.run(main())
"""


def rss_with(n: int) -> tuple[int, int]:
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        if n:
            populate(root, n)
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(root)], capture_output=True, text=True, check=True
        ).stdout
        known, rss = (int(x) for x in out.split())
        return known, rss


def main() -> int:
    base = rss_with(0)
    loaded = rss_with(10_000)
    result = {
        "empty_rss_mb": base[1] / 2**20,
        "snapshots": loaded[0],
        "rss_mb": loaded[1] / 2**20,
        "per_snapshot_kb": (loaded[1] - base[1]) / loaded[0] / 1024,
    }
    print(write("rss", result))
    print(
        f"RSS: {result['empty_rss_mb']:.0f} MB with no snapshots, {result['rss_mb']:.0f} MB with {loaded[0]:,} "
        f"({result['per_snapshot_kb']:.1f} KB per snapshot)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
