"""The value types of config keys, shared by every section: sizes (`Bytes`), paths (`PathValue`, `~` and
`$VARS` expanded), URLs (`BaseUrl`) and listen addresses (`ListenAddress`), and `Section`, the frozen,
keyword-only base every section model derives from (an unknown key is an error)."""

from __future__ import annotations

import copy
import os
import re
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
)
from pydantic.json_schema import JsonSchemaValue

# The spellings a size may take: a number and an optional unit, K/M/G/T/P/E (powers of 1000) or
# Ki/Mi/Gi/Ti/Pi/Ei (powers of 1024), with or without a trailing B, any case, spaces allowed around the unit.
# pydantic's ByteSize does the arithmetic; this pattern is stricter than its own, which takes the leading
# number of "1.5.3GB" or "5.GB", any Unicode digit, and bit units ("1Gbit").
_SIZE = re.compile(r"\A\s*(\d+(?:\.\d+)?)\s*(?:([KMGTPE])(I)?B?|B)?\s*\Z", re.IGNORECASE | re.ASCII)


def size_spelling(value: object) -> object:
    """Accept 123, "100GB", "1.5GiB", "512M", "512Mi"; hand ByteSize its own spelling of them."""
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"not a size: {value!r} (a whole number of bytes, or e.g. 100GB)")
    if isinstance(value, int | float) and value < 0:
        raise ValueError(f"not a size: {value!r} (sizes are never negative)")
    if isinstance(value, str):
        m = _SIZE.match(value)
        if not m:
            raise ValueError(f"not a size: {value!r} (use e.g. 100GB, 512MiB or a number of bytes)")
        number, prefix, binary = m.groups()
        return f"{number}{prefix or ''}{'i' if binary else ''}B"
    return value


def expand_path(value: object) -> object:
    if isinstance(value, str | Path):
        return Path(os.path.expandvars(os.path.expanduser(str(value))))
    return value


# The JSON Schema of a size: what size_spelling() takes, as an ECMA-262 pattern (for editors).
_SIZE_SCHEMA: JsonSchemaValue = {
    "anyOf": [
        {"type": "integer", "minimum": 0},
        {"type": "string", "pattern": r"^\s*\d+(\.\d+)?\s*([KMGTPEkmgtpe][Ii]?[Bb]?|[Bb])?\s*$"},
    ]
}


class _SizeJsonSchema:
    """Annotated metadata: the schema above, a fresh copy each time (pydantic 2.6 edits what it is given)."""

    def __get_pydantic_json_schema__(self, _core: Any, _handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return copy.deepcopy(_SIZE_SCHEMA)


Bytes = Annotated[ByteSize, BeforeValidator(size_spelling), Field(ge=0), _SizeJsonSchema()]
PathValue = Annotated[Path, BeforeValidator(expand_path)]


def home_path(text: str) -> Any:
    """A default under ~: expanded when a config is built, shown as written in the JSON Schema."""
    return Field(default=Path(text), validate_default=True)


# A config section: frozen once built, and a key it does not know is an error.
class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def _http_url(value: str) -> str:
    if not re.match(r"^https?://[^/\s]+", value):
        raise ValueError(f"must be an http(s) URL, got {value!r}")
    return value


BaseUrl = Annotated[str, AfterValidator(_http_url)]


def _listen_address(value: str) -> str:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"must be HOST:PORT, got {value!r}")
    return value


ListenAddress = Annotated[str, AfterValidator(_listen_address)]
