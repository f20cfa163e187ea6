"""What a slot snapshot of a model costs on disk, predicted from its GGUF metadata, its memory class and the
server's cache types: bytes a saved token adds, and the fixed part whatever the length (the headers left
out: a few hundred bytes). It follows the state file llama.cpp 11434 writes (`llama_kv_cache::state_write`,
`llama_memory_recurrent::state_write`; `store/state_sections.py` reads the same), and `doctor --deep`
measures the real figure from two probe saves (`doctor/restore_check.py`). Pure: no file is read here.

- **A token**: its id (4 bytes) and, in each full-attention cell, its position, its sequence count and one
  sequence id (12 bytes; 12 more where the cells carry M-RoPE fields), plus the K and V rows of every
  full-attention layer.
- **Fixed**: a recurrent model's state (one cell: the conv and state rows of each recurrent layer), and a
  sliding-window model's SWA layers, which keep n_swa cells once the prompt is past the window.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvsidecar.fingerprint.llama_settings import RuntimeSettings
from kvsidecar.fingerprint.memory_class import SWA, UNKNOWN, MemoryClass
from kvsidecar.fingerprint.swa_cache import per_layer_ints, row_bytes, swa_layers

TOKEN_BYTES = 4
CELL_BYTES = 12  # pos, n_seq_id, one seq_id
CELL_EXT_BYTES = 12  # llama_kv_cell_ext: x, y, token


@dataclass(frozen=True, kw_only=True)
class SnapshotCost:
    per_token: int
    fixed: int

    def text(self) -> str:
        return f"a snapshot costs {self.per_token:,} B a token + about {self.fixed:,} B fixed"

    def to_dict(self) -> dict[str, int]:
        return {"bytes_per_token": self.per_token, "fixed_bytes": self.fixed}


def _attention_layers(
    meta: Mapping[str, Any], memory: MemoryClass, kv: list[int], *, per_layer: bool
) -> list[int] | None:
    """The attention layers, as the metadata says them (llama.cpp's rules; the class counted them from the
    tensors, and the caller checks the two agree), or None where it does not say."""
    n, arch = memory.n_layer, memory.arch
    if not memory.recurrent_layers:
        return [i for i in range(n) if kv[i]] if per_layer else list(range(n))
    flags = per_layer_ints(meta.get(f"{arch}.attention.recurrent_layers"), n)
    interval = meta.get(f"{arch}.full_attention_interval")
    if flags is not None:
        return [i for i in range(n) if not flags[i]]
    if isinstance(interval, int) and not isinstance(interval, bool) and interval > 0:
        return [i for i in range(n) if (i + 1) % interval == 0]
    if per_layer:  # the recurrent (and feed-forward only) layers have no KV heads
        return [i for i in range(n) if kv[i]]
    return None


def _attention_rows(
    meta: Mapping[str, Any], memory: MemoryClass, settings: RuntimeSettings
) -> dict[int, int] | None:
    """The K + V bytes of one cell of each attention layer (by layer), or None where not known."""
    arch, n = memory.arch, memory.n_layer
    key = f"{arch}.attention."
    heads = per_layer_ints(meta.get(key + "head_count"), n)
    embd = meta.get(f"{arch}.embedding_length")
    if not heads or not heads[0] or not isinstance(embd, int):
        return None
    raw_kv = meta.get(key + "head_count_kv")
    kv = per_layer_ints(raw_kv, n) or heads
    layers = _attention_layers(meta, memory, kv, per_layer=isinstance(raw_kv, list))
    if layers is None or len(layers) != memory.attention_layers:
        return None
    swa = set(swa_layers(meta, arch, n) or ()) if memory.kind == SWA else set()
    type_k = settings.effective("cache-type-k") or "f16"
    type_v = settings.effective("cache-type-v") or "f16"
    rows: dict[int, int] = {}
    for il in layers:
        suffix = "_swa" if il in swa else ""
        k_len = meta.get(key + "key_length" + suffix, meta.get(key + "key_length", embd // heads[0]))
        v_len = meta.get(key + "value_length" + suffix, meta.get(key + "value_length", embd // heads[0]))
        if not isinstance(k_len, int) or not isinstance(v_len, int):
            return None
        k, v = row_bytes(type_k, kv[il] * k_len), row_bytes(type_v, kv[il] * v_len)
        if k is None or v is None:
            return None
        rows[il] = k + v
    return rows


def snapshot_cost(
    meta: Mapping[str, Any], memory: MemoryClass, settings: RuntimeSettings
) -> SnapshotCost | None:
    """The predicted cost of a snapshot (`meta`: the model's GGUF metadata, per-layer arrays decoded), or
    None where a figure it needs is not known."""
    if memory.kind == UNKNOWN:
        return None
    fixed = 0
    if memory.recurrent_layers:
        if memory.r_row_bytes is None or memory.s_row_bytes is None:
            return None
        fixed += memory.recurrent_layers * (memory.r_row_bytes + memory.s_row_bytes)
    rows = _attention_rows(meta, memory, settings) if memory.attention_layers else {}
    if rows is None:
        return None
    cell = CELL_BYTES + (CELL_EXT_BYTES if memory.cell_ext else 0)
    swa = set(swa_layers(meta, memory.arch, memory.n_layer) or ()) if memory.kind == SWA else set()
    full = sum(r for il, r in rows.items() if il not in swa)
    if swa and memory.n_swa:
        fixed += memory.n_swa * (cell + sum(r for il, r in rows.items() if il in swa))
    return SnapshotCost(per_token=TOKEN_BYTES + (cell + full if len(swa) < len(rows) else 0), fixed=fixed)
