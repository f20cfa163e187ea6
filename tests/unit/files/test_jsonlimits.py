"""The caps in front of every JSON parse of a file read back from disk."""

from __future__ import annotations

import pytest

from kvsidecar.files.jsonlimits import JsonLimitError, loads_capped, nesting_depth


@pytest.mark.parametrize(
    ("raw", "depth"),
    [
        (b"{}", 1),
        (b'{"a": [1, {"b": []}]}', 4),
        (b'{"a": "[[[[[[[[[["}', 1),  # brackets inside strings do not count
        (b'{"a": "\\"[[[[", "b": [[]]}', 3),  # nor after an escaped quote
        (b"1", 0),
    ],
)
def test_depth_scan(raw: bytes, depth: int) -> None:
    assert nesting_depth(raw) == depth


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"[" * 200_000, "TOO_LARGE"),
        (b"[" * 5_000 + b"]" * 5_000, "TOO_DEEP"),  # json.loads would raise RecursionError at ~1,000
        (b'{"a":' * 900 + b"1" + b"}" * 900, "TOO_DEEP"),
        (b"NaN", "NOT_JSON"),
        (b'{"a": Infinity}', "NOT_JSON"),
        (b"\xff\xfe", "NOT_JSON"),
        (b"{", "NOT_JSON"),
    ],
)
def test_refusals_are_value_errors_with_a_reason(raw: bytes, reason: str) -> None:
    with pytest.raises(JsonLimitError) as info:
        loads_capped(raw, max_bytes=100_000, max_depth=8)
    assert info.value.reason == reason and isinstance(info.value, ValueError)


def test_within_the_caps_it_is_json() -> None:
    assert loads_capped(b'{"a": [1, 2.5, "x"]}', max_bytes=100, max_depth=2) == {"a": [1, 2.5, "x"]}
