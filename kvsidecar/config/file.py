"""Reading the config file: the bytes of a regular file, parsed by the one document reader
(`kvsidecar.files.documents.CONFIG`: PyYAML's safe loader under size, depth, alias and number caps, strict
UTF-8, a key given twice refused), and every refusal turned into a config error.

`config check`, `serve` and a SIGHUP reload all read through `read_mapping`, so a file they cannot use is
the same clear error (`ConfigError` / `ConfigInvalid`, KV_CONFIG_INVALID) for all three, never a traceback:
a key given twice is one problem per duplicate, naming its dotted key and both lines; a file nested too
deep, whose aliases expand too far ("billion laughs"), with a huge number, a byte-order mark, a NUL byte
or invalid UTF-8 is one line saying which.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

from kvsidecar.config.errors import ConfigInvalid
from kvsidecar.errors import ConfigError
from kvsidecar.files.documents import CONFIG, DocumentError
from kvsidecar.files.limits import DUPLICATE_KEY

MAX_BYTES = CONFIG.max_bytes  # a config file larger than this is refused before it is parsed


def load_strict(text: str | bytes) -> Any:
    """The document in `text` (None when it holds none); `ConfigInvalid` listing every duplicate key,
    `DocumentError` for anything else the reader refuses."""
    try:
        return CONFIG.read(text)
    except DocumentError as exc:
        if exc.reason == DUPLICATE_KEY and exc.problems:
            raise ConfigInvalid(
                list(exc.problems), hint="Remove all but one of each key named above."
            ) from None
        raise


def _read_bytes(chosen: Path) -> bytes:
    """The file's bytes, after checking without blocking that it is a regular file of at most MAX_BYTES: a
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
    return data


def read_mapping(chosen: Path) -> dict[str, Any]:
    """The config file's top-level mapping; an empty file (or only comments) is `{}`."""
    try:
        loaded = load_strict(_read_bytes(chosen))
    except FileNotFoundError:
        raise ConfigError(f"{chosen}: no such config file") from None
    except DocumentError as exc:
        if exc.reason == "WRONG_TYPE":
            raise ConfigError(f"{chosen}: the top level must be a mapping of keys") from None
        raise ConfigError(f"{chosen}: {exc.message}", hint=_HINTS.get(exc.reason)) from None
    except OSError as exc:
        raise ConfigError(f"{chosen}: cannot read ({exc.strerror or exc})") from None
    return {} if loaded is None else dict(loaded)


_HINTS = {
    "NOT_UTF8": "Save the config as plain UTF-8 (no byte-order mark, no NUL bytes).",
    "TOO_DEEP": "A config nests a few levels: check that this is the file you meant.",
    "TOO_MANY": "A config holds a few hundred values: anchors and aliases may not multiply them.",
    "BIG_NUMBER": "Every number in a config fits in a few digits.",
    "NOT_FINITE": "Use a finite number (.inf and .nan are not settings).",
}
