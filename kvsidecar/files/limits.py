"""What the one document reader (`documents.py`) checks around any parser, and how it refuses: the caps'
codes, `DocumentError`, strict UTF-8, and the linear scan of JSON's nesting and size that runs before a
parser could recurse. No parser here (the YAML half, `yamlstrict.py`, and `documents.py` both use it)."""

from __future__ import annotations

import re

MAX_INT_DIGITS = 40  # a 128-bit value is 39 digits; nothing of ours is longer
MAX_FLOAT_CHARS = 64

# Stable reasons (logged, and mapped by callers onto their own codes, e.g. MANIFEST_NOT_JSON).
TOO_LARGE = "TOO_LARGE"
TOO_DEEP = "TOO_DEEP"
TOO_MANY = "TOO_MANY"
NOT_UTF8 = "NOT_UTF8"
NOT_JSON = "NOT_JSON"
NOT_YAML = "NOT_YAML"
DUPLICATE_KEY = "DUPLICATE_KEY"
NOT_FINITE = "NOT_FINITE"
BIG_NUMBER = "BIG_NUMBER"
WRONG_TYPE = "WRONG_TYPE"
# Of the content rather than of the syntax: a caller that sorts "not parseable" from "not our schema" maps
# these onto its schema code.
VALUE_REASONS = frozenset({DUPLICATE_KEY, NOT_FINITE, BIG_NUMBER, WRONG_TYPE})

_BOMS = (b"\xef\xbb\xbf", b"\xfe\xff", b"\xff\xfe")  # UTF-8, UTF-16 (and UTF-32 LE starts like UTF-16 LE)


class DocumentError(ValueError):
    """A document refused. `reason` is one of the codes above; `problems`: one line per problem where the
    reader found several (a config's duplicate keys), else empty."""

    def __init__(self, reason: str, message: str, problems: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.problems = problems


def utf8_text(raw: bytes) -> str:
    """`raw` as strict UTF-8 text: no byte-order mark, no NUL byte, no invalid sequence or surrogate."""
    if raw.startswith(_BOMS):
        raise DocumentError(NOT_UTF8, "starts with a byte-order mark (save it as UTF-8 without one)")
    if b"\x00" in raw:
        raise DocumentError(NOT_UTF8, "holds a NUL byte")
    try:
        return raw.decode("utf-8", errors="strict")
    except UnicodeDecodeError as exc:
        raise DocumentError(NOT_UTF8, f"not UTF-8 (byte {exc.start})") from None


# A JSON string, and an unterminated one to the end (so a lone quote never makes the scan retry from every
# later quote: linear, whatever the input).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b"[]{},")


def shape(raw: bytes, *, stop_above: int | None = None) -> tuple[int, int]:
    """(deepest bracket nesting, values) of JSON text, outside strings: a linear scan that never recurses
    (an approximation for text that is not JSON). Values are counted as containers plus commas plus one."""
    structure = _STRING.sub(b'""', raw).translate(None, _NOT_STRUCTURE)
    items = len(structure) - structure.count(b"]") - structure.count(b"}") + 1
    depth = deepest = 0
    for b in structure.translate(None, b","):
        if b in (0x5B, 0x7B):  # [ {
            depth += 1
            if depth > deepest:
                deepest = depth
                if stop_above is not None and deepest > stop_above:
                    break
        else:
            depth -= 1
    return deepest, items


def check_text(item: str) -> None:
    if "\x00" in item:
        raise DocumentError(NOT_UTF8, "a string holds a NUL character")
    try:
        item.encode("utf-8")
    except UnicodeEncodeError:
        raise DocumentError(NOT_UTF8, "a string holds a lone surrogate") from None
