"""Snapshot manifests (spec §14, §39-41): one small JSON file per snapshot identity, in the state directory.

A manifest records, per generation (`a`/`b`), what the save produced: file name, tokens, bytes on disk,
checksum, state-file format version and the runtime fingerprint it was saved under, and which generation
is current. The `.bin` files themselves live in the server's snapshot directory. Decoding never raises
anything but `ManifestInvalid`; writing goes only through `atomic_write_bytes`.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from kvsidecar.errors import ManifestInvalid
from kvsidecar.store.atomic import atomic_write_bytes
from kvsidecar.store.naming import GENERATIONS, Generation, SnapshotIdentity

SCHEMA_VERSION = 1


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
        )

    @property
    def identity(self) -> SnapshotIdentity:
        return SnapshotIdentity(
            server=self.server, provider=self.provider, model=self.model, session_id=self.session_id
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
            data = json.loads(raw)
            if not isinstance(data, dict) or data.get("schema") != SCHEMA_VERSION:
                raise ManifestInvalid(
                    f"{source}: unknown schema {data.get('schema') if isinstance(data, dict) else None}"
                )
            gens = data.pop("generations", {})
            if not isinstance(gens, dict) or not set(gens) <= set(GENERATIONS):
                raise ManifestInvalid(f"{source}: bad generations")
            records = {g: GenerationRecord(**r) for g, r in gens.items()}
            manifest = cls(generations=records, **data)
        except ManifestInvalid:
            raise
        except (ValueError, TypeError, AttributeError) as exc:
            raise ManifestInvalid(f"{source}: {type(exc).__name__}: {str(exc)[:120]}") from None
        if manifest.current is not None and manifest.current not in records:
            raise ManifestInvalid(f"{source}: current generation {manifest.current!r} has no record")
        if manifest.identity.key != manifest.key:
            raise ManifestInvalid(f"{source}: key does not match its identity")
        return manifest


def manifest_path(directory: Path, key: str) -> Path:
    return directory / f"{key}.json"


def write_manifest(directory: Path, manifest: Manifest, *, durable: bool = True) -> None:
    atomic_write_bytes(manifest_path(directory, manifest.key), manifest.to_json(), durable=durable)


def read_manifest(path: Path) -> Manifest:
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise ManifestInvalid(f"{path.name}: cannot read ({exc.strerror})") from None
    manifest = Manifest.from_json(raw, source=path.name)
    if path.stem != manifest.key:
        raise ManifestInvalid(f"{path.name}: file name does not match its key")
    return manifest
