"""Issue 15: a file this daemon checksummed is not hashed again before its restore, unless someone wrote it."""

from __future__ import annotations

import os

import pytest

from kvsidecar.coordinator.state import Outcome
from kvsidecar.store import integrity
from kvsidecar.store.naming import SnapshotIdentity
from tests.unit.coordinator_helpers import Harness


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


async def test_a_file_written_while_it_was_hashed_is_never_remembered_as_verified(
    h: Harness, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Review: the stat taken after the hash was remembered, so a file changed during the hash (mtime put
    back) skipped every later hash. Now such a file is rejected and nothing is remembered."""
    await h.turn("A")
    await h.turn("B")
    store = h.coordinator.store
    m = next(x for x in store.all() if x.session_id == "A")
    assert m.current is not None
    path = h.fake.snapshot_dir / m.generations[m.current].filename
    store.verified._known.clear()  # force a hash at the next restore
    real = integrity.checksum_from_fd

    def tamper_while_hashing(fd: int) -> str:
        digest = real(fd)
        st = path.stat()
        with path.open("r+b") as f:
            f.seek(st.st_size - 1)
            last = f.read(1)
            f.seek(st.st_size - 1)
            f.write(bytes([last[0] ^ 0xFF]))
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
        return digest

    monkeypatch.setattr(integrity, "checksum_from_fd", tamper_while_hashing)
    r, *_ = await h.turn("A")
    monkeypatch.setattr(integrity, "checksum_from_fd", real)
    assert r.outcome is not Outcome.RESTORED
    assert all(name != path.name for _server, name in store.verified._known)


async def test_every_valid_generation_is_a_point_newest_first(h: Harness) -> None:
    """`find_points` offers both generations that pass the checks, newest first; one whose file is corrupt is
    passed over (and marked invalid), the other still offered."""
    await h.turn("A")
    await h.turn("B")  # A: one generation
    await h.turn("A")
    await h.turn("B")  # A: two generations
    store = h.coordinator.store
    m = next(m for m in store.all() if m.session_id == "A")
    srv = h.coordinator.servers["local"]
    assert srv.fingerprint is not None
    assert m.scope is not None
    identity = SnapshotIdentity(
        server=m.server, provider=m.provider, model=m.model, session_id="A", scope=m.scope
    )
    found, rejections = store.find_points(identity, srv.fingerprint)
    assert [c.generation for c in found] == [g for g, _ in m.ordered_generations()]
    assert len(found) == 2 and rejections == []
    older = found[1]
    store.verified._known.clear()  # hash again
    h.fake.corrupt_snapshot(older.path.name)  # same size, one byte flipped
    found2, rejections2 = store.find_points(identity, srv.fingerprint)
    assert [c.generation for c in found2] == [found[0].generation]
    assert [r.generation for r in rejections2] == [older.generation]
    first, _ = store.find_restorable(identity, srv.fingerprint)
    assert first is not None and first.generation == found[0].generation
