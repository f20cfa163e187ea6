"""Snapshot identity and file names (spec §13, §16; Invariant 9).

A snapshot belongs to (server, provider, model, session, credential scope). Its files are named by an opaque
xxh3-128 digest of that identity plus a generation letter: `<32 hex>.a.bin` / `<32 hex>.b.bin`. No
client-supplied string ever reaches a filesystem path; session ids are also validated here, at the edge.

The scope is part of what a session is: one session id under two credentials is two sessions, with their
own keys and snapshots (docs/CLIENTS.md). The operator's scope (`HOOK_SCOPE`: the hook API, and the proxy when
`api.token_file` is set) keeps the key it had before scopes were part of it, so the operator's snapshots
survive the upgrade; any other scope (a proxy client's credential digest) is hashed into the key.
"""

from __future__ import annotations

import functools
import re
import secrets
from dataclasses import dataclass
from typing import Literal

import xxhash

from kvsidecar.errors import BadRequest, InvalidSessionId, KvError

Generation = Literal["a", "b"]
GENERATIONS: tuple[Generation, Generation] = ("a", "b")

_SESSION_ID = re.compile(r"\A[A-Za-z0-9._:@+\-]{1,128}\Z", re.ASCII)
# A credential scope: a name of ours (`hook`, `anon`) or a digest of a client's credential (`k` + hex); never
# client text.
SCOPE = re.compile(r"\A[a-z][a-z0-9]{0,63}\Z", re.ASCII)
HOOK_SCOPE = "hook"  # the operator's scope: the hook API's token (and the proxy's, when it has that token)
_LABEL_MAX = 256
_NAME_VERSION = "kvsidecar-v1"

# Invariant 9: snapshot file names are ours (an xxh3 digest + generation), never a client string.
# Every name read back from disk (a manifest field, a directory listing, a watcher event) must match one
# of these patterns before it is used at all. `\A...\Z` and re.ASCII: no trailing newline, no Unicode
# digits or look-alikes, no separators, no dot-only names, bounded length.
# A generation's file, `<key>.<gen>.bin`; in fleet mode a save is first written under a staging name of the
# same generation, `<key>.<gen>.<8 hex>.bin`, and renamed to the generation's name at its commit.
SNAPSHOT_FILE = re.compile(r"\A(?P<key>[0-9a-f]{32})\.(?P<gen>[ab])(?:\.[0-9a-f]{8})?\.bin\Z", re.ASCII)
MANIFEST_FILE = re.compile(r"\A(?P<key>[0-9a-f]{32})\.json\Z", re.ASCII)
FINGERPRINT_FILE = re.compile(r"\A(?P<digest>[0-9a-f]{16,128})\.json\Z", re.ASCII)
KEY = re.compile(r"\A[0-9a-f]{32}\Z", re.ASCII)


def validate_session_id(session_id: str) -> str:
    if not isinstance(session_id, str) or not _SESSION_ID.match(session_id):
        raise InvalidSessionId("session id must be 1-128 characters from [A-Za-z0-9._:@+-]")
    return session_id


def validate_label(kind: str, value: str) -> str:
    """Provider and model names: free text, but bounded and printable (they are hashed, never a path)."""
    if not isinstance(value, str) or not 0 < len(value) <= _LABEL_MAX or not value.isprintable():
        raise BadRequest(f"{kind} must be 1-{_LABEL_MAX} printable characters")
    return value


def validate_scope(scope: str) -> str:
    """A credential scope is ours (a name, or a digest we made): anything else is a bug upstream."""
    if not isinstance(scope, str) or not SCOPE.match(scope):
        raise BadRequest("not a credential scope")
    return scope


def short_id(session_id: str) -> str:
    """What logs show instead of a session id (spec §45): stable, short, not reversible."""
    return xxhash.xxh3_64_hexdigest(session_id.encode())[:8]


@dataclass(frozen=True, kw_only=True)
class SnapshotIdentity:
    server: str
    provider: str
    model: str
    session_id: str
    scope: str = HOOK_SCOPE  # the credential scope it belongs to (a name of ours or a digest, checked)

    def __post_init__(self) -> None:
        validate_scope(self.scope)

    @functools.cached_property
    def key(self) -> str:
        """The identity's name on disk and in every table: a hash, computed once per identity (the hook path
        reads it several times per call). A frozen dataclass keeps `cached_property` working: it writes the
        instance's `__dict__`, not through `__setattr__`, and the fields alone decide equality. The operator's
        scope adds nothing (its keys are those of before scopes); another scope is one more part, so no key
        of a client's scope can equal an operator's key or another scope's (no part can hold a NUL)."""
        parts: tuple[str, ...] = (_NAME_VERSION, self.server, self.provider, self.model, self.session_id)
        if self.scope != HOOK_SCOPE:
            parts += (f"scope={self.scope}",)
        return xxhash.xxh3_128_hexdigest("\0".join(parts).encode())

    @property
    def short(self) -> str:
        return short_id(self.session_id)

    def filename(self, generation: Generation) -> str:
        return f"{self.key}.{generation}.bin"


def other_generation(generation: Generation | None) -> Generation:
    return "b" if generation == "a" else "a"


def snapshot_filename(key: str, generation: Generation) -> str:
    """The one file name a snapshot identity's generation may have (the manifest cannot choose another)."""
    if not KEY.match(key) or generation not in GENERATIONS:
        raise ValueError("not a snapshot key/generation")
    return f"{key}.{generation}.bin"


def staging_filename(key: str, generation: Generation) -> str:
    """A fresh name a save is written under before its commit renames it (fleet mode): unique, so a stale
    host's llama-server can never write over the file another host committed under the generation's name."""
    return f"{snapshot_filename(key, generation)[:-4]}.{secrets.token_hex(4)}.bin"


def parse_snapshot_name(name: str) -> tuple[str, Generation] | None:
    """(key, generation) when `name` is one of our snapshot file names, else None."""
    m = SNAPSHOT_FILE.match(name) if isinstance(name, str) else None
    if m is None:
        return None
    gen: Generation = "a" if m.group("gen") == "a" else "b"
    return m.group("key"), gen


def managed_key(server: str, *, provider: str, model: str, session_id: str, scope: str) -> str | None:
    """The key of the identity these name, or None when a label or the id is not one (fleet routing asks
    before the acquire that refuses them)."""
    try:
        validate_label("provider", provider)
        validate_label("model", model)
        validate_session_id(session_id)
        identity = SnapshotIdentity(
            server=server, provider=provider, model=model, session_id=session_id, scope=scope
        )
    except KvError:
        return None
    return identity.key
