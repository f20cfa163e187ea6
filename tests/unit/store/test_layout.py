"""Issue 16 item 15: directories the store owns are tightened at start, and it says so.

Pre-existing snapshot and state directories left 0755 by an earlier install stayed world-readable
(snapshots are plaintext transcripts). Now: 0700, or exactly 2770 for a deliberate shared-group setup
(setgid + group-writable, as install-systemd prescribes); a directory we do not own is reported, not changed.
"""

from __future__ import annotations

import logging
import os
import stat
from pathlib import Path

import pytest

from kvsidecar.files.atomic import secure_directory
from kvsidecar.store.snapshots import SnapshotStore


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def store_over(tmp_path: Path) -> SnapshotStore:
    return SnapshotStore(state_dir=tmp_path / "state", snapshot_dirs={"local": tmp_path / "snaps"})


@pytest.mark.parametrize("before", [0o755, 0o775, 0o777, 0o750, 0o711, 0o1777])
def test_preexisting_open_directories_become_0700(
    tmp_path: Path, before: int, caplog: pytest.LogCaptureFixture
) -> None:
    dirs = [tmp_path / "state", tmp_path / "state" / "manifests", tmp_path / "snaps"]
    for d in dirs:
        d.mkdir(exist_ok=True)
        d.chmod(before)
    with caplog.at_level(logging.INFO, logger="kvsidecar.store"):
        report = store_over(tmp_path).open()
    for d in dirs:
        assert mode(d) == 0o700, d
    assert len(report.dirs_tightened) >= len(dirs) and report.dir_problems == []
    assert f"before={before:04o}" in caplog.text and "kv.store.dir_tightened" in caplog.text


def test_shared_group_snapshot_dir_keeps_exactly_2770(tmp_path: Path) -> None:
    (tmp_path / "snaps").mkdir()
    (tmp_path / "snaps").chmod(0o2775)  # setgid + group-writable: shared with llama-server's group
    store_over(tmp_path).open()
    assert mode(tmp_path / "snaps") == 0o2770
    assert mode(tmp_path / "state") == 0o700  # the state directory is never shared


def test_directory_we_do_not_own_is_reported_not_changed(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    snaps.chmod(0o755)
    os.chown(snaps, 12345, -1)  # tests run as root in CI; as non-root this test needs that uid
    with caplog.at_level(logging.WARNING, logger="kvsidecar.store"):
        report = store_over(tmp_path).open()
    assert mode(snaps) == 0o755
    assert len(report.dir_problems) == 1 and "chmod o-rwx" in report.dir_problems[0]
    assert "kv.store.dir_too_open" in caplog.text


def test_secure_directory_never_follows_a_symlink(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    real.chmod(0o755)
    link = tmp_path / "link"
    link.symlink_to(real, target_is_directory=True)
    with pytest.raises(OSError):
        secure_directory(link)
    assert mode(real) == 0o755


def test_symlinked_configured_dir_is_tightened_at_its_target(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    real.chmod(0o755)
    (tmp_path / "snaps").symlink_to(real, target_is_directory=True)
    store_over(tmp_path).open()
    assert mode(real) == 0o700


def test_read_only_look_for_the_doctor_changes_nothing(tmp_path: Path) -> None:
    d = tmp_path / "snaps"
    d.mkdir()
    d.chmod(0o755)
    result = secure_directory(d, allow_shared_group=True, fix=False)
    assert mode(d) == 0o755 and not result.changed
    assert result.problem is not None and "0700" in result.problem
    d.chmod(0o700)
    assert secure_directory(d, fix=False).problem is None
