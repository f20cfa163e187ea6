"""Fault injection against a real llama-server: crashes, storage faults and changed runtimes.

In every case the next request succeeds (cold if need be), llama-server stays up, the event has a stable
code, and no good snapshot is lost. The results are summarized in docs/RELIABILITY.md.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from kvsidecar.backend.base import SaveResult
from kvsidecar.coordinator.state import Outcome
from kvsidecar.errors import BackendUnavailable
from kvsidecar.fingerprint.runtime import RuntimeFingerprint
from kvsidecar.store.naming import SnapshotIdentity
from kvsidecar.store.snapshots import Candidate, Rejection
from kvsidecar.testing.daemon import DaemonProcess
from tests.conftest import StartServer
from tests.integration.real_helpers import RealHarness, real_harness


def ident(session: str) -> SnapshotIdentity:
    return SnapshotIdentity(server="local", provider="local", model="tiny", session_id=session)


async def switch_away_and_back(h: RealHarness, session: str = "A") -> tuple[Outcome, str | None, int]:
    await h.turn("X")
    r, _, _, cn = await h.turn(session)
    return r.outcome, r.reason, cn


async def test_llama_killed_during_a_save_keeps_the_previous_generation(
    start_llama: StartServer, tmp_path: Path
) -> None:
    server = start_llama()
    h = await real_harness(server, tmp_path)
    try:
        await h.turn("A")
        await h.turn("B")  # A saved: generation a
        await h.turn("A")  # A resident and dirty again
        real_save = h.backend.save_slot

        async def dying_save(slot_id: int, filename: str) -> SaveResult:
            (server.save_dir / filename).write_bytes(b"ggsq-half-written")
            server.kill()  # kill -9 in the middle of writing
            return await real_save(slot_id, filename)

        h.backend.save_slot = dying_save  # type: ignore[method-assign]
        r = await h.coordinator.acquire("B", provider="local", model="tiny")
        assert r.outcome is Outcome.COLD_FALLBACK and r.lease_id is not None  # B still gets to run
        await h.coordinator.release(r.lease_id, status="error")
        h.backend.save_slot = real_save  # type: ignore[method-assign]
        m = h.coordinator.store.get(ident("A").key)
        assert m is not None and m.current == "a" and m.generations["a"].valid  # the manifest's truth
        server.start()
        await h.coordinator.guard.refresh(h.coordinator.servers["local"])
        h.turns["A"] = 1  # the unsaved second turn is gone with the server
        r2, _, _, cn = await h.turn("A")
        assert r2.outcome is Outcome.RESTORED and cn > 500 and server.alive
    finally:
        await h.coordinator.aclose()


@pytest.mark.parametrize(
    ("change", "reason"),
    [
        (("--cache-type-k", "q8_0"), "KV_LAYOUT_CHANGED"),
        (("--swa-full",), "KV_LAYOUT_CHANGED"),
    ],
)
async def test_server_restarted_with_another_kv_layout(
    start_llama: StartServer, tmp_path: Path, change: tuple[str, ...], reason: str
) -> None:
    server = start_llama()
    h = await real_harness(server, tmp_path)
    await h.turn("A")
    await h.coordinator.aclose()  # saves A
    server.stop()
    server.extra_args = (*server.extra_args, *change)
    server.start()
    h2 = await real_harness(server, tmp_path)
    try:
        r, *_ = await h2.turn("A")
        assert r.outcome is Outcome.COLD_FALLBACK and r.reason == reason
        assert "restore" not in h2.calls()  # never even attempted
        assert (server.save_dir / ident("A").filename("a")).exists()  # kept
    finally:
        await h2.coordinator.aclose()


async def test_server_restarted_with_another_model(
    start_llama: StartServer, tmp_path: Path, llama_bin: Path
) -> None:
    from kvsidecar.testing.llama import vocab_dir
    from kvsidecar.testing.models import ModelShape, generate_llama_model

    server = start_llama()
    h = await real_harness(server, tmp_path)
    await h.turn("A")
    await h.coordinator.aclose()
    server.stop()
    server.model = generate_llama_model(ModelShape(seed=99), vocab_dir=vocab_dir(llama_bin), out_dir=tmp_path)
    server.start()
    h2 = await real_harness(server, tmp_path)
    try:
        r, *_ = await h2.turn("A")
        assert r.outcome is Outcome.COLD_FALLBACK and r.reason == "MODEL_FINGERPRINT_CHANGED"
        assert "restore" not in h2.calls()
    finally:
        await h2.coordinator.aclose()


async def test_smaller_context_than_the_snapshot(start_llama: StartServer, tmp_path: Path) -> None:
    server = start_llama(ctx_size=4096)
    h = await real_harness(server, tmp_path)
    await h.turn("A")
    await h.turn("A")  # ~1,950 tokens
    await h.coordinator.aclose()
    server.stop()
    server.ctx_size = 1024
    server.start()
    h2 = await real_harness(server, tmp_path)
    try:
        r = await h2.coordinator.acquire("A", provider="local", model="tiny")
        assert r.outcome is Outcome.COLD_FALLBACK and r.reason == "SNAPSHOT_EXCEEDS_SLOT_CONTEXT"
        assert "restore" not in h2.calls() and server.alive
        assert r.lease_id is not None
        await h2.coordinator.release(r.lease_id, status="aborted")
    finally:
        await h2.coordinator.aclose()


async def test_file_deleted_between_check_and_restore(start_llama: StartServer, tmp_path: Path) -> None:
    server = start_llama()
    h = await real_harness(server, tmp_path)
    try:
        await h.turn("A")
        await h.turn("B")
        store = h.coordinator.store
        real_find = store.find_points  # every generation the start plan may restore

        def find_then_lose(
            identity: SnapshotIdentity,
            fingerprint: RuntimeFingerprint,
            *,
            max_tokens: int | None = None,
            deep: bool | None = None,
        ) -> tuple[list[Candidate], list[Rejection]]:
            cands, rej = real_find(identity, fingerprint, max_tokens=max_tokens, deep=deep)
            for cand in cands:
                cand.path.unlink()  # an operator's rm lands right after our checks
            return cands, rej

        store.find_points = find_then_lose  # type: ignore[method-assign]
        h.calls()
        r, _, pn, cn = await h.turn("A")
        # The name is checked again right before llama-server is asked (issue 26 B): the deletion is seen
        # there, so llama-server is never handed a missing file (which would wipe the slot).
        assert r.outcome is Outcome.COLD_FALLBACK and r.reason == "KV_SNAPSHOT_NOT_FOUND"
        assert "restore" not in h.calls()
        assert cn == 0 and pn > 500 and server.alive
        assert h.coordinator.servers["local"].breaker.state.value == "healthy"  # a file's problem only
    finally:
        await h.coordinator.aclose()


@contextlib.contextmanager
def tmpfs(path: Path, size: str) -> Iterator[Path]:
    path.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
            check=True,
            capture_output=True,
        )
    except (subprocess.CalledProcessError, FileNotFoundError) as exc:
        pytest.skip(f"cannot mount a tmpfs here ({exc})")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


async def test_disk_full_during_save_keeps_the_old_generation(
    start_llama: StartServer, tmp_path: Path
) -> None:
    with tmpfs(tmp_path / "small", "9m") as snaps:
        server = start_llama(slot_save_path=snaps)
        h = await real_harness(server, tmp_path)
        try:
            await h.turn("A")
            await h.turn("B")  # A saved (~3.8 MB)
            await h.turn("A")
            await h.turn("A")  # A is now ~2,900 tokens: its next save (~11 MB) cannot fit
            r, *_ = await h.turn("B")  # switching saves A: ENOSPC
            assert r.outcome is Outcome.RESTORED  # B still runs, restored
            assert h.coordinator.telemetry.stats()["save_failures"] == 1 and server.alive
            m = h.coordinator.store.get(ident("A").key)
            assert m is not None and m.current == "a" and m.generations["a"].valid  # old generation intact
            r, _, _, cn = await h.turn("A")
            assert r.outcome is Outcome.RESTORED and cn > 500  # from the older generation, for real
        finally:
            await h.coordinator.aclose()


async def test_read_only_bind_mount_over_manifests_does_not_divert_or_lose_writes(
    start_llama: StartServer, tmp_path: Path
) -> None:
    """The manifests directory is held open since start (issue 26 B): a read-only bind mount laid over its
    path later neither fails nor diverts a manifest write; it lands in the directory kvsidecar holds, which
    the mount shows (the same inode)."""
    server = start_llama()
    h = await real_harness(server, tmp_path)
    state = tmp_path / "state" / "manifests"
    try:
        await h.turn("A")
        try:
            subprocess.run(["mount", "-o", "bind", str(state), str(state)], check=True, capture_output=True)
        except (subprocess.CalledProcessError, FileNotFoundError) as exc:
            pytest.skip(f"cannot bind-mount here ({exc})")
        subprocess.run(["mount", "-o", "remount,bind,ro", str(state)], check=True)
        try:
            r, *_ = await h.turn("B")  # saving A writes its manifest through the held directory
            assert r.outcome is Outcome.COLD and server.alive
            assert h.coordinator.telemetry.stats()["save_failures"] == 0
            assert [p.name for p in state.iterdir() if p.suffix == ".json"]  # visible through the mount
        finally:
            subprocess.run(["umount", str(state)], check=False)
        r, *_ = await h.turn("A")
        assert r.outcome is Outcome.RESTORED
    finally:
        await h.coordinator.aclose()


async def test_a_full_state_directory_fails_the_save_cleanly(
    start_llama: StartServer, tmp_path: Path
) -> None:
    """A manifest that cannot be written (ENOSPC on the state directory) fails that save with
    KV_METADATA_IO: the session starts cold later, nothing half-written is trusted, llama-server is fine."""
    with tmpfs(tmp_path / "statefs", "2m") as statefs:
        server = start_llama()
        h = await real_harness(server, tmp_path, state_dir=str(statefs / "state"))
        try:
            await h.turn("A")
            fd = os.open(statefs / "filler", os.O_WRONLY | os.O_CREAT)
            with contextlib.suppress(OSError):
                while os.write(fd, b"\0" * 65536):
                    pass
            os.close(fd)
            r, *_ = await h.turn("B")  # saving A cannot write its manifest
            assert r.outcome is Outcome.COLD and server.alive
            assert h.coordinator.telemetry.stats()["save_failures"] == 1
            (statefs / "filler").unlink()
            r, *_ = await h.turn("A")
            assert r.outcome in (Outcome.COLD, Outcome.COLD_FALLBACK)  # never a half-written generation
            r, *_ = await h.turn("C")
            assert r.outcome is Outcome.COLD
        finally:
            await h.coordinator.aclose()


def test_kvsidecar_killed_mid_flight_restarts_clean(start_llama: StartServer, tmp_path: Path) -> None:
    """kill -9 the daemon with a dirty session and a half-written manifest temp file: the next start
    sweeps the temp file, trusts no slot, and restores the last durable snapshot."""
    server = start_llama()
    daemon = DaemonProcess(tmp_path, base_url=server.base_url, snapshot_dir=server.save_dir)
    url, auth = daemon.url, daemon.auth

    def turn(session: str, n: int) -> str:
        from kvsidecar.testing.llama import complete, words

        lease = httpx.post(
            f"{url}/v1/sessions/{session}/acquire", json={"provider": "local", "model": "tiny"}, headers=auth
        ).json()
        t = complete(server.base_url, words(session, 600 * n), slot_id=lease["slot_id"])
        httpx.post(
            f"{url}/v1/leases/{lease['lease_id']}/release",
            headers=auth,
            json={"status": "ok", "prompt_tokens": t["prompt_n"], "cached_tokens": t["cache_n"]},
        )
        return str(lease["outcome"])

    daemon.start()
    try:
        turn("A", 1)
        turn("B", 1)  # A saved
        turn("A", 2)  # A dirty, unsaved
        (tmp_path / "state" / "manifests" / f".{ident('A').key}.json.tmp-dead").write_bytes(b'{"half":')
        daemon.kill()
        daemon.start()
        manifests = list((tmp_path / "state" / "manifests").iterdir())
        assert all(not m.name.startswith(".") for m in manifests)  # the temp file was swept
        for m in manifests:
            json.loads(m.read_text())  # every manifest is whole
        assert turn("A", 2) == "restored"  # nothing trusted in the slot; the durable snapshot comes back
        assert server.alive
    finally:
        daemon.stop()


async def test_restore_of_a_truncated_file_is_never_sent(start_llama: StartServer, tmp_path: Path) -> None:
    """The protection against the llama-server crash: with it removed (checks off), the server dies."""
    server = start_llama()
    h = await real_harness(server, tmp_path)
    try:
        await h.turn("A")
        await h.turn("B")
        path = server.save_dir / ident("A").filename("a")
        data = path.read_bytes()
        path.write_bytes(data[: len(data) // 2])
        r, *_ = await h.turn("A")
        assert r.outcome is Outcome.COLD_FALLBACK and server.alive
        # what the checks prevent: hand the same truncated file to llama-server directly
        shutil.copy(path, path.with_name("direct.bin"))
        with pytest.raises(BackendUnavailable):
            await h.backend.restore_slot(0, "direct.bin")
        time.sleep(0.5)
        assert not server.alive  # GGML_ASSERT abort: the reason every restore is checked first
    finally:
        await h.coordinator.aclose()
