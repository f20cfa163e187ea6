"""The limits a body is held under before it reaches llama-server (kvsidecar.backend.llama_body): nesting,
values, members, a schema's `$ref`s, a grammar's groups and rules, llama-server's own fields; and that the
check itself never recurses on what a client sends. The limits' measurements: bench/bench_body_limits.py,
docs/RELIABILITY.md; the whole gate against a real llama-server: tests/integration/test_proxy_body_gate_real.py.
"""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsidecar.backend.llama_body import (
    INTERNAL_FIELDS,
    MAX_DEPTH,
    MAX_GRAMMAR_CHARS,
    MAX_GRAMMAR_NESTING,
    MAX_GRAMMAR_RULES,
    MAX_MEMBERS,
    MAX_NODES,
    MAX_SCHEMA_REFS,
    check_fields,
    check_grammar,
    read_json,
)
from kvsidecar.errors import BadRequest, BodyLimit
from tests.unit.client_fixtures import posts

FAST = settings(max_examples=300, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])


def arrays(n: int) -> bytes:
    return b"[" * n + b"]" * n


def objects(n: int) -> bytes:
    return b'{"a":' * n + b"1" + b"}" * n


def mixed(n: int) -> bytes:
    odd = n % 2
    return b'{"x":[' * (n // 2) + b"[" * odd + b"0" + b"]" * odd + b"]}" * (n // 2)


def depth(value: Any) -> int:
    """Containers nested (a scalar: 0, `[]`: 1, `[[1]]`: 2), as the limit counts them."""
    stack, most = [(value, 0)], 0
    while stack:
        item, d = stack.pop()
        if isinstance(item, dict | list):
            most = max(most, d + 1)
            stack.extend((c, d + 1) for c in (item.values() if isinstance(item, dict) else item))
    return most


@pytest.mark.parametrize("build", [arrays, objects, mixed])
def test_nesting_is_held_at_the_limit(build: Any) -> None:
    assert read_json(build(MAX_DEPTH)) is not None
    for n in (MAX_DEPTH + 1, MAX_DEPTH + 2, 80_000, 2_000_000):
        with pytest.raises(BodyLimit, match="nested deeper" if n < MAX_NODES else "values"):
            read_json(build(n))


def test_brackets_in_strings_and_escapes_are_not_nesting() -> None:
    assert read_json(b'["' + b"[" * 10_000 + b'"]') == ["[" * 10_000]
    assert read_json(b'["\\"' + b"[" * 500 + b'"]') == ['"' + "[" * 500]  # an escaped quote ends nothing
    assert read_json(b'["\\\\", ' + arrays(MAX_DEPTH - 1) + b"]") == ["\\", json.loads(arrays(MAX_DEPTH - 1))]
    # an escaped backslash ends the string: what follows is nesting, and counted
    with pytest.raises(BodyLimit):
        read_json(b'["\\\\",' + arrays(MAX_DEPTH) + b"]")
    with pytest.raises(BodyLimit):  # an unterminated string is no hiding place either
        read_json(b'["\\\\' + b"[" * 500)


def test_the_parser_never_sees_a_body_too_deep(monkeypatch: pytest.MonkeyPatch) -> None:
    def parse(*_: Any, **__: Any) -> Any:
        raise AssertionError("json.loads was handed a body the pre-scan should have refused")

    monkeypatch.setattr(json, "loads", parse)  # the module llama_body parses with
    for body in (arrays(MAX_DEPTH + 1), b'{"a":' * 200_000, b"[" * 5_000 + b'"' + b"]" * 5_000):
        with pytest.raises(BodyLimit):
            read_json(body)


def test_values_members_and_refs_are_bounded() -> None:
    at_limit = b"[" + b"0," * (MAX_NODES - 3) + b"0]"
    assert len(read_json(at_limit)) == MAX_NODES - 2
    with pytest.raises(BodyLimit, match="values"):
        read_json(b"[" + b"0," * MAX_NODES + b"0]")
    members = {f"k{i}": 0 for i in range(MAX_MEMBERS)}
    assert read_json(json.dumps(members).encode()) == members
    with pytest.raises(BodyLimit, match="members"):
        read_json(json.dumps({**members, "one more": 0}).encode())
    # a repeated key is one member, in llama-server's map as here: it costs no more than one
    assert read_json(b"{" + b'"a":0,' * (2 * MAX_MEMBERS) + b'"a":1}') == {"a": 1}
    refs = [{"$ref": f"#/$defs/a{i}"} for i in range(MAX_SCHEMA_REFS)]
    assert read_json(json.dumps({"json_schema": {"anyOf": refs}}).encode())
    with pytest.raises(BodyLimit, match=r"\$ref"):
        read_json(json.dumps({"json_schema": {"anyOf": [*refs, {"$ref": "#"}]}}).encode())
    spelled = json.dumps({"a": [{"\\u0024ref": "#"}] * (MAX_SCHEMA_REFS + 1)}).replace("\\\\", "\\")
    with pytest.raises(BodyLimit, match=r"\$ref"):  # however the key is spelled
        read_json(spelled.encode())


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"not json",
        b"[1,]",
        b"[1] [2]",
        b"NaN",
        b"[Infinity]",
        b"[-Infinity]",
        b"[1e400]",
        b"\xef\xbb\xbf{}",  # a byte order mark
        b'["\xff"]',  # not UTF-8
        b'["\xed\xa0\x80"]',  # an encoded surrogate
        b'{"a": 1' + b"2" * 5000 + b"}",  # an integer Python will not parse
        b"\xff\xfe[\x00]\x00",  # UTF-16
    ],
)
def test_what_is_not_json_text_in_utf8_is_a_bad_request(body: bytes) -> None:
    with pytest.raises(BadRequest):
        read_json(body)


@FAST
@given(st.binary(max_size=200) | st.text(alphabet='[]{}"\\,:01 a', max_size=300).map(str.encode))
def test_any_bytes_give_a_value_or_a_stable_refusal(body: bytes) -> None:
    with contextlib.suppress(BadRequest, BodyLimit):
        read_json(body)


JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)  # what llama-server's parser keeps as integers
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=30,
)


@FAST
@given(JSON, st.integers(min_value=0, max_value=MAX_DEPTH + 4))
def test_a_value_within_the_limits_reads_as_json_and_one_past_them_does_not(value: Any, wrap: int) -> None:
    value = json.loads(json.dumps(value))  # what a client's JSON is
    for _ in range(wrap):
        value = [value]
    body = json.dumps(value).encode()
    if depth(value) <= MAX_DEPTH:
        assert read_json(body) == value
    else:
        with pytest.raises(BodyLimit):
            read_json(body)


@FAST
@given(st.integers(min_value=2**64) | st.integers(max_value=-(2**63) - 1), st.booleans())
def test_an_integer_past_64_bits_is_a_bad_request(n: int, in_a_list: bool) -> None:
    """llama-server's parser reads such a number as a double (or fails past a double's range), which its
    handlers then take for an integer field."""
    with pytest.raises(BadRequest):
        read_json(json.dumps([n] if in_a_list else {"n_predict": n}).encode())


@pytest.mark.parametrize(
    "text",
    [r'"\ud800"', r'"a\udc00"', r'["x", "\uDBFF"]', r'{"\ud800": 1}', r'"\ude00\ud83d"', r'"\ud83d\u0041"'],
)
def test_a_lone_surrogate_escape_is_a_bad_request(text: str) -> None:
    with pytest.raises(BadRequest):
        read_json(text.encode())


@pytest.mark.parametrize("text", [r'"\ud83d\ude00"', r'"\\\\ud800"', r'"\u00e9"', '"\u00e9 plain é"'])
def test_paired_surrogates_and_escaped_backslashes_read_as_text(text: str) -> None:
    assert read_json(text.encode()) == json.loads(text)


def test_recorded_client_bodies_are_far_under_every_limit() -> None:
    """The limits leave real clients' bodies (Claude Code, Codex, opencode, aider) a wide margin."""
    for recorded in posts():
        body = json.dumps(recorded.body).encode()
        data = read_json(body)
        check_fields(data)
        assert depth(data) * 8 <= MAX_DEPTH, (recorded.client, recorded.name, depth(data))
        assert body.count(b",") * 100 < MAX_NODES
        assert body.count(b'"$ref"') * 8 <= MAX_SCHEMA_REFS


def test_a_grammars_groups_rules_and_size_are_bounded() -> None:
    check_grammar("root ::= " + "(" * MAX_GRAMMAR_NESTING + '"a"' + ")" * MAX_GRAMMAR_NESTING)
    with pytest.raises(BodyLimit, match="nested"):
        check_grammar("root ::= " + "(" * (MAX_GRAMMAR_NESTING + 1) + '"a"' + ")" * (MAX_GRAMMAR_NESTING + 1))
    with pytest.raises(BodyLimit, match="nested"):  # a literal ")" closes no group
        check_grammar('root ::= ( ")" ' * (MAX_GRAMMAR_NESTING + 1) + ")" * (MAX_GRAMMAR_NESTING + 1))
    many = "root ::= " + '"(" ' * 500 + "[(] " * 500 + "\n# " + "(" * 500 + '\n"\\"' + "(" * 500 + '"'
    check_grammar(many)  # parentheses in literals, classes and comments are not groups
    check_grammar("root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(MAX_GRAMMAR_RULES - 1)))
    with pytest.raises(BodyLimit, match="rules"):
        check_grammar("root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(MAX_GRAMMAR_RULES)))
    with pytest.raises(BodyLimit, match="characters"):
        check_grammar('root ::= "' + "a" * MAX_GRAMMAR_CHARS + '"')


def test_llama_servers_own_fields_are_refused_whatever_their_value() -> None:
    for name in INTERNAL_FIELDS:
        values: list[Any] = ["", [], {"parsers": []}, None, [{"type": 1, "value": "x"}]]
        for value in values:
            with pytest.raises(BadRequest, match=name):
                check_fields({"prompt": "x", name: value})
    check_fields({"prompt": "x", "grammar": 'root ::= "a"', "json_schema": {"type": "object"}})
    check_fields(["not an object"])
