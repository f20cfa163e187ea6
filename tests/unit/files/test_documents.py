"""The one reader of every JSON and YAML document of ours (`kvsidecar.files.documents.KINDS`).

Each kind is fed the same attacks (nesting, size, value counts, type, encoding, duplicate keys, non-finite
and huge numbers, and for YAML alias bombs and cycles): every one is refused as one `DocumentError`, within
a few seconds, never another exception. Each kind's caller is then shown to survive them
(`test_document_callers.py`), and the package is searched for any other parser, so that a new reader cannot
skip this one."""

from __future__ import annotations

import ast
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from kvsidecar.files.documents import KINDS, DocumentError, DocumentKind

Attack = Callable[[DocumentKind], tuple[bytes, set[str]]]
PACKAGE = Path(__file__).resolve().parents[3] / "kvsidecar"


def _deep(kind: DocumentKind) -> tuple[bytes, set[str]]:
    """600,000 `[` would be 600 KB: each kind gets as many as its size cap allows (still far too deep)."""
    if kind.format == "yaml":
        return b"a: " + b"[" * (kind.max_bytes - 3), {"TOO_DEEP"}
    return b"[" * kind.max_bytes, {"TOO_DEEP"}


def _one_too_deep(kind: DocumentKind) -> tuple[bytes, set[str]]:
    n = kind.max_depth
    if kind.format == "yaml":
        return b"a: " + b"[" * n + b"1" + b"]" * n, {"TOO_DEEP"}
    return b'{"a":' * (n + 1) + b"1" + b"}" * (n + 1), {"TOO_DEEP"}


def _large(kind: DocumentKind) -> tuple[bytes, set[str]]:
    return b"{}" + b" " * (kind.max_bytes - 1), {"TOO_LARGE"}


def _many(kind: DocumentKind) -> tuple[bytes, set[str]]:
    n = kind.max_items + 1
    if kind.format == "yaml":
        return b"a: [" + b"0," * n + b"0]", {"TOO_MANY"}
    if kind.max_depth >= 2:
        return b'{"a":[' + b"0," * n + b"0]}", {"TOO_MANY"}
    return b"{" + b",".join(b'"k%d":0' % i for i in range(n)) + b"}", {"TOO_MANY"}


def _json_or_yaml(json_text: bytes, yaml_text: bytes, reasons: set[str]) -> Attack:
    return lambda kind: (yaml_text if kind.format == "yaml" else json_text, reasons)


def _huge_int(kind: DocumentKind) -> tuple[bytes, set[str]]:
    digits = b"9" * min(5000, kind.max_bytes - 16)  # past Python's 4300-digit limit where the cap allows
    return (b"a: " + digits if kind.format == "yaml" else b'{"a":' + digits + b"}"), {"BIG_NUMBER"}


def _open_quotes(kind: DocumentKind) -> tuple[bytes, set[str]]:
    """A string that never closes, full of escaped quotes (a scan that retried at each quote took hours)."""
    body = b'\\"' * ((kind.max_bytes - 8) // 2)
    return (b'a: "' + body if kind.format == "yaml" else b'{"a":"' + body), {"NOT_JSON", "NOT_YAML"}


LAUGHS = b"\n".join(
    [b"a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    + [b"a%d: &a%d [%s]" % (i, i, b", ".join([b"*a%d" % (i - 1)] * 10)) for i in range(1, 10)]
)
MERGES = b"\n".join(
    [b"b0: &b0 {x: 1}"] + [b"b%d: &b%d {<<: [*b%d, *b%d]}" % (i, i, i - 1, i - 1) for i in range(1, 40)]
)

ATTACKS: dict[str, Attack] = {
    "deep": _deep,
    "one level too deep": _one_too_deep,
    "large": _large,
    "many values": _many,
    "top level a list": _json_or_yaml(b"[]", b"- a\n", {"WRONG_TYPE"}),
    "top level a string": _json_or_yaml(b'"x"', b"just text\n", {"WRONG_TYPE"}),
    "top level null": _json_or_yaml(b"null", b"[]\n", {"WRONG_TYPE"}),
    "byte-order mark": _json_or_yaml(b"\xef\xbb\xbf{}", b"\xef\xbb\xbfa: 1\n", {"NOT_UTF8"}),
    "utf-16": _json_or_yaml("{}".encode("utf-16"), "a: 1".encode("utf-16"), {"NOT_UTF8"}),
    "nul byte": _json_or_yaml(b'{"a":"\x00"}', b"a: b\x00\n", {"NOT_UTF8"}),
    "invalid utf-8": _json_or_yaml(b'{"a":"\xff"}', b"a: \xff\n", {"NOT_UTF8"}),
    "over-long utf-8": _json_or_yaml(b'{"a":"\xc0\xaf"}', b"a: \xc0\xaf\n", {"NOT_UTF8"}),
    "encoded surrogate": _json_or_yaml(b'{"a":"\xed\xa0\x80"}', b"a: \xed\xa0\x80\n", {"NOT_UTF8"}),
    "escaped surrogate": _json_or_yaml(b'{"a":"\\ud800"}', b'a: "\\ud800"\n', {"NOT_UTF8"}),
    "escaped nul": _json_or_yaml(b'{"a":"\\u0000"}', b'a: "\\0"\n', {"NOT_UTF8"}),
    "escaped nul in a key": _json_or_yaml(b'{"\\u0000":1}', b'"\\0": 1\n', {"NOT_UTF8"}),
    "duplicate key": _json_or_yaml(b'{"a":1,"b":2,"a":3}', b"a: 1\nb: 2\na: 3\n", {"DUPLICATE_KEY"}),
    "NaN": _json_or_yaml(b'{"a":NaN}', b"a: .nan\n", {"NOT_FINITE"}),
    "Infinity": _json_or_yaml(b'{"a":-Infinity}', b"a: -.inf\n", {"NOT_FINITE"}),
    "a float that overflows": _json_or_yaml(b'{"a":1e999}', b"a: 1.0e+999\n", {"NOT_FINITE"}),
    "huge integer": _huge_int,
    "truncated": _json_or_yaml(b'{"a": 1, "b": ', b"a: [1, ", {"NOT_JSON", "NOT_YAML"}),
    "quotes that never close": _open_quotes,
    "empty": _json_or_yaml(b"", b"{", {"NOT_JSON", "NOT_YAML"}),
}
YAML_ATTACKS: dict[str, tuple[bytes, set[str]]] = {
    "billion laughs": (LAUGHS + b"\nz: *a9\n", {"TOO_MANY"}),
    "merge-key bomb": (MERGES, {"TOO_MANY"}),
    "an alias inside itself": (b"a: &a [1, *a]\n", {"TOO_DEEP"}),
    "a mapping inside itself": (b"a: &a {b: *a}\n", {"TOO_DEEP"}),
    "sexagesimal integer": (b"a: " + b":".join([b"1"] + [b"30"] * 300_000) + b"\n", {"BIG_NUMBER"}),
    "a python tag": (b"a: !!python/object/apply:os.system ['true']\n", {"NOT_YAML"}),
    "two documents": (b"a: 1\n---\nb: 2\n", {"NOT_YAML"}),
}


def _attack(kind: DocumentKind, name: str) -> tuple[bytes, set[str]]:
    return YAML_ATTACKS[name] if name in YAML_ATTACKS else ATTACKS[name](kind)


CASES = [
    pytest.param(kind, name, id=f"{kind.name}-{name}")
    for kind in KINDS
    for name in [*ATTACKS, *(YAML_ATTACKS if kind.format == "yaml" else ())]
]


@pytest.mark.parametrize(("kind", "attack"), CASES)
def test_every_kind_refuses_every_attack_as_one_error(kind: DocumentKind, attack: str) -> None:
    raw, reasons = _attack(kind, attack)
    started = time.monotonic()
    with pytest.raises(DocumentError) as info:
        kind.read(raw)
    assert info.value.reason in reasons, info.value.message
    assert isinstance(info.value, ValueError)  # what every caller already treats as a bad file
    assert time.monotonic() - started < 5


@pytest.mark.parametrize("kind", KINDS, ids=[k.name for k in KINDS])
def test_what_is_within_the_caps_reads(kind: DocumentKind) -> None:
    if kind.format == "yaml":
        assert kind.read(b"a: [1, 2.5, x]\nb: {c: null}\n") == {"a": [1, 2.5, "x"], "b": {"c": None}}
        assert kind.read(b"# only a comment\n") is None
    else:
        assert kind.read('{"a": "naïve \\ud83d\\ude00", "n": -3}') == {"a": "naïve \U0001f600", "n": -3}


def test_every_kind_has_its_own_name() -> None:
    assert len({k.name for k in KINDS}) == len(KINDS)


# no other parser -------------------------------------------------------------------------------------
READERS = {"files/documents.py", "files/yamlstrict.py"}
# Network answers and request bodies, not documents read back: each parsed where its protocol is handled.
NOT_DOCUMENTS = {
    "buildcheck.py": "llama-server's answer to the smoke decode (standard library only, below files/)",
    "backend/llamacpp.py": "llama-server's /props and /slots answers (httpx)",
    "backend/llama_http.py": "llama-server's answers, read for their token counts",
    "backend/llama_body.py": "client request bodies, parsed after the proxy's body gate scanned them",
    "backend/fake_prompts.py": "the fake engine's chat template reading a request body (unit tests)",
    "client/wire.py": "the hook API's answers",
    "http/router.py": "hook API request bodies (pydantic)",
    "demo.py": "llama-server's streamed answer in the demo",
    "testing/": "test rigs reading answers",
    "proxy/": "client request bodies and llama-server's answers (the proxy's own body gate)",
}
_MODULES = {"json", "yaml", "orjson", "ujson", "simplejson", "tomllib", "tomli", "pickle", "marshal", "jiter"}
_MODULES |= {"pydantic_core"}
_PARSERS = {"loads", "load", "load_all", "safe_load", "safe_load_all", "full_load", "unsafe_load", "compose"}
_PARSERS |= {"from_json", "JSONDecoder"}
_ALWAYS = {"model_validate_json", "validate_json", "raw_decode"}


def _parses(path: Path) -> list[str]:
    """The parse calls of one module: json/yaml/... `loads`-style calls (aliases too), their direct imports,
    pydantic's JSON validation, and `.json()` on an HTTP answer."""
    tree = ast.parse(path.read_text())
    imports = [a for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    aliases = {a.asname or a.name for a in imports if a.name.split(".")[0] in _MODULES}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] in _MODULES:
            found += [
                f"from {node.module} import {a.name}"
                for a in node.names
                if a.name in _PARSERS | _ALWAYS or a.name.endswith("Loader")
            ]
        loader = isinstance(node, ast.Attribute) and node.attr.endswith("Loader")  # yaml.SafeLoader
        if loader and isinstance(node.value, ast.Name) and node.value.id in aliases:  # type: ignore[attr-defined]
            found.append(f"{node.value.id}.{node.attr}")  # type: ignore[attr-defined]
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Attribute | ast.Name):
            continue
        name = node.func.attr if isinstance(node.func, ast.Attribute) else node.func.id
        owner = node.func.value if isinstance(node.func, ast.Attribute) else None
        if name in _PARSERS and isinstance(owner, ast.Name) and owner.id in aliases:
            found.append(f"{owner.id}.{name}")
        elif name in _ALWAYS and not (isinstance(owner, ast.Name) and owner.id in ("cls", "self")):
            found.append(name)
        elif name == "json" and owner is not None and not node.args and not node.keywords:
            found.append(".json()")
    return [f"line {getattr(node, 'lineno', '?')}: {f}" for f in found]


def _excused(rel: str) -> bool:
    return rel in NOT_DOCUMENTS or any(rel.startswith(p) for p in NOT_DOCUMENTS if p.endswith("/"))


def test_no_json_or_yaml_is_parsed_outside_the_one_reader() -> None:
    """Like the architecture test's greps: a new `json.loads` of a file of ours fails here, not in an audit."""
    offenders = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel in READERS or _excused(rel):
            continue
        if found := _parses(path):
            offenders[rel] = found
    assert offenders == {}, "parse these through kvsidecar.files.documents (a DocumentKind in KINDS)"


def test_the_search_sees_parsers_and_the_exceptions_are_still_needed(tmp_path: Path) -> None:
    """It cannot pass by seeing nothing: a module made for the purpose is caught in every spelling, and
    each module excused by name still parses something (else it leaves the list)."""
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import json as j\nimport yaml\nfrom json import loads\nfrom pydantic import BaseModel\n"
        "j.loads(b'1')\nyaml.safe_load('a')\nyaml.load('a', yaml.SafeLoader)\nBaseModel.model_validate_json('1')\n"
        "def f(r): return r.json()\n"
        "class L(yaml.CSafeLoader): pass\n"
    )
    assert len(_parses(probe)) == 8  # yaml.load's yaml.SafeLoader counts as well
    for rel in (r for r in NOT_DOCUMENTS if not r.endswith("/")):
        assert _parses(PACKAGE / rel), f"{rel} parses nothing any more: drop it from NOT_DOCUMENTS"
    for rel in READERS:
        assert _parses(PACKAGE / rel)
