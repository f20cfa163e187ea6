"""What a snapshot costs, predicted from the model: against the sizes llama-server 11434 wrote for the
generated models and Gemma 3 270M (docs/MODELS.md, "What a saved state holds": bytes a token exactly, the
fixed part less the headers' few hundred bytes); `doctor --deep` measures the same on the running binary
(tests/integration/test_doctor_classes_real.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from kvsidecar.fingerprint.gguf_meta import read_gguf
from kvsidecar.fingerprint.llama_settings import parse_settings
from kvsidecar.fingerprint.memory_class import model_class
from kvsidecar.fingerprint.snapshot_cost import SnapshotCost, snapshot_cost
from kvsidecar.testing.arch_models import GEMMA3_SWA, GRANITE_HYBRID, QWEN35, generate_arch_model
from kvsidecar.testing.models import TINY, generate_llama_model
from tests.unit.gguf_helpers import write_vocab
from tests.unit.memory_helpers import plain_gguf

ARRAYS = ("attention.head_count", "attention.head_count_kv", "attention.sliding_window_pattern")


@pytest.fixture(scope="module")
def vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_vocab(tmp_path_factory.mktemp("vocab"))


def cost(model: Path, *args: str) -> SnapshotCost | None:
    settings = parse_settings(["llama-server", "-m", str(model), *args], {})
    meta = read_gguf(model, array_suffixes=ARRAYS).meta
    return snapshot_cost(meta, model_class([model], settings), settings)


@pytest.mark.parametrize(
    ("shape", "per_token", "fixed", "measured_fixed"),
    [
        # one attention layer of 2 KV heads x 64 (f16); qwen35's cells carry M-RoPE fields (12 B more)
        (QWEN35, 4 + 24 + 512, 3 * (6_144 + 65_536), 215_208),
        (GRANITE_HYBRID, 4 + 12 + 512, 3 * (7_680 + 131_072), 416_424),
        # the one global layer a token; the 5 SWA layers' 128 cells fixed
        (GEMMA3_SWA, 4 + 12 + 256, 128 * (12 + 5 * 256), 165_596),
    ],
    ids=["qwen35", "granitehybrid", "gemma3-swa"],
)
def test_each_generated_class_as_llama_server_writes_it(
    vocab: Path, tmp_path: Path, shape: Any, per_token: int, fixed: int, measured_fixed: int
) -> None:
    c = cost(generate_arch_model(shape, vocab_dir=vocab, out_dir=tmp_path))
    assert c == SnapshotCost(per_token=per_token, fixed=fixed)
    assert 0 < measured_fixed - c.fixed < 1024  # the headers
    assert c.text() == f"a snapshot costs {per_token:,} B a token + about {fixed:,} B fixed"


def test_a_plain_model_and_the_cache_type(vocab: Path, tmp_path: Path) -> None:
    tiny = generate_llama_model(TINY, vocab_dir=vocab, out_dir=tmp_path)
    assert cost(tiny) == SnapshotCost(per_token=4_112, fixed=0)  # measured: 4,112 + 148 of headers
    # q8_0: 34 bytes a block of 32 values, K and V of 256 values in each of the 4 layers
    assert cost(tiny, "-ctk", "q8_0", "-ctv", "q8_0") == SnapshotCost(per_token=16 + 4 * 2 * 8 * 34, fixed=0)
    assert cost(tiny, "-ctk", "q3_k") is None  # a type whose row size is not known here


def test_what_is_not_known_is_none(tmp_path: Path) -> None:
    plain = plain_gguf(tmp_path)
    settings = parse_settings(["llama-server"], {})
    meta = dict(read_gguf(plain, array_suffixes=ARRAYS).meta)
    memory = model_class([plain], settings)
    assert snapshot_cost(meta, memory, settings) is not None
    del meta["llama.attention.head_count"]
    assert snapshot_cost(meta, memory, settings) is None
    # the metadata's attention layers disagree with the tensors' count
    meta = {**read_gguf(plain, array_suffixes=ARRAYS).meta, "llama.attention.head_count_kv": [4, 0]}
    assert snapshot_cost(meta, memory, settings) is None
