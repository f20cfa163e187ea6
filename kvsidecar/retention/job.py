"""Retention (spec §43): a pure policy and the job that applies it.

`plan()` is a pure function of (files, policy, disks, now): no I/O, no clock. It returns what to delete and
why, in this order:

1. junk, always: generations marked invalid, orphan files (ours by name, in no manifest, older than a grace
   period), stale temp files;
2. expired: every file of a snapshot unused for longer than `max_age_days`, oldest first;
3. least recently used, only while a limit is exceeded (`max_total_bytes`, `max_sessions`, a free-disk
   floor), until each holds with the low watermark: previous generations first, then whole snapshots.

It never selects a file of a protected snapshot (resident in a slot, leased, being saved or restored) nor a
file llama-server may be writing. `RetentionJob` gathers the inputs, calls `plan()`, deletes (files before
manifests) and reports; `delete=False` in the config, or a dry run, only reports.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

import psutil

from kvsidecar.config import RetentionConfig
from kvsidecar.errors import KvError
from kvsidecar.logs import event
from kvsidecar.metrics import Metrics
from kvsidecar.store.naming import Generation, parse_snapshot_name
from kvsidecar.store.snapshots import LooseFile, SnapshotStore

log = logging.getLogger("kvsidecar.retention")

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


# the job ---------------------------------------------------------------------------------------------


class RetentionJob:
    """Gathers the inputs, applies the plan, logs each deletion with its reason, updates metrics."""

    def __init__(
        self,
        *,
        store: SnapshotStore,
        config: RetentionConfig,
        metrics: Metrics,
        protected_keys: Callable[[], set[str]],
        clock: Callable[[], float] = time.time,
        disk_usage: Callable[[Path], Disk] | None = None,
    ) -> None:
        self.store = store
        self.config = config
        self.policy = Policy.from_config(config)
        self.metrics = metrics
        self.protected_keys = protected_keys
        self.clock = clock
        self.disk_usage = disk_usage or _psutil_disk
        self._lock = asyncio.Lock()  # one pass at a time
        self.last_report: dict[str, Any] | None = None
        self.fleet: FleetRetention | None = None  # fleet mode: only the leader runs, over the shared store

    def inventory(self, also_protected: set[str] | None = None) -> tuple[list[FileInfo], dict[str, Disk]]:
        protected = self.protected_keys() | (also_protected or set())
        inflight = self.store.inflight()
        files: list[FileInfo] = []
        for m in self.store.all():
            if m.server not in self.store.snapshot_dirs:
                continue
            for gen, rec in m.generations.items():
                kind: Kind = "invalid" if not rec.valid else "current" if gen == m.current else "previous"
                files.append(
                    FileInfo(
                        name=rec.filename,
                        server=m.server,
                        bytes=rec.bytes,
                        kind=kind,
                        last_used_at=m.last_used_at,
                        key=m.key,
                        generation=gen,
                        protected=m.key in protected or (m.server, rec.filename) in inflight,
                    )
                )
        # Orphans and temp files: the store's one rule (names of ours, unreferenced, not being written,
        # not held by a refused manifest). For temp files `server` is the state area they are in.
        files += [
            FileInfo(name=f.name, server=f.area, bytes=f.bytes, kind=f.kind, last_used_at=f.mtime)
            for f in self.store.loose_files()
        ]
        disks = {s: self.disk_usage(d) for s, d in self.store.snapshot_dirs.items()}
        return files, disks

    def needs_run(self) -> bool:
        """Cheap check after a save: is any limit exceeded right now? (Fleet: only the leader looks.)"""
        if self.fleet is not None and not self.fleet.leads():
            return False
        files, disks = self.inventory()
        return bool(_over(_State(files, disks), self.policy, disks, target=False))

    async def run(self, *, dry_run: bool = False) -> dict[str, Any]:
        async with self._lock:
            fleet_protected: set[str] | None = None
            if self.fleet is not None:
                # fleet: the leader alone, after re-reading the shared manifests; what any live host holds
                # resident or owns is protected like this host's own
                fleet_protected = await self.fleet.prepare()
                if fleet_protected is None:
                    return self._not_leader(dry_run)
            files, disks = await asyncio.to_thread(self.inventory, fleet_protected)
            the_plan = plan(files, self.policy, disks, self.clock())
            deleting = not dry_run and self.config.delete
            done: list[dict[str, Any]] = []
            for d in the_plan.deletions:
                done.append(await self._apply(d, deleting, fleet_protected or set()))
            report = {
                "dry_run": not deleting,
                "deletion_enabled": self.config.delete,
                "deletions": done,
                "freed_bytes": the_plan.freed_bytes if deleting else 0,
                "planned_bytes": the_plan.freed_bytes,
                "bytes_before": the_plan.bytes_before,
                "bytes_after": the_plan.bytes_after,
                "snapshots_before": the_plan.sessions_before,
                "snapshots_after": the_plan.sessions_after,
                "unmet": the_plan.unmet,
                "policy": asdict(self.policy),
            }
            if self.fleet is not None:
                report["fleet"] = "leader"
            if the_plan.unmet:
                event(
                    log,
                    logging.WARNING,
                    "kv.gc.limit_unmet",
                    limits=",".join(the_plan.unmet),
                    hint="only protected (resident or busy) snapshots are left",
                )
            self.last_report = report
            return report

    async def _apply(self, d: Deletion, deleting: bool, fleet_protected: set[str]) -> dict[str, Any]:
        """One planned deletion: re-checked (and, in fleet mode, claimed: its fencing token) first."""
        entry = _describe(d)
        key = d.file.key or _orphan_key(d.file)
        if not deleting:
            return entry
        if d.file.key is not None and d.file.key in self.protected_keys():
            entry["deleted"], entry["skipped"] = False, "became active"
            return entry
        if self.fleet is not None and key is not None:
            if key in fleet_protected:  # an orphan of a session another host holds
                entry["deleted"], entry["skipped"] = False, "held by another host"
                return entry
            if not await self.fleet.claim(key):
                entry["deleted"], entry["skipped"] = False, "owned by another host"
                return entry
        try:
            entry["deleted"] = await asyncio.to_thread(self._delete, d)
        finally:
            if self.fleet is not None and key is not None:
                await self.fleet.done(key)  # let go of the session: its next acquire is placed as usual
        if entry["deleted"]:
            self.metrics.gc_deleted.labels(d.reason).inc()
            self.metrics.gc_deleted_bytes.labels(d.reason).inc(d.file.bytes)
            event(
                log,
                logging.INFO,
                "kv.gc.deleted",
                file=d.file.name[:12],
                server=d.file.server,
                session=entry.get("snapshot"),
                bytes=d.file.bytes,
                reason=d.reason,
            )
        return entry

    def _not_leader(self, dry_run: bool) -> dict[str, Any]:
        """Fleet mode on a host that does not lead: the shared directory is the leader's to clean."""
        return {
            "dry_run": dry_run,
            "deletion_enabled": self.config.delete,
            "deletions": [],
            "freed_bytes": 0,
            "planned_bytes": 0,
            "bytes_before": 0,
            "bytes_after": 0,
            "snapshots_before": 0,
            "snapshots_after": 0,
            "unmet": [],
            "policy": asdict(self.policy),
            "fleet": "not leader",
        }

    def _delete(self, d: Deletion) -> bool:
        f = d.file
        try:
            if f.key is not None and f.generation in ("a", "b"):
                gen: Generation = "a" if f.generation == "a" else "b"
                manifest = self.store.get(f.key)
                if manifest is None or manifest.generation(gen) is None:
                    return False
                self.store.delete_generation(f.key, gen)
                return True
            if f.kind not in ("orphan", "temp"):
                return False
            loose = LooseFile(
                area=f.server,
                name=f.name,
                bytes=f.bytes,
                mtime=f.last_used_at,
                kind="orphan" if f.kind == "orphan" else "temp",
            )
            return self.store.delete_loose(loose)
        except KvError as exc:
            event(
                log,
                logging.WARNING,
                "kv.gc.delete_failed",
                file=f.name[:12],
                code=exc.code,
                error=exc.message,
            )
            return False


class FleetRetention(Protocol):
    async def prepare(self) -> set[str] | None:
        """None: this host does not lead (nothing to do). Else: the shared manifests were re-read, and the
        keys any live host holds resident or owns (never deleted)."""
        ...

    async def claim(self, key: str) -> bool:
        """Take the key's ownership (and its fencing token) before deleting its files; False: another
        host owns it (skip it)."""
        ...

    async def done(self, key: str) -> None:
        """After deleting (or trying to): give the key's ownership back."""
        ...

    def leads(self) -> bool:
        """Whether this host leads now (no Redis call: as of its last heartbeat)."""
        ...


def _orphan_key(f: FileInfo) -> str | None:
    parsed = parse_snapshot_name(f.name) if f.kind == "orphan" else None
    return parsed[0] if parsed is not None else None


def _describe(d: Deletion) -> dict[str, Any]:
    return {
        "file": d.file.name,
        "server": d.file.server,
        "bytes": d.file.bytes,
        "reason": d.reason,
        "kind": d.file.kind,
        "generation": d.file.generation,
        "snapshot": d.file.key[:8] if d.file.key else None,
    }


def _psutil_disk(path: Path) -> Disk:
    usage = psutil.disk_usage(str(path))
    return Disk(total_bytes=usage.total, free_bytes=usage.free)
