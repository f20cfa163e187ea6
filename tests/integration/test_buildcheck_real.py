"""The real build passes the smoke check it was cached by (issue 25): one decode of a model whose weights are
quantized, so the q8_0/q4_0 matmul kernels ran; and the cache's smoke model really is quantized."""

from __future__ import annotations

from pathlib import Path

import gguf
import pytest

from kvsidecar.buildcheck import smoke_decode
from kvsidecar.testing.llama import vocab_dir
from kvsidecar.testing.models import SMOKE_Q8_0, generate_llama_model


def test_the_real_build_decodes_a_quantized_model(llama_bin: Path, tmp_path: Path) -> None:
    model = generate_llama_model(SMOKE_Q8_0, vocab_dir=vocab_dir(llama_bin), out_dir=tmp_path)
    types = {t.name: t.tensor_type for t in gguf.GGUFReader(str(model)).tensors}
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q8_0
    assert types["blk.0.ffn_up.weight"] == gguf.GGMLQuantizationType.Q4_0
    assert types["output.weight"] == gguf.GGMLQuantizationType.Q8_0
    result = smoke_decode(llama_bin, model, timeout_s=120)
    assert result.ok, result.detail + "\n" + result.log_tail
    assert "decoded" in result.detail


def test_the_cached_build_kept_its_smoke_model_and_record(llama_bin: Path) -> None:
    """What provision-llama-server re-checks once per boot is there, beside the binary."""
    dest = llama_bin.parent.parent
    if not (dest / "BUILD-INFO").exists():
        pytest.skip("LLAMA_SERVER_BIN names a binary that provision-llama-server did not build")
    info = (dest / "BUILD-INFO").read_text()
    assert "recipe " in info and "cpu_key " in info
    types = {t.tensor_type for t in gguf.GGUFReader(str(dest / "smoke" / "model.gguf")).tensors}
    assert gguf.GGMLQuantizationType.Q8_0 in types
    assert smoke_decode(llama_bin, dest / "smoke" / "model.gguf", timeout_s=120).ok
