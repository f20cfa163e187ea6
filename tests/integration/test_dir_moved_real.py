"""Issue 26 class B against a real llama-server: its --slot-save-path is a symlink that gets retargeted.

llama-server builds `<slot_save_path>/<filename>` and opens it by path at every save and restore
(tools/server, handle_slots_save/restore). Once the link leads elsewhere, kvsidecar asks it to save or
restore nothing: a link planted at the next generation's name in the other directory does not get the
state file written through it, a truncated file there is never restored (it would abort llama-server:
GGML_ASSERT(nread <= state_size)), llama-server stays alive, and once the link leads back it all works.
"""

from __future__ import annotations

import os
from pathlib import Path

from kvsidecar.coordinator.state import Outcome
from kvsidecar.store.naming import SnapshotIdentity
from tests.conftest import StartServer
from tests.integration.real_helpers import real_harness

MOVED = "KV_SNAPSHOT_DIR_MOVED"
VICTIM_TEXT = "operator notes, not kvsidecar's\n" * 12  # 390-odd bytes of text


def ident(session: str) -> SnapshotIdentity:
    return SnapshotIdentity(server="local", provider="local", model="tiny", session_id=session)


def retarget(link: Path, target: Path) -> None:
    new = link.with_name(link.name + ".new")
    new.symlink_to(target, target_is_directory=True)
    os.replace(new, link)


def listing(directory: Path) -> dict[str, tuple[bool, int]]:
    return {p.name: (p.is_symlink(), p.lstat().st_size) for p in directory.iterdir()}


async def test_a_retargeted_slot_save_path_link_is_never_saved_or_restored_through(
    start_llama: StartServer, tmp_path: Path
) -> None:
    real = tmp_path / "real"
    real.mkdir()
    link = tmp_path / "slots"
    link.symlink_to(real, target_is_directory=True)
    server = start_llama(slot_save_path=link)  # llama-server and kvsidecar both name the link
    h = await real_harness(server, tmp_path)
    a = ident("A")
    try:
        await h.turn("A")
        assert (await h.coordinator.save("A"))["saved"] == 1  # generation a, in real/
        saved = real / a.filename("a")
        assert saved.is_file()

        outside = tmp_path / "outside"
        outside.mkdir()
        victim = tmp_path / "victim.txt"
        victim.write_text(VICTIM_TEXT)
        (outside / a.filename("b")).symlink_to(victim)  # the next save's name: a link out of both trees
        (outside / a.filename("a")).write_bytes(saved.read_bytes()[: saved.stat().st_size // 3])
        before = listing(outside)
        retarget(link, outside)

        await h.turn("A")  # resident: no restore; dirty again
        h.calls()
        assert (await h.coordinator.save("A"))["saved"] == 0
        assert "save" not in h.calls()  # llama-server was not asked to write through the link
        assert victim.read_text() == VICTIM_TEXT

        await h.turn("B")  # evicts A: its save is refused the same way
        h.calls()
        r, _, _, _ = await h.turn("A")
        assert r.outcome is Outcome.COLD_FALLBACK and r.reason == MOVED
        assert "restore" not in h.calls()  # the truncated file was never handed over
        assert server.alive
        [view] = h.coordinator.status()["servers"]
        assert [w["code"] for w in view["warnings"]] == [MOVED]
        assert view["persistence_now"]["reason"] == "SNAPSHOT_DIR_MOVED"
        m = h.coordinator.store.get(a.key)
        assert m is not None and m.generations["a"].valid  # nothing invalidated
        assert saved.is_file()  # nothing deleted
        assert victim.read_text() == VICTIM_TEXT and listing(outside) == before

        retarget(link, real)  # leads back: saving and restoring resume
        await h.turn("B")
        r, _, _, cn = await h.turn("A")
        assert r.outcome is Outcome.RESTORED and cn > 0
        assert h.coordinator.status()["servers"][0]["warnings"] == []
        assert server.alive
    finally:
        await h.coordinator.aclose()
