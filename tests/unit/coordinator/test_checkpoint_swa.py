"""A server whose saves no restore could use (a sliding-window model that llama-server runs without
`--swa-full`, read from its model file and its settings): the checkpoint policy makes no save of it,
whatever the trigger (a switch, the idle timer, a hint, the operator, a planned stop, a background save),
writes the unsaved turns off and counts each, says so once in the log and in status with the fix's memory
figure, and reads the class again when the server restarts with other settings."""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvsidecar.backend.base import BackendCapabilities
from kvsidecar.cli.text import render_status
from kvsidecar.coordinator.canary import CANARY_FILE
from kvsidecar.coordinator.decisions import SWA_WINDOW_NOT_SAVED
from kvsidecar.coordinator.state import SessionRuntime
from kvsidecar.fingerprint.llama_process import ProcessInfo
from kvsidecar.fingerprint.memory_class import HYBRID
from kvsidecar.fingerprint.server_memory import ServerMemory
from kvsidecar.testing.poll import until
from tests.unit.coordinator_helpers import Harness, start_harness
from tests.unit.memory_helpers import hybrid_gguf, process_running, swa_gguf


def useless(h: Harness) -> float:
    value: float = h.coordinator.metrics.save_skipped.labels("local", SWA_WINDOW_NOT_SAVED)._value.get()
    return value


def session_saves(h: Harness) -> list[str]:
    """The files llama-server was asked to save for sessions (the runtime canary's own save aside)."""
    names = [str(c[2]) for c in h.fake.calls if c[0] == "save" and not CANARY_FILE.match(str(c[2]))]
    h.fake.calls.clear()
    return names


def rt_of(h: Harness, session: str) -> SessionRuntime:
    return next(rt for rt in h.coordinator.sessions.by_key.values() if rt.identity.session_id == session)


async def runs(h: Harness, model: Path, *args: str, pid: int) -> None:
    """llama-server (re)started as `pid`, running `model` with `args`: the coordinator's next look."""
    h.fake.model_path = str(model)
    h.process[0] = process_running(model, *args, pid=pid)
    await h.coordinator.servers["local"].refresh()


@pytest.fixture
async def harness(tmp_path: Path) -> AsyncIterator[Harness]:
    h = await start_harness(tmp_path, checkpoint={"idle_s": 3600, "max_unsaved_turns": 1})
    await runs(h, swa_gguf(tmp_path / "models"), "-np", "1", pid=42)
    h.calls()
    yield h
    await h.coordinator.aclose()


async def test_no_save_is_made_whatever_the_trigger(harness: Harness, tmp_path: Path) -> None:
    h, snaps = harness, tmp_path / "snaps"
    await h.turn("A")
    assert (await h.coordinator.session_event("A", "flush"))["saved"] == 0  # the harness's hint
    assert useless(h) == 1 and rt_of(h, "A").unsaved_turns == 0  # written off: nothing could keep it
    await h.turn("A")
    await h.turn("B")  # the switch evicts A, dirty again: not saved either
    assert useless(h) == 2
    assert (await h.coordinator.save("B"))["saved"] == 0  # the operator's save
    await h.turn("B")
    out = await h.coordinator.checkpoint(None, wait=True, timeout_s=10)  # a planned stop: nothing lost
    assert out["saved"] == 1 and useless(h) == 4
    assert not session_saves(h) and not list(snaps.glob("*.bin"))


async def test_the_idle_timer_and_background_saves_save_nothing(tmp_path: Path) -> None:
    h = await start_harness(tmp_path, checkpoint={"idle_s": 0.05, "max_unsaved_turns": 1})
    try:
        await runs(h, swa_gguf(tmp_path / "models"), pid=42)
        await h.turn("A")  # max_unsaved_turns 1: protect would save at this give-back
        await until(lambda: useless(h) == 1, what="the idle timer's skipped save")
        assert not session_saves(h) and not list((tmp_path / "snaps").glob("*.bin"))
        assert rt_of(h, "A").unsaved_turns == 0
    finally:
        await h.coordinator.aclose()


async def test_said_once_in_the_log_and_in_status_with_the_fix_and_its_figure(
    harness: Harness, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    h = harness
    (said,) = [r for r in caplog.get_records("setup") if "kv.backend.memory" in r.getMessage()]
    assert said.levelno == logging.WARNING and "saves=off" in said.getMessage()
    memory = h.coordinator.status()["servers"][0]["memory"]
    assert memory["class"] == "swa" and memory["n_swa"] == 128 and memory["swa_full"] is False
    assert memory["saves"] == "off" and memory["reason"] == SWA_WINDOW_NOT_SAVED
    assert memory["fix"] == "add --swa-full to llama-server"
    # the fake's slot context is 4096: 768 SWA cells (1 stream) against 4,096 with --swa-full
    assert (
        memory["cost"] == "--swa-full takes the SWA cache from 0.94 to 5 MiB (768 -> 4,096 cells, 5 layers)"
    )
    assert memory["swa_cache"]["mib"] == 0.94 and memory["swa_cache"]["mib_swa_full"] == 5.0
    # a token: its id, its cell and the one global layer's K and V; fixed: the 5 SWA layers' 128 cells
    assert memory["snapshot"] == {"bytes_per_token": 272, "fixed_bytes": 128 * (12 + 5 * 256)}
    text = render_status(h.coordinator.status())  # `kvsidecar status`
    assert (
        "  model memory: swa (gemma3), window 128, no --swa-full; a restore keeps: nothing; a snapshot: 272 B "
        "a token + about 165,376 B; saves off (swa_window_not_saved)\n    fix: add --swa-full to "
        "llama-server: --swa-full takes the SWA cache from 0.94 to 5 MiB"
    ) in text
    caplog.set_level(logging.INFO, logger="kvsidecar")
    srv = h.coordinator.servers["local"]
    for _ in range(3):  # a look at the same instance, and a restart with the same settings: not again
        await srv.refresh(force=True)
    await runs(h, tmp_path / "models" / "gemma3-swa.gguf", "-np", "1", pid=43)
    await h.turn("A")
    await h.turn("B")
    assert not [r for r in caplog.records if "kv.backend.memory" in r.getMessage()]
    assert not [r for r in caplog.records if "kv.session.save.skipped" in r.getMessage()]  # not per session


async def test_read_again_when_the_server_restarts_with_other_settings(
    harness: Harness, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    h, model = harness, tmp_path / "models" / "gemma3-swa.gguf"
    caplog.set_level(logging.INFO, logger="kvsidecar")
    await runs(h, model, "--swa-full", pid=43)
    memory = h.coordinator.status()["servers"][0]["memory"]
    assert memory["swa_full"] is True and memory["saves"] == "on" and memory["restore_keeps"] == "extension"
    await h.turn("A")
    await h.turn("B")  # the switch saves A now
    assert session_saves(h) and useless(h) == 0
    (first,) = [r.getMessage() for r in caplog.records if "kv.backend.memory" in r.getMessage()]
    assert "memory=swa" in first and "saves=on" in first
    await runs(h, model, pid=44)  # restarted without it: off again, said again, with the fix
    said = [r for r in caplog.records if "kv.backend.memory" in r.getMessage()][-1]
    assert said.levelno == logging.WARNING and "saves=off" in said.getMessage()
    assert "reason=swa_window_not_saved" in said.getMessage() and "--swa-full takes" in said.getMessage()
    await runs(h, hybrid_gguf(tmp_path / "models"), pid=45)  # another model: hybrid, saved
    assert h.coordinator.status()["servers"][0]["memory"]["class"] == "hybrid"
    session_saves(h)
    await h.turn("A")
    await h.turn("B")
    assert session_saves(h)


async def test_an_unread_environment_is_not_proof(harness: Harness, tmp_path: Path) -> None:
    """`--swa-full` may come from LLAMA_ARG_SWA_FULL: with the environment unreadable, saves go on."""
    h = harness
    proc = process_running(tmp_path / "models" / "gemma3-swa.gguf", pid=43)
    h.process[0] = type(proc)(**{**proc.__dict__, "environ": None})
    await h.coordinator.servers["local"].refresh()
    assert h.coordinator.status()["servers"][0]["memory"]["saves"] == "on"
    await h.turn("A")
    await h.turn("B")
    assert session_saves(h) and useless(h) == 0


async def test_a_look_at_an_older_instance_that_ends_last_is_not_kept(
    harness: Harness, tmp_path: Path
) -> None:
    """Two looks at the server overlap (the exit watch's and the next acquire's): the class read for the
    instance the first one saw, arriving after the second one read the next instance, is not kept."""
    h, srv = harness, harness.coordinator.servers["local"]
    entered, gate, read = threading.Event(), threading.Event(), srv.memory_reader

    def slow_first(caps: BackendCapabilities, process: ProcessInfo | None) -> ServerMemory:
        if not entered.is_set():
            entered.set()
            assert gate.wait(10)
        return read(caps, process)

    srv.memory_reader = slow_first
    h.fake.model_path = str(tmp_path / "models" / "gemma3-swa.gguf")
    h.process[0] = process_running(tmp_path / "models" / "gemma3-swa.gguf", "--swa-full", pid=43)
    older = asyncio.create_task(srv.refresh())
    await until(entered.is_set, what="the first look reading its instance's class")
    await runs(h, hybrid_gguf(tmp_path / "models"), pid=44)  # the next instance, read meanwhile
    assert srv.memory is not None and srv.memory.kind == HYBRID
    gate.set()
    await older
    assert srv.memory.kind == HYBRID and h.coordinator.status()["servers"][0]["memory"]["saves"] == "on"


async def test_status_never_shows_the_class_of_an_instance_that_is_gone(
    harness: Harness, tmp_path: Path
) -> None:
    """llama-server restarted with `--swa-full` and is asleep (`--sleep-idle-seconds`): the new instance's
    class is not read yet (the planner's is unknown, the strict rule). Status and the checkpoint policy read
    the same: not "saves off, swa_no_full" of the instance that is gone."""
    h, srv = harness, harness.coordinator.servers["local"]
    assert h.coordinator.status()["servers"][0]["memory"]["saves"] == "off"
    h.fake.sleep()
    h.process[0] = process_running(tmp_path / "models" / "gemma3-swa.gguf", "--swa-full", pid=43)
    await srv.refresh()
    assert srv.sleeping and srv.memory_class is None  # the identity: not read
    assert srv.memory is None and h.coordinator.status()["servers"][0]["memory"] is None
    await srv.refresh(wake=True)  # woken and read: with --swa-full, saves are on
    assert srv.memory_class is not None and srv.memory_class.swa_full
    assert srv.memory is not None and h.coordinator.status()["servers"][0]["memory"]["saves"] == "on"
