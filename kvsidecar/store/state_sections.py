"""The sections of llama.cpp's sequence-state file after the token list, each parsed strictly: an attention
KV cache and a recurrent state, and which of them a model's memory writes, in which order (`MemoryLayout`).

What each memory writes (llama.cpp 11434, `state_write` of each memory type), all little-endian:

- plain attention (`llama_kv_cache`): one KV section;
- sliding-window attention (`llama_kv_cache_iswa`): the full-attention layers' KV section, then the SWA
  layers' (a save keeps only the positions the window still sees there, `--swa-full` or not);
- hybrid (`llama_memory_hybrid`): the attention layers' KV section, then the recurrent section;
  with SWA attention layers (`llama_memory_hybrid_iswa`) two KV sections, then the recurrent one;
- recurrent only (`llama_memory_recurrent`): the recurrent section.

A KV section:

    u32 n_stream, then per stream: u32 cell_count (0: nothing more for this stream)
        per cell: i32 pos, u32 n_seq_id, [12 bytes x, y, token where cells carry M-RoPE fields],
                  i32 seq_id[n_seq_id]
        u32 v_trans, u32 n_layer, [v4 only: u32 n_rot_k, u32 n_rot_v]
        per layer: i32 k_type, u64 k_row, bytes[cell_count * k_row]
        v_trans = 0, per layer: i32 v_type, u64 v_row, bytes[cell_count * v_row]
        v_trans = 1, per layer: i32 v_type, u32 v_el, u32 n_embd_v, bytes[n_embd_v * cell_count * v_el]

The recurrent section (one cell per sequence: the state after its last token):

    u32 cell_count, per cell: i32 pos, u32 n_seq_id, i32 seq_id[n_seq_id]
    u32 s_trans (0), u32 n_layer (every layer of the model, recurrent or not)
    per recurrent layer: i32 r_type, u64 r_row, bytes[cell_count * r_row]     (the convolution's rows)
    per recurrent layer: i32 s_type, u64 s_row, bytes[cell_count * s_row]     (the state's rows)

The file does not say how many layers are recurrent: the count (and each row's size, where known) comes
from the model (`MemoryLayout`); without it the records are split in two equal halves whose rows must all
be the same size each. Records with another shape (a per-layer-embedding conv row, a transposed state)
are refused.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass, field
from typing import BinaryIO

from kvsidecar.fingerprint.memory_class import HYBRID, PLAIN, SWA, MemoryClass
from kvsidecar.fingerprint.memory_class import RECURRENT as RECURRENT_ONLY

MAX_STREAMS = 256  # LLAMA_MAX_SEQ
MAX_LAYERS = 4096
MAX_SEQ_IDS = 256
MAX_ROW = 1 << 30
MAX_TOKENS = 1 << 26
CELL_EXT_BYTES = 12  # llama_kv_cell_ext: x, y, token

# ggml types a KV cache can have: id -> (name, bytes per block, elements per block). Others are refused.
KV_TYPES: dict[int, tuple[str, int, int]] = {
    0: ("f32", 4, 1),
    1: ("f16", 2, 1),
    2: ("q4_0", 18, 32),
    3: ("q4_1", 20, 32),
    6: ("q5_0", 22, 32),
    7: ("q5_1", 24, 32),
    8: ("q8_0", 34, 32),
    20: ("iq4_nl", 18, 32),
    30: ("bf16", 2, 1),
}
UNQUANTIZED = frozenset({0, 1, 30})
RECURRENT_TYPES = frozenset({0})  # llama.cpp keeps recurrent states in f32
ROTATIONS = frozenset({0, 64, 128, 256, 512, 1024})

KV, RECURRENT = "kv", "recurrent"


class StateFormatError(Exception):
    """The file is not a sequence-state file this module can vouch for; `code` is stable."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass(frozen=True, kw_only=True)
class MemoryLayout:
    """What a model's memory writes after the token list, in order, and what the model says about it."""

    parts: tuple[str, ...] = (KV,)
    cell_ext: bool = False  # KV cells carry M-RoPE fields
    recurrent_layers: int | None = None  # None: inferred from the file (two equal halves)
    r_row: int | None = None  # bytes of one recurrent layer's conv row, when the model says
    s_row: int | None = None

    def __post_init__(self) -> None:
        kv = [p for p in self.parts if p == KV]
        if not self.parts or len(kv) > 2 or any(p not in (KV, RECURRENT) for p in self.parts):
            raise ValueError(f"not a memory layout: {self.parts}")
        if RECURRENT in self.parts and self.parts.index(RECURRENT) != len(self.parts) - 1:
            raise ValueError("the recurrent section is the last one")


PLAIN_LAYOUT = MemoryLayout()


@dataclass(frozen=True, kw_only=True)
class LayerKV:
    k_type: int
    k_row: int
    k_offset: int  # where its payload starts in the file
    v_type: int
    v_row: int  # bytes per cell of V (v_el * n_embd_v_gqa when transposed)
    v_offset: int
    v_embd: int = 0  # n_embd_v_gqa when transposed, else 0


@dataclass(frozen=True, kw_only=True)
class Stream:
    cell_count: int
    meta_offset: int
    data_offset: int  # the offset of v_trans
    layers_offset: int  # just after n_layer (v3) or n_rot_v (v4): where v4 inserts its two words
    v_trans: bool
    n_layer: int
    rot_k: int | None  # v4 only
    rot_v: int | None
    layers: tuple[LayerKV, ...]
    positions: tuple[int, ...] = field(repr=False, default=())

    @property
    def bytes_per_cell(self) -> int:
        return sum(layer.k_row + layer.v_row for layer in self.layers)


@dataclass(frozen=True, kw_only=True)
class RecurrentRow:
    type: int
    row: int  # bytes per cell
    offset: int  # where its payload starts


@dataclass(frozen=True, kw_only=True)
class RecurrentState:
    cell_count: int
    meta_offset: int
    n_layer: int  # the model's layer count, as written
    r: tuple[RecurrentRow, ...]
    s: tuple[RecurrentRow, ...]
    positions: tuple[int, ...] = field(repr=False, default=())

    @property
    def bytes(self) -> int:
        return self.cell_count * sum(x.row for x in (*self.r, *self.s))


class Reader:
    def __init__(self, f: BinaryIO, size: int) -> None:
        self.f, self.size, self.pos = f, size, 0

    def take(self, n: int) -> bytes:
        if n < 0 or self.pos + n > self.size:
            raise StateFormatError(
                "STATE_TRUNCATED", f"the file ends at {self.size}, a field needs {self.pos + n}"
            )
        data = self.f.read(n)
        if len(data) != n:
            raise StateFormatError("STATE_TRUNCATED", "short read")
        self.pos += n
        return data

    def u32(self) -> int:
        return int(struct.unpack("<I", self.take(4))[0])

    def i32(self) -> int:
        return int(struct.unpack("<i", self.take(4))[0])

    def u64(self) -> int:
        return int(struct.unpack("<Q", self.take(8))[0])

    def skip(self, n: int) -> int:
        start = self.pos
        if n < 0 or self.pos + n > self.size:
            raise StateFormatError("STATE_TRUNCATED", f"a payload of {n} bytes at {self.pos} passes the end")
        self.f.seek(n, os.SEEK_CUR)
        self.pos += n
        return start


def check_type(type_id: int, what: str) -> None:
    if type_id not in KV_TYPES:
        raise StateFormatError("STATE_UNKNOWN_TYPE", f"{what} type {type_id} is not a KV cache type we know")


def kv_section(r: Reader, version: int, *, cell_ext: bool = False) -> tuple[Stream, ...]:
    """One KV cache's streams (the empty ones left out)."""
    n_stream = r.u32()
    if not 1 <= n_stream <= MAX_STREAMS:
        raise StateFormatError("STATE_BAD_FIELD", f"{n_stream} streams")
    return tuple(s for s in (_stream(r, version, cell_ext) for _ in range(n_stream)) if s is not None)


def _stream(r: Reader, version: int, cell_ext: bool) -> Stream | None:
    cell_count = r.u32()
    if cell_count == 0:
        return None
    if cell_count > MAX_TOKENS:
        raise StateFormatError("STATE_BAD_FIELD", f"{cell_count} cells")
    meta_offset = r.pos
    positions = cells(r, cell_count, cell_ext=cell_ext)
    data_offset = r.pos
    v_trans, n_layer = r.u32(), r.u32()
    if v_trans not in (0, 1) or not 1 <= n_layer <= MAX_LAYERS:
        raise StateFormatError("STATE_BAD_FIELD", f"v_trans {v_trans}, {n_layer} layers")
    rot_k = rot_v = None
    if version >= 4:
        rot_k, rot_v = r.u32(), r.u32()
        if rot_k not in ROTATIONS or rot_v not in ROTATIONS:
            raise StateFormatError("STATE_BAD_FIELD", f"rotations {rot_k}/{rot_v}")
    layers_offset = r.pos
    return Stream(
        cell_count=cell_count,
        meta_offset=meta_offset,
        data_offset=data_offset,
        layers_offset=layers_offset,
        v_trans=bool(v_trans),
        n_layer=n_layer,
        rot_k=rot_k,
        rot_v=rot_v,
        layers=_layers(r, cell_count, n_layer, bool(v_trans)),
        positions=positions,
    )


def cells(r: Reader, cell_count: int, *, cell_ext: bool = False) -> tuple[int, ...]:
    """Each cell's position (its sequence ids, and M-RoPE fields where cells carry them, are checked and
    skipped)."""
    positions = []
    for _ in range(cell_count):
        pos, n_seq = r.i32(), r.u32()
        if pos < 0 or n_seq > MAX_SEQ_IDS:
            raise StateFormatError("STATE_BAD_FIELD", f"cell at {r.pos}: pos {pos}, {n_seq} sequences")
        if cell_ext:
            r.take(CELL_EXT_BYTES)
        for _ in range(n_seq):
            if not 0 <= r.i32() < MAX_SEQ_IDS:
                raise StateFormatError("STATE_BAD_FIELD", f"a sequence id out of range at {r.pos}")
        positions.append(pos)
    return tuple(positions)


def _layers(r: Reader, cell_count: int, n_layer: int, v_trans: bool) -> tuple[LayerKV, ...]:
    keys = []
    for _ in range(n_layer):
        k_type, k_row = r.i32(), r.u64()
        check_type(k_type, "K")
        if not 0 < k_row <= MAX_ROW:
            raise StateFormatError("STATE_BAD_FIELD", f"K row of {k_row} bytes")
        keys.append((k_type, k_row, r.skip(cell_count * k_row)))
    layers = []
    for k_type, k_row, k_offset in keys:
        v_type = r.i32()
        check_type(v_type, "V")
        v_embd = 0
        if v_trans:
            v_el, v_embd = r.u32(), r.u32()
            if v_type not in UNQUANTIZED or v_el != KV_TYPES[v_type][1] or not 0 < v_embd <= MAX_ROW:
                raise StateFormatError("STATE_BAD_FIELD", f"transposed V: type {v_type}, {v_el} B, {v_embd}")
            v_row = v_el * v_embd
        else:
            v_row = r.u64()
            if not 0 < v_row <= MAX_ROW:
                raise StateFormatError("STATE_BAD_FIELD", f"V row of {v_row} bytes")
        v_offset = r.skip(cell_count * v_row)
        layers.append(
            LayerKV(
                k_type=k_type,
                k_row=k_row,
                k_offset=k_offset,
                v_type=v_type,
                v_row=v_row,
                v_offset=v_offset,
                v_embd=v_embd,
            )
        )
    return tuple(layers)


def recurrent_section(r: Reader, layout: MemoryLayout) -> RecurrentState:
    """The recurrent section, which is the file's last: its records end exactly at the end of the file."""
    cell_count = r.u32()
    if cell_count > MAX_SEQ_IDS:
        raise StateFormatError("STATE_BAD_FIELD", f"{cell_count} recurrent cells")
    meta_offset = r.pos
    positions = cells(r, cell_count)
    s_trans, n_layer = r.u32(), r.u32()
    if s_trans != 0 or not 1 <= n_layer <= MAX_LAYERS:
        raise StateFormatError("STATE_BAD_FIELD", f"recurrent s_trans {s_trans}, {n_layer} layers")
    records: list[RecurrentRow] = []
    while r.pos < r.size and len(records) < 2 * n_layer:
        type_id, row = r.i32(), r.u64()
        if type_id not in RECURRENT_TYPES or not 0 < row <= MAX_ROW:
            raise StateFormatError("STATE_BAD_FIELD", f"a recurrent row of type {type_id}, {row} bytes")
        records.append(RecurrentRow(type=type_id, row=row, offset=r.skip(cell_count * row)))
    half = len(records) // 2
    want = layout.recurrent_layers
    if not records or len(records) % 2 or (want is not None and half != want) or half > n_layer:
        raise StateFormatError(
            "STATE_BAD_FIELD", f"{len(records)} recurrent records for {want or 'an unknown number of'} layers"
        )
    r_rows, s_rows = tuple(records[:half]), tuple(records[half:])
    for rows, expected, what in ((r_rows, layout.r_row, "conv"), (s_rows, layout.s_row, "state")):
        sizes = {x.row for x in rows}
        if len(sizes) != 1 or (expected is not None and sizes != {expected}):
            raise StateFormatError("STATE_MODEL_MISMATCH", f"recurrent {what} rows of {sorted(sizes)} bytes")
    return RecurrentState(
        cell_count=cell_count,
        meta_offset=meta_offset,
        n_layer=n_layer,
        r=r_rows,
        s=s_rows,
        positions=positions,
    )


def layout_for(memory: MemoryClass) -> MemoryLayout | None:
    """The sections a model of this memory class writes (None: a class whose layout is not known)."""
    kv: tuple[str, ...] = (KV, KV) if memory.n_swa else (KV,)
    parts = {
        PLAIN: (KV,),
        SWA: (KV, KV),
        HYBRID: (*kv, RECURRENT),
        RECURRENT_ONLY: (RECURRENT,),
    }.get(memory.kind)
    if parts is None:
        return None
    recurrent = memory.kind in (HYBRID, RECURRENT_ONLY)
    return MemoryLayout(
        parts=parts,
        cell_ext=memory.cell_ext,
        recurrent_layers=memory.recurrent_layers if recurrent else None,
        r_row=memory.r_row_bytes if recurrent else None,
        s_row=memory.s_row_bytes if recurrent else None,
    )
