"""The retention policy against golden files: tests/golden/retention/*.json hold inputs and the expected
plan. After a deliberate policy change, regenerate with KVSIDECAR_UPDATE_GOLDEN=1 and review the diff."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, NotRequired, TypedDict

import pytest

from kvsidecar.retention.plan import Disk, FileInfo, Policy, plan

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "retention"
CASES = sorted(GOLDEN.glob("*.json"))


class Case(TypedDict):
    """A golden file: the inputs of `plan()` as keyword arguments, and the expected result."""

    files: list[dict[str, Any]]
    disks: dict[str, dict[str, Any]]
    policy: dict[str, Any]
    now: float
    expected: NotRequired[Result]


class Result(TypedDict):
    deletions: list[list[str]]
    bytes_after: int
    snapshots_after: int
    unmet: list[str]


def load(path: Path) -> Case:
    data: Case = json.loads(path.read_text())
    return data


def run_case(data: Case) -> Result:
    files = [FileInfo(**f) for f in data["files"]]
    disks = {k: Disk(**v) for k, v in data["disks"].items()}
    result = plan(files, Policy(**data["policy"]), disks, float(data["now"]))
    return {
        "deletions": [[d.file.name, d.reason] for d in result.deletions],
        "bytes_after": result.bytes_after,
        "snapshots_after": result.sessions_after,
        "unmet": result.unmet,
    }


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_policy_matches_golden(path: Path) -> None:
    data = load(path)
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
    data = load(GOLDEN / "over_quota_then_whole_snapshots_lru.json")
    forward = run_case(data)
    data["files"] = list(reversed(data["files"]))
    assert run_case(data) == forward


def test_protected_files_are_never_selected_in_any_case() -> None:
    for path in CASES:
        data = load(path)
        protected = {f["name"] for f in data["files"] if f.get("protected")}
        assert not protected & {name for name, _ in run_case(data)["deletions"]}
