"""Fixtures shared by the unit tests."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.unit.coordinator_helpers import Harness, start_harness


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    """A coordinator over a fake one-slot llama-server (the default config), closed after the test."""
    harness = await start_harness(tmp_path)
    yield harness
    await harness.coordinator.aclose()
