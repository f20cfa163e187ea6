"""The SWA cache's size with and without --swa-full, against llama-server 11434's own log lines
(`llama_kv_cache: size = ... MiB (N cells, L layers, ...)` at `-lv 4`, the SWA cache's line) for the
generated gemma3-swa model and Gemma 3 270M; the integration test checks the same on the running binary
(tests/integration/test_doctor_classes_real.py)."""

from __future__ import annotations

from typing import Any

import pytest

from kvsidecar.fingerprint.llama_settings import parse_settings
from kvsidecar.fingerprint.swa_cache import MIB, swa_cache, swa_layers

GENERATED = {  # kvsidecar.testing.arch_models.GEMMA3_SWA's keys (5 SWA layers: Gemma 3's default pattern)
    "general.architecture": "gemma3",
    "gemma3.block_count": 6,
    "gemma3.embedding_length": 256,
    "gemma3.attention.head_count": 4,
    "gemma3.attention.head_count_kv": 1,
    "gemma3.attention.key_length": 64,
    "gemma3.attention.value_length": 64,
    "gemma3.attention.sliding_window": 128,
}
GEMMA_270M = {  # gemma-3-270m-q4_k_m.gguf's keys
    "general.architecture": "gemma3",
    "gemma3.block_count": 18,
    "gemma3.embedding_length": 640,
    "gemma3.attention.head_count": 4,
    "gemma3.attention.head_count_kv": 1,
    "gemma3.attention.key_length": 256,
    "gemma3.attention.value_length": 256,
    "gemma3.attention.sliding_window": 512,
}


def cache(
    meta: dict[str, Any], *args: str, n_ctx: int = 16384, slots: int = 1
) -> tuple[int, int, float, float]:
    c = swa_cache(meta, parse_settings(["llama-server", *args], {}), n_ctx_seq=n_ctx, n_slots=slots)
    assert c is not None
    return c.cells, c.streams, round(c.bytes / MIB, 2), round(c.bytes_full / MIB, 2)


@pytest.mark.parametrize(
    ("args", "n_ctx", "slots", "logged"),
    [
        # -c 16384 -np 1: "size = 0.94 MiB (768 cells, 5 layers, 1/1 seqs)"; --swa-full: 20.00 MiB
        (("-np", "1"), 16384, 1, (768, 1, 0.94, 20.0)),
        # -c 16384, -np left to llama-server (4 slots, unified): "1.25 MiB (1024 cells, 5 layers, 4/1 seqs)"
        ((), 16384, 4, (1024, 1, 1.25, 20.0)),
        # -c 16384 -np 2 --no-kv-unified (8,192 a slot): "1.88 MiB (768 cells, 5 layers, 2/2 seqs)"
        (("-np", "2", "--no-kv-unified"), 8192, 2, (768, 2, 1.88, 20.0)),
    ],
)
def test_the_generated_model_as_llama_server_logs_it(
    args: tuple[str, ...], n_ctx: int, slots: int, logged: tuple[int, int, float, float]
) -> None:
    assert cache(GENERATED, *args, n_ctx=n_ctx, slots=slots) == logged


def test_gemma_3_270m_at_16k_context() -> None:
    """docs/MODELS.md: `size = 15.00 MiB (1024 cells, 15 layers)` against `240.00 MiB (16384 cells, ...)`."""
    assert cache(GEMMA_270M, "-np", "1") == (1024, 1, 15.0, 240.0)
    c = swa_cache(GEMMA_270M, parse_settings(["llama-server", "-np", "1"], {}), n_ctx_seq=16384, n_slots=1)
    assert c is not None and c.layers == 15
    assert c.text() == "--swa-full takes the SWA cache from 15 to 240 MiB (1,024 -> 16,384 cells, 15 layers)"
    # a q8_0 cache: 34 bytes a block of 32
    assert cache(GEMMA_270M, "-np", "1", "-ctk", "q8_0", "-ctv", "q8_0")[2:] == (7.97, 127.5)
    # a smaller ubatch: 512 + 256 -> 768 cells
    assert cache(GEMMA_270M, "-np", "1", "-ub", "256")[0] == 768


def test_the_swa_layers_from_the_file_or_the_architecture() -> None:
    assert swa_layers(GEMMA_270M, "gemma3", 18) == [i for i in range(18) if i % 6 < 5]
    assert swa_layers({"x.attention.sliding_window_pattern": [1, 0, 1]}, "x", 3) == [0, 2]
    assert swa_layers({"x.attention.sliding_window_pattern": 2}, "x", 4) == [0, 2]
    assert swa_layers({}, "cohere2moe", 8) == [1, 2, 3, 5, 6, 7]  # dense first
    assert swa_layers({}, "an-unknown-arch", 8) is None


@pytest.mark.parametrize(
    ("meta", "args"),
    [
        ({**GENERATED, "gemma3.attention.sliding_window": 0}, ()),  # no window
        ({**GENERATED, "general.architecture": "other", "other.block_count": 6}, ()),
        (
            {
                **GENERATED,
                "general.architecture": "newarch",
                "newarch.block_count": 6,
                "newarch.attention.sliding_window": 128,
            },
            (),
        ),
        (GENERATED, ("-ctk", "q9_9")),  # a cache type not known here
        (GENERATED, ("--kv-unified-per-slot", "4096")),  # the slot's context is capped, not the cache's
        (GENERATED, ("-np", "x")),
        ({**GENERATED, "gemma3.attention.head_count_kv": [1, 1, 1, 1, 1, 2]}, ()),  # V widths differ
    ],
)
def test_not_known_is_none(meta: dict[str, Any], args: tuple[str, ...]) -> None:
    settings = parse_settings(["llama-server", *args], {})
    assert swa_cache(meta, settings, n_ctx_seq=4096, n_slots=1) is None
