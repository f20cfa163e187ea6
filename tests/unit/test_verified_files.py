"""Issue 15: a file this daemon checksummed is not hashed again before its restore, unless someone wrote it."""

from __future__ import annotations

import os
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvsidecar.coordinator.state import Outcome
from kvsidecar.store import integrity
from tests.unit.coordinator_helpers import Harness, start_harness


@pytest.fixture
async def h(tmp_path: Path) -> AsyncIterator[Harness]:
    harness = await start_harness(tmp_path)
    yield harness
    await harness.coordinator.aclose()


def count_hashes(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls: list[int] = []
    real = integrity.checksum_from_fd

    def counting(fd: int) -> str:
        calls.append(fd)
        return real(fd)

    monkeypatch.setattr(integrity, "checksum_from_fd", counting)
    return calls


async def test_a_file_saved_by_this_daemon_is_not_hashed_again(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    await h.turn("A")
    await h.turn("B")  # A saved (and hashed once, after the save)
    hashes = count_hashes(monkeypatch)
    r, *_ = await h.turn("A")
    assert r.outcome is Outcome.RESTORED
    assert hashes == []  # the restore's checks did not hash A's file again


async def test_a_file_rewritten_with_its_mtime_put_back_is_hashed_and_caught(h: Harness) -> None:
    await h.turn("A")
    await h.turn("B")
    m = next(m for m in h.coordinator.store.all() if m.session_id == "A")
    assert m.current is not None
    path = h.fake.snapshot_dir / m.generations[m.current].filename
    st = path.stat()
    h.fake.corrupt_snapshot(path.name)  # same size, one byte flipped
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))  # mtime put back; ctime cannot be
    r, _, _, cache_n = await h.turn("A")
    assert r.outcome is Outcome.COLD_FALLBACK and r.reason == "SNAPSHOT_CORRUPT" and cache_n == 0
