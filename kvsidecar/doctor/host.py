"""Doctor's checks of this host's storage: the state directory is writable, and the snapshot directory's
disk has the free space retention keeps (`retention.plan.free_floor_bytes`, the same rule) and room for
`retention.max_total_bytes`."""

from __future__ import annotations

import secrets
from pathlib import Path

import psutil

from kvsidecar.config import Config, RetentionConfig
from kvsidecar.doctor.report import DoctorReport
from kvsidecar.files.atomic import atomic_write_bytes
from kvsidecar.retention.plan import free_floor_bytes


def state_dir_check(report: DoctorReport, config: Config) -> None:
    probe = config.state_dir / f".doctor.tmp-{secrets.token_hex(4)}"
    try:
        config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        atomic_write_bytes(probe, b"ok")
        probe.unlink()
        report.add("state directory", "OK", f"{config.state_dir} is writable")
    except OSError as exc:
        report.add(
            "state directory",
            "FAIL",
            f"{config.state_dir}: {exc.strerror}",
            "create it and give kvsidecar's user write access",
        )


def disk_check(report: DoctorReport, r: RetentionConfig, directory: Path) -> None:
    """The disk of a server's snapshot `directory` (its parent when it does not exist yet)."""
    try:
        usage = psutil.disk_usage(str(directory if directory.exists() else directory.parent))
    except OSError as exc:
        report.add("disk", "WARN", f"cannot read disk usage of {directory}: {exc.strerror}")
        return
    floor = (
        free_floor_bytes(
            total_bytes=usage.total, min_free_bytes=r.min_free_bytes, min_free_percent=r.min_free_percent
        )
        or 0
    )
    detail = f"{usage.free / 2**30:.1f} GiB free of {usage.total / 2**30:.1f} GiB"
    if floor and usage.free < floor:
        report.add(
            "disk",
            "WARN",
            f"{detail}: under the free-space floor ({floor / 2**30:.1f} GiB)",
            "free space, or lower retention.min_free_*: retention will delete snapshots to get there",
        )
    elif r.max_total_bytes and r.max_total_bytes > usage.free:
        report.add(
            "disk",
            "WARN",
            f"{detail}: retention.max_total_bytes ({r.max_total_bytes / 2**30:.1f} GiB) is more than is free",
            "lower retention.max_total_bytes",
        )
    else:
        report.add("disk", "OK", detail)
