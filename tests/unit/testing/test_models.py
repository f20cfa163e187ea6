"""Generated test models: an independent head_dim (issue 15) without changing any existing model file."""

from __future__ import annotations

import pytest

from kvsidecar.testing.models import LLAMA3_8B_GEOMETRY, TINY, ModelShape


@pytest.mark.parametrize(
    ("shape", "key"),
    [
        (TINY, "fc2681cab12cb368"),
        (ModelShape(seed=99), "98ac9c77c730b2b8"),
        (ModelShape(n_ctx=65536), "6c7f654092f557dc"),
    ],
)
def test_shapes_without_head_dim_keep_their_cache_key(shape: ModelShape, key: str) -> None:
    # The keys these shapes had before head_dim existed: their cached files stay valid.
    assert shape.cache_key() == key


def test_explicit_head_dim_is_another_model() -> None:
    # Equal to the default head_dim, but written as key_length/value_length: another file, another key.
    explicit = ModelShape(head_dim=TINY.n_embd // TINY.n_head)
    assert explicit.attn_head_dim == TINY.attn_head_dim
    assert explicit.cache_key() != TINY.cache_key()


def test_kv_bytes_per_token() -> None:
    assert TINY.kv_bytes_per_token_f16 == 2 * 4 * 4 * 64 * 2
    assert LLAMA3_8B_GEOMETRY.kv_bytes_per_token_f16 == 128 * 1024  # Llama-3-8B: 32 x 8 x 128 x 2 x 2 B
    assert LLAMA3_8B_GEOMETRY.attn_head_dim * LLAMA3_8B_GEOMETRY.n_head != LLAMA3_8B_GEOMETRY.n_embd
