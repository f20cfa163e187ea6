"""llama.cpp's sequence-state format, parsed strictly, and the v3 -> v4 step (issue 29).

Files are built here field by field as llama.cpp writes them (kvsidecar/store/state_format.py has the layout);
tests/integration/test_upgrade_real.py converts files written by the two real builds.
"""

from __future__ import annotations

import io
import random
import struct

import pytest

from kvsidecar.store.state_format import (
    MAGIC,
    ModelFacts,
    StateFormatError,
    StateLayout,
    conversion_refusal,
    convert_v3_to_v4,
    kv_digest,
    parse,
    v3_rotations,
)

F16, Q8_0, Q4_0 = 1, 8, 2
FACTS = ModelFacts(arch="llama", n_layer=2, head_k=(64,) * 2, head_v=(64,) * 2)


def build(
    *,
    version: int,
    n_cells: int = 5,
    n_layer: int = 2,
    k_type: int = F16,
    v_type: int = F16,
    row: int = 256,
    rot: tuple[int, int] = (0, 0),
    v_trans: bool = False,
    streams: int = 1,
    seed: int = 1,
) -> bytes:
    """A state file as llama.cpp writes one; KV bytes drawn from `seed`."""
    rng = random.Random(seed)
    out = bytearray(struct.pack("<III", MAGIC, version, n_cells + 1))
    out += struct.pack(f"<{n_cells + 1}i", *range(100, 101 + n_cells))
    out += struct.pack("<I", streams)
    for s in range(streams):
        out += struct.pack("<I", n_cells)
        for i in range(n_cells):
            out += struct.pack("<iIi", i, 1, s)
        out += struct.pack("<II", int(v_trans), n_layer)
        if version >= 4:
            out += struct.pack("<II", *rot)
        for _ in range(n_layer):
            out += struct.pack("<iQ", k_type, row) + rng.randbytes(n_cells * row)
        for _ in range(n_layer):
            if v_trans:
                out += struct.pack("<iII", v_type, 2, row // 2) + rng.randbytes(n_cells * row)
            else:
                out += struct.pack("<iQ", v_type, row) + rng.randbytes(n_cells * row)
    return bytes(out)


def parsed(data: bytes) -> StateLayout:
    return parse(io.BytesIO(data), len(data))


def test_both_versions_parse_to_the_same_kv() -> None:
    v3, v4 = parsed(build(version=3)), parsed(build(version=4))
    assert (v3.version, v4.version) == (3, 4)
    assert v3.streams[0].cell_count == 5 and v3.streams[0].n_layer == 2
    assert v3.streams[0].rot_k is None and v4.streams[0].rot_k == 0
    assert kv_digest(io.BytesIO(build(version=3))) == kv_digest(io.BytesIO(build(version=4)))
    assert kv_digest(io.BytesIO(build(version=3))) != kv_digest(io.BytesIO(build(version=3, seed=2)))


def test_v3_becomes_exactly_the_v4_file_of_the_same_kv() -> None:
    for kwargs in ({}, {"v_trans": True}, {"streams": 2}):
        out = io.BytesIO()
        convert_v3_to_v4(io.BytesIO(build(version=3, **kwargs)), out, FACTS)
        assert out.getvalue() == build(version=4, **kwargs)


def test_a_quantized_cache_gets_the_rotations_v3_applied() -> None:
    out = io.BytesIO()
    src = build(version=3, k_type=Q8_0, v_type=Q8_0, row=272)
    convert_v3_to_v4(io.BytesIO(src), out, FACTS)
    assert out.getvalue() == build(version=4, k_type=Q8_0, v_type=Q8_0, row=272, rot=(64, 64))


@pytest.mark.parametrize(
    ("k_type", "v_type", "head", "disabled", "expected"),
    [
        (F16, F16, 128, False, (0, 0)),  # an unquantized cache is never rotated
        (Q8_0, Q8_0, 64, False, (64, 64)),
        (Q8_0, Q8_0, 128, False, (128, 64)),  # K: the largest power of two from 64 dividing the head
        (Q4_0, F16, 256, False, (256, 0)),
        (Q8_0, Q8_0, 96, False, (0, 0)),  # not a multiple of 64
        (Q8_0, Q8_0, 128, True, (0, 0)),  # LLAMA_ATTN_ROT_DISABLE
    ],
)
def test_v3_rotation_rule(
    k_type: int, v_type: int, head: int, disabled: bool, expected: tuple[int, int]
) -> None:
    facts = ModelFacts(arch="llama", n_layer=4, head_k=(head,) * 4, head_v=(head,) * 4, rot_disabled=disabled)
    assert v3_rotations(k_type, v_type, facts) == expected


def test_layers_with_different_head_sizes_are_not_rotated_on_k() -> None:
    facts = ModelFacts(arch="llama", n_layer=2, head_k=(128, 256), head_v=(128, 128))
    assert v3_rotations(Q8_0, Q8_0, facts) == (0, 64)


def test_a_quantized_cache_with_unknown_heads_or_environment_is_refused() -> None:
    assert v3_rotations(F16, F16, ModelFacts(arch="llama", n_layer=2, rot_disabled=None)) == (0, 0)
    for facts in (
        ModelFacts(arch="llama", n_layer=2, head_k=(64, 64), head_v=(64, 64), rot_disabled=None),
        ModelFacts(arch="llama", n_layer=2),
    ):
        with pytest.raises(StateFormatError) as e:
            v3_rotations(Q8_0, F16, facts)
        assert e.value.code == "STATE_NOT_MECHANICAL"


@pytest.mark.parametrize(
    ("facts", "words"),
    [
        (ModelFacts(arch="qwen2vl", n_layer=2, mrope=True), "M-RoPE"),
        (ModelFacts(arch="gemma3", n_layer=2, sliding_window=True), "sliding-window"),
        (ModelFacts(arch="jamba", n_layer=2, recurrent=True), "recurrent"),
        (ModelFacts(arch="deepseek32", n_layer=2), "deepseek32"),
        (ModelFacts(arch="llama", n_layer=0), "unknown"),
    ],
)
def test_models_whose_step_is_not_mechanical_are_refused(facts: ModelFacts, words: str) -> None:
    reason = conversion_refusal(facts)
    assert reason is not None and words in reason
    with pytest.raises(StateFormatError) as e:
        convert_v3_to_v4(io.BytesIO(build(version=3)), io.BytesIO(), facts)
    assert e.value.code == "STATE_NOT_MECHANICAL"


def test_only_v3_is_converted() -> None:
    with pytest.raises(StateFormatError) as e:
        convert_v3_to_v4(io.BytesIO(build(version=4)), io.BytesIO(), FACTS)
    assert e.value.code == "STATE_UNKNOWN_VERSION"


def test_a_file_with_another_layer_count_than_the_model_is_refused() -> None:
    with pytest.raises(StateFormatError) as e:
        convert_v3_to_v4(io.BytesIO(build(version=3, n_layer=3)), io.BytesIO(), FACTS)
    assert e.value.code == "STATE_MODEL_MISMATCH"


def _patch(data: bytes, offset: int, fmt: str, value: int) -> bytes:
    b = bytearray(data)
    struct.pack_into(fmt, b, offset, value)
    return bytes(b)


HEADER = 12 + 4 * 6 + 4  # magic, version, n_token, 6 tokens, n_stream
DATA = HEADER + 4 + 5 * 12  # cell_count, 5 cells of (pos, n_seq, seq)


@pytest.mark.parametrize(
    ("data", "code"),
    [
        (b"", "STATE_TRUNCATED"),
        (_patch(build(version=3), 0, "<I", 0x46554747), "STATE_BAD_MAGIC"),
        (_patch(build(version=3), 4, "<I", 5), "STATE_UNKNOWN_VERSION"),
        (_patch(build(version=3), 4, "<I", 2), "STATE_UNKNOWN_VERSION"),
        (build(version=3)[:-1], "STATE_TRUNCATED"),
        (build(version=3) + b"\0", "STATE_TRAILING_DATA"),
        (build(version=3) + build(version=3)[HEADER - 4 :], "STATE_TRAILING_DATA"),  # two caches (iSWA)
        (_patch(build(version=3), HEADER - 4, "<I", 0), "STATE_BAD_FIELD"),  # no stream
        (_patch(build(version=3), HEADER, "<I", 1 << 30), "STATE_BAD_FIELD"),  # cell count
        (_patch(build(version=3), HEADER + 4, "<i", -1), "STATE_BAD_FIELD"),  # a negative position
        (_patch(build(version=3), HEADER + 8, "<I", 1000), "STATE_BAD_FIELD"),  # sequences per cell
        (_patch(build(version=3), DATA, "<I", 2), "STATE_BAD_FIELD"),  # v_trans
        (_patch(build(version=3), DATA + 4, "<I", 0), "STATE_BAD_FIELD"),  # no layer
        (_patch(build(version=3), DATA + 8, "<i", 99), "STATE_UNKNOWN_TYPE"),  # K type
        (_patch(build(version=3), DATA + 12, "<Q", 1 << 40), "STATE_BAD_FIELD"),  # K row
        (_patch(build(version=4), DATA + 8, "<I", 48), "STATE_BAD_FIELD"),  # a rotation no build writes
        (build(version=3, v_trans=True, v_type=Q8_0), "STATE_BAD_FIELD"),  # a transposed quantized V
    ],
)
def test_hostile_files_are_refused_with_a_stable_code(data: bytes, code: str) -> None:
    with pytest.raises(StateFormatError) as e:
        parsed(data)
    assert e.value.code == code


def test_m_rope_cells_do_not_parse_as_plain_cells() -> None:
    """With per-cell extra fields (M-RoPE, 12 bytes a cell) the fields that follow land elsewhere."""
    plain = build(version=3)
    b = bytearray(plain[: HEADER + 4])
    for i in range(5):
        b += struct.pack("<iI", i, 1) + struct.pack("<iii", 7, 9, 30000) + struct.pack("<i", 0)
    b += plain[DATA:]
    with pytest.raises(StateFormatError):
        parsed(bytes(b))


def test_the_prompt_tokens_are_read_from_llama_servers_packed_state() -> None:
    """llama-server writes its server-tokens state where the token list goes (seen in both real builds)."""
    from kvsidecar.store.state_format import text_tokens

    def layout_of(tokens: list[int]) -> StateLayout:
        return StateLayout(version=4, tokens=tuple(tokens), streams=(), size=0)

    assert text_tokens(layout_of([-1, 1, 3, 1, 15595, 29900, 0])) == (1, 15595, 29900)
    assert text_tokens(layout_of([1, 2, 3])) == (1, 2, 3)  # a plain list, as older builds wrote
    for hostile, code in (
        ([-1, 2, 3, 1, 2, 3, 0], "STATE_BAD_FIELD"),  # another server-tokens version
        ([-1, 1, 99, 1], "STATE_BAD_FIELD"),  # a count past the end
        ([-1, 1, 2, 1, 2, 1, 7, 7], "STATE_NOT_MECHANICAL"),  # a media chunk follows
    ):
        with pytest.raises(StateFormatError) as e:
            text_tokens(layout_of(hostile))
        assert e.value.code == code
