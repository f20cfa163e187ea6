from __future__ import annotations

from pathlib import Path
from typing import NamedTuple

import psutil
import pytest

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
