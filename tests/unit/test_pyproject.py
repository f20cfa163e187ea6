"""pyproject.toml's optional dependencies are bounded like the runtime ones (a new major of pytest or numpy
is adopted on purpose, not by the next `pip install -e .[dev]`), and no project URL is claimed: there is no
public repository or documentation site yet, so [project.urls] stays a comment."""

from __future__ import annotations

import tomllib
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]


def _project() -> dict[str, Any]:
    project: dict[str, Any] = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return project


def _extras() -> list[Requirement]:
    extras: dict[str, list[str]] = _project()["optional-dependencies"]
    return [Requirement(dep) for deps in extras.values() for dep in deps if not dep.startswith("kvsidecar[")]


@pytest.mark.parametrize("req", _extras(), ids=str)
def test_every_extra_has_a_lower_and_an_upper_bound(req: Requirement) -> None:
    ops = {spec.operator for spec in req.specifier}
    assert ops == {"=="} or ops == {">=", "<"}, f"{req}: bound it >=lowest,<next major (or pin it ==)"
    if ops == {">=", "<"}:
        low = next(Version(s.version) for s in req.specifier if s.operator == ">=")
        high = next(Version(s.version) for s in req.specifier if s.operator == "<")
        assert high.release[1:] in ((), (0,), (0, 0)) or high.major == 0, f"{req}: the upper bound is a major"
        assert low < high
    try:
        installed = version(req.name)
    except PackageNotFoundError:
        return  # an extra not installed here (bench): nothing to compare
    assert req.specifier.contains(installed, prereleases=True), f"{req}: {installed} is installed here"


def test_no_project_url_is_claimed() -> None:
    assert "urls" not in _project()
    text = (REPO / "pyproject.toml").read_text()
    assert all(line.startswith("#") for line in text.splitlines() if "project.urls" in line)
