"""Issue 16 part B (items 5-8) and item 15 against a real llama-server.

Hostile manifests and planted links in the directories a real daemon and a real llama-server share: nothing
outside the snapshot directory is deleted, llama-server is never made to write or read through a planted
link, a poisoned manifest costs one session (the daemon starts and answers JSON), and a failed save never
takes the last good generation with it.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

import httpx

from kvsidecar.backend.base import SaveResult
from kvsidecar.coordinator.state import Outcome
from kvsidecar.errors import SaveFailed
from kvsidecar.store.naming import SnapshotIdentity
from kvsidecar.testing.daemon import DaemonProcess
from kvsidecar.testing.llama import LlamaServer, complete
from tests.conftest import StartServer
from tests.integration.real_helpers import prompt, real_harness

UNSAFE = "SNAPSHOT_FILE_UNSAFE"


def ident(session: str) -> SnapshotIdentity:
    return SnapshotIdentity(server="local", provider="local", model="tiny", session_id=session)


def http_turn(d: DaemonProcess, server: LlamaServer, session: str, turn: int = 1) -> dict[str, Any]:
    """acquire over the daemon's API, one completion on the slot it names, release with the numbers."""
    r = httpx.post(
        f"{d.url}/v1/sessions/{session}/acquire", json={"provider": "local", "model": "tiny"}, headers=d.auth
    )
    assert r.status_code == 200, r.text
    acquired = r.json()
    timings = complete(server.base_url, prompt(session, turn), slot_id=acquired["slot_id"])
    released = httpx.post(
        f"{d.url}/v1/leases/{acquired['lease_id']}/release",
        json={"status": "ok", "prompt_tokens": timings["prompt_n"], "cached_tokens": timings["cache_n"]},
        headers=d.auth,
    )
    assert released.status_code == 200, released.text
    return {**acquired, "cache_n": timings["cache_n"]}


def rewrite(path: Path, change: Any) -> None:
    data = json.loads(path.read_bytes())
    change(data)
    path.write_text(json.dumps(data))


def test_preexisting_open_directories_are_tightened_by_the_daemon(
    start_llama: StartServer, tmp_path: Path
) -> None:
    """Item 15: a 0755 snapshot directory (llama-server created it with umask 022) and state directory."""
    server = start_llama()
    snaps = server.slot_save_path
    assert snaps is not None
    work = tmp_path / "d"
    (work / "state").mkdir(parents=True)
    (work / "state").chmod(0o755)
    snaps.chmod(0o755)
    d = DaemonProcess(work, base_url=server.base_url, snapshot_dir=snaps).start()
    try:
        assert http_turn(d, server, "A")["outcome"] == "cold"  # llama-server still saves into it (below)
    finally:
        d.stop()
    for directory in (snaps, work / "state", work / "state" / "manifests"):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o700, directory
    assert "kv.store.dir_tightened" in d.log() and "before=0755" in d.log()
    assert len(list(snaps.glob("*.a.bin"))) == 1


def test_hostile_manifests_on_a_real_daemon(start_llama: StartServer, tmp_path: Path) -> None:
    """Items 5 and 7 through the daemon's HTTP API, as an operator or attacker would meet them."""
    server = start_llama()
    snaps = server.slot_save_path
    assert snaps is not None
    work = tmp_path / "d"
    d = DaemonProcess(work, base_url=server.base_url, snapshot_dir=snaps).start()
    try:
        for s in ("good", "other", "escape", "steal", "deep", "typed"):
            http_turn(d, server, s)
    finally:
        d.stop()  # the shutdown checkpoint saves the last one

    manifests = work / "state" / "manifests"
    victim = tmp_path / "victim.txt"  # the snapshot directory's parent
    victim.write_text("not kvsidecar's")
    other_file = snaps / ident("other").filename("a")
    other_bytes = other_file.read_bytes()

    def set_a(session: str, **fields: Any) -> None:
        path = manifests / f"{ident(session).key}.json"
        rewrite(path, lambda m: m["generations"]["a"].update(fields))

    set_a("escape", filename="../victim.txt")
    set_a("steal", filename=ident("other").filename("a"))  # valid name, another session's file
    set_a("typed", tokens="958")
    (manifests / f"{ident('deep').key}.json").write_bytes(b"[" * 40_000)
    (manifests / ("f" * 32 + ".json")).write_text(json.dumps({"schema": 1, "tokens": "958"}))

    d = DaemonProcess(work, base_url=server.base_url, snapshot_dir=snaps).start()  # no RecursionError
    try:
        answers = [
            httpx.get(f"{d.url}/v1/status", headers=d.auth),
            httpx.get(f"{d.url}/v1/sessions", headers=d.auth),
            httpx.get(f"{d.url}/v1/sessions/good", headers=d.auth),
            httpx.post(f"{d.url}/v1/gc", params={"dry_run": "true"}, headers=d.auth),
            httpx.post(f"{d.url}/v1/gc", headers=d.auth),
        ]
        good = http_turn(d, server, "good", 2)
        assert good["outcome"] == "restored" and good["cache_n"] > 500
        for s in ("escape", "steal", "typed", "deep"):
            assert http_turn(d, server, s, 2)["outcome"] == "cold"  # one bad manifest, one bad session
        answers += [httpx.delete(f"{d.url}/v1/sessions/{s}", headers=d.auth) for s in ("escape", "steal")]
        answers.append(httpx.post(f"{d.url}/v1/gc", headers=d.auth))
        for r in answers:
            assert r.headers["content-type"].startswith("application/json") and r.status_code == 200, r.text
        assert answers[0].json()["snapshots"]["bad_manifests"] == 5
        assert victim.read_text() == "not kvsidecar's"
        assert other_file.read_bytes() == other_bytes
        assert http_turn(d, server, "other", 2)["outcome"] == "restored"
        log = d.log()
        for reason in ("MANIFEST_TOO_DEEP", "MANIFEST_BAD_FILENAME", "MANIFEST_SCHEMA"):
            assert reason in log
    finally:
        d.stop()
    assert server.alive


async def test_planted_symlinks_are_never_written_or_read_through(
    start_llama: StartServer, tmp_path: Path
) -> None:
    """Item 6: a symlink at the next generation's name, then one at the current generation's name."""
    server = start_llama()
    snaps = server.slot_save_path
    assert snaps is not None
    h = await real_harness(server, tmp_path)
    try:
        await h.turn("A")
        assert (await h.coordinator.save("A"))["saved"] == 1  # generation a
        victim = tmp_path / "victim.txt"
        victim.write_bytes(b"precious")
        victim.chmod(0o644)
        (snaps / ident("A").filename("b")).symlink_to(victim)
        await h.turn("A")
        assert (await h.coordinator.save("A"))["saved"] == 1  # generation b: through the link before
        assert victim.read_bytes() == b"precious" and stat.S_IMODE(victim.stat().st_mode) == 0o644
        b = snaps / ident("A").filename("b")
        st = os.lstat(b)
        assert stat.S_ISREG(st.st_mode) and st.st_nlink == 1
        m = h.coordinator.store.get(ident("A").key)
        assert m is not None and m.current == "b"

        # Now swap the current generation for a link to an identical copy: never handed to llama-server.
        copy = tmp_path / "copy.bin"
        copy.write_bytes(b.read_bytes())
        b.unlink()
        b.symlink_to(copy)
        await h.turn("B")  # evicts A (clean: no save)
        h.calls()
        r, _, _, cn = await h.turn("A")
        assert r.outcome is Outcome.RESTORED and r.reason is not None and UNSAFE in r.reason
        m = h.coordinator.store.get(ident("A").key)
        assert m is not None and m.generations["b"].invalid_reason == UNSAFE
        assert r.restored_tokens == m.generations["a"].tokens  # the previous, verified, generation
        assert cn >= m.generations["a"].tokens - 8
        assert server.alive
    finally:
        await h.coordinator.aclose()


async def test_failed_save_keeps_the_last_good_generation(start_llama: StartServer, tmp_path: Path) -> None:
    """Item 8: current generation corrupt, previous restored, then a save fails like a full disk."""
    server = start_llama()
    snaps = server.slot_save_path
    assert snaps is not None
    h = await real_harness(server, tmp_path)
    key = ident("A").key
    real_save = h.backend.save_slot

    async def disk_full(slot_id: int, filename: str) -> SaveResult:
        """llama-server writes part of the file, then the write fails (ENOSPC)."""
        await real_save(slot_id, filename)
        path = snaps / filename
        path.write_bytes(path.read_bytes()[: path.stat().st_size // 3])
        raise SaveFailed("failed to save slot: No space left on device")

    try:
        await h.turn("A")
        await h.coordinator.save("A")  # a
        await h.turn("A")
        await h.coordinator.save("A")  # b (current)
        b = snaps / ident("A").filename("b")
        b.write_bytes(b.read_bytes()[:4096])  # truncated: would crash llama-server if restored
        await h.turn("B")
        r, *_ = await h.turn("A")
        assert r.outcome is Outcome.RESTORED and r.reason is not None and "CORRUPT" in r.reason
        before = h.coordinator.store.get(key)
        assert before is not None
        good_tokens = before.generations["a"].tokens
        h.backend.save_slot = disk_full  # type: ignore[method-assign]
        assert (await h.coordinator.save("A"))["saved"] == 0
        m = h.coordinator.store.get(key)
        assert m is not None and m.generations["a"].valid and (snaps / ident("A").filename("a")).exists()
    finally:
        await h.coordinator.aclose()  # the shutdown checkpoint fails the same way
    h2 = await real_harness(server, tmp_path)  # a restart: only what is on disk counts
    h2.turns = dict(h.turns)
    try:
        r, _, _, cn = await h2.turn("A")
        assert r.outcome is Outcome.RESTORED and r.restored_tokens == good_tokens
        assert cn >= good_tokens - 8  # the engine reused it: the session is not cold forever
        assert server.alive
    finally:
        await h2.coordinator.aclose()
