from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import psutil
import pytest

from kvsidecar.backend.fake import FakeKvBackend
from kvsidecar.doctor.checks import Doctor
from kvsidecar.doctor.host import disk_check
from kvsidecar.doctor.report import DoctorReport
from tests.unit.coordinator_helpers import make_config


class Usage(NamedTuple):
    total: int
    used: int
    free: int
    percent: float


def test_disk_check_uses_retentions_free_floor(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """10 % of 1001 bytes is 100.1: retention keeps 101 bytes free, so the doctor warns at 100 free."""
    usage = Usage(total=1001, used=901, free=100, percent=90.0)
    monkeypatch.setattr(psutil, "disk_usage", lambda _path: usage)
    config = make_config(tmp_path, retention={"min_free_percent": 10.0})
    report = DoctorReport(server="local", endpoint="")
    disk_check(report, config.retention, config.servers["local"].snapshot_dir)
    assert [c.status for c in report.checks if c.name == "disk"] == ["WARN"]


async def test_the_doctor_checks_the_disk_with_retentions_floor_and_the_servers_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`Doctor.run` hands `disk_check` the retention config and the server's own snapshot directory."""
    usage = Usage(total=1001, used=901, free=100, percent=90.0)
    asked: list[str] = []

    def disk_usage(path: str) -> Usage:
        asked.append(str(path))
        return usage

    monkeypatch.setattr(psutil, "disk_usage", disk_usage)
    config = make_config(tmp_path, retention={"min_free_percent": 10.0})
    config.servers["local"].snapshot_dir.mkdir(parents=True, exist_ok=True)
    doctor = Doctor(
        config=config,
        server="local",
        backend=FakeKvBackend(tmp_path / "snaps"),
        process_finder=lambda _url: None,
    )
    report = await doctor.run()
    assert [c.status for c in report.checks if c.name == "disk"] == ["WARN"]
    assert str(config.servers["local"].snapshot_dir) in asked
