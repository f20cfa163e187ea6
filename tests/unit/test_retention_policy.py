"""The retention policy against golden files: tests/golden/retention/*.json hold inputs and the expected
plan. After a deliberate policy change, regenerate with KVSIDECAR_UPDATE_GOLDEN=1 and review the diff."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from kvsidecar.retention import Disk, FileInfo, Policy, plan

GOLDEN = Path(__file__).resolve().parents[1] / "golden" / "retention"
CASES = sorted(GOLDEN.glob("*.json"))


def run_case(data: dict[str, object]) -> dict[str, object]:
    files = [FileInfo(**f) for f in data["files"]]  # type: ignore[union-attr, arg-type]
    disks = {k: Disk(**v) for k, v in data["disks"].items()}  # type: ignore[union-attr]
    result = plan(files, Policy(**data["policy"]), disks, float(data["now"]))  # type: ignore[arg-type]
    return {
        "deletions": [[d.file.name, d.reason] for d in result.deletions],
        "bytes_after": result.bytes_after,
        "snapshots_after": result.sessions_after,
        "unmet": result.unmet,
    }


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_policy_matches_golden(path: Path) -> None:
    data = json.loads(path.read_text())
    got = run_case(data)
    if os.environ.get("KVSIDECAR_UPDATE_GOLDEN") == "1":
        data["expected"] = got
        path.write_text(json.dumps(data, indent=1) + "\n")
    assert "expected" in data, (
        f"{path.name} has no expected plan: run with KVSIDECAR_UPDATE_GOLDEN=1 and review"
    )
    assert got == data["expected"]


def test_there_are_golden_cases() -> None:
    assert len(CASES) >= 12


def test_plan_is_deterministic_whatever_the_input_order() -> None:
    data = json.loads((GOLDEN / "over_quota_then_whole_snapshots_lru.json").read_text())
    forward = run_case(data)
    data["files"] = list(reversed(data["files"]))
    assert run_case(data) == forward


def test_protected_files_are_never_selected_in_any_case() -> None:
    for path in CASES:
        data = json.loads(path.read_text())
        protected = {f["name"] for f in data["files"] if f.get("protected")}
        assert not protected & {name for name, _ in run_case(data)["deletions"]}  # type: ignore[union-attr]
