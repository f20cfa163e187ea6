"""Just enough of the GGUF format to read a model's metadata keys and tensor names (no tensor data),
without extra dependencies.

Used by `doctor` and `memory_class` to tell what kind of memory a model has (sliding-window layers,
recurrent layers), and by the carry-over of snapshots across builds. Every count and length read from the
file is bounded before it is used: a hostile or truncated file raises `GgufError`, never a huge allocation.
"""

from __future__ import annotations

import struct
from collections.abc import Collection
from dataclasses import dataclass, field
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
_MAX_ARRAY_KEPT = 1 << 16  # a per-layer array has one item a layer; a longer one is not decoded
_MAX_TENSORS = 1 << 20
_MAX_DIMS = 8  # GGML_MAX_DIMS is 4; anything past 8 is not a GGUF written by llama.cpp's tools


class GgufError(ValueError):
    pass


@dataclass(frozen=True)
class GgufFile:
    """Metadata (scalars, strings and the arrays asked for), the keys of every array, and the tensors'
    names and dimensions (ggml order, innermost first) when asked for."""

    meta: dict[str, Any]
    array_keys: frozenset[str]
    tensors: dict[str, tuple[int, ...]] = field(default_factory=dict)


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
    raw = f.read(n)
    if len(raw) != n:
        raise GgufError("truncated GGUF string")
    return raw.decode("utf-8", errors="replace")


def _value(f: IO[bytes], vtype: int, *, keep: bool) -> Any:
    if vtype in _SCALARS:
        return _read(f, _SCALARS[vtype])
    if vtype == _STRING:
        return _string(f)
    if vtype == _ARRAY:
        itype, count = _read(f, "<I"), _read(f, "<Q")
        if count > 1 << 40:
            raise GgufError("implausible array length")
        if itype in _SCALARS and not keep:  # skip big arrays (token scores) without decoding them
            f.seek(struct.calcsize(_SCALARS[itype]) * count, 1)
            return None
        if keep and (count > _MAX_ARRAY_KEPT or itype not in _SCALARS):
            raise GgufError("an array asked for is not a short list of numbers")
        items = [_value(f, itype, keep=keep) for _ in range(count)]
        return items if keep else None
    raise GgufError(f"unknown GGUF value type {vtype}")


def read_gguf(
    path: Path,
    *,
    arrays: Collection[str] = (),
    array_suffixes: tuple[str, ...] = (),
    tensors: bool = False,
    max_keys: int = 4096,
) -> GgufFile:
    """The metadata of a GGUF file; the arrays named in `arrays`, or whose key ends with `.` and one of
    `array_suffixes`, decoded (each a list of numbers, at most 65,536 of them), the others only listed;
    with `tensors`, every tensor's name and dimensions."""
    suffixes = tuple("." + s for s in array_suffixes)
    with path.open("rb") as f:
        if f.read(4) != b"GGUF":
            raise GgufError(f"{path.name} is not a GGUF file")
        version = _read(f, "<I")
        if version < 2:
            raise GgufError(f"GGUF version {version} is not supported")
        n_tensors = _read(f, "<Q")
        n_kv = _read(f, "<Q")
        if n_kv > max_keys or n_tensors > _MAX_TENSORS:
            raise GgufError("implausible metadata key or tensor count")
        meta: dict[str, Any] = {}
        array_keys: set[str] = set()
        for _ in range(n_kv):
            key = _string(f)
            vtype = _read(f, "<I")
            keep = vtype == _ARRAY and (key in arrays or (bool(suffixes) and key.endswith(suffixes)))
            value = _value(f, vtype, keep=keep)
            if vtype == _ARRAY:
                array_keys.add(key)
            if value is not None:
                meta[key] = value
        infos = _tensor_infos(f, n_tensors) if tensors else {}
        return GgufFile(meta=meta, array_keys=frozenset(array_keys), tensors=infos)


def _tensor_infos(f: IO[bytes], n_tensors: int) -> dict[str, tuple[int, ...]]:
    out: dict[str, tuple[int, ...]] = {}
    for _ in range(n_tensors):
        name = _string(f)
        n_dims = _read(f, "<I")
        if not 1 <= n_dims <= _MAX_DIMS:
            raise GgufError(f"tensor {name[:64]!r} has {n_dims} dimensions")
        dims = tuple(_read(f, "<Q") for _ in range(n_dims))
        _read(f, "<I")  # type
        _read(f, "<Q")  # offset
        if name in out:
            raise GgufError(f"tensor {name[:64]!r} is listed twice")
        out[name] = dims
    return out


def read_metadata(path: Path, *, max_keys: int = 4096, arrays: set[str] | None = None) -> dict[str, Any]:
    """Scalar and string metadata of a GGUF file (arrays are skipped; their keys are added to `arrays`
    when given, so a caller can tell that one is present)."""
    info = read_gguf(path, max_keys=max_keys)
    if arrays is not None:
        arrays.update(info.array_keys)
    return info.meta


def sliding_window(meta: dict[str, Any]) -> int | None:
    arch = meta.get("general.architecture")
    value = meta.get(f"{arch}.attention.sliding_window") if isinstance(arch, str) else None
    return int(value) if isinstance(value, int) and value > 0 else None
