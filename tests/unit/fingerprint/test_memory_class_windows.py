"""A model whose window is its architecture's default (no sliding_window key) is never read as plain
attention (llama.cpp 11434: models/llama4.cpp chunks at 8192 when the key is absent; models/gemma2.cpp 4096;
a 64-layer exaone4 4096): its class is unknown, so the strict rule applies."""

from __future__ import annotations

import pytest

from kvsidecar.fingerprint.gguf_meta import GgufFile
from kvsidecar.fingerprint.memory_class import PLAIN, SWA, UNKNOWN, classify


@pytest.mark.parametrize("arch,n_layer", [("llama4", 48), ("gemma2", 26), ("exaone4", 64)])
def test_default_window_architectures_are_not_plain(arch: str, n_layer: int) -> None:
    meta = {"general.architecture": arch, f"{arch}.block_count": n_layer}
    tensors: dict[str, tuple[int, ...]] = {f"blk.{i}.attn_k.weight": (8, 8) for i in range(n_layer)}
    c = classify(GgufFile(meta, frozenset(), tensors))
    assert c.kind == UNKNOWN and c.kind != PLAIN, (
        f"{arch}: llama.cpp may give it a window; kvsidecar: {c.kind}"
    )
    # the key stated (0 for llama4: no window; a window for the others) decides as before
    stated = classify(GgufFile({**meta, f"{arch}.attention.sliding_window": 0}, frozenset(), tensors))
    assert stated.kind == PLAIN
    windowed = classify(GgufFile({**meta, f"{arch}.attention.sliding_window": 4096}, frozenset(), tensors))
    assert windowed.kind == SWA and windowed.n_swa == 4096
