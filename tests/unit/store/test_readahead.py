"""Issue 15, "overlap the rest": before a switch's save, the incoming session's snapshot is read ahead.

A save writes the outgoing session's KV; the restore after it reads the incoming one's. When that file is
not in the page cache, the read used to start only after the save (331 ms of a 369 MB cold restore here,
185 ms when read ahead during the save: docs/BENCHMARKS.md). The read-ahead is advice to the kernel
(POSIX_FADV_WILLNEED) on the generation a restore would try first; it proves nothing, and the restore checks
everything as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from pathlib import Path
from typing import Any

import psutil
import pytest

from kvsidecar.store import readahead, snapshots
from kvsidecar.store.naming import SnapshotIdentity
from kvsidecar.store.snapshots import SnapshotStore
from kvsidecar.testing.poll import until
from tests.unit.coordinator_helpers import Harness, start_harness
from tests.unit.store.test_snapshots import FP, FP2, ID, make_store, save

pytestmark = pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="posix_fadvise: Linux")


class Advice:
    """Records each POSIX_FADV_WILLNEED: the file (by the descriptor's path) and the range."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.real = os.posix_fadvise
        monkeypatch.setattr(os, "posix_fadvise", self)

    def __call__(self, fd: int, offset: int, length: int, advice: int) -> None:
        if advice == os.POSIX_FADV_WILLNEED:
            self.calls.append((os.path.basename(os.readlink(f"/proc/self/fd/{fd}")), offset, length))
        self.real(fd, offset, length, advice)

    @property
    def paths(self) -> list[str]:
        return sorted({name for name, _, _ in self.calls})

    def covered(self, name: str) -> int:
        """How much of `name`, from its start, the calls advised without a gap."""
        end = 0
        for _, offset, length in sorted(c for c in self.calls if c[0] == name):
            if offset > end:
                break
            end = max(end, offset + length)
        return end


def test_the_current_generation_of_the_running_runtime_is_read_ahead(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_store(tmp_path)
    save(store, 10, fp=FP)  # a under FP
    save(store, 20, fp=FP2, revision=2)  # b under FP2, current
    advice = Advice(monkeypatch)
    size_b = (store.snapshot_dirs["local"] / ID.filename("b")).stat().st_size
    assert store.preread(ID, FP2.digest) == size_b and advice.paths == [ID.filename("b")]
    advice.calls.clear()
    size_a = (store.snapshot_dirs["local"] / ID.filename("a")).stat().st_size
    assert store.preread(ID, FP.digest) == size_a and advice.paths == [ID.filename("a")]  # what FP restores
    advice.calls.clear()
    store.mark_invalid(ID.key, "a", "RESTORE_FAILED")
    assert store.preread(ID, FP.digest) == 0 and advice.paths == []  # nothing a restore would try


def test_nothing_to_read_ahead_is_not_an_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = make_store(tmp_path)
    advice = Advice(monkeypatch)
    assert store.preread(ID, FP.digest) == 0  # no manifest
    other = SnapshotIdentity(server="elsewhere", provider="p", model="m", session_id="s1")
    save(store, 10)
    assert store.preread(other, FP.digest) == 0  # not this server's session
    (store.snapshot_dirs["local"] / ID.filename("a")).unlink()
    assert store.preread(ID, FP.digest) == 0 and advice.paths == []  # file gone


@pytest.mark.parametrize("planted", ["symlink", "fifo", "directory"])
def test_a_planted_entry_is_never_opened(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, planted: str
) -> None:
    store = make_store(tmp_path)
    save(store, 10)
    target = store.snapshot_dirs["local"] / ID.filename("a")
    target.unlink()
    outside = tmp_path / "outside"
    outside.write_bytes(b"x" * 100)
    if planted == "symlink":
        target.symlink_to(outside)
    elif planted == "fifo":
        os.mkfifo(target)  # opening it for reading would block forever
    else:
        target.mkdir()
    advice = Advice(monkeypatch)
    assert store.preread(ID, FP.digest) == 0 and advice.paths == []


async def test_a_switch_reads_the_incoming_snapshot_ahead_of_the_outgoing_save(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    for s in ("A", "B", "A"):  # B saved; A resident and dirty
        await h.turn(s)
    store: SnapshotStore = h.coordinator.store
    advice = Advice(monkeypatch)
    b_file = store.get(SnapshotIdentity(server="local", provider="local", model="m", session_id="B").key)
    assert b_file is not None and b_file.current is not None
    b_name = b_file.generations[b_file.current].filename
    advised_at_save: list[list[str]] = []
    original_save = h.fake.save_slot

    async def save_slot(slot_id: int, filename: str) -> Any:
        # the read-ahead runs in a thread, started before the save; up to 1 s, the assert below judges
        with contextlib.suppress(AssertionError):
            await until(lambda: advice.paths, timeout_s=1.0, interval_s=0.01, what="the read-ahead advice")
        advised_at_save.append(advice.paths)
        return await original_save(slot_id, filename)

    monkeypatch.setattr(h.fake, "save_slot", save_slot)
    result, _, _, cache_n = await h.turn("B")
    assert result.outcome == "restored" and cache_n == result.restored_tokens
    assert advised_at_save == [[b_name]]


async def test_no_read_ahead_without_a_save_before_the_restore(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    for s in ("A", "B", "A"):
        await h.turn(s)
    await h.coordinator.save("A")  # A is clean: B's switch restores at once
    advice = Advice(monkeypatch)
    result, _, _, _ = await h.turn("B")
    assert result.outcome == "restored"
    await asyncio.sleep(0.05)
    assert advice.paths == []
    result, _, _, _ = await h.turn("B")  # resident: no disk at all
    assert result.outcome == "resident" and advice.paths == []


def test_the_whole_file_is_advised_one_window_at_a_time(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Linux reads at most one read-ahead window per WILLNEED call, whatever range is asked for: one
    call for the whole file would read only its first window."""
    store = make_store(tmp_path)
    save(store, 200)
    size = (store.snapshot_dirs["local"] / ID.filename("a")).stat().st_size
    monkeypatch.setattr(snapshots, "step_bytes", lambda _dev: 4096)
    advice = Advice(monkeypatch)
    assert store.preread(ID, FP.digest) == size
    assert advice.covered(ID.filename("a")) >= size
    assert len(advice.calls) == -(-size // 4096) and all(length == 4096 for _, _, length in advice.calls)


def test_the_window_is_the_devices(tmp_path: Path) -> None:
    """What one call reads is the larger of the device's read_ahead_kb and max_sectors_kb."""
    readahead.step_bytes.cache_clear()
    dev = os.stat(tmp_path).st_dev
    step = readahead.step_bytes(dev)
    assert readahead.DEFAULT_STEP <= step <= readahead.MAX_STEP
    assert readahead.step_bytes(os.stat("/proc").st_dev) == readahead.DEFAULT_STEP  # no block device


def test_a_stop_ends_it_between_windows(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = make_store(tmp_path)
    save(store, 200)
    monkeypatch.setattr(snapshots, "step_bytes", lambda _dev: 4096)
    advice = Advice(monkeypatch)
    calls = iter(range(10**6))
    assert store.preread(ID, FP.digest, stop=lambda: next(calls) >= 3) == 3 * 4096
    assert len(advice.calls) == 3


def test_a_file_larger_than_half_the_available_memory_is_left_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = make_store(tmp_path)
    save(store, 200)
    size = (store.snapshot_dirs["local"] / ID.filename("a")).stat().st_size

    class Memory:
        available = 2 * size - 2

    monkeypatch.setattr(psutil, "virtual_memory", lambda: Memory())
    advice = Advice(monkeypatch)
    assert store.preread(ID, FP.digest) == 0 and advice.calls == []


def test_it_never_raises(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = make_store(tmp_path)
    save(store, 10)
    unknown = SnapshotIdentity(server="not-configured", provider="p", model="m", session_id="s1")
    assert store.preread(unknown, FP.digest) == 0

    def broken(*_a: Any, **_k: Any) -> int:
        raise RuntimeError("a bug")

    monkeypatch.setattr(snapshots, "read_ahead", broken)
    assert store.preread(ID, FP.digest) == 0


@pytest.mark.parametrize("why", ["on_switch off", "restore off", "breaker open", "shut down"])
async def test_no_read_ahead_when_no_save_or_no_restore_follows(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, why: str
) -> None:
    overrides: dict[str, Any] = {}
    if why == "on_switch off":
        overrides["checkpoint"] = {"on_switch": False}
    elif why == "restore off":
        overrides["restore"] = {"enabled": False}
    h = await start_harness(tmp_path, **overrides)
    try:
        for s in ("A", "B", "A"):
            await h.turn(s)
            if why == "on_switch off" and s == "B":
                await h.coordinator.save("B")  # B has a snapshot to read; A's switch saves nothing
        srv = h.coordinator.servers["local"]
        rt = h.coordinator.sessions.get(
            SnapshotIdentity(server="local", provider="local", model="m", session_id="B").key
        )
        if why == "breaker open":
            for _ in range(20):
                srv.breaker.failure("KV_BACKEND_UNAVAILABLE")
        advice = Advice(monkeypatch)
        if why in ("breaker open", "shut down"):
            assert rt is not None
            if why == "shut down":
                h.coordinator.restorer.close()
            h.coordinator.restorer.preread(srv, rt)
        else:
            await h.turn("B")
        await asyncio.sleep(0.1)
        assert advice.calls == []
    finally:
        await h.coordinator.aclose()
