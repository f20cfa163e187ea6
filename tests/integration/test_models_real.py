"""A generated model with Llama-3-8B's KV geometry (issue 15): llama-server loads it and its KV costs what
Llama-3-8B's does, 128 KiB per token; models without a head_dim are written exactly as before."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import gguf
import httpx
import numpy as np
import pytest

from kvsidecar.testing.llama import complete, vocab_dir, words
from kvsidecar.testing.models import LLAMA3_8B_GEOMETRY, TINY, generate_llama_model
from tests.conftest import StartServer

TINY_SHA256 = "189332952056737097f63bc2301b624bff228b0cba738f3c2b44b18956e634b4"  # before head_dim existed


@pytest.fixture(scope="module")
def geometry_model(llama_bin: Path) -> Path:
    return generate_llama_model(LLAMA3_8B_GEOMETRY, vocab_dir=vocab_dir(llama_bin))


def _fields(path: Path) -> tuple[dict[str, Any], dict[str, tuple[int, ...]]]:
    reader = gguf.GGUFReader(str(path))
    keys = {name: f.contents() for name, f in reader.fields.items() if name.startswith("llama.")}
    shapes = {t.name: tuple(int(d) for d in np.asarray(t.shape)) for t in reader.tensors}
    return keys, shapes


def test_tiny_model_file_is_bit_identical(llama_bin: Path, tmp_path: Path) -> None:
    path = generate_llama_model(TINY, vocab_dir=vocab_dir(llama_bin), out_dir=tmp_path)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == TINY_SHA256
    keys, _ = _fields(path)
    assert "llama.attention.key_length" not in keys and "llama.attention.value_length" not in keys


def test_head_dim_is_written_as_key_and_value_length(geometry_model: Path) -> None:
    keys, shapes = _fields(geometry_model)
    assert keys["llama.attention.key_length"] == 128
    assert keys["llama.attention.value_length"] == 128
    assert keys["llama.rope.dimension_count"] == 128
    assert keys["llama.block_count"] == 32 and keys["llama.embedding_length"] == 256
    # GGUF lists dimensions innermost first: (n_in, n_out)
    assert shapes["blk.0.attn_q.weight"] == (256, 8 * 128)
    assert shapes["blk.0.attn_k.weight"] == (256, 8 * 128)
    assert shapes["blk.0.attn_v.weight"] == (256, 8 * 128)
    assert shapes["blk.0.attn_output.weight"] == (8 * 128, 256)


def _save(base_url: str, name: str) -> dict[str, Any]:
    r = httpx.post(f"{base_url}/slots/0?action=save", json={"filename": name}, timeout=120)
    r.raise_for_status()
    data: dict[str, Any] = r.json()
    return data


def test_llama_server_saves_128_kib_per_token(
    start_llama: StartServer, geometry_model: Path, tmp_path: Path
) -> None:
    server = start_llama(model=geometry_model, ctx_size=1024, slot_save_path=tmp_path / "snaps")
    timings = complete(server.base_url, words("geometry", 200), n_predict=1)
    assert int(timings["prompt_n"]) > 100
    first = _save(server.base_url, "a.bin")
    complete(server.base_url, words("geometry", 200) + " " + words("more", 200), n_predict=1)
    second = _save(server.base_url, "b.bin")
    size_a = (tmp_path / "snaps" / "a.bin").stat().st_size
    size_b = (tmp_path / "snaps" / "b.bin").stat().st_size
    tokens = int(second["n_saved"]) - int(first["n_saved"])
    assert tokens > 100
    per_token = (size_b - size_a) / tokens
    # K and V of 32 layers x 8 KV heads x 128 dims in f16, plus a few bytes of the cell's own
    # (16 in this build: its token, position and sequence)
    assert LLAMA3_8B_GEOMETRY.kv_bytes_per_token_f16 == 131072
    assert 131072 <= per_token < 131072 + 64, per_token
    assert size_a >= 131072 * int(first["n_saved"])
