"""Slot pool benchmarks (issue 6): coordinator acquire/release throughput with the fake backend at 1, 4 and
16 slots, and the tail latency of acquire under contention (64 concurrent clients, 200 sessions).

The fake backend writes real snapshot files and the store writes real fsync'd manifests, so a switch costs
what kvsidecar's own bookkeeping costs; the engine's save/restore time is not in these numbers."""

from __future__ import annotations

import asyncio
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import summary, write

from tests.unit.coordinator_helpers import conversation, start_harness


async def run(slots: int, clients: int, pairs: int, sessions: int) -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as tmp:
        h = await start_harness(
            Path(tmp),
            total_slots=slots,
            servers={"local": {"mode": "managed-slots"}},
            checkpoint={"idle_s": None},
        )
        c = h.coordinator
        rng = random.Random(slots)
        waits: list[float] = []
        outcomes: dict[str, int] = {}
        turns: dict[str, int] = {}

        async def client(n: int) -> None:
            for _ in range(n):
                s = f"s{rng.randrange(sessions)}"
                t0 = time.perf_counter()
                r = await c.acquire(s, provider="local", model="m")
                waits.append((time.perf_counter() - t0) * 1000)
                outcomes[r.outcome.value] = outcomes.get(r.outcome.value, 0) + 1
                turns[s] = turns.get(s, 0) + 1
                assert r.slot_id is not None and r.lease_id is not None
                h.fake.infer(r.slot_id, conversation(s, min(turns[s], 8), 16))
                await asyncio.sleep(0)  # the model call: other clients run meanwhile
                await c.release(r.lease_id, status="ok")

        started = time.perf_counter()
        await asyncio.gather(*(client(pairs // clients) for _ in range(clients)))
        elapsed = time.perf_counter() - started
        await c.aclose()
    done = (pairs // clients) * clients
    return {
        "slots": slots,
        "clients": clients,
        "sessions": sessions,
        "pairs": done,
        "pairs_per_s": done / elapsed,
        "acquire_ms": summary(waits),
        "outcomes": outcomes,
    }


def main() -> int:
    # switch-heavy: 200 sessions over the pool, nearly every acquire saves one session and restores another;
    # resident: as many sessions as slots, every acquire after the first finds its session in place.
    results = [asyncio.run(run(n, 64, 3200, 200)) for n in (1, 4, 16)]
    results += [asyncio.run(run(n, 64, 6400, n)) for n in (1, 4, 16)]
    print(write("pool", {"runs": results}))
    for r in results:
        a: dict[str, float] = r["acquire_ms"]
        print(
            f"{r['slots']:>2} slots, {r['sessions']:>3} sessions: {r['pairs_per_s']:,.0f} acquire+release/s; "
            f"acquire p50 {a['p50']:.2f} ms, p99 {a['p99']:.2f} ms; outcomes {r['outcomes']}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
