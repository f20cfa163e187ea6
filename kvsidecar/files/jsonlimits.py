"""Caps for JSON files the daemon reads back from disk (manifests, fingerprint records, digest cache).

`json.loads` recurses once per nesting level: a file of 100,000 `[` raises RecursionError (not
ValueError), which escapes ordinary error handling and once kept the daemon from starting. So before any
parser sees the bytes: a size cap, then a cheap scan of the bracket depth outside strings.
"""

from __future__ import annotations

import json
import re
from typing import Any

# A JSON string: a quote, then runs of ordinary characters or escapes, then a quote (unrolled, linear).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


class JsonLimitError(ValueError):
    """The bytes are refused before parsing. `reason` is a stable code."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def nesting_depth(raw: bytes, *, stop_above: int | None = None) -> int:
    """The deepest bracket nesting outside strings (an approximation for invalid JSON; never recurses)."""
    brackets = _STRING.sub(b'""', raw).translate(None, _NOT_BRACKETS)
    depth = deepest = 0
    for b in brackets:
        if b in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > deepest:
                deepest = depth
                if stop_above is not None and deepest > stop_above:
                    return deepest
        else:
            depth -= 1
    return deepest


def check_limits(raw: bytes, *, max_bytes: int, max_depth: int) -> None:
    if len(raw) > max_bytes:
        raise JsonLimitError("TOO_LARGE", f"larger than {max_bytes} bytes")
    if nesting_depth(raw, stop_above=max_depth) > max_depth:
        raise JsonLimitError("TOO_DEEP", f"nested deeper than {max_depth} levels")


def loads_capped(raw: bytes, *, max_bytes: int, max_depth: int) -> Any:
    """json.loads behind the caps. Raises JsonLimitError (a ValueError) for every refusal, including
    invalid JSON (reason NOT_JSON) and non-finite numbers (NaN/Infinity, which json accepts)."""
    check_limits(raw, max_bytes=max_bytes, max_depth=max_depth)
    try:
        return json.loads(raw, parse_constant=_no_constants)
    except JsonLimitError:
        raise
    except (ValueError, RecursionError) as exc:
        raise JsonLimitError("NOT_JSON", f"not JSON: {str(exc)[:100]}") from None


def _no_constants(name: str) -> Any:
    raise JsonLimitError("NOT_JSON", f"not JSON: {name} is not a number")
