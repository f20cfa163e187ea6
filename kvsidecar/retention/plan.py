"""Retention's policy (spec §43): `plan()`, a pure function of (files, policy, disks, now), and its inputs.

No I/O, no clock. It returns what to delete and why, in this order:

1. junk, always: generations marked invalid, orphan files (ours by name, in no manifest, older than a grace
   period), stale temp files;
2. expired: every file of a snapshot unused for longer than `max_age_days`, oldest first;
3. least recently used, only while a limit is exceeded (`max_total_bytes`, `max_sessions`, a free-disk
   floor), until each holds with the low watermark: previous generations first, then whole snapshots.

It never selects a file of a protected snapshot (resident in a slot, leased, being saved or restored) nor a
file llama-server may be writing. Golden files (tests/golden/retention/) pin its answers; the job that
gathers the inputs and deletes is `retention.job`.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Literal

from kvsidecar.config import RetentionConfig

Kind = Literal["current", "previous", "invalid", "orphan", "temp"]
Reason = Literal["invalid", "orphan", "temp", "expired", "lru_previous", "lru"]
ORPHAN_GRACE_S = 600.0


@dataclass(frozen=True, kw_only=True)
class FileInfo:
    name: str
    server: str
    bytes: int
    kind: Kind
    last_used_at: float  # the snapshot's last use; the file's mtime for orphans and temp files
    key: str | None = None  # snapshot identity; None for orphans and temp files
    generation: str | None = None
    protected: bool = False


@dataclass(frozen=True, kw_only=True)
class Disk:
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True, kw_only=True)
class Policy:
    max_total_bytes: int | None = None
    max_sessions: int | None = None
    max_age_s: float | None = None
    min_free_bytes: int | None = None
    min_free_percent: float | None = None
    low_watermark: float = 0.9
    orphan_grace_s: float = ORPHAN_GRACE_S

    @classmethod
    def from_config(cls, cfg: RetentionConfig) -> Policy:
        return cls(
            max_total_bytes=cfg.max_total_bytes,
            max_sessions=cfg.max_sessions,
            max_age_s=cfg.max_age_days * 86400 if cfg.max_age_days is not None else None,
            min_free_bytes=cfg.min_free_bytes,
            min_free_percent=cfg.min_free_percent,
            low_watermark=cfg.low_watermark,
        )

    def floor(self, disk: Disk) -> int | None:
        return free_floor_bytes(
            total_bytes=disk.total_bytes,
            min_free_bytes=self.min_free_bytes,
            min_free_percent=self.min_free_percent,
        )


def free_floor_bytes(
    *, total_bytes: int, min_free_bytes: int | None, min_free_percent: float | None
) -> int | None:
    """The free space retention keeps on a disk of `total_bytes`: the larger of the two settings, a
    percentage rounded up to a whole byte. None when neither is set. The one rule: retention's plan and
    the doctor's disk check both use it."""
    floors = [f for f in (min_free_bytes,) if f is not None]
    if min_free_percent is not None:
        floors.append(math.ceil(total_bytes * min_free_percent / 100))
    return max(floors) if floors else None


@dataclass(frozen=True, kw_only=True)
class Deletion:
    file: FileInfo
    reason: Reason


@dataclass(kw_only=True)
class Plan:
    deletions: list[Deletion] = field(default_factory=list)
    bytes_before: int = 0
    bytes_after: int = 0
    sessions_before: int = 0
    sessions_after: int = 0
    unmet: list[str] = field(default_factory=list)  # limits still exceeded (only protected files left)

    @property
    def freed_bytes(self) -> int:
        return sum(d.file.bytes for d in self.deletions)


class _State:
    """Usage while the plan is built: what is still kept. Every update is O(1), so a plan over 10,000
    snapshots stays linear."""

    def __init__(self, files: list[FileInfo], disks: dict[str, Disk]) -> None:
        self.kept: dict[str, FileInfo] = {f"{f.server}/{f.name}": f for f in files}
        self.free = {s: d.free_bytes for s, d in disks.items()}
        self.total = sum(f.bytes for f in files)
        self.by_key: dict[str, list[FileInfo]] = {}
        self.live: dict[str, int] = {}  # key -> kept current/previous files
        for f in files:
            if f.key is not None:
                self.by_key.setdefault(f.key, []).append(f)
                if f.kind in ("current", "previous"):
                    self.live[f.key] = self.live.get(f.key, 0) + 1

    def has(self, f: FileInfo) -> bool:
        return f"{f.server}/{f.name}" in self.kept

    def remove(self, f: FileInfo, plan: Plan, reason: Reason) -> None:
        del self.kept[f"{f.server}/{f.name}"]
        self.total -= f.bytes
        self.free[f.server] = self.free.get(f.server, 0) + f.bytes
        if f.key is not None and f.kind in ("current", "previous"):
            self.live[f.key] -= 1
            if not self.live[f.key]:
                del self.live[f.key]
        plan.deletions.append(Deletion(file=f, reason=reason))

    @property
    def sessions(self) -> int:
        return len(self.live)


def plan(files: Iterable[FileInfo], policy: Policy, disks: dict[str, Disk], now: float) -> Plan:
    """What to delete, and why. Pure: same inputs, same plan."""
    ordered = sorted(files, key=lambda f: (f.last_used_at, f.name))
    st = _State(ordered, disks)
    out = Plan(bytes_before=st.total, sessions_before=st.sessions)
    for f in ordered:  # 1. junk
        if f.protected:
            continue
        if f.kind == "invalid" or (
            f.kind in ("orphan", "temp") and now - f.last_used_at >= policy.orphan_grace_s
        ):
            st.remove(f, out, "invalid" if f.kind == "invalid" else f.kind)
    if policy.max_age_s is not None:  # 2. expired, oldest first (ordered is by last use)
        for f in ordered:
            expired = f.key is not None and now - f.last_used_at > policy.max_age_s
            if expired and not f.protected and st.has(f):
                st.remove(f, out, "expired")
    _lru(st, ordered, out, policy, disks)
    out.bytes_after, out.sessions_after = st.total, st.sessions
    return out


def _over(st: _State, policy: Policy, disks: dict[str, Disk], *, target: bool) -> list[str]:
    """Limits exceeded now (target=False: the limits themselves; True: with the low watermark)."""
    lw = policy.low_watermark if target else 1.0
    over = []
    if policy.max_total_bytes is not None and st.total > policy.max_total_bytes * lw:
        over.append("max_total_bytes")
    if policy.max_sessions is not None and st.sessions > (
        math.floor(policy.max_sessions * lw) if target else policy.max_sessions
    ):
        over.append("max_sessions")
    for server, disk in disks.items():
        floor = policy.floor(disk)
        if floor is not None and st.free.get(server, disk.free_bytes) < (floor / lw):
            over.append(f"min_free:{server}")
    return over


def _lru(st: _State, ordered: list[FileInfo], out: Plan, policy: Policy, disks: dict[str, Disk]) -> None:
    """3. while a limit is exceeded: previous generations first, then whole snapshots, least recent first."""
    if not _over(st, policy, disks, target=False):
        return
    for stage in ("previous", "current"):
        for f in ordered:
            over = _over(st, policy, disks, target=True)
            if not over:
                return
            if f.protected or f.kind != stage or not st.has(f) or not _helps(f, over):
                continue
            if stage == "previous":
                st.remove(f, out, "lru_previous")
            else:  # a whole snapshot goes: its current and any previous generation
                for g in st.by_key.get(f.key or "", [f]):
                    if st.has(g):
                        st.remove(g, out, "lru")
    out.unmet = _over(st, policy, disks, target=False)


def _helps(f: FileInfo, over: list[str]) -> bool:
    """Would deleting f move an exceeded limit? A previous generation does not change the snapshot count."""
    sessions = f.kind == "current" and "max_sessions" in over
    return sessions or "max_total_bytes" in over or f"min_free:{f.server}" in over


def limits_exceeded(files: Iterable[FileInfo], policy: Policy, disks: dict[str, Disk]) -> list[str]:
    """The limits the files break now, before any deletion (the cheap check after a save)."""
    return _over(_State(list(files), disks), policy, disks, target=False)
