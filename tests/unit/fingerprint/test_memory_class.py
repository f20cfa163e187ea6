"""A model's memory class, read from its GGUF metadata and tensor names and the server's settings: each
architecture family as llama.cpp 11434 marks its layers, the generated models, and the cases that must not
be guessed (the metadata and the tensors disagree, a file cannot be read)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from kvsidecar.fingerprint.gguf_meta import GgufFile
from kvsidecar.fingerprint.llama_settings import parse_settings
from kvsidecar.fingerprint.memory_class import (
    HYBRID,
    PLAIN,
    RECURRENT,
    SWA,
    UNKNOWN,
    apply_settings,
    classify,
    model_class,
)
from kvsidecar.testing.arch_models import GEMMA3_SWA, GRANITE_HYBRID, QWEN35, generate_arch_model
from tests.unit.gguf_helpers import write_vocab


@pytest.fixture(scope="module")
def vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_vocab(tmp_path_factory.mktemp("vocab"))


def _file(arch: str, n_layer: int, layer_tensors: list[list[str]], **meta: Any) -> GgufFile:
    tensors: dict[str, tuple[int, ...]] = {"token_embd.weight": (8, 8)}
    for i, names in enumerate(layer_tensors):
        tensors |= {f"blk.{i}.{n}": (8,) for n in names}
    keys = {"general.architecture": arch, f"{arch}.block_count": n_layer}
    keys |= {f"{arch}.{k.replace('__', '.')}": v for k, v in meta.items()}
    return GgufFile(meta=keys, array_keys=frozenset(), tensors=tensors)


ATTN = ["attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_up.weight"]
GDN = [
    "attn_qkv.weight",
    "attn_gate.weight",
    "ssm_conv1d.weight",
    "ssm_a",
    "ssm_beta.weight",
    "ffn_up.weight",
]
MAMBA2 = ["ssm_in.weight", "ssm_conv1d.weight", "ssm_a", "ssm_d", "ssm_norm.weight", "ssm_out.weight"]
MLP = ["ffn_up.weight", "ffn_down.weight"]


def test_plain_attention() -> None:
    c = classify(_file("llama", 2, [ATTN, ATTN]))
    assert (c.kind, c.attention_layers, c.recurrent_layers, c.n_swa) == (PLAIN, 2, 0, 0)
    assert c.restore_keeps == "prefix"


def test_qwen35_by_its_interval() -> None:
    c = classify(
        _file(
            "qwen35",
            4,
            [GDN, GDN, GDN, ATTN],
            full_attention_interval=4,
            rope__dimension_sections=[11, 11, 10, 0],
            ssm__conv_kernel=4,
            ssm__inner_size=256,
            ssm__state_size=64,
            ssm__group_count=2,
        )
    )
    assert (c.kind, c.attention_layers, c.recurrent_layers) == (HYBRID, 1, 3)
    assert c.recurrent_kind == "gated-delta-net"
    assert c.cell_ext  # IMRoPE cells carry their 2-D position and token in a saved state
    assert (c.r_row_bytes, c.s_row_bytes) == (4 * 3 * (256 + 2 * 2 * 64), 4 * 64 * 256)
    assert c.restore_keeps == "extension"


def test_granite_and_nemotron_by_their_head_counts() -> None:
    granite = classify(
        _file("granitehybrid", 4, [MAMBA2, MAMBA2, MAMBA2, ATTN], attention__head_count_kv=[0, 0, 0, 2])
    )
    assert (granite.kind, granite.recurrent_kind, granite.recurrent_layers) == (HYBRID, "mamba2", 3)
    # Nemotron-H: Mamba2, MLP and attention layers; an MLP layer has no heads either, but a feed-forward
    nemotron = classify(
        _file(
            "nemotron_h",
            4,
            [MAMBA2, MLP, ATTN[:4], MLP],
            attention__head_count_kv=[0, 0, 2, 0],
            feed_forward_length=[0, 64, 0, 64],
        )
    )
    assert (nemotron.kind, nemotron.recurrent_layers, nemotron.attention_layers) == (HYBRID, 1, 1)


def test_recurrent_only_and_attention_in_every_recurrent_layer() -> None:
    mamba = classify(_file("mamba2", 3, [MAMBA2] * 3, attention__head_count=0))
    assert (mamba.kind, mamba.attention_layers, mamba.recurrent_layers) == (RECURRENT, 0, 3)
    # Falcon-H1: every layer has both
    falcon = classify(_file("falcon-h1", 2, [MAMBA2 + ATTN] * 2))
    assert (falcon.kind, falcon.attention_layers, falcon.recurrent_layers) == (HYBRID, 2, 2)


@pytest.mark.parametrize(
    ("pattern", "swa_layers"),
    [(None, None), (6, 5), ([True, True, False, True, True, False], 4), (0, 6)],
)
def test_sliding_window(pattern: Any, swa_layers: int | None) -> None:
    extra = {} if pattern is None else {"attention__sliding_window_pattern": pattern}
    c = classify(_file("gemma3", 6, [ATTN] * 6, attention__sliding_window=512, **extra))
    assert (c.kind, c.n_swa, c.swa_layers) == (SWA, 512, swa_layers)


def test_settings_decide_swa_full_and_checkpoints() -> None:
    swa = classify(_file("gemma3", 6, [ATTN] * 6, attention__sliding_window=512))
    plain = classify(_file("llama", 1, [ATTN]))
    hybrid = classify(_file("granitehybrid", 2, [MAMBA2, ATTN], attention__head_count_kv=[0, 2]))
    defaults = apply_settings(swa, None)
    assert not defaults.swa_full and defaults.restore_keeps == "nothing"
    assert defaults.checkpoints is not None and defaults.checkpoints.made
    assert defaults.checkpoints.before_end == (516, 4) and defaults.checkpoints.ram_cache_mib == 8192
    full = apply_settings(swa, parse_settings(["llama-server", "--swa-full", "-ub", "128"], {}))
    assert full.swa_full and full.restore_keeps == "extension"
    assert full.checkpoints is not None and not full.checkpoints.made  # nothing to roll back
    env = apply_settings(hybrid, parse_settings(["llama-server"], {"LLAMA_ARG_CTX_CHECKPOINTS": "0"}))
    assert env.checkpoints is not None and not env.checkpoints.made and env.checkpoints.max_per_slot == 0
    ram = apply_settings(plain, parse_settings(["llama-server", "--swa-full", "-cram", "0"], {}))
    assert not ram.swa_full  # llama-server turns --swa-full off for a model without a window
    assert ram.checkpoints is not None and ram.checkpoints.ram_cache_mib == 0 and not ram.checkpoints.made


def test_what_cannot_be_known_is_unknown(tmp_path: Path) -> None:
    # the metadata names recurrent layers the tensors do not have, or the other way round
    lying = classify(_file("qwen35", 4, [ATTN] * 4, full_attention_interval=4))
    assert lying.kind == UNKNOWN and "recurrent" in lying.why
    other = classify(_file("granitehybrid", 2, [MAMBA2, ATTN], attention__head_count_kv=[2, 0]))
    assert other.kind == UNKNOWN
    assert classify(GgufFile(meta={}, array_keys=frozenset())).kind == UNKNOWN
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 16)
    assert model_class([bad]).kind == UNKNOWN
    assert model_class([tmp_path / "missing.gguf"]).kind == UNKNOWN
    assert model_class([]).kind == UNKNOWN


def test_the_generated_models(vocab: Path, tmp_path: Path) -> None:
    qwen = model_class([generate_arch_model(QWEN35, vocab_dir=vocab, out_dir=tmp_path)])
    assert (qwen.kind, qwen.arch, qwen.recurrent_layers, qwen.recurrent_kind) == (
        HYBRID,
        "qwen35",
        3,
        "gated-delta-net",
    )
    granite = model_class([generate_arch_model(GRANITE_HYBRID, vocab_dir=vocab, out_dir=tmp_path)])
    assert (granite.kind, granite.recurrent_layers, granite.recurrent_kind) == (HYBRID, 3, "mamba2")
    gemma = model_class([generate_arch_model(GEMMA3_SWA, vocab_dir=vocab, out_dir=tmp_path)])
    assert (gemma.kind, gemma.n_swa, gemma.attention_layers) == (SWA, 128, 6)


def test_a_split_model_reads_its_tensors_from_every_shard(tmp_path: Path) -> None:
    out = tmp_path / "split.gguf"
    writer = gguf.GGUFWriter(str(out), "granitehybrid", split_max_tensors=2, small_first_shard=True)
    writer.add_block_count(2)
    writer.add_array("granitehybrid.attention.head_count_kv", [0, 2])
    for name in (
        "blk.0.ssm_in.weight",
        "blk.0.ssm_conv1d.weight",
        "blk.1.attn_k.weight",
        "blk.1.attn_q.weight",
    ):
        writer.add_tensor(name, np.zeros((2, 2), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    shards = sorted(tmp_path.glob("split-*-of-*.gguf"))
    assert len(shards) == 3
    c = model_class(shards)
    assert (c.kind, c.recurrent_layers, c.attention_layers) == (HYBRID, 1, 1)
    assert model_class(shards[:1]).kind == UNKNOWN  # the metadata names a recurrent layer no shard has
