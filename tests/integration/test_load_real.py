"""Load: 50 concurrent simulated harness sessions on a real `--parallel 2` llama-server for a bounded time,
with switches, flushes, cancellations and a llama-server restart in the middle.

Checked afterwards (and during): one owner per slot; no session ever got another's cache (every prompt
differs from its first word, so a wrong restore shows as ~0 tokens reused where the engine should reuse
most of them); no leaked lease, task or timer; RSS of this process stable. KVSIDECAR_LOAD_S sets the
duration (default 20 s; bench runs it longer).
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from pathlib import Path

import httpx
import psutil

from kvsidecar.coordinator.state import Outcome
from kvsidecar.testing.llama import complete, words
from tests.conftest import StartServer
from tests.integration.real_helpers import real_harness


async def test_fifty_sessions_with_a_server_restart(start_llama: StartServer, tmp_path: Path) -> None:
    duration_s = float(os.environ.get("KVSIDECAR_LOAD_S", "20"))
    server = start_llama(parallel=2, ctx_size=8192)
    h = await real_harness(
        server,
        tmp_path,
        servers={
            "local": {
                "base_url": server.base_url,
                "snapshot_dir": str(server.slot_save_path),
                "mode": "managed-slots",
                "probe_interval_s": 0.5,
                "slot_wait_s": 120,
            }
        },
    )
    c = h.coordinator
    rng = random.Random(5)
    rss0 = psutil.Process().memory_info().rss
    deadline = time.monotonic() + duration_s
    kinds: dict[str, int] = {}
    outcomes: dict[str, int] = {}
    counts = {"turns": 0, "restored": 0, "wrong_cache": 0, "errors": 0, "aborted": 0, "flushes": 0}

    async def worker(i: int) -> None:
        session, turn = f"load-{i}", 0
        while time.monotonic() < deadline:
            r = await c.acquire(session, provider="local", model="tiny")
            assert r.lease_id is not None and r.slot_id is not None
            label = f"{r.outcome.value}:{r.reason}"
            outcomes[label] = outcomes.get(label, 0) + 1
            owners = [s.owner for s in c.servers["local"].slots.values() if s.owner]
            assert len(owners) == len(set(owners))
            if rng.random() < 0.1:
                await c.release(r.lease_id, status="aborted")
                counts["aborted"] += 1
                continue
            n = min(turn + 1, 6)
            try:
                t = await asyncio.to_thread(
                    complete,
                    server.base_url,
                    words(session, 150 * n),
                    slot_id=r.slot_id,
                    n_predict=2,
                    timeout_s=120,
                )
            except httpx.HTTPError as exc:
                await c.release(r.lease_id, status="error")
                counts["errors"] += 1
                kind = type(exc).__name__ + str(getattr(getattr(exc, "response", None), "status_code", ""))
                kinds[kind] = kinds.get(kind, 0) + 1  # expected only around the restart
                continue
            pn, cn = t["prompt_n"], t["cache_n"]
            if r.outcome is Outcome.RESTORED and r.restored_tokens:
                counts["restored"] += 1
                if cn < 0.8 * min(r.restored_tokens, pn + cn) - 8:
                    counts["wrong_cache"] += 1
            await c.release(r.lease_id, status="ok", prompt_tokens=pn, cached_tokens=cn)
            turn, counts["turns"] = turn + 1, counts["turns"] + 1
            if rng.random() < 0.05:
                await c.session_event(session, "flush")
                counts["flushes"] += 1

    async def chaos() -> None:
        await asyncio.sleep(duration_s * 0.4)
        await asyncio.to_thread(server.restart)  # the engine loses every slot

    try:
        await asyncio.gather(chaos(), *(worker(i) for i in range(50)))
        assert counts["wrong_cache"] == 0, counts
        assert counts["turns"] > 50 and counts["restored"] > 0, counts
        assert c.telemetry.stats()["server_restarts"] >= 1
        assert len(c.leases) == 0 and all(s.holder is None for s in c.servers["local"].slots.values())
        assert c.telemetry.stats()["restore_ineffective"] == 0
        growth_mb = (psutil.Process().memory_info().rss - rss0) / 2**20
        assert growth_mb < 100, f"RSS grew {growth_mb:.0f} MB"
    finally:
        await c.aclose()
    assert not c._tasks
    print(f"load: {counts}, restarts seen {c.telemetry.stats()['server_restarts']}, {kinds}, {outcomes}")
