"""Snapshots carried over a llama.cpp upgrade (issue 29): when a snapshot saved under one build may be
restored under another, and the proof that the two compute the same KV.

A new build changes the fingerprint's build components (`build_info`, `server_binary`, `server_libs`) and
often the state-file format, while computing exactly the same KV. A snapshot of the old build is carried
over only when everything else in the fingerprint is equal (model, every KV-relevant flag, environment,
config files: `build_only_difference`) and two behavioural proofs hold, both bit-exact:

- the runtime canary (the KV of a fixed prompt, digested independently of the file format,
  `state_format.kv_digest`) is the same under both builds;
- the first rows of a real snapshot: the new build computes the KV of the snapshot's first tokens, and every
  K and V byte of those positions equals the snapshot's (`rows_match`). The canary is short and fixed; this
  is the user's own model on the user's own text, at the lengths a session has.

The verdict for a pair of fingerprints (old, new) is recorded once (`Verdicts`, in the state directory) and
serves every snapshot of the old runtime. Anything unproven stays unrestorable, as before.
"""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import BinaryIO

from kvsidecar.errors import KvError
from kvsidecar.files.atomic import atomic_write_at
from kvsidecar.files.confined import DirAnchor
from kvsidecar.files.documents import CARRY_VERDICTS, DocumentError
from kvsidecar.logs import event
from kvsidecar.store.state_format import (
    LayerKV,
    StateFormatError,
    StateLayout,
    Stream,
    parse,
    text_tokens,
)

log = logging.getLogger("kvsidecar.store")
BUILD_COMPONENTS = frozenset({"build_info", "server_binary", "server_libs"})
CANARY = "canary_kv"
_UNMEASURED = frozenset({"", "absent", "pending", "unknown", "none"})
_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
ROWS_TO_PROVE = 256  # positions recomputed under the new build: a few hundred tokens of the real session


def build_only_difference(old: Mapping[str, str], new: Mapping[str, str]) -> str | None:
    """None when `old` and `new` differ only in build components and carry the same measured canary;
    else why a snapshot of `old` cannot be carried over to `new`."""
    differing = {k for k in set(old) | set(new) if old.get(k) != new.get(k)}
    if not differing:
        return "the same runtime"
    other = sorted(differing - BUILD_COMPONENTS)
    if other:
        return "differs beyond the build: " + ", ".join(other[:5])
    canary = new.get(CANARY)
    if canary is None or canary in _UNMEASURED or old.get(CANARY) != canary:
        return "no runtime canary measured under both builds"
    return None


@dataclass(frozen=True, kw_only=True)
class RowsProof:
    equal: bool
    rows: int  # positions compared
    detail: str


def _rows_by_position(stream: Stream) -> dict[int, int]:
    return {pos: i for i, pos in enumerate(stream.positions)}


def _read(f: BinaryIO, offset: int, n: int) -> bytes:
    f.seek(offset)
    data = f.read(n)
    if len(data) != n:
        raise StateFormatError("STATE_TRUNCATED", "the file shrank while it was compared")
    return data


def rows_match(old: BinaryIO, new: BinaryIO, *, rows: int = ROWS_TO_PROVE) -> RowsProof:
    """Do the K and V bytes of positions 0..rows-1 agree between two state files (any known format)?

    Both must be one stream of one plain cache whose first positions are 0, 1, 2, ... in order, with the same
    layer layout and cache types; anything else is not a proof."""
    try:
        a, b = parse(old), parse(new)
    except StateFormatError as e:
        return RowsProof(equal=False, rows=0, detail=f"not comparable: {e.code}")
    return _compare(old, a, new, b, rows)


def _compare(old: BinaryIO, a: StateLayout, new: BinaryIO, b: StateLayout, rows: int) -> RowsProof:
    if len(a.streams) != 1 or len(b.streams) != 1:
        return RowsProof(equal=False, rows=0, detail="not one stream each")
    sa, sb = a.streams[0], b.streams[0]
    n = min(rows, sa.cell_count, sb.cell_count)
    why = _not_comparable(a, b, n)
    if why is not None:
        return RowsProof(equal=False, rows=0, detail=why)
    for la, lb in zip(sa.layers, sb.layers, strict=True):
        if _read(old, la.k_offset, n * la.k_row) != _read(new, lb.k_offset, n * lb.k_row):
            return RowsProof(equal=False, rows=n, detail="K differs")
        if not _same_v(old, new, sa, sb, la, lb, n):
            return RowsProof(equal=False, rows=n, detail="V differs")
    return RowsProof(equal=True, rows=n, detail=f"{n} positions bit-identical in every layer")


def _not_comparable(a: StateLayout, b: StateLayout, n: int) -> str | None:
    sa, sb = a.streams[0], b.streams[0]
    if n < 1 or sa.positions[:n] != tuple(range(n)) or sb.positions[:n] != tuple(range(n)):
        return "the first positions are not 0..n-1 in order"
    if sa.v_trans != sb.v_trans or sa.n_layer != sb.n_layer:
        return "another cache layout"
    try:
        if text_tokens(a)[:n] != text_tokens(b)[:n]:
            return "other tokens"
    except StateFormatError as e:
        return f"not comparable: {e.code}"
    for la, lb in zip(sa.layers, sb.layers, strict=True):
        if (la.k_type, la.k_row, la.v_type, la.v_row) != (lb.k_type, lb.k_row, lb.v_type, lb.v_row):
            return "other cache types or row sizes"
    return None


def _same_v(old: BinaryIO, new: BinaryIO, sa: Stream, sb: Stream, la: LayerKV, lb: LayerKV, n: int) -> bool:
    if not sa.v_trans:
        return _read(old, la.v_offset, n * la.v_row) == _read(new, lb.v_offset, n * lb.v_row)
    el = la.v_row // max(1, la.v_embd)
    for j in range(la.v_embd):  # transposed V: one run of cells per embedding element
        va = _read(old, la.v_offset + j * sa.cell_count * el, n * el)
        if va != _read(new, lb.v_offset + j * sb.cell_count * el, n * el):
            return False
    return True


class Verdicts:
    """Which (old fingerprint, new fingerprint) pairs were proven to compute the same KV, or not.

    Kept in `<state_dir>/build-equivalence.json`, read and written only inside the held state directory
    (never through its path, never through a link at the name); a record that does not parse counts as no
    verdict, so the proof runs again: whatever the file holds (nested 600,000 deep, a huge number, not UTF-8),
    the one document reader refuses it as a `DocumentError`, never a `RecursionError` that would fail every
    acquire needing a carry-over, across restarts. The next verdict recorded replaces the file."""

    NAME = "build-equivalence.json"
    MAX_BYTES = CARRY_VERDICTS.max_bytes
    MAX_ENTRIES = 1024

    def __init__(self, directory: DirAnchor) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._verdicts: dict[str, dict[str, object]] = self._load()

    @staticmethod
    def key(old: str, new: str) -> str:
        return f"{old}>{new}"

    def _load(self) -> dict[str, dict[str, object]]:
        try:
            with self.directory.fd() as dfd:
                fd = os.open(
                    self.NAME, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd
                )
        except (OSError, KvError):
            return {}
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                return {}
            data = os.read(fd, self.MAX_BYTES + 1)
        except OSError:
            return {}
        finally:
            os.close(fd)
        try:
            raw = CARRY_VERDICTS.read(data)
        except DocumentError as exc:
            event(
                log, logging.WARNING, "kv.carry_over.verdicts_ignored", reason=exc.reason, error=exc.message
            )
            return {}
        out: dict[str, dict[str, object]] = {}
        for k, v in list(raw.items())[: self.MAX_ENTRIES]:
            if (
                isinstance(k, str)
                and len(k) <= 200
                and isinstance(v, dict)
                and isinstance(v.get("equal"), bool)
            ):
                rows = v.get("rows")
                out[k] = {"equal": v["equal"], "rows": rows if isinstance(rows, int) else 0}
        return out

    def get(self, old: str, new: str, *, min_rows: int = 1) -> bool | None:
        """The verdict for the pair; None where there is none, or where "equal" rests on fewer than
        `min_rows` positions (a proof on a short snapshot does not vouch for a longer one's rows)."""
        with self._lock:
            v = self._verdicts.get(self.key(old, new))
        if v is None:
            return None
        rows = v["rows"]
        if v["equal"] and (not isinstance(rows, int) or rows < min_rows):
            return None
        return bool(v["equal"])

    def rows(self, old: str, new: str) -> int | None:
        """The rows an "equal" verdict for the pair rests on (None: no such verdict): for the trust rule."""
        with self._lock:
            v = self._verdicts.get(self.key(old, new))
        if v is None or v["equal"] is not True or not isinstance(v["rows"], int):
            return None
        return v["rows"]

    def record(self, old: str, new: str, proof: RowsProof) -> None:
        """Remember the verdict, durably (call off the event loop; threads of two carry-overs serialize)."""
        with self._lock:
            self._verdicts[self.key(old, new)] = {"equal": proof.equal, "rows": proof.rows}
            while len(self._verdicts) > self.MAX_ENTRIES:
                self._verdicts.pop(next(iter(self._verdicts)))
            data = json.dumps(self._verdicts, sort_keys=True).encode()
            self.directory.ensure()
            with self.directory.fd() as dfd:
                atomic_write_at(dfd, self.NAME, data)
