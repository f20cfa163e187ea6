"""Small GGUF files of each memory class (metadata and tensor names, 8-float tensors) and a llama-server
process that runs one, for the unit tests of what kvsidecar reads of a running server's model memory."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvsidecar.fingerprint.llama_process import ProcessInfo
from kvsidecar.fingerprint.llama_settings import parse_flags

ATTN = ["attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight", "ffn_up.weight"]
MAMBA2 = ["ssm_in.weight", "ssm_conv1d.weight", "ssm_a", "ssm_d", "ssm_norm.weight", "ssm_out.weight"]


def write_gguf(path: Path, arch: str, layers: list[list[str]], **meta: Any) -> Path:
    """A GGUF of `arch` whose layer i has the tensors `layers[i]`; `meta` keys are `{arch}.` + the name
    with `__` for `.` (`attention__sliding_window=128`)."""
    import gguf
    import numpy as np

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_uint32(f"{arch}.block_count", len(layers))
    for key, value in meta.items():
        name = f"{arch}.{key.replace('__', '.')}"
        if isinstance(value, list):
            writer.add_array(name, value)
        else:
            writer.add_uint32(name, value)
    writer.add_tensor("token_embd.weight", np.zeros((8,), dtype=np.float32))
    for i, names in enumerate(layers):
        for n in names:
            writer.add_tensor(f"blk.{i}.{n}", np.zeros((8,), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def plain_gguf(folder: Path) -> Path:
    return write_gguf(
        folder / "plain.gguf", "llama", [ATTN] * 2, embedding_length=256, attention__head_count=4
    )


def swa_gguf(folder: Path) -> Path:
    """Gemma 3's shape as the generated `gemma3-swa` has it: 6 layers (5 SWA, window 128, the sixth
    global by the architecture's default), 1 KV head of 64."""
    return write_gguf(
        folder / "gemma3-swa.gguf",
        "gemma3",
        [ATTN] * 6,
        embedding_length=256,
        attention__head_count=4,
        attention__head_count_kv=1,
        attention__key_length=64,
        attention__value_length=64,
        attention__sliding_window=128,
    )


def hybrid_gguf(folder: Path) -> Path:
    """Granite 4's shape: 3 Mamba2 layers (a zero KV head count) and 1 attention layer."""
    return write_gguf(
        folder / "granitehybrid.gguf",
        "granitehybrid",
        [MAMBA2, MAMBA2, MAMBA2, ATTN],
        embedding_length=256,
        attention__head_count=4,
        attention__head_count_kv=[0, 0, 0, 2],
    )


def process_running(
    model: Path, *args: str, pid: int = 42, environ: dict[str, str] | None = None
) -> ProcessInfo:
    """A local llama-server process that runs `model` with `args` (its environment read: `environ`)."""
    cmdline = ("/usr/bin/llama-server", "-m", str(model), "--port", "8080", *args)
    return ProcessInfo(
        pid=pid,
        create_time=float(pid),
        exe=None,
        cmdline=cmdline,
        flags=parse_flags(cmdline),
        environ={} if environ is None else environ,
        mapped_models=None,
    )
