"""Snapshot manifests (spec §14, §39-41): one small JSON file per snapshot identity, in the state directory.

A manifest records, per generation (`a`/`b`), what the save produced: file name, tokens, bytes on disk,
checksum, state-file format version and the runtime fingerprint it was saved under, and which generation
is current. The `.bin` files themselves live in the server's snapshot directory. Writing goes only through
`atomic_write_bytes`.

A manifest on disk is hostile input. Reading it: a plain regular file of ours (no link, FIFO, ...), at
most `MAX_BYTES`, nested at most `MAX_DEPTH` deep (checked before any parser runs), then a strict schema
(types are not coerced: `"tokens": "958"` is refused; unknown fields are refused). Each generation's
`filename` must be exactly the name derived from the manifest's own key and that generation, so a
manifest can never point at a file outside the snapshot directory or at another session's file.
Decoding never raises anything but `BadManifest` (a `ManifestInvalid`) with a stable `reason`.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StringConstraints, ValidationError

from kvsidecar.errors import ManifestInvalid
from kvsidecar.files.atomic import atomic_write_bytes
from kvsidecar.files.confined import read_capped
from kvsidecar.files.documents import MANIFEST, DocumentError
from kvsidecar.files.limits import NOT_JSON as _DOC_NOT_JSON
from kvsidecar.files.limits import NOT_UTF8, VALUE_REASONS
from kvsidecar.files.limits import TOO_DEEP as _DOC_TOO_DEEP
from kvsidecar.store.naming import GENERATIONS, HOOK_SCOPE, Generation, SnapshotIdentity, snapshot_filename

SCHEMA_VERSION = 1
MAX_BYTES = MANIFEST.max_bytes  # a real manifest is under 2 KB
MAX_DEPTH = MANIFEST.max_depth  # {"generations": {"a": {...}}} is 3

# Stable reasons a manifest file is refused (logged, and reported by status/doctor).
UNREADABLE = "MANIFEST_UNREADABLE"
NOT_REGULAR = "MANIFEST_NOT_REGULAR"
TOO_LARGE = "MANIFEST_TOO_LARGE"
TOO_DEEP = "MANIFEST_TOO_DEEP"
NOT_JSON = "MANIFEST_NOT_JSON"
SCHEMA = "MANIFEST_SCHEMA"
KEY_MISMATCH = "MANIFEST_KEY_MISMATCH"
BAD_FILENAME = "MANIFEST_BAD_FILENAME"
BAD_NAME = "MANIFEST_BAD_NAME"


class BadManifest(ManifestInvalid):
    """A manifest that is refused as a whole; `reason` is one of the codes above."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(f"{reason}: {message}")
        self.reason = reason


_Hex32 = Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{32}$")]
_Count = Annotated[int, Field(ge=0, le=2**63 - 1)]
_Time = Annotated[float, Field(ge=0, allow_inf_nan=False)]


def _printable(value: str) -> str:
    if not value.isprintable():
        raise ValueError("must be printable")
    return value


_Label = Annotated[str, StringConstraints(min_length=1, max_length=256), AfterValidator(_printable)]


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid", frozen=True)


class _RecordSchema(_Strict):
    filename: Annotated[str, StringConstraints(max_length=64)]
    tokens: _Count
    header_tokens: _Count
    bytes: _Count
    checksum: Annotated[str, StringConstraints(pattern=r"^xxh3-128:[0-9a-f]{32}$")] | None
    format_version: Annotated[int, Field(ge=0, le=2**32 - 1)]
    fingerprint: Annotated[str, StringConstraints(pattern=r"^[0-9a-f]{16,128}$")]
    saved_at: _Time
    revision: _Count
    invalid_reason: Annotated[str, StringConstraints(pattern=r"^[A-Z][A-Z0-9_]{0,63}$")] | None = None


class _ManifestSchema(_Strict):
    key: _Hex32
    server: _Label
    provider: _Label
    model: _Label
    session_id: Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9._:@+\-]{1,128}$")]
    created_at: _Time
    updated_at: _Time
    last_used_at: _Time
    current: Literal["a", "b"] | None = None
    generations: dict[Literal["a", "b"], _RecordSchema] = Field(default_factory=dict)
    session_seq: Annotated[int, Field(ge=0, le=2**63 - 1)] | None = None
    scope: Annotated[str, StringConstraints(pattern=r"^[a-z][a-z0-9]{0,63}$")] | None = None
    schema_: Literal[1] = Field(alias="schema")


@dataclass(frozen=True, kw_only=True)
class GenerationRecord:
    filename: str
    tokens: int  # what the server reported saving (and will report restoring)
    header_tokens: int  # the token count in the file header (llama.cpp counts differently: keep both)
    bytes: int
    checksum: str | None  # "xxh3-128:<hex>" of the whole file, computed after the save
    format_version: int
    fingerprint: str
    saved_at: float
    revision: int
    invalid_reason: str | None = None

    @property
    def valid(self) -> bool:
        return self.invalid_reason is None


@dataclass(frozen=True, kw_only=True)
class Manifest:
    key: str
    server: str
    provider: str
    model: str
    session_id: str
    created_at: float
    updated_at: float
    last_used_at: float
    current: Generation | None = None
    generations: dict[str, GenerationRecord] = field(default_factory=dict)
    session_seq: int | None = None
    # The credential scope of the session, recorded at each save. None: a manifest written before scopes were
    # recorded; its key is the operator's (`HOOK_SCOPE`), so only the operator's sessions can reach it, and
    # it is never a prefix donor (its real scope is unknown).
    scope: str | None = None
    schema: int = SCHEMA_VERSION

    @classmethod
    def new(cls, identity: SnapshotIdentity, now: float) -> Manifest:
        return cls(
            key=identity.key,
            server=identity.server,
            provider=identity.provider,
            model=identity.model,
            session_id=identity.session_id,
            created_at=now,
            updated_at=now,
            last_used_at=now,
            scope=identity.scope,
        )

    @property
    def identity(self) -> SnapshotIdentity:
        return SnapshotIdentity(
            server=self.server,
            provider=self.provider,
            model=self.model,
            session_id=self.session_id,
            scope=self.scope if self.scope is not None else HOOK_SCOPE,
        )

    def generation(self, gen: Generation | None) -> GenerationRecord | None:
        return self.generations.get(gen) if gen is not None else None

    def ordered_generations(self) -> list[tuple[Generation, GenerationRecord]]:
        """Current first, then the previous one (the fallback)."""
        order = [g for g in GENERATIONS if g == self.current] + [g for g in GENERATIONS if g != self.current]
        return [(g, self.generations[g]) for g in order if g in self.generations]

    @property
    def total_bytes(self) -> int:
        return sum(r.bytes for r in self.generations.values())

    @property
    def has_valid(self) -> bool:
        return any(r.valid for r in self.generations.values())

    def with_generation(self, gen: Generation, record: GenerationRecord | None, **changes: Any) -> Manifest:
        gens = dict(self.generations)
        if record is None:
            gens.pop(gen, None)
        else:
            gens[gen] = record
        return replace(self, generations=gens, **changes)

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), separators=(",", ":"), sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes, *, source: str = "manifest") -> Manifest:
        try:
            data = _ManifestSchema.model_validate(MANIFEST.read(raw), strict=True)
        except DocumentError as exc:
            raise BadManifest(_refusal(exc.reason), f"{source}: {exc.message}") from None
        except ValidationError as exc:
            raise BadManifest(*_schema_error(exc, source)) from None
        records: dict[str, GenerationRecord] = {
            g: GenerationRecord(**r.model_dump()) for g, r in data.generations.items()
        }
        manifest = cls(
            **data.model_dump(exclude={"generations", "schema_"}), generations=records, schema=data.schema_
        )
        for gen, rec in data.generations.items():
            if rec.filename != snapshot_filename(manifest.key, gen):
                raise BadManifest(BAD_FILENAME, f"{source}: generation {gen} names a file not its own")
        if manifest.current is not None and manifest.current not in records:
            raise BadManifest(SCHEMA, f"{source}: current generation {manifest.current!r} has no record")
        if manifest.identity.key != manifest.key:
            raise BadManifest(KEY_MISMATCH, f"{source}: key does not match its identity")
        return manifest


def _refusal(reason: str) -> str:
    """The manifest's code for what the document reader refused."""
    if reason in (_DOC_NOT_JSON, NOT_UTF8):
        return NOT_JSON
    if reason in VALUE_REASONS:
        return SCHEMA
    return TOO_DEEP if reason == _DOC_TOO_DEEP else TOO_LARGE  # too deep; too large or too many values


def _schema_error(exc: ValidationError, source: str) -> tuple[str, str]:
    err = exc.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or "(top level)"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return SCHEMA, f"{source}: {where}: {err['msg'][:100]}{more}"


def manifest_path(directory: Path, key: str) -> Path:
    return directory / f"{key}.json"


def write_manifest(directory: Path, manifest: Manifest, *, durable: bool = True) -> None:
    atomic_write_bytes(manifest_path(directory, manifest.key), manifest.to_json(), durable=durable)


def read_manifest(path: Path, *, dir_fd: int | None = None) -> Manifest:
    """Read one manifest file: never through a link, never more than MAX_BYTES, never a parse of an
    over-deep document. The file name must be `<key>.json` for the key inside. With `dir_fd`, `path` is
    a plain name in that directory (the store's held manifests directory)."""
    try:
        first = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
        if not stat.S_ISREG(first.st_mode):  # a link, FIFO or device is never even opened
            raise BadManifest(NOT_REGULAR, f"{path.name[:40]}: not a regular file")
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as exc:
        reason = NOT_REGULAR if exc.errno == errno.ELOOP else UNREADABLE
        raise BadManifest(reason, f"{path.name[:40]}: cannot open ({exc.strerror})") from None
    try:
        st = os.fstat(fd)
        if not _is_plain_file(st):
            raise BadManifest(NOT_REGULAR, f"{path.name[:40]}: not a plain regular file of ours")
        if st.st_size > MAX_BYTES:
            raise BadManifest(TOO_LARGE, f"{path.name[:40]}: {st.st_size} bytes > {MAX_BYTES}")
        raw = read_capped(fd, MAX_BYTES)
    except OSError as exc:
        raise BadManifest(UNREADABLE, f"{path.name[:40]}: cannot read ({exc.strerror})") from None
    finally:
        os.close(fd)
    manifest = Manifest.from_json(raw, source=path.name[:40])
    if path.name != f"{manifest.key}.json":
        raise BadManifest(KEY_MISMATCH, f"{path.name[:40]}: file name does not match its key")
    return manifest


def _is_plain_file(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_nlink == 1 and st.st_uid == os.geteuid()
