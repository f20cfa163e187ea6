"""State files of sliding-window, hybrid and recurrent memories, built field by field as llama.cpp 11434
writes them (kvsidecar/store/state_sections.py has the layouts), parsed strictly with the model's layout,
and refused when read as another memory's. tests/integration/test_arch_models_real.py parses the files the
real llama-server writes for each generated model."""

from __future__ import annotations

import io
import random
import struct

import pytest

from kvsidecar.fingerprint.memory_class import MemoryClass
from kvsidecar.store.state_format import MAGIC, StateFormatError, StateLayout, kv_digest, parse, text_tokens
from kvsidecar.store.state_sections import KV, PLAIN_LAYOUT, RECURRENT, MemoryLayout, layout_for

F16, F32 = 1, 0
HYBRID = MemoryLayout(parts=(KV, RECURRENT), cell_ext=True, recurrent_layers=3, r_row=24, s_row=64)
SWA = MemoryLayout(parts=(KV, KV))


def _tokens(n: int) -> bytes:
    """llama-server's packed server-tokens state: NULL, version 1, n, tokens, no media."""
    packed = [-1, 1, n, *range(100, 100 + n), 0]
    return struct.pack("<I", len(packed)) + struct.pack(f"<{len(packed)}i", *packed)


def kv(positions: list[int], *, n_layer: int = 1, row: int = 16, ext: bool = False, seed: int = 1) -> bytes:
    rng = random.Random(seed)
    out = bytearray(struct.pack("<II", 1, len(positions)))
    for p in positions:
        out += struct.pack("<iI", p, 1)
        if ext:
            out += struct.pack("<iii", 0, 0, 100 + p)
        out += struct.pack("<i", 0)
    out += struct.pack("<IIII", 0, n_layer, 0, 0)
    for _ in range(2 * n_layer):
        out += struct.pack("<iQ", F16, row) + rng.randbytes(len(positions) * row)
    return bytes(out)


def recurrent(
    pos: int, *, layers: int = 3, n_layer: int = 4, r_row: int = 24, s_row: int = 64, seed: int = 2
) -> bytes:
    rng = random.Random(seed)
    out = bytearray(struct.pack("<IiIII", 1, pos, 0, 0, n_layer))
    for row in [r_row] * layers + [s_row] * layers:
        out += struct.pack("<iQ", F32, row) + rng.randbytes(row)
    return bytes(out)


def state(*sections: bytes, n: int = 6) -> bytes:
    return struct.pack("<II", MAGIC, 4) + _tokens(n) + b"".join(sections)


def parsed(data: bytes, memory: MemoryLayout = PLAIN_LAYOUT) -> StateLayout:
    return parse(io.BytesIO(data), len(data), memory=memory)


def test_a_hybrid_file_is_the_attention_kv_then_one_recurrent_state() -> None:
    layout = parsed(state(kv(list(range(6)), ext=True), recurrent(5)), HYBRID)
    assert text_tokens(layout) == tuple(range(100, 106))
    (part,) = layout.kv_parts
    assert part[0].cell_count == 6 and part[0].positions == tuple(range(6)) and part[0].bytes_per_cell == 32
    rec = layout.recurrent
    assert rec is not None and rec.positions == (5,) and rec.n_layer == 4
    assert [x.row for x in rec.r] == [24] * 3 and [x.row for x in rec.s] == [64] * 3
    assert rec.bytes == 3 * (24 + 64)
    # without the model's counts the records split in two equal halves
    inferred = parsed(
        state(kv(list(range(6)), ext=True), recurrent(5)), MemoryLayout(parts=(KV, RECURRENT), cell_ext=True)
    )
    assert inferred.recurrent is not None and len(inferred.recurrent.r) == 3


def test_a_sliding_window_file_is_two_kv_caches() -> None:
    layout = parsed(state(kv(list(range(6))), kv([4, 5], n_layer=5)), SWA)
    base, window = layout.kv_parts
    assert base[0].positions == tuple(range(6)) and window[0].positions == (4, 5) and window[0].n_layer == 5
    assert layout.streams == (*base, *window) and layout.recurrent is None


@pytest.mark.parametrize(
    ("data", "memory", "code"),
    [
        # read as another memory's file
        (state(kv(list(range(6)), ext=True), recurrent(5)), PLAIN_LAYOUT, "STATE_BAD_FIELD"),
        (state(kv(list(range(6))), kv([4, 5])), PLAIN_LAYOUT, "STATE_TRAILING_DATA"),
        (state(kv(list(range(6)))), SWA, "STATE_TRUNCATED"),
        (
            state(kv(list(range(6)), ext=True), recurrent(5)),
            MemoryLayout(parts=(KV, RECURRENT)),
            "STATE_BAD_FIELD",
        ),
        # the model's recurrent layer count or row sizes differ from the file's
        (state(kv(list(range(6)), ext=True), recurrent(5, layers=2)), HYBRID, "STATE_BAD_FIELD"),
        (state(kv(list(range(6)), ext=True), recurrent(5, r_row=28)), HYBRID, "STATE_MODEL_MISMATCH"),
        # hostile recurrent fields
        (state(kv(list(range(6)), ext=True), recurrent(5) + b"\0"), HYBRID, "STATE_TRUNCATED"),
        (state(kv(list(range(6)), ext=True), recurrent(5)[:-1]), HYBRID, "STATE_TRUNCATED"),
        (state(kv(list(range(6)), ext=True), struct.pack("<I", 1 << 20)), HYBRID, "STATE_BAD_FIELD"),
        (
            state(
                kv(list(range(6)), ext=True), recurrent(5)[:12] + struct.pack("<I", 1) + recurrent(5)[16:]
            ),  # s_trans
            HYBRID,
            "STATE_BAD_FIELD",
        ),
        (
            state(
                kv(list(range(6)), ext=True), recurrent(5)[:20] + struct.pack("<iQ", 1, 24)
            ),  # an f16 state
            HYBRID,
            "STATE_BAD_FIELD",
        ),
    ],
)
def test_a_file_of_another_memory_or_a_hostile_one_is_refused(
    data: bytes, memory: MemoryLayout, code: str
) -> None:
    with pytest.raises(StateFormatError) as e:
        parsed(data, memory)
    assert e.value.code == code


def test_the_digest_covers_the_recurrent_state_and_the_window() -> None:
    a = state(kv(list(range(6)), ext=True), recurrent(5))
    b = state(kv(list(range(6)), ext=True), recurrent(5, seed=3))  # same KV, another recurrent state
    digest_a = kv_digest(io.BytesIO(a), parsed(a, HYBRID))
    assert digest_a != kv_digest(io.BytesIO(b), parsed(b, HYBRID))
    one = state(kv([0, 1, 2, 3, 4, 5, 6, 7]))
    two = state(kv([0, 1, 2, 3]), kv([4, 5, 6, 7]))  # the same streams, split into two caches
    assert kv_digest(io.BytesIO(one), parsed(one)) != kv_digest(io.BytesIO(two), parsed(two, SWA))


def test_the_layout_of_each_memory_class() -> None:
    def cls(kind: str, **kw: object) -> MemoryClass:
        return MemoryClass(kind=kind, arch="x", n_layer=4, attention_layers=1, **kw)  # type: ignore[arg-type]

    assert layout_for(cls("plain")) == PLAIN_LAYOUT
    assert layout_for(cls("swa", n_swa=512)) == SWA
    hybrid = layout_for(cls("hybrid", recurrent_layers=3, cell_ext=True, r_row_bytes=24, s_row_bytes=64))
    assert hybrid == HYBRID
    hybrid_swa = layout_for(cls("hybrid", n_swa=4096, recurrent_layers=3))
    assert hybrid_swa is not None and hybrid_swa.parts == (KV, KV, RECURRENT)
    only = layout_for(cls("recurrent", recurrent_layers=4))
    assert only is not None and only.parts == (RECURRENT,) and only.recurrent_layers == 4
    assert layout_for(cls("unknown")) is None
    with pytest.raises(ValueError):
        MemoryLayout(parts=(RECURRENT, KV))
