"""Generated tiny models of the architecture classes that are not plain attention, for tests and benchmarks.

- `QWEN35`: a hybrid of gated-delta-net ("linear attention") layers and gated full-attention layers, as
  llama.cpp builds `qwen35` (`src/models/qwen35.cpp`): every `full_attention_interval`-th layer attends,
  the others carry a recurrent state (a short convolution and a per-head delta-rule state).
- `GRANITE_HYBRID`: Mamba2 layers mixed with attention layers (`granitehybrid`,
  `src/models/granite-hybrid.cpp`); a layer is recurrent where `attention.head_count_kv` is 0.
- `GEMMA3_SWA`: `gemma3` with a small sliding window, five local layers to one global
  (`src/models/gemma3.cpp`), so sliding-window tests run in seconds (Gemma 3 270M is the real one).

Tensor names and shapes follow each architecture's `load_arch_tensors` in the llama.cpp 11434 source; the
tokenizer is copied from llama.cpp's llama-spm vocabulary file, as for `models.generate_llama_model`. The
weights are random (seeded by the shape) and drawn at scales where the next token really depends on the
prompt and the seed, so a test can tell one state from another by what the model says. Files are cached
under the kvsidecar cache root and named by their shape, so a second call is instant.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import xxhash

from kvsidecar.testing.model_cache import cache_root, copy_tokenizer, vocab_file

# Bumped when what a generator writes for the same shape changes, so a cached file is never stale.
GENERATOR_VERSION = 1


@dataclass(frozen=True)
class TensorSpec:
    """One tensor: its GGUF name, its dimensions in ggml order (innermost first), and how it is drawn."""

    name: str
    dims: tuple[int, ...]
    # "matrix": f16, N(0, 1/fan_in); "embed": f16, N(0, 1); "ones", "zeros": f32; "conv": f32, N(0, 1/k);
    # "decay": f32, -exp(U(log lo, log hi)) (a recurrent layer's A); "dt_bias": f32, softplus^-1(U(1e-3, 0.1))
    kind: str
    gain: float = 1.0


@dataclass(frozen=True, kw_only=True)
class ArchShape:
    """What every generated model has: the trunk, the attention layers' geometry, the seed."""

    arch: str
    n_layer: int
    n_embd: int = 256
    n_head: int = 4
    n_head_kv: int = 2
    head_dim: int = 64
    n_ff: int = 512
    n_ctx: int = 32768
    seed: int = 1234
    output_gain: float = 4.0  # logits' standard deviation: large enough that greedy decoding varies

    @property
    def embed_gain(self) -> float:
        return 1.0

    def cache_key(self) -> str:
        fields = sorted({**asdict(self), "generator": GENERATOR_VERSION}.items())
        return xxhash.xxh3_64_hexdigest(repr(fields).encode())

    def file_name(self) -> str:
        return f"{self.arch}-random-{self.n_layer}L-{self.n_embd}d-{self.cache_key()}.gguf"

    def hparams(self) -> dict[str, Any]:
        """Metadata keys (without the `{arch}.` prefix) -> value; lists are written as arrays."""
        return {
            "context_length": self.n_ctx,
            "embedding_length": self.n_embd,
            "block_count": self.n_layer,
            "feed_forward_length": self.n_ff,
            "attention.head_count": self.n_head,
            "attention.head_count_kv": self.n_head_kv,
            "attention.key_length": self.head_dim,
            "attention.value_length": self.head_dim,
            "rope.dimension_count": self.head_dim,
            "attention.layer_norm_rms_epsilon": 1e-6,
        }

    def tensors(self) -> list[TensorSpec]:
        raise NotImplementedError

    def trunk(self, n_vocab: int) -> list[TensorSpec]:
        return [
            TensorSpec("token_embd.weight", (self.n_embd, n_vocab), "embed", self.embed_gain),
            TensorSpec("output_norm.weight", (self.n_embd,), "ones"),
            TensorSpec("output.weight", (self.n_embd, n_vocab), "matrix", self.output_gain),
        ]

    def ffn(self, i: int) -> list[TensorSpec]:
        e, f = self.n_embd, self.n_ff
        return [
            TensorSpec(f"blk.{i}.ffn_gate.weight", (e, f), "matrix"),
            TensorSpec(f"blk.{i}.ffn_up.weight", (e, f), "matrix"),
            TensorSpec(f"blk.{i}.ffn_down.weight", (f, e), "matrix"),
        ]

    def attention(self, i: int, *, q_out: int | None = None) -> list[TensorSpec]:
        e, hd = self.n_embd, self.head_dim
        return [
            TensorSpec(f"blk.{i}.attn_q.weight", (e, q_out or self.n_head * hd), "matrix"),
            TensorSpec(f"blk.{i}.attn_k.weight", (e, self.n_head_kv * hd), "matrix"),
            TensorSpec(f"blk.{i}.attn_v.weight", (e, self.n_head_kv * hd), "matrix"),
            TensorSpec(f"blk.{i}.attn_output.weight", (self.n_head * hd, e), "matrix"),
        ]


@dataclass(frozen=True, kw_only=True)
class Qwen35Shape(ArchShape):
    """`qwen35`: with n_layer 4 and interval 4, layers 0-2 are gated delta nets and layer 3 attends."""

    arch: str = "qwen35"
    n_layer: int = 4
    full_attention_interval: int = 4
    ssm_d_conv: int = 4  # ssm.conv_kernel
    ssm_d_state: int = 64  # ssm.state_size: the head size of both keys and values
    ssm_n_group: int = 2  # ssm.group_count: key heads
    ssm_dt_rank: int = 4  # ssm.time_step_rank: value heads
    rope_sections: tuple[int, ...] = (11, 11, 10, 0)  # IMRoPE sections, summing to rope dims / 2

    @property
    def value_dim(self) -> int:
        return self.ssm_d_state * self.ssm_dt_rank  # ssm.inner_size

    @property
    def conv_dim(self) -> int:
        return 2 * self.ssm_d_state * self.ssm_n_group + self.value_dim

    def is_recurrent(self, i: int) -> bool:
        return (i + 1) % self.full_attention_interval != 0

    def hparams(self) -> dict[str, Any]:
        return {
            **super().hparams(),
            "rope.dimension_sections": list(self.rope_sections),
            "rope.freq_base": 1e7,
            "ssm.conv_kernel": self.ssm_d_conv,
            "ssm.inner_size": self.value_dim,
            "ssm.state_size": self.ssm_d_state,
            "ssm.time_step_rank": self.ssm_dt_rank,
            "ssm.group_count": self.ssm_n_group,
            "full_attention_interval": self.full_attention_interval,
        }

    def tensors(self) -> list[TensorSpec]:
        e, hd, v = self.n_embd, self.head_dim, self.ssm_dt_rank
        specs: list[TensorSpec] = []
        for i in range(self.n_layer):
            p = f"blk.{i}."
            specs += [
                TensorSpec(p + "attn_norm.weight", (e,), "ones"),
                TensorSpec(p + "post_attention_norm.weight", (e,), "ones"),
            ]
            if not self.is_recurrent(i):
                specs += self.attention(i, q_out=2 * self.n_head * hd)  # the query and its gate
                specs += [
                    TensorSpec(p + "attn_q_norm.weight", (hd,), "ones"),
                    TensorSpec(p + "attn_k_norm.weight", (hd,), "ones"),
                ]
            else:
                specs += [
                    TensorSpec(p + "attn_qkv.weight", (e, self.conv_dim), "matrix"),
                    TensorSpec(p + "attn_gate.weight", (e, self.value_dim), "matrix"),
                    TensorSpec(p + "ssm_conv1d.weight", (self.ssm_d_conv, self.conv_dim), "conv"),
                    TensorSpec(p + "ssm_dt.bias", (v,), "dt_bias"),
                    TensorSpec(p + "ssm_a", (v,), "decay"),
                    TensorSpec(p + "ssm_beta.weight", (e, v), "matrix"),
                    TensorSpec(p + "ssm_alpha.weight", (e, v), "matrix"),
                    TensorSpec(p + "ssm_norm.weight", (self.ssm_d_state,), "ones"),
                    TensorSpec(p + "ssm_out.weight", (self.value_dim, e), "matrix"),
                ]
            specs += self.ffn(i)
        return specs


@dataclass(frozen=True, kw_only=True)
class GraniteHybridShape(ArchShape):
    """`granitehybrid`: Mamba2 layers except those in `attention_layers` (Granite 4 attends in 1 layer of
    10; denser here)."""

    arch: str = "granitehybrid"
    n_layer: int = 4
    attention_layers: tuple[int, ...] = (3,)
    ssm_d_conv: int = 4
    ssm_d_state: int = 64
    ssm_n_group: int = 1
    ssm_n_head: int = 8  # ssm.time_step_rank; head size = inner / heads

    @property
    def d_inner(self) -> int:
        return 2 * self.n_embd  # llama.cpp supports an expansion factor of 2 only

    @property
    def conv_dim(self) -> int:
        return self.d_inner + 2 * self.ssm_n_group * self.ssm_d_state

    def is_recurrent(self, i: int) -> bool:
        return i not in self.attention_layers

    def hparams(self) -> dict[str, Any]:
        kv = [0 if self.is_recurrent(i) else self.n_head_kv for i in range(self.n_layer)]
        return {
            **super().hparams(),
            "attention.head_count_kv": kv,
            "rope.freq_base": 10000.0,
            "ssm.conv_kernel": self.ssm_d_conv,
            "ssm.inner_size": self.d_inner,
            "ssm.state_size": self.ssm_d_state,
            "ssm.time_step_rank": self.ssm_n_head,
            "ssm.group_count": self.ssm_n_group,
        }

    def tensors(self) -> list[TensorSpec]:
        e, h, g = self.n_embd, self.ssm_n_head, self.ssm_n_group
        d_in_proj = 2 * self.d_inner + 2 * g * self.ssm_d_state + h
        specs: list[TensorSpec] = []
        for i in range(self.n_layer):
            p = f"blk.{i}."
            specs.append(TensorSpec(p + "attn_norm.weight", (e,), "ones"))
            if self.is_recurrent(i):
                specs += [
                    TensorSpec(p + "ssm_in.weight", (e, d_in_proj), "matrix"),
                    TensorSpec(p + "ssm_conv1d.weight", (self.ssm_d_conv, self.conv_dim), "conv"),
                    TensorSpec(p + "ssm_conv1d.bias", (self.conv_dim,), "zeros"),
                    TensorSpec(p + "ssm_dt.bias", (h,), "dt_bias"),
                    TensorSpec(p + "ssm_a", (1, h), "decay"),
                    TensorSpec(p + "ssm_d", (1, h), "ones"),
                    TensorSpec(p + "ssm_norm.weight", (self.d_inner // g, g), "ones"),
                    TensorSpec(p + "ssm_out.weight", (self.d_inner, e), "matrix"),
                ]
            else:
                specs += self.attention(i)
            specs.append(TensorSpec(p + "ffn_norm.weight", (e,), "ones"))
            specs += self.ffn(i)
        return specs


@dataclass(frozen=True, kw_only=True)
class Gemma3Shape(ArchShape):
    """`gemma3` with sliding-window attention: layer i is global when i % 6 == 5 (llama.cpp's default for
    gemma3 when the file has no `sliding_window_pattern`, which Gemma 3's own files do not have)."""

    arch: str = "gemma3"
    n_layer: int = 6
    n_head_kv: int = 1
    n_swa: int = 128

    def is_swa(self, i: int) -> bool:
        return i % 6 < 5

    @property
    def embed_gain(self) -> float:
        return 1.0 / math.sqrt(self.n_embd)  # gemma scales its input embeddings by sqrt(n_embd)

    def hparams(self) -> dict[str, Any]:
        return {
            **super().hparams(),
            "attention.sliding_window": self.n_swa,
            "rope.freq_base": 1e6,  # Gemma 3 270M's keys, less its size
        }

    def tensors(self) -> list[TensorSpec]:
        e, hd = self.n_embd, self.head_dim
        specs: list[TensorSpec] = []
        for i in range(self.n_layer):
            p = f"blk.{i}."
            specs.append(TensorSpec(p + "attn_norm.weight", (e,), "ones"))
            specs += self.attention(i)
            specs += [
                TensorSpec(p + "post_attention_norm.weight", (e,), "ones"),
                TensorSpec(p + "attn_k_norm.weight", (hd,), "ones"),
                TensorSpec(p + "attn_q_norm.weight", (hd,), "ones"),
                TensorSpec(p + "ffn_norm.weight", (e,), "ones"),
            ]
            specs += self.ffn(i)
            specs.append(TensorSpec(p + "post_ffw_norm.weight", (e,), "ones"))
        return specs


QWEN35 = Qwen35Shape()
GRANITE_HYBRID = GraniteHybridShape()
GEMMA3_SWA = Gemma3Shape()


def all_tensors(shape: ArchShape, n_vocab: int) -> list[TensorSpec]:
    return shape.trunk(n_vocab) + shape.tensors()


def _draw(spec: TensorSpec, rng: Any) -> Any:
    import numpy as np

    shape = tuple(reversed(spec.dims))  # numpy's order is ggml's reversed
    if spec.kind == "ones":
        return np.ones(shape, dtype=np.float32)
    if spec.kind == "zeros":
        return np.zeros(shape, dtype=np.float32)
    if spec.kind == "decay":
        return -np.exp(rng.uniform(math.log(1.0), math.log(16.0), shape)).astype(np.float32) / 8
    if spec.kind == "dt_bias":
        dt = np.exp(rng.uniform(math.log(1e-3), math.log(0.1), shape))
        return (dt + np.log(-np.expm1(-dt))).astype(np.float32)
    std = {"embed": 1.0, "matrix": 1.0 / math.sqrt(spec.dims[0]), "conv": 1.0 / math.sqrt(spec.dims[0])}
    data = rng.standard_normal(shape, dtype=np.float32) * (std[spec.kind] * spec.gain)
    return data.astype(np.float32 if spec.kind == "conv" else np.float16)


def _arrays(shape: ArchShape, n_vocab: int) -> Iterator[tuple[str, Any]]:
    import numpy as np

    rng = np.random.default_rng(shape.seed)
    for spec in all_tensors(shape, n_vocab):
        yield spec.name, _draw(spec, rng)


def generate_arch_model(shape: ArchShape, *, vocab_dir: Path, out_dir: Path | None = None) -> Path:
    """Write (or reuse) the model of `shape`; returns its path."""
    import gguf

    target = (out_dir or cache_root() / "models") / shape.file_name()
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(str(vocab_file(vocab_dir)))
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), shape.arch)
    writer.add_name(f"kvsidecar random {shape.arch}")
    for key, value in shape.hparams().items():
        _add(writer, f"{shape.arch}.{key}", value)
    writer.add_file_type(1)  # mostly f16
    n_vocab = copy_tokenizer(reader, writer)
    for name, data in _arrays(shape, n_vocab):
        writer.add_tensor(name, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(target)
    return target


def _add(writer: Any, key: str, value: Any) -> None:
    import gguf

    if isinstance(value, list):
        writer.add_array(key, value)
    elif isinstance(value, float):
        writer.add_float32(key, value)
    elif isinstance(value, bool):
        writer.add_bool(key, value)
    else:
        writer.add_key_value(key, int(value), gguf.GGUFValueType.UINT32)


ARCH_SHAPES: dict[str, ArchShape] = {
    "qwen35": QWEN35,
    "granitehybrid": GRANITE_HYBRID,
    "gemma3-swa": GEMMA3_SWA,
}
