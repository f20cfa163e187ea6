"""Issue 26 E on a real llama-server: a session that calls back to back (far more often than `idle_s`)
keeps its slot and used to be saved never; with a staleness bound it is saved in the background, so that a
crash of llama-server (kill -9, then a restart) brings it back `restored`, warm, not cold."""

from __future__ import annotations

import contextlib
from pathlib import Path

from kvsidecar.coordinator.checkpoint import PROTECT_FORCED
from kvsidecar.coordinator.state import Outcome, SessionRuntime
from kvsidecar.testing.poll import until
from tests.conftest import StartServer
from tests.integration.real_helpers import TOKENS_PER_TURN, RealHarness, real_harness


def rt_of(h: RealHarness, session: str) -> SessionRuntime:
    return next(rt for rt in h.coordinator.sessions.by_key.values() if rt.identity.session_id == session)


async def saved(h: RealHarness, rt: SessionRuntime) -> None:
    """Wait for the background save already started (it holds the slot until its commit ends)."""
    slot = h.coordinator.servers["local"].slots[0]
    with contextlib.suppress(AssertionError):  # the caller's assertions decide; 20 s: less than idle_s
        await until(
            lambda: not rt.dirty and slot.free, timeout_s=20, interval_s=0.05, what="the background save"
        )


async def test_a_busy_session_survives_a_llama_server_crash(start_llama: StartServer, tmp_path: Path) -> None:
    server = start_llama()
    h = await real_harness(
        server,
        tmp_path,
        checkpoint={"policy": "cost-aware", "idle_s": 30, "max_unsaved_turns": 2, "max_unsaved_s": 0},
    )
    try:
        await h.turn("A")
        a = rt_of(h, "A")
        assert a.dirty and "save" not in h.calls()  # one turn: within the bound
        view = h.coordinator.session_views("A")[0]
        assert view["unsaved_turns"] == 1 and view["unsaved_tokens"] >= TOKENS_PER_TURN
        await h.turn("A")  # the second: released at the bound, the server idle
        await saved(h, a)
        assert not a.dirty and h.calls() == ["save"]
        assert h.coordinator.metrics.save.labels("local", PROTECT_FORCED)._value.get() == 1
        await h.turn("A")  # a third turn, unsaved: the crash costs only that one

        server.kill()  # kill -9: every slot's KV is gone with the process
        server.start()
        await h.coordinator.guard.refresh(h.coordinator.servers["local"])
        assert h.turns["A"] == 3  # the harness' conversation goes on where it was
        r, _, prompt_n, cache_n = await h.turn("A")  # (the new instance's canary is measured first)
        assert r.outcome is Outcome.RESTORED and r.actions == [f"restore {a.identity.short}"]
        assert r.restored_tokens is not None and r.restored_tokens >= 2 * TOKENS_PER_TURN
        # warm: what was restored (the two saved turns) is reused, less the reply's last few tokens; only
        # the lost turn and the new one are computed
        assert cache_n >= r.restored_tokens - max(8, r.restored_tokens // 50)
        assert prompt_n > 0 and cache_n > prompt_n // 4  # (cold: cache_n is 0)
    finally:
        await h.coordinator.aclose()
