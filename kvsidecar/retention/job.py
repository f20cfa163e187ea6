"""Retention's job (spec §43): `RetentionJob` gathers the inputs of `retention.plan.plan()` from the store
and the disks, applies the plan (files before manifests; in fleet mode only on the leader, each deletion
claimed first) and reports, logging each deletion with its reason and counting it in the metrics.
`delete=False` in the config, or a dry run, only reports."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any, Protocol

import psutil

from kvsidecar.config import RetentionConfig
from kvsidecar.errors import KvError
from kvsidecar.logs import event
from kvsidecar.metrics import Metrics
from kvsidecar.retention.plan import Deletion, Disk, FileInfo, Kind, Policy, limits_exceeded, plan
from kvsidecar.store.naming import Generation, parse_snapshot_name
from kvsidecar.store.snapshots import LooseFile, SnapshotStore

log = logging.getLogger("kvsidecar.retention")


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
        fleet: FleetRetention | None = None,
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
        self.fleet = fleet  # fleet mode: only the leader runs, over the shared store

    def reconfigure(self, config: RetentionConfig) -> None:
        """SIGHUP: the new limits, from the next pass on."""
        self.config, self.policy = config, Policy.from_config(config)

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
        return bool(limits_exceeded(files, self.policy, disks))

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
