"""The YAML half of the one document reader (`documents.py`: `DocumentKind.read` is the only caller here):
PyYAML's safe loader, bounded, with a key given twice refused.

PyYAML alone is not safe on a hostile file: its composer and constructor recurse once per nesting level
(`[` x 100,000 raises RecursionError), an anchor used ten times in each of ten levels ("billion laughs")
builds a value that every later walk expands to 10^10 items, a merge key chain (`<<: [*a, *a]`) does the
same in the constructor, an anchor used inside itself is a cycle, and an integer of thousands of digits
(or sexagesimal `1:2:3:...`) raises ValueError or takes quadratic time. So:

- the composer counts the nesting of the text and the nodes as it goes, and stops past the caps;
- before anything is constructed, the node graph (every alias counted where it is used, every merge) is
  walked without recursion: its depth and expanded size must stay under the caps, and no node may contain
  itself;
- integers of more than `MAX_INT_DIGITS` characters and non-finite floats (`.inf`, `.nan`) are refused;
- every string is checked for a lone surrogate or a NUL character (escapes make them).

Plain `yaml.safe_load` also keeps the last of two equal keys without a word, so `enabled: true` ...
`enabled: false` silently changes what the first line says. Here every duplicate, at any depth, is a
problem naming its dotted key and both lines (`DocumentError.problems`). A `<<` merge key (`<<: *base`) is
not a duplicate of the keys it brings in: the mapping's own keys override merged ones, as YAML says.
Everything refused is a `DocumentError`; nothing else escapes.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, ScalarNode, SequenceNode

from kvsidecar.files.limits import (
    BIG_NUMBER,
    DUPLICATE_KEY,
    MAX_INT_DIGITS,
    NOT_FINITE,
    NOT_YAML,
    TOO_DEEP,
    TOO_MANY,
    DocumentError,
    check_text,
)

_MERGE_TAG = "tag:yaml.org,2002:merge"
_PLAIN_KEY = re.compile(r"\A[A-Za-z0-9_-]{1,64}\Z")
_MAX_NUMBER_CHARS = MAX_INT_DIGITS + 24  # room for a sign, a base prefix and digit separators


def _key_text(key: object) -> str:
    """A key as one dotted-path segment: as written when plain, else quoted (control characters escaped)."""
    if isinstance(key, str) and _PLAIN_KEY.match(key):
        return key
    text = key if isinstance(key, str) else repr(key)
    return json.dumps(text[:64] + ("..." if len(text) > 64 else ""))


class StrictLoader(yaml.SafeLoader):
    """SafeLoader under caps (see the module), which records every key repeated within one mapping
    (`duplicates`, one problem line each) instead of letting the last one win. Paths are dotted keys
    (`servers.local.snapshot_dir`), with `[i]` for a list item."""

    def __init__(self, stream: str, *, max_depth: int, max_items: int) -> None:
        super().__init__(stream)
        self.max_depth = max_depth
        self.max_items = max_items
        self._depth = 0
        self._nodes = 0
        self._duplicates: list[tuple[int, str]] = []  # (line of the repeat, problem)
        self._paths: dict[int, str] = {}  # id(node) -> its dotted path, set by the mapping/list holding it

    # composing: the text's own nesting and size -----------------------------------------------------
    def compose_node(self, parent: Node | None, index: Any) -> Node | None:
        self._depth += 1
        self._nodes += 1
        try:
            if self._depth > self.max_depth + 1:  # a collection's scalars are one level below it
                raise DocumentError(TOO_DEEP, f"nested deeper than {self.max_depth} levels")
            if self._nodes > self.max_items:
                raise DocumentError(TOO_MANY, f"more than {self.max_items} values")
            return super().compose_node(parent, index)
        finally:
            self._depth -= 1

    # constructing -----------------------------------------------------------------------------------
    def _path(self, parent: Node, segment: str) -> str:
        where = self._paths.get(id(parent), "")
        return f"{where}.{segment}" if where and not segment.startswith("[") else where + segment

    def _child(self, parent: Node, segment: str, child: Node) -> None:
        self._paths.setdefault(id(child), self._path(parent, segment))  # an alias keeps its first place

    def construct_mapping(self, node: MappingNode, deep: bool = False) -> dict[Any, Any]:
        if isinstance(node, MappingNode):
            self._check_keys(node)
        return super().construct_mapping(node, deep=deep)

    def construct_sequence(self, node: SequenceNode, deep: bool = False) -> list[Any]:
        if isinstance(node, SequenceNode):
            for index, item in enumerate(node.value):
                self._child(node, f"[{index}]", item)
        return super().construct_sequence(node, deep=deep)

    def construct_bounded_int(self, node: ScalarNode) -> int:
        if len(str(node.value)) > _MAX_NUMBER_CHARS:
            raise DocumentError(
                BIG_NUMBER, f"line {node.start_mark.line + 1}: an integer too long to be ours"
            )
        return super().construct_yaml_int(node)

    def construct_finite_float(self, node: ScalarNode) -> float:
        if len(str(node.value)) > _MAX_NUMBER_CHARS:
            raise DocumentError(BIG_NUMBER, f"line {node.start_mark.line + 1}: a number too long to be ours")
        value = float(super().construct_yaml_float(node))
        if not math.isfinite(value):
            raise DocumentError(
                NOT_FINITE, f"line {node.start_mark.line + 1}: {node.value!s:.20} is not finite"
            )
        return value

    def _check_keys(self, node: MappingNode) -> None:
        first_line: dict[Any, int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == _MERGE_TAG:
                continue
            key = self.construct_object(key_node, deep=True)
            try:
                hash(key)
            except TypeError:
                continue  # the base constructor refuses an unhashable key with its own error
            segment = _key_text(key)
            self._child(node, segment, value_node)
            line = key_node.start_mark.line + 1
            if key in first_line:
                self._duplicates.append(
                    (
                        line,
                        f"{self._path(node, segment)}: given twice (lines {first_line[key]} and {line}); "
                        "YAML would silently keep the last: keep one",
                    )
                )
            else:
                first_line[key] = line

    @property
    def duplicates(self) -> list[str]:
        """One problem per repeated key, in the order of the repeats in the file."""
        return [problem for _line, problem in sorted(self._duplicates, key=lambda d: d[0])]


StrictLoader.add_constructor("tag:yaml.org,2002:int", StrictLoader.construct_bounded_int)
StrictLoader.add_constructor("tag:yaml.org,2002:float", StrictLoader.construct_finite_float)


def _children(node: Node) -> list[Node]:
    if isinstance(node, SequenceNode):
        return list(node.value)
    if isinstance(node, MappingNode):
        return [n for pair in node.value for n in pair]
    return []


def check_graph(root: Node, *, max_depth: int, max_items: int) -> None:
    """The node graph as the constructor will expand it (aliases and merges counted at every use): at most
    `max_items` values, `max_depth` nested collections, no collection inside itself. Never recurses."""
    size: dict[int, int] = {}
    depth: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[Node, bool]] = [(root, False)]
    while stack:
        node, done = stack.pop()
        key = id(node)
        kids = _children(node)
        if done:
            on_path.discard(key)
            size[key] = 1 + sum(size[id(k)] for k in kids)
            deepest = max((depth[id(k)] for k in kids), default=0)
            depth[key] = 0 if isinstance(node, ScalarNode) else 1 + deepest
            if size[key] > max_items:
                raise DocumentError(TOO_MANY, f"its aliases expand to more than {max_items} values")
            if depth[key] > max_depth:
                raise DocumentError(TOO_DEEP, f"its aliases nest deeper than {max_depth} levels")
            continue
        if key in size:
            continue
        if key in on_path:
            raise DocumentError(TOO_DEEP, f"line {node.start_mark.line + 1}: an alias used inside itself")
        on_path.add(key)
        stack.append((node, True))
        stack.extend((k, False) for k in kids if id(k) not in size)


def _check_values(value: Any) -> None:
    """No lone surrogate or NUL in any string or key; each container walked once (aliases share them)."""
    seen: set[int] = set()
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            check_text(item)
        elif isinstance(item, dict | list | set | tuple):
            if id(item) in seen:
                continue
            seen.add(id(item))
            if isinstance(item, dict):
                stack.extend(item.keys())
                stack.extend(item.values())
            else:
                stack.extend(item)


def parse_yaml(text: str, *, max_depth: int, max_items: int) -> Any:
    """The one document in `text` (None when it holds none), within the caps; `DocumentError` for
    anything refused, with every duplicate key as a problem (`DUPLICATE_KEY`)."""
    loader = StrictLoader(text, max_depth=max_depth, max_items=max_items)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        check_graph(node, max_depth=max_depth, max_items=max_items)
        data = loader.construct_document(node)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise DocumentError(NOT_YAML, f"not valid YAML{where}") from None
    except (ValueError, TypeError, RecursionError, OverflowError) as exc:
        if isinstance(exc, DocumentError):
            raise
        raise DocumentError(NOT_YAML, f"not a value YAML can read ({type(exc).__name__})") from None
    finally:
        loader.dispose()
    if problems := loader.duplicates:
        raise DocumentError(DUPLICATE_KEY, "a key is given twice", tuple(problems))
    _check_values(data)
    return data
