"""The coordinator's share of a resident hook call, in process: CPU time of acquire + release of a session
that stays in its slot (the fake engine: no HTTP, no llama-server), the median of batches.

bench_hooks.py measures the whole call against a real daemon; its CPU figure is dominated by HTTP and
uvicorn and moves by 20-30 % between runs on these machines, too much to see a change of a few
microseconds in the coordinator. This one isolates that part, and `--against REV` runs the same
measurement on another revision in the same run, alternating, so the two medians can be compared:

    .venv/bin/python bench/bench_hook_path.py --against 411487c
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


async def measure(calls: int, batches: int) -> list[float]:
    """Microseconds of CPU per acquire + release, one figure per batch."""
    from kvsidecar.backend.fake import FakeKvBackend
    from kvsidecar.config import config_from_mapping
    from kvsidecar.coordinator.core import Coordinator
    from kvsidecar.store.snapshots import SnapshotStore

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        config = config_from_mapping(
            {
                "state_dir": str(work / "state"),
                "servers": {"local": {"snapshot_dir": str(work / "snaps"), "probe_interval_s": 3600}},
                "routes": {"local": "local"},
                "checkpoint": {"on_shutdown": False},  # the fake slot holds no KV to save at the end
            }
        )  # the defaults otherwise: the cost-aware policy, its unsaved-work bounds
        fake = FakeKvBackend(work / "snaps")
        store = SnapshotStore(state_dir=config.state_dir, snapshot_dirs={"local": work / "snaps"})
        store.open()
        coordinator = Coordinator(config=config, store=store, backends={"local": fake}, process_finder=None)
        await coordinator.start()
        try:
            out = []
            for batch in range(batches + 1):
                start = time.process_time()
                for _ in range(calls):
                    lease = await coordinator.acquire("bench", provider="local", model="m")
                    assert lease.lease_id is not None
                    await coordinator.release(lease.lease_id, status="ok", prompt_tokens=5, cached_tokens=100)
                if batch:  # the first batch warms up
                    out.append((time.process_time() - start) / calls * 1e6)
            return out
        finally:
            await coordinator.aclose()


def run_in(tree: Path, calls: int, batches: int) -> float:
    """The median of one run of this file with `tree`'s package first on the path."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, __file__, "--once", "--calls", str(calls), "--batches", str(batches)]
    done = subprocess.run(cmd, env=env, cwd=tree, check=True, capture_output=True, text=True)
    return float(json.loads(done.stdout)["median_us"])


def compare(rev: str, calls: int, batches: int, rounds: int) -> dict[str, object]:
    with tempfile.TemporaryDirectory() as tmp:
        other = Path(tmp) / "tree"
        subprocess.run(
            ["git", "worktree", "add", "--detach", str(other), rev], cwd=ROOT, check=True, capture_output=True
        )
        try:
            here: list[float] = []
            there: list[float] = []
            for _ in range(rounds):  # alternating, so that the machine's noise falls on both alike
                there.append(run_in(other, calls, batches))
                here.append(run_in(ROOT, calls, batches))
        finally:
            subprocess.run(
                ["git", "worktree", "remove", "--force", str(other)],
                cwd=ROOT,
                check=True,
                capture_output=True,
            )
    ratio = statistics.median(here) / statistics.median(there)
    return {"rev": rev, "here_us": here, "there_us": there, "ratio_of_medians": round(ratio, 3)}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--calls", type=int, default=1000)
    parser.add_argument("--batches", type=int, default=15)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--against", metavar="REV", help="also measure this git revision, alternating")
    parser.add_argument("--once", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.against:
        print(json.dumps(compare(args.against, args.calls, args.batches, args.rounds), indent=1))
        return 0
    per_call = asyncio.run(measure(args.calls, args.batches))
    median = statistics.median(per_call)
    if args.once:
        print(json.dumps({"median_us": median}))
    else:
        print(f"resident acquire + release in the coordinator: median {median:.1f} us CPU per call")
    return 0


if __name__ == "__main__":
    sys.exit(main())
