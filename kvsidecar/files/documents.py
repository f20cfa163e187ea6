"""The one reader of the structured files kvsidecar reads back: every JSON or YAML document of ours
(manifests, fingerprint records, the file-digest cache, carry-over verdicts, the state lock's record, the
config file, fleet records and answers from Redis and peers) is parsed here and
nowhere else (`tests/unit/files/test_documents.py` greps the package for any other parser).

A file of ours is hostile input: damaged by a crash or a full disk, or written by someone else. Each kind of
document (`KINDS`, one `DocumentKind` per reader, with its caps) is read the same way, in this order, and
every refusal is one exception, `DocumentError` (a `ValueError`, with a stable `reason`), which each caller
already treats as "a bad file": a cold start, the file refused or set aside, a config error. Nothing else
escapes: no `RecursionError`, no `MemoryError`-sized work, no hang.

1. size: at most `max_bytes`, before anything else;
2. encoding: strict UTF-8; a byte-order mark, a NUL byte, an invalid or over-long sequence or an encoded
   surrogate is refused (`NOT_UTF8`);
3. shape, before any parser recurses: the bracket nesting outside strings (`TOO_DEEP`) and the number of
   values (`TOO_MANY`), by a linear scan (JSON; YAML's are checked on its node graph, `yamlstrict.py`);
4. the parse: a key given twice in one object (`DUPLICATE_KEY`), NaN or Infinity, or a number that parses to
   an infinite float (`NOT_FINITE`), an integer of more than `MAX_INT_DIGITS` digits (`BIG_NUMBER`: Python
   refuses over 4300 anyway, other readers may hang) are refused; a string holding a lone surrogate or a NUL
   character (by escape) is `NOT_UTF8`;
5. the top-level type (`WRONG_TYPE`).

The codes, the error and the checks around any parser are in `limits.py`; the YAML parse in `yamlstrict.py`.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Literal

from kvsidecar.files.limits import (
    BIG_NUMBER,
    DUPLICATE_KEY,
    MAX_FLOAT_CHARS,
    MAX_INT_DIGITS,
    NOT_FINITE,
    NOT_JSON,
    NOT_UTF8,
    TOO_DEEP,
    TOO_LARGE,
    TOO_MANY,
    WRONG_TYPE,
    DocumentError,
    check_text,
    shape,
    utf8_text,
)
from kvsidecar.files.yamlstrict import parse_yaml

__all__ = ["KINDS", "DocumentError", "DocumentKind"]


@dataclass(frozen=True, kw_only=True)
class DocumentKind:
    """One kind of document kvsidecar reads, and its caps. Every kind is in `KINDS`."""

    name: str
    format: Literal["json", "yaml"]
    max_bytes: int
    max_depth: int  # containers nested (an object holding a list is 2)
    max_items: int  # values in all (YAML: with every alias counted where it is used)
    top: type | tuple[type, ...] | None = dict  # None: any JSON value

    def read(self, data: bytes | str) -> Any:
        """The document's value; `DocumentError` for anything refused."""
        raw = _bytes(data)
        if len(raw) > self.max_bytes:
            raise DocumentError(TOO_LARGE, f"larger than {self.max_bytes} bytes")
        text = utf8_text(raw)
        if self.format == "yaml":
            value = parse_yaml(text, max_depth=self.max_depth, max_items=self.max_items)
        else:
            value = _parse_json(raw, text, self)
        empty = value is None and self.format == "yaml"  # a YAML file of only comments holds no document
        if self.top is not None and not empty and not isinstance(value, self.top):
            raise DocumentError(
                WRONG_TYPE, f"the top level is {type(value).__name__}, not {_names(self.top)}"
            )
        return value


def _names(top: type | tuple[type, ...]) -> str:
    return " or ".join(t.__name__ for t in (top if isinstance(top, tuple) else (top,)))


def _bytes(data: bytes | str) -> bytes:
    if isinstance(data, str):
        try:
            return data.encode("utf-8")
        except UnicodeEncodeError:
            raise DocumentError(NOT_UTF8, "holds a lone surrogate") from None
    return bytes(data)


def _parse_json(raw: bytes, text: str, kind: DocumentKind) -> Any:
    deepest, items = shape(raw, stop_above=kind.max_depth)
    if deepest > kind.max_depth:
        raise DocumentError(TOO_DEEP, f"nested deeper than {kind.max_depth} levels")
    if items > kind.max_items:
        raise DocumentError(TOO_MANY, f"more than {kind.max_items} values")
    try:
        value = json.loads(
            text,
            object_pairs_hook=_object,
            parse_int=_int,
            parse_float=_float,
            parse_constant=_constant,
        )
    except DocumentError:
        raise
    except (ValueError, RecursionError) as exc:  # RecursionError cannot happen below the depth cap
        raise DocumentError(NOT_JSON, f"not JSON: {str(exc)[:100]}") from None
    _check_strings(value)
    return value


def _object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                break
            seen.add(key)
        raise DocumentError(DUPLICATE_KEY, f"the key {key[:40]!r} is given twice in one object")
    return out


def _int(digits: str) -> int:
    if len(digits.lstrip("-")) > MAX_INT_DIGITS:
        raise DocumentError(BIG_NUMBER, f"an integer of more than {MAX_INT_DIGITS} digits")
    return int(digits)


def _float(text: str) -> float:
    if len(text) > MAX_FLOAT_CHARS:
        raise DocumentError(BIG_NUMBER, f"a number of more than {MAX_FLOAT_CHARS} characters")
    value = float(text)
    if not math.isfinite(value):
        raise DocumentError(NOT_FINITE, f"{text[:20]} is not a finite number")
    return value


def _constant(name: str) -> Any:
    raise DocumentError(NOT_FINITE, f"{name} is not a number")


def _check_strings(value: Any) -> None:
    """No lone surrogate and no NUL character in any string or key (escapes decode to them)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            check_text(item)
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _json(name: str, *, max_bytes: int, max_depth: int, max_items: int, top: Any = dict) -> DocumentKind:
    return DocumentKind(
        name=name, format="json", max_bytes=max_bytes, max_depth=max_depth, max_items=max_items, top=top
    )


# Every kind of document kvsidecar reads, with its caps; the comment names the reader.
MANIFEST = _json("manifest", max_bytes=64 * 1024, max_depth=4, max_items=512)  # store/manifest.py
# fingerprint/records.py: a flat map of strings
FINGERPRINT_RECORD = _json("fingerprint record", max_bytes=1 << 20, max_depth=2, max_items=8192)
# fingerprint/file_digests.py: {"version": 2, "entries": {identity: digest}}
DIGEST_CACHE = _json("file-digest cache", max_bytes=1 << 20, max_depth=2, max_items=4096)
# store/carryover.py: <state_dir>/build-equivalence.json
CARRY_VERDICTS = _json("carry-over verdicts", max_bytes=1 << 20, max_depth=2, max_items=8192)
LOCK_RECORD = _json("state lock record", max_bytes=4096, max_depth=1, max_items=64)  # daemon/statelock.py
# config/file.py: the config file
CONFIG = DocumentKind(name="config", format="yaml", max_bytes=1 << 20, max_depth=32, max_items=10_000)
HOST_RECORD = _json("fleet host record", max_bytes=64 * 1024, max_depth=4, max_items=4096)  # fleet/plane.py
RESIDENCY = _json("fleet residency entry", max_bytes=1024, max_depth=1, max_items=16)  # fleet/plane.py
QUEUED_RELEASE = _json("fleet queued release", max_bytes=4096, max_depth=2, max_items=64)  # fleet/agent.py
# fleet/routing.py: a peer's hook-API answer
PEER_ANSWER = _json("fleet peer answer", max_bytes=1 << 20, max_depth=16, max_items=100_000)

KINDS: tuple[DocumentKind, ...] = (
    MANIFEST,
    FINGERPRINT_RECORD,
    DIGEST_CACHE,
    CARRY_VERDICTS,
    LOCK_RECORD,
    CONFIG,
    HOST_RECORD,
    RESIDENCY,
    QUEUED_RELEASE,
    PEER_ANSWER,
)
