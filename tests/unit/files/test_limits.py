"""The checks around every parse of a document of ours: the linear shape scan and strict UTF-8."""

from __future__ import annotations

import time

import pytest

from kvsidecar.files.limits import DocumentError, check_text, shape, utf8_text


@pytest.mark.parametrize(
    ("raw", "depth", "items"),
    [
        (b"{}", 1, 2),
        (b'{"a": [1, {"b": []}]}', 4, 6),
        (b'{"a": "[[[[[[[[[["}', 1, 2),  # brackets inside strings do not count
        (b'{"a": "\\"[[[[", "b": [[]]}', 3, 5),  # nor after an escaped quote
        (b'{"a": "x,y,z"}', 1, 2),  # nor commas
        (b"1", 0, 1),
        (b'"unterminated [[[[ {', 0, 1),  # an unterminated string runs to the end
    ],
)
def test_shape_scan(raw: bytes, depth: int, items: int) -> None:
    assert shape(raw) == (depth, items)


def test_the_scan_is_linear_on_quotes_that_never_close() -> None:
    """A string that never ends, full of escaped quotes, once made the scan retry from every later quote:
    40 KB took 15 s and a 1 MB file hours. It is one pass now."""
    started = time.monotonic()
    depth, _items = shape(b'"' + b'\\"' * 500_000)
    assert depth == 0 and time.monotonic() - started < 5


def test_the_scan_stops_early_above_the_cap() -> None:
    assert shape(b"[" * 500_000, stop_above=8)[0] == 9


@pytest.mark.parametrize(
    "raw",
    [
        b"\xef\xbb\xbf{}",
        b"\xff\xfe{\x00}\x00",
        b"\xfe\xff\x00{",
        b'{"a": "\x00"}',
        b"\xff",
        b"\xed\xa0\x80",
        b"\xc0\xaf",
    ],
)
def test_only_strict_utf8_is_text(raw: bytes) -> None:
    with pytest.raises(DocumentError) as info:
        utf8_text(raw)
    assert info.value.reason == "NOT_UTF8" and isinstance(info.value, ValueError)


def test_text_with_a_lone_surrogate_or_a_nul_is_refused() -> None:
    for bad in ("a\x00b", "a\ud800b"):
        with pytest.raises(DocumentError):
            check_text(bad)
    check_text("naïve \U0001f600")
    assert utf8_text("naïve".encode()) == "naïve"
