"""The generated hybrid and sliding-window models: the metadata llama.cpp reads, and exactly the tensors its
loader creates, with the shapes it asks for.

The expected tensors are computed here the way llama.cpp 11434's `load_arch_tensors` computes them
(`src/models/qwen35.cpp`, `granite-hybrid.cpp`, `gemma3.cpp`) from the hyper-parameters it reads from the
file, not from the generator's own tables; every name must also be one the gguf package lists for the
architecture. That the real llama-server loads and decodes each file is
tests/integration/test_arch_models_real.py's.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from kvsidecar.testing.arch_models import (
    GEMMA3_SWA,
    GRANITE_HYBRID,
    QWEN35,
    ArchShape,
    Gemma3Shape,
    Qwen35Shape,
    generate_arch_model,
)
from tests.unit.gguf_helpers import N_VOCAB, write_vocab


@pytest.fixture(scope="module")
def vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_vocab(tmp_path_factory.mktemp("vocab"))


def _read(path: Path) -> tuple[dict[str, Any], dict[str, tuple[tuple[int, ...], str]]]:
    reader = gguf.GGUFReader(str(path))
    meta = {name: f.contents() for name, f in reader.fields.items() if not name.startswith("tokenizer.")}
    tensors = {
        t.name: (tuple(int(d) for d in np.asarray(t.shape)), t.tensor_type.name) for t in reader.tensors
    }
    return meta, tensors


def _qwen35_expected(m: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """llama_model_qwen35::load_arch_tensors, with is_recr from full_attention_interval."""
    a = "qwen35"
    e, n_head, n_kv = (
        m[f"{a}.embedding_length"],
        m[f"{a}.attention.head_count"],
        m[f"{a}.attention.head_count_kv"],
    )
    hd, ff = m[f"{a}.attention.key_length"], m[f"{a}.feed_forward_length"]
    head_k = head_v = m[f"{a}.ssm.state_size"]
    k_heads, v_heads = m[f"{a}.ssm.group_count"], m[f"{a}.ssm.time_step_rank"]
    key_dim, value_dim = head_k * k_heads, head_v * v_heads
    conv_dim = 2 * key_dim + value_dim
    interval = m[f"{a}.full_attention_interval"]
    out = _trunk(e)
    for i in range(m[f"{a}.block_count"]):
        p = f"blk.{i}."
        out |= {p + "attn_norm.weight": (e,), p + "post_attention_norm.weight": (e,)}
        if (i + 1) % interval == 0:
            out |= {
                p + "attn_q.weight": (e, hd * n_head * 2),
                p + "attn_k.weight": (e, hd * n_kv),
                p + "attn_v.weight": (e, hd * n_kv),
                p + "attn_output.weight": (hd * n_head, e),
                p + "attn_q_norm.weight": (hd,),
                p + "attn_k_norm.weight": (hd,),
            }
        else:
            out |= {
                p + "attn_qkv.weight": (e, conv_dim),
                p + "attn_gate.weight": (e, value_dim),
                p + "ssm_conv1d.weight": (m[f"{a}.ssm.conv_kernel"], conv_dim),
                p + "ssm_dt.bias": (v_heads,),
                p + "ssm_a": (v_heads,),
                p + "ssm_beta.weight": (e, v_heads),
                p + "ssm_alpha.weight": (e, v_heads),
                p + "ssm_norm.weight": (head_v,),
                p + "ssm_out.weight": (value_dim, e),
            }
        out |= _ffn(p, e, ff)
    return out


def _granite_expected(m: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """llama_model_granite_hybrid::load_arch_tensors: a layer is recurrent iff its head_count_kv is 0."""
    a = "granitehybrid"
    e, n_head, ff = m[f"{a}.embedding_length"], m[f"{a}.attention.head_count"], m[f"{a}.feed_forward_length"]
    hd = m[f"{a}.attention.key_length"]
    d_conv, d_inner, d_state = (m[f"{a}.ssm.{k}"] for k in ("conv_kernel", "inner_size", "state_size"))
    n_ssm_head, n_group = m[f"{a}.ssm.time_step_rank"], m[f"{a}.ssm.group_count"]
    assert d_inner == 2 * e  # llama.cpp asserts an expansion factor of 2
    d_in_proj = 2 * d_inner + 2 * n_group * d_state + n_ssm_head
    out = _trunk(e)
    for i, n_kv in enumerate(m[f"{a}.attention.head_count_kv"]):
        p = f"blk.{i}."
        out[p + "attn_norm.weight"] = (e,)
        if n_kv == 0:
            out |= {
                p + "ssm_in.weight": (e, d_in_proj),
                p + "ssm_conv1d.weight": (d_conv, d_inner + 2 * n_group * d_state),
                p + "ssm_conv1d.bias": (d_inner + 2 * n_group * d_state,),
                p + "ssm_dt.bias": (n_ssm_head,),
                p + "ssm_a": (1, n_ssm_head),
                p + "ssm_d": (1, n_ssm_head),
                p + "ssm_norm.weight": (d_inner // n_group, n_group),
                p + "ssm_out.weight": (d_inner, e),
            }
        else:
            out |= {
                p + "attn_q.weight": (e, hd * n_head),
                p + "attn_k.weight": (e, hd * n_kv),
                p + "attn_v.weight": (e, hd * n_kv),
                p + "attn_output.weight": (hd * n_head, e),
            }
        out[p + "ffn_norm.weight"] = (e,)
        out |= _ffn(p, e, ff)
    return out


def _gemma3_expected(m: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """llama_model_gemma3::load_arch_tensors."""
    a = "gemma3"
    e, n_head, n_kv = (
        m[f"{a}.embedding_length"],
        m[f"{a}.attention.head_count"],
        m[f"{a}.attention.head_count_kv"],
    )
    hd, ff = m[f"{a}.attention.key_length"], m[f"{a}.feed_forward_length"]
    out = _trunk(e)
    for i in range(m[f"{a}.block_count"]):
        p = f"blk.{i}."
        out |= {
            p + "attn_norm.weight": (e,),
            p + "attn_q.weight": (e, hd * n_head),
            p + "attn_k.weight": (e, hd * n_kv),
            p + "attn_v.weight": (e, hd * n_kv),
            p + "attn_output.weight": (hd * n_head, e),
            p + "post_attention_norm.weight": (e,),
            p + "attn_k_norm.weight": (hd,),
            p + "attn_q_norm.weight": (hd,),
            p + "ffn_norm.weight": (e,),
            p + "post_ffw_norm.weight": (e,),
        }
        out |= _ffn(p, e, ff)
    return out


def _trunk(e: int) -> dict[str, tuple[int, ...]]:
    return {"token_embd.weight": (e, N_VOCAB), "output_norm.weight": (e,), "output.weight": (e, N_VOCAB)}


def _ffn(p: str, e: int, ff: int) -> dict[str, tuple[int, ...]]:
    return {p + "ffn_gate.weight": (e, ff), p + "ffn_down.weight": (ff, e), p + "ffn_up.weight": (e, ff)}


EXPECTED = {"qwen35": _qwen35_expected, "granitehybrid": _granite_expected, "gemma3": _gemma3_expected}


@pytest.mark.parametrize("shape", [QWEN35, GRANITE_HYBRID, GEMMA3_SWA], ids=lambda s: s.arch)
def test_the_file_holds_exactly_the_tensors_llama_cpp_loads(
    shape: ArchShape, vocab: Path, tmp_path: Path
) -> None:
    meta, tensors = _read(generate_arch_model(shape, vocab_dir=vocab, out_dir=tmp_path))
    assert meta["general.architecture"] == shape.arch
    expected = EXPECTED[shape.arch](meta)
    assert {name: dims for name, (dims, _) in tensors.items()} == expected
    # every name is one the gguf package knows for the architecture
    arch = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == shape.arch)
    known = {gguf.TENSOR_NAMES[t] for t in gguf.MODEL_TENSORS[arch]}
    for name in tensors:
        generic = name.split(".", 2)
        pattern = f"blk.{{bid}}.{generic[2]}" if generic[0] == "blk" else name
        assert pattern.rsplit(".weight", 1)[0].rsplit(".bias", 1)[0] in known, name
    # the recurrent layers' convolution and decay are f32, as llama.cpp's ops expect
    for name, (_, qtype) in tensors.items():
        if "ssm_conv1d" in name or name.endswith(("ssm_a", "ssm_d")) or name.endswith("norm.weight"):
            assert qtype == "F32", name


def test_hyper_parameters_are_the_keys_llama_cpp_reads(vocab: Path, tmp_path: Path) -> None:
    qwen, _ = _read(generate_arch_model(QWEN35, vocab_dir=vocab, out_dir=tmp_path))
    k = gguf.Keys
    assert qwen[k.SSM.CONV_KERNEL.format(arch="qwen35")] == 4
    assert qwen[k.SSM.INNER_SIZE.format(arch="qwen35")] == 64 * 4  # state size x value heads
    assert qwen[k.SSM.STATE_SIZE.format(arch="qwen35")] == 64
    assert qwen[k.SSM.TIME_STEP_RANK.format(arch="qwen35")] == 4
    assert qwen[k.SSM.GROUP_COUNT.format(arch="qwen35")] == 2
    assert qwen[k.LLM.FULL_ATTENTION_INTERVAL.format(arch="qwen35")] == 4
    assert list(qwen[k.Rope.DIMENSION_SECTIONS.format(arch="qwen35")]) == [11, 11, 10, 0]
    granite, _ = _read(generate_arch_model(GRANITE_HYBRID, vocab_dir=vocab, out_dir=tmp_path))
    assert list(granite[k.Attention.HEAD_COUNT_KV.format(arch="granitehybrid")]) == [0, 0, 0, 2]
    gemma, _ = _read(generate_arch_model(GEMMA3_SWA, vocab_dir=vocab, out_dir=tmp_path))
    assert gemma[k.Attention.SLIDING_WINDOW.format(arch="gemma3")] == 128
    # like Gemma 3's own files: no pattern key, so llama.cpp's gemma3 default (5 local : 1 global) applies
    assert k.Attention.SLIDING_WINDOW_PATTERN.format(arch="gemma3") not in gemma
    assert [GEMMA3_SWA.is_swa(i) for i in range(6)] == [True] * 5 + [False]


def test_a_model_is_deterministic_by_its_seed_and_cached(vocab: Path, tmp_path: Path) -> None:
    a = generate_arch_model(QWEN35, vocab_dir=vocab, out_dir=tmp_path / "a")
    b = generate_arch_model(QWEN35, vocab_dir=vocab, out_dir=tmp_path / "b")
    assert a.read_bytes() == b.read_bytes()
    other = generate_arch_model(Qwen35Shape(seed=7), vocab_dir=vocab, out_dir=tmp_path / "a")
    assert (
        other != a and hashlib.sha256(other.read_bytes()).digest() != hashlib.sha256(a.read_bytes()).digest()
    )
    stamp = a.stat().st_mtime_ns
    assert generate_arch_model(QWEN35, vocab_dir=vocab, out_dir=tmp_path / "a") == a
    assert a.stat().st_mtime_ns == stamp  # reused, not written again
    assert not list((tmp_path / "a").glob("*.tmp*"))


def test_shapes_name_their_files_by_every_field() -> None:
    assert QWEN35.cache_key() != Qwen35Shape(full_attention_interval=2).cache_key()
    assert GEMMA3_SWA.cache_key() != Gemma3Shape(n_swa=256).cache_key()
    assert QWEN35.file_name().startswith("qwen35-random-4L-256d-")
    assert QWEN35.cache_key() == Qwen35Shape().cache_key()
