"""Issue 16 A on a real llama-server: never a restore under another runtime, whatever changed.

llama-server is restarted between two acquires with no probe in between (probe_interval_s is an hour), so
every detection comes from the identity bracket around restores and saves and from the fingerprint. The
proof that nothing wrong was reused: the text generated at temperature 0 after the acquire equals the text
of a cold run of the same prompt on the same server.
"""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from kvsidecar.coordinator.state import Outcome
from kvsidecar.store.naming import SnapshotIdentity
from kvsidecar.testing.llama import LlamaServer, llama_server_binary, vocab_dir
from kvsidecar.testing.models import ModelShape, generate_llama_model
from tests.conftest import StartServer
from tests.integration.real_helpers import RealHarness, erase, generate, prompt, real_harness

OTHER = ModelShape(seed=4321)  # the same shape and size as TINY, other weights


async def acquire_and_generate(h: RealHarness, session: str) -> tuple[Outcome, str, str]:
    """Acquire `session`'s next turn, generate, release; then the same prompt cold on the same server."""
    n = h.turns.get(session, 0) + 1
    h.turns[session] = n
    text = prompt(session, n)
    r = await h.coordinator.acquire(session, provider="local", model="tiny")
    assert r.lease_id is not None and r.slot_id is not None
    warm = await asyncio.to_thread(generate, h.server.base_url, text, r.slot_id)
    await h.coordinator.release(r.lease_id, status="aborted")  # not dirty: nothing saved from here on
    await asyncio.to_thread(erase, h.server.base_url, r.slot_id)
    cold = await asyncio.to_thread(generate, h.server.base_url, text, r.slot_id)
    return r.outcome, warm, cold


def in_place(model: Path) -> Callable[[LlamaServer], None]:
    """Another model file written over the same path (same size: the same shape)."""

    def change(server: LlamaServer) -> None:
        shutil.copyfile(model, server.model)

    return change


def with_args(*args: str) -> Callable[[LlamaServer], None]:
    def change(server: LlamaServer) -> None:
        server.extra_args = (*server.extra_args, *args)

    return change


@pytest.fixture(scope="module")
def other_model() -> Path:
    return generate_llama_model(OTHER, vocab_dir=vocab_dir(llama_server_binary()))


@pytest.mark.parametrize("what", ["model replaced in place", "rope-freq-base", "LLAMA_ARG_ env var"])
async def test_restart_with_another_runtime_in_the_window_costs_a_cold_prefill_only(
    start_llama: StartServer,
    tiny_model: Path,
    other_model: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    what: str,
) -> None:
    model = tmp_path / "model.gguf"
    shutil.copyfile(tiny_model, model)
    server = start_llama(model=model)
    h = await real_harness(server, tmp_path)
    try:
        await h.turn("A")
        await h.turn("B")  # A saved under the first runtime
        server.stop()
        if what == "model replaced in place":
            in_place(other_model)(server)
        elif what == "rope-freq-base":
            with_args("--rope-freq-base", "5000")(server)
        else:
            monkeypatch.setenv("LLAMA_ARG_ROPE_FREQ_BASE", "5000")  # invisible on the command line
        server.start()
        h.calls()
        outcome, warm, cold = await acquire_and_generate(h, "A")
        assert "restore" not in h.calls()
        assert outcome is Outcome.COLD_FALLBACK
        assert warm == cold
    finally:
        await h.coordinator.aclose()


async def test_same_runtime_restart_in_the_window_restores_and_matches_cold(
    start_llama: StartServer, tmp_path: Path
) -> None:
    server = start_llama()
    h = await real_harness(server, tmp_path)
    try:
        await h.turn("A")
        await h.turn("B")
        server.restart()
        h.calls()
        outcome, warm, cold = await acquire_and_generate(h, "A")
        assert outcome is Outcome.RESTORED and "restore" in h.calls()
        assert warm == cold
    finally:
        await h.coordinator.aclose()


async def test_dirty_owner_is_not_saved_from_the_emptied_slot(
    start_llama: StartServer, tmp_path: Path
) -> None:
    server = start_llama()
    h = await real_harness(server, tmp_path)
    try:
        await h.turn("A")
        await h.turn("A")  # A dirty and resident, never saved
        server.restart()
        await h.turn("B")  # evicts A: the old process took A's KV with it
        key = SnapshotIdentity(server="local", provider="local", model="tiny", session_id="A").key
        assert h.coordinator.store.get(key) is None
        assert server.slot_save_path is not None
        assert not [p for p in server.slot_save_path.iterdir() if p.name.startswith(key)]
    finally:
        await h.coordinator.aclose()
