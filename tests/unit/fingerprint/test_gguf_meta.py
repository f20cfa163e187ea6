"""The GGUF reader: metadata, the per-layer arrays asked for, tensor names and dimensions, and hostile files
refused with GgufError (never a huge allocation or a hang)."""

from __future__ import annotations

import struct
from pathlib import Path

import gguf
import numpy as np
import pytest

from kvsidecar.fingerprint.gguf_meta import GgufError, read_gguf, read_metadata


def _model(path: Path) -> Path:
    writer = gguf.GGUFWriter(str(path), "granitehybrid")
    writer.add_block_count(2)
    writer.add_array("granitehybrid.attention.head_count_kv", [0, 2])
    writer.add_array("granitehybrid.other_list", [1, 2, 3])
    writer.add_token_list(["a", "b"])
    writer.add_tensor("blk.0.ssm_in.weight", np.zeros((3, 2), dtype=np.float32))
    writer.add_tensor("blk.1.attn_k.weight", np.zeros((4,), dtype=np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_arrays_asked_for_and_tensor_names(tmp_path: Path) -> None:
    path = _model(tmp_path / "m.gguf")
    info = read_gguf(path, array_suffixes=("attention.head_count_kv",), tensors=True)
    assert info.meta["granitehybrid.attention.head_count_kv"] == [0, 2]
    assert "granitehybrid.other_list" not in info.meta  # listed, not decoded
    assert {"granitehybrid.other_list", "tokenizer.ggml.tokens"} <= info.array_keys
    assert info.tensors == {"blk.0.ssm_in.weight": (2, 3), "blk.1.attn_k.weight": (4,)}  # ggml order
    by_name = read_gguf(path, arrays=("granitehybrid.other_list",))
    assert by_name.meta["granitehybrid.other_list"] == [1, 2, 3] and by_name.tensors == {}
    # the old interface is unchanged
    arrays: set[str] = set()
    meta = read_metadata(path, arrays=arrays)
    assert meta["granitehybrid.block_count"] == 2 and "granitehybrid.attention.head_count_kv" in arrays


def _header(n_tensors: int, kvs: bytes, n_kv: int) -> bytes:
    return b"GGUF" + struct.pack("<IQQ", 3, n_tensors, n_kv) + kvs


def _key(name: str) -> bytes:
    return struct.pack("<Q", len(name)) + name.encode()


@pytest.mark.parametrize(
    "data",
    [
        _header(0, _key("x") + struct.pack("<IIQ", 9, 4, 1 << 62), 1),  # an array of 2^62 items
        _header(1 << 40, b"", 0),  # a tensor count no file has
        _header(0, _key("x.head_count_kv") + struct.pack("<IIQ", 9, 4, 1 << 20), 1),  # too long to decode
        _header(
            0, _key("x.head_count_kv") + struct.pack("<IIQ", 9, 8, 1), 1
        ),  # an array of strings asked for
        _header(1, _key("t") + struct.pack("<I", 99), 0),  # 99 dimensions
        _header(2, (_key("t") + struct.pack("<IQIQ", 1, 4, 0, 0)) * 2, 0),  # one tensor listed twice
        _header(1, _key("t") + struct.pack("<I", 1), 0),  # truncated
        _header(0, struct.pack("<Q", 1 << 30), 1),  # a key of a gigabyte
    ],
)
def test_hostile_files_are_refused(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "bad.gguf"
    path.write_bytes(data)
    with pytest.raises(GgufError):
        read_gguf(path, array_suffixes=("head_count_kv",), tensors=True)
