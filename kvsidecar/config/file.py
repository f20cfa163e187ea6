"""Reading the config file's YAML: PyYAML's safe loader, but a key given twice in one mapping is an error.

Plain `yaml.safe_load` keeps the last of two equal keys without a word, so `enabled: true` ... `enabled:
false` (or a second `snapshot_dir` under a server) silently changes what the first line says. Here every
duplicate, at any depth, is a problem naming its dotted key and both lines, and the file is refused
(`ConfigInvalid`, KV_CONFIG_INVALID) by `config check`, `serve` and a SIGHUP reload alike: they all read
through `read_mapping`. A `<<` merge key (`<<: *base`) is not a duplicate of the keys it brings in: the
mapping's own keys override merged ones, as YAML says.
"""

from __future__ import annotations

import json
import os
import re
import stat
from pathlib import Path
from typing import Any

import yaml
from yaml.nodes import MappingNode, Node, SequenceNode

from kvsidecar.config.errors import ConfigInvalid
from kvsidecar.errors import ConfigError

_MERGE_TAG = "tag:yaml.org,2002:merge"
MAX_BYTES = 1024 * 1024  # a config file larger than this is refused before it is parsed
_PLAIN_KEY = re.compile(r"\A[A-Za-z0-9_-]{1,64}\Z")


def _key_text(key: object) -> str:
    """A key as one dotted-path segment: as written when plain, else quoted (control characters escaped)."""
    if isinstance(key, str) and _PLAIN_KEY.match(key):
        return key
    text = key if isinstance(key, str) else repr(key)
    return json.dumps(text[:64] + ("..." if len(text) > 64 else ""))


class StrictLoader(yaml.SafeLoader):
    """SafeLoader that records every key repeated within one mapping (`duplicates`, one problem line each)
    instead of letting the last one win. Paths are dotted keys (`servers.local.snapshot_dir`), with `[i]`
    for a list item."""

    def __init__(self, stream: str) -> None:
        super().__init__(stream)
        self._duplicates: list[tuple[int, str]] = []  # (line of the repeat, problem)
        self._paths: dict[int, str] = {}  # id(node) -> its dotted path, set by the mapping/list holding it

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


def load_strict(text: str) -> Any:
    """The document in `text` (None when it holds none); `ConfigInvalid` listing every duplicate key."""
    loader = StrictLoader(text)
    try:
        data = loader.get_single_data()
    finally:
        loader.dispose()
    if problems := loader.duplicates:
        raise ConfigInvalid(problems, hint="Remove all but one of each key named above.")
    return data


def _read_text(chosen: Path) -> str:
    """The file's text, after checking without blocking that it is a regular file of at most MAX_BYTES: a
    FIFO or a device at the config path would block (or never end), and a huge file would take minutes and
    gigabytes to parse (PyYAML is pure Python here). /dev/null is the one device taken: an empty config."""
    fd = os.open(chosen, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | getattr(os, "O_CLOEXEC", 0))
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) and not os.path.samestat(info, os.stat(os.devnull)):
            raise ConfigError(f"{chosen}: not a regular file (a directory, FIFO, socket or device)")
        data = f.read(MAX_BYTES + 1)
    if len(data) > MAX_BYTES:
        size = max(info.st_size, len(data))
        raise ConfigError(
            f"{chosen}: {size} bytes, over the {MAX_BYTES} byte (1 MiB) limit for a config file",
            hint="A config is a few kilobytes: check that this is the file you meant.",
        )
    return data.decode("utf-8")


def read_mapping(chosen: Path) -> dict[str, Any]:
    """The config file's top-level mapping; an empty file (or only comments) is `{}`."""
    try:
        loaded = load_strict(_read_text(chosen))
    except FileNotFoundError:
        raise ConfigError(f"{chosen}: no such config file") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"{chosen}: not valid YAML{where}") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{chosen}: cannot read ({getattr(exc, 'strerror', None) or exc})") from None
    if loaded is None:
        return {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"{chosen}: the top level must be a mapping of keys")
    return loaded
