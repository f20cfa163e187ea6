"""managed-slots on a real `--parallel 2` llama-server: two sessions at once, each in its own slot."""

from __future__ import annotations

import asyncio
from pathlib import Path

from kvsidecar.coordinator.state import Outcome
from kvsidecar.testing.llama import complete, words
from tests.conftest import StartServer
from tests.integration.real_helpers import real_harness


async def test_two_sessions_restore_into_their_own_slots_concurrently(
    start_llama: StartServer, tmp_path: Path
) -> None:
    server = start_llama(parallel=2, ctx_size=8192)  # 4,096 tokens per slot
    h = await real_harness(
        server,
        tmp_path,
        servers={
            "local": {
                "base_url": server.base_url,
                "snapshot_dir": str(server.slot_save_path),
                "mode": "managed-slots",
                "probe_interval_s": 3600,
            }
        },
    )
    c = h.coordinator
    try:
        assert sorted(c.servers["local"].slots) == [0, 1]

        async def turn(session: str, n: int) -> tuple[Outcome, int, int, int]:
            r = await c.acquire(session, provider="local", model="tiny")
            assert r.lease_id is not None and r.slot_id is not None
            t = await asyncio.to_thread(complete, server.base_url, words(session, 600 * n), slot_id=r.slot_id)
            await c.release(r.lease_id, status="ok", prompt_tokens=t["prompt_n"], cached_tokens=t["cache_n"])
            return r.outcome, r.slot_id, t["prompt_n"], t["cache_n"]

        first = await asyncio.gather(turn("A", 1), turn("B", 1))
        assert {o for o, *_ in first} == {Outcome.COLD} and {s for _, s, *_ in first} == {0, 1}
        # a third and fourth session push A and B out of their slots (saved first)
        await asyncio.gather(turn("C", 1), turn("D", 1))
        assert c.store.get(next(iter(c.sessions.by_session_id["A"]))) is not None
        # A and B come back at the same time, each restored into a slot, each reusing its own prefix
        back = await asyncio.gather(turn("A", 2), turn("B", 2))
        for outcome, _slot, prompt_n, cache_n in back:
            assert outcome is Outcome.RESTORED
            assert cache_n > 800 and prompt_n < cache_n + 1100  # prefix from disk; only the new turn computed
        assert {s for _, s, *_ in back} == {0, 1}
        assert server.alive
    finally:
        await c.aclose()
