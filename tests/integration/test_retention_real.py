"""Retention end to end on a real llama-server: a quota forces the least recently used session out, and
its next request is a clean cold start (never a failure, never another session's cache)."""

from __future__ import annotations

import types
from pathlib import Path

import httpx

from kvsidecar.config import config_from_mapping
from kvsidecar.coordinator.state import Outcome
from kvsidecar.daemon.service import Daemon
from kvsidecar.testing.llama import complete
from tests.conftest import StartServer
from tests.integration.real_helpers import prompt


async def test_quota_evicts_lru_session_which_then_starts_cold(
    start_llama: StartServer, tmp_path: Path
) -> None:
    server = start_llama()
    config = config_from_mapping(
        {
            "state_dir": str(tmp_path / "state"),
            "servers": {"local": {"base_url": server.base_url, "snapshot_dir": str(server.save_dir)}},
            "routes": {"local": "local"},
            # one ~4 MB tiny-model snapshot fits; a second pushes usage over the quota
            "retention": {"max_total_bytes": 6_000_000, "low_watermark": 1.0},
        }
    )
    daemon = Daemon(config)
    await daemon.start()
    c = daemon.coordinator
    turns: dict[str, int] = {}

    async def turn(session: str) -> tuple[Outcome, int, int]:
        r = await c.acquire(session, provider="local", model="tiny")
        turns[session] = turns.get(session, 0) + 1
        t = complete(server.base_url, prompt(session, turns[session]), slot_id=r.slot_id)
        assert r.lease_id is not None
        await c.release(r.lease_id, status="ok", prompt_tokens=t["prompt_n"], cached_tokens=t["cache_n"])
        return r.outcome, t["prompt_n"], t["cache_n"]

    try:
        await turn("A")
        await turn("B")  # saves A (4 MB): under quota
        await turn("C")  # saves B: 8 MB > 6 MB -> the after-save check runs retention: A (LRU) goes
        for task in list(c._tasks):
            coro = task.get_coro()
            if isinstance(coro, types.CoroutineType) and coro.__qualname__.endswith("check"):
                await task
        report = daemon.retention.last_report
        assert report is not None and [d["reason"] for d in report["deletions"]] == ["lru"]
        names = {p.name for p in server.save_dir.iterdir()}
        assert len(names) == 1
        outcome, pn, cn = await turn("A")
        # a cold start: no snapshot; at most the slot's leftover common prefix (token-exact) is reused,
        # since a plain cold start keeps the slot's KV (issue 28)
        assert outcome is Outcome.COLD and cn < 0.05 * pn and pn > 500
        # saving C on that switch pushed usage over again: B (now the LRU) went; C, just saved, stays
        outcome, _, cn = await turn("C")
        assert outcome is Outcome.RESTORED and cn > 500
        assert server.alive
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app=daemon.app()), base_url="http://127.0.0.1"
        ) as h:
            r = await h.post("/v1/gc", params={"dry_run": "true"})
        assert r.status_code == 200 and r.json()["dry_run"] is True
    finally:
        await daemon.aclose()
