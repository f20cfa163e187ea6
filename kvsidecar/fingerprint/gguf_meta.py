"""Just enough of the GGUF format to read a model's metadata keys (no tensors), without extra dependencies.

Used by `doctor` to tell whether a model uses sliding-window attention (then llama-server needs
`--swa-full` for a restored KV cache to be reusable).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import IO, Any

_SCALARS = {
    0: "<B",
    1: "<b",
    2: "<H",
    3: "<h",
    4: "<I",
    5: "<i",
    6: "<f",
    7: "<?",
    10: "<Q",
    11: "<q",
    12: "<d",
}
_STRING, _ARRAY = 8, 9


class GgufError(ValueError):
    pass


def _read(f: IO[bytes], fmt: str) -> Any:
    size = struct.calcsize(fmt)
    raw = f.read(size)
    if len(raw) != size:
        raise GgufError("truncated GGUF header")
    return struct.unpack(fmt, raw)[0]


def _string(f: IO[bytes]) -> str:
    n = _read(f, "<Q")
    if n > 1 << 24:
        raise GgufError("implausible string length")
    return f.read(n).decode("utf-8", errors="replace")


def _value(f: IO[bytes], vtype: int, *, keep: bool) -> Any:
    if vtype in _SCALARS:
        return _read(f, _SCALARS[vtype])
    if vtype == _STRING:
        return _string(f)
    if vtype == _ARRAY:
        itype, count = _read(f, "<I"), _read(f, "<Q")
        if itype in _SCALARS and not keep:  # skip big arrays (token scores) without decoding them
            f.seek(struct.calcsize(_SCALARS[itype]) * count, 1)
            return None
        items = [_value(f, itype, keep=keep) for _ in range(count)]
        return items if keep else None
    raise GgufError(f"unknown GGUF value type {vtype}")


def read_metadata(path: Path, *, max_keys: int = 4096, arrays: set[str] | None = None) -> dict[str, Any]:
    """Scalar and string metadata of a GGUF file (arrays are skipped; their keys are added to `arrays`
    when given, so a caller can tell that one is present)."""
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise GgufError(f"{path.name} is not a GGUF file")
        version = _read(f, "<I")
        if version < 2:
            raise GgufError(f"GGUF version {version} is not supported")
        _read(f, "<Q")  # tensor count
        n_kv = _read(f, "<Q")
        if n_kv > max_keys:
            raise GgufError("implausible metadata key count")
        meta: dict[str, Any] = {}
        for _ in range(n_kv):
            key = _string(f)
            vtype = _read(f, "<I")
            value = _value(f, vtype, keep=False)
            if value is not None:
                meta[key] = value
            elif vtype == _ARRAY and arrays is not None:
                arrays.add(key)
        return meta


def sliding_window(meta: dict[str, Any]) -> int | None:
    arch = meta.get("general.architecture")
    value = meta.get(f"{arch}.attention.sliding_window") if isinstance(arch, str) else None
    return int(value) if isinstance(value, int) and value > 0 else None
