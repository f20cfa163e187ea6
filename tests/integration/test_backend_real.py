"""LlamaCppBackend against a real llama-server, including the dangerous cases of docs/LLAMA_SERVER.md."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsidecar.backend.llamacpp import LlamaCppBackend
from kvsidecar.errors import (
    BackendUnavailable,
    BackendUnsupported,
    RestoreFailed,
    SlotNotFound,
)
from kvsidecar.store.integrity import read_header
from kvsidecar.testing.llama import complete, free_port, words
from tests.conftest import StartServer


async def test_probe_reports_props_and_slots(start_llama: StartServer, tiny_model: Path) -> None:
    server = start_llama(parallel=2)
    backend = LlamaCppBackend(base_url=server.base_url)
    try:
        caps = await backend.probe()
        slots = await backend.inspect_slots()
    finally:
        await backend.aclose()
    assert caps.alive and caps.slots_endpoint
    assert caps.total_slots == 2
    assert caps.model_path == str(tiny_model)
    assert caps.build_info
    assert [s.id for s in slots] == [0, 1]
    assert all(s.n_ctx == 2048 for s in slots)  # --ctx-size 4096 split over 2 slots


async def test_save_erase_restore_round_trip_reuses_the_prefix(
    start_llama: StartServer, tmp_path: Path
) -> None:
    server = start_llama(slot_save_path=tmp_path / "snaps")
    prompt = words("roundtrip", 1200)
    cold = complete(server.base_url, prompt)
    assert cold["prompt_n"] > 1000
    backend = LlamaCppBackend(base_url=server.base_url)
    try:
        saved = await backend.save_slot(0, "k.a.bin")
        erased = await backend.erase_slot(0)
        restored = await backend.restore_slot(0, "k.a.bin")
    finally:
        await backend.aclose()
    path = tmp_path / "snaps" / "k.a.bin"
    assert saved.tokens > 1000 and saved.bytes_written > 0 and saved.server_ms is not None
    assert path.stat().st_size >= saved.bytes_written
    assert read_header(path).tokens >= saved.tokens  # the header also counts generated tokens
    assert erased.tokens == saved.tokens
    assert restored.tokens == saved.tokens and restored.bytes_read > 0
    warm = complete(server.base_url, prompt + " tail")
    assert (
        warm["cache_n"] >= saved.tokens - 8
    )  # the engine reused what was restored (bar the re-tokenized tail)
    assert warm["prompt_n"] < 20


async def test_restore_of_a_missing_file_is_a_restore_failure(start_llama: StartServer) -> None:
    server = start_llama()
    backend = LlamaCppBackend(base_url=server.base_url)
    try:
        with pytest.raises(RestoreFailed) as info:
            await backend.restore_slot(0, "missing.a.bin")
    finally:
        await backend.aclose()
    assert info.value.code == "KV_RESTORE_FAILED"
    assert server.alive


async def test_empty_slot_saves_a_header_only_file(start_llama: StartServer, tmp_path: Path) -> None:
    server = start_llama(slot_save_path=tmp_path / "s")
    backend = LlamaCppBackend(base_url=server.base_url)
    try:
        saved = await backend.save_slot(0, "empty.a.bin")
        restored = await backend.restore_slot(0, "empty.a.bin")
    finally:
        await backend.aclose()
    assert saved.tokens == 0 and restored.tokens == 0
    header = read_header(tmp_path / "s" / "empty.a.bin")
    assert header.version >= 1  # the third header word is not a plain token count: 4 here, n_saved+4 above


async def test_slot_ids_are_validated_against_slots(start_llama: StartServer) -> None:
    server = start_llama(parallel=2)
    backend = LlamaCppBackend(base_url=server.base_url)
    try:
        with pytest.raises(SlotNotFound):
            await backend.erase_slot(5)  # llama-server itself would answer 200 here
    finally:
        await backend.aclose()


@pytest.mark.parametrize("name", ["../x.bin", "a/b.bin", "..", "x\\y.bin", ""])
async def test_unsafe_filenames_never_reach_the_server(start_llama: StartServer, name: str) -> None:
    server = start_llama()
    backend = LlamaCppBackend(base_url=server.base_url)
    try:
        with pytest.raises(BackendUnsupported):
            await backend.save_slot(0, name)
    finally:
        await backend.aclose()
    assert server.alive


async def test_server_without_slot_save_path_is_unsupported(start_llama: StartServer) -> None:
    server = start_llama(save=False)
    backend = LlamaCppBackend(base_url=server.base_url)
    try:
        with pytest.raises(BackendUnsupported) as info:
            await backend.save_slot(0, "x.a.bin")
    finally:
        await backend.aclose()
    assert "--slot-save-path" in info.value.message


async def test_unreachable_server_is_backend_unavailable() -> None:
    backend = LlamaCppBackend(base_url=f"http://127.0.0.1:{free_port()}", connect_timeout_s=0.5)
    try:
        with pytest.raises(BackendUnavailable) as info:
            await backend.probe()
        assert await backend.health() is False
    finally:
        await backend.aclose()
    assert info.value.hint
