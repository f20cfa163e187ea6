"""Issue 26 A on a real llama-server: the fingerprint describes the weights the process has loaded.

1. Sleep mode (`--sleep-idle-seconds`) frees the model and loads it again on wake, from whatever file is at
   the path then, in the same process (same pid, same /props nonce). kvsidecar's probe must not wake it, and
   a model renamed over the path during the sleep must not receive the KV saved under the old one.
2. A split GGUF: every shard is digested, not only the first (which may hold metadata only).
3. A model renamed over the path while llama-server runs the old one, with kvsidecar restarted in that
   window: the fingerprint is the mapped (deleted) file's, so sessions saved then do not go into the new
   model once llama-server restarts.

Each wrong-restore case compares the text generated after the acquire with a cold run of the same prompt on
the same server, and first checks that the two models' outputs really differ: KV of the wrong model
restored directly (past kvsidecar) gives another text than the cold run.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsidecar.coordinator.canary import CANARY_PROMPT
from kvsidecar.coordinator.state import Outcome
from kvsidecar.store.naming import SnapshotIdentity
from kvsidecar.testing.llama import LlamaServer
from kvsidecar.testing.poll import eventually
from tests.conftest import StartServer
from tests.integration.real_helpers import RealHarness, erase, generate, prompt, real_harness
from tests.integration.test_runtime_identity_real import acquire_and_generate
from tests.integration.weights_helpers import distinct_model

NO_CANARY = {"runtime_canary": False}  # the documented setting for GPU backends: the files must prove it


async def harness(server: LlamaServer, tmp_path: Path, **server_overrides: Any) -> RealHarness:
    assert server.slot_save_path is not None
    servers = {
        "local": {
            "base_url": server.base_url,
            "snapshot_dir": str(server.slot_save_path),
            "probe_interval_s": 3600,
            **server_overrides,
        }
    }
    return await real_harness(server, tmp_path, servers=servers)


def snapshot_files(h: RealHarness, session: str) -> list[str]:
    key = SnapshotIdentity(server="local", provider="local", model="tiny", session_id=session).key
    assert h.server.slot_save_path is not None
    names = sorted(p.name for p in h.server.slot_save_path.iterdir() if p.name.startswith(key))
    assert names, f"{session} was never saved: the test would prove nothing"
    return names


def wrong_restore_differs(h: RealHarness, session: str, files: list[str]) -> None:
    """The sensitivity check: the old KV restored directly gives another text than a cold run."""
    text = prompt(session, h.turns[session])
    url = h.server.base_url
    erase(url, 0)
    cold = generate(url, text, 0)
    outs = []
    for name in files:
        r = httpx.post(f"{url}/slots/0?action=restore", json={"filename": name}, timeout=120)
        if r.status_code == 200:
            outs.append(generate(url, text, 0))
    assert outs and all(o != cold for o in outs), (outs, cold)


def props(server: LlamaServer) -> dict[str, Any]:
    data = httpx.get(f"{server.base_url}/props", timeout=30).json()
    assert isinstance(data, dict)
    return data


def wait_asleep(server: LlamaServer, deadline_s: float = 120.0) -> None:
    eventually(
        lambda: props(server).get("is_sleeping"),
        timeout_s=deadline_s,
        interval_s=0.2,
        what="llama-server to enter sleep mode",
    )


async def test_kvsidecar_does_not_wake_a_sleeping_server(start_llama: StartServer, tmp_path: Path) -> None:
    server = start_llama(extra_args=("--cache-ram", "0", "--sleep-idle-seconds", "1"))
    h = await harness(server, tmp_path, **NO_CANARY)
    try:
        srv = h.coordinator.servers["local"]
        await asyncio.to_thread(wait_asleep, server)
        # GET /slots would wake it (and, awake, reset its idle timer); /props does neither
        await h.coordinator.guard.refresh(srv)
        assert props(server)["is_sleeping"] is True
        await h.coordinator.guard.refresh(srv)
        assert props(server)["is_sleeping"] is True
        assert srv.sleeping and srv.fingerprint is None  # no model loaded: nothing to restore into
    finally:
        await h.coordinator.aclose()


@pytest.mark.parametrize("mmap", [True, False], ids=["mapped", "load-mode-none"])
async def test_a_model_swapped_during_sleep_gets_no_kv_of_the_old_one(
    start_llama: StartServer, tmp_path: Path, mmap: bool
) -> None:
    a = distinct_model(tmp_path / "a.gguf", seed=1)
    b = distinct_model(tmp_path / "b.gguf", seed=2)
    model = tmp_path / "model.gguf"
    shutil.copyfile(a, model)
    load = () if mmap else ("--load-mode", "none")  # unmapped: which file a wake read is unprovable
    server = start_llama(model=model, extra_args=("--cache-ram", "0", "--sleep-idle-seconds", "2", *load))
    h = await harness(server, tmp_path, **NO_CANARY)
    try:
        await h.turn("A")
        await h.turn("B")  # A saved under model a
        files = snapshot_files(h, "A")
        await asyncio.to_thread(wait_asleep, server)
        os.replace(shutil.copyfile(b, tmp_path / "b-copy.gguf"), model)  # renamed over the path
        h.calls()
        outcome, warm, cold = await acquire_and_generate(h, "A")  # the acquire wakes it: model b
        assert "restore" not in h.calls()
        assert outcome is Outcome.COLD_FALLBACK
        assert warm == cold
        await asyncio.to_thread(wrong_restore_differs, h, "A", files)
    finally:
        await h.coordinator.aclose()


async def test_a_session_restores_after_sleep_when_the_model_is_unchanged(
    start_llama: StartServer, tmp_path: Path
) -> None:
    model = distinct_model(tmp_path / "a.gguf", seed=1)
    server = start_llama(model=model, extra_args=("--cache-ram", "0", "--sleep-idle-seconds", "2"))
    h = await harness(server, tmp_path, **NO_CANARY)
    try:
        await h.turn("A")
        await h.turn("B")
        snapshot_files(h, "A")
        await asyncio.to_thread(wait_asleep, server)
        outcome, warm, cold = await acquire_and_generate(h, "A")
        assert outcome is Outcome.RESTORED
        assert warm == cold
    finally:
        await h.coordinator.aclose()


def tokens(server: LlamaServer, text: str) -> frozenset[int]:
    r = httpx.post(f"{server.base_url}/tokenize", json={"content": text, "add_special": True}, timeout=60)
    r.raise_for_status()
    return frozenset(int(t) for t in r.json()["tokens"])


@pytest.mark.parametrize("canary", [False, True], ids=["no-canary", "canary"])
async def test_every_shard_of_a_split_model_is_fingerprinted(
    start_llama: StartServer, tmp_path: Path, canary: bool
) -> None:
    first = distinct_model(tmp_path / "a" / "m.gguf", seed=1, split=8)
    shard2 = first.name.replace("-00001-", "-00002-")
    server = start_llama(model=first)
    if canary:  # only the embedding rows of tokens the canary's prompt does not use differ
        kept = tokens(server, CANARY_PROMPT)
        other = distinct_model(tmp_path / "b" / "m.gguf", seed=1, split=8, redraw_rows=(2, kept))
    else:  # the other model's second shard
        other = distinct_model(tmp_path / "b" / "m.gguf", seed=2, split=8)
    h = await harness(server, tmp_path, runtime_canary=canary)
    try:
        await h.turn("A")
        await h.turn("B")
        files = snapshot_files(h, "A")
        canary_before = h.coordinator.servers["local"].canary
        server.stop()
        os.replace(shutil.copyfile(other.parent / shard2, tmp_path / "s2"), first.parent / shard2)
        server.start()
        h.calls()
        outcome, warm, cold = await acquire_and_generate(h, "A")
        assert "restore" not in h.calls()
        assert outcome is Outcome.COLD_FALLBACK
        assert warm == cold
        await asyncio.to_thread(wrong_restore_differs, h, "A", files)
        srv = h.coordinator.servers["local"]
        assert srv.fingerprint is not None
        entries = json.loads(srv.fingerprint.components["model_file"])
        assert len(entries) == 4 and all(len(e) == 32 for e in entries)  # a digest of each shard
        if canary:  # the canary alone could not tell: the shard's digest did
            assert srv.canary == canary_before
    finally:
        await h.coordinator.aclose()


@pytest.mark.parametrize("mmap", [True, False], ids=["mapped", "load-mode-none"])
async def test_a_model_renamed_over_the_path_of_a_running_server_is_not_its_fingerprint(
    start_llama: StartServer, tmp_path: Path, mmap: bool
) -> None:
    a = distinct_model(tmp_path / "a.gguf", seed=1)
    b = distinct_model(tmp_path / "b.gguf", seed=2)
    model = tmp_path / "model.gguf"
    shutil.copyfile(a, model)
    server = start_llama(
        model=model, extra_args=("--cache-ram", "0", *(() if mmap else ("--load-mode", "none")))
    )
    h = await harness(server, tmp_path, **NO_CANARY)
    assert h.coordinator.servers["local"].fingerprint is not None
    before = h.coordinator.servers["local"].fingerprint.components["model_file"]
    await h.coordinator.aclose()
    os.replace(shutil.copyfile(b, tmp_path / "b-copy.gguf"), model)  # llama-server still runs a
    maps = Path(f"/proc/{server.pid}/maps").read_text()
    assert (f"{model} (deleted)" in maps) is mmap  # without mmap nothing shows which file it read
    h = await harness(server, tmp_path, **NO_CANARY)  # kvsidecar restarted in that window
    try:
        srv = h.coordinator.servers["local"]
        assert srv.fingerprint is not None
        window, pid = srv.fingerprint.components["model_file"], srv.fingerprint.info["pid"]
        await h.turn("C")
        await h.turn("D")  # C saved while the process still runs a
        files = snapshot_files(h, "C")
        server.restart()  # now it loads b
        h.calls()
        outcome, warm, cold = await acquire_and_generate(h, "C")
        assert "restore" not in h.calls()
        assert outcome is Outcome.COLD_FALLBACK
        assert warm == cold
        await asyncio.to_thread(wrong_restore_differs, h, "C", files)
        if mmap:
            assert window == before  # a's digest, read through /proc/<pid>/map_files/
        else:  # bound to the process that read it: never equal to another process' fingerprint
            assert json.loads(window)[0].startswith(f"loaded@{pid}:")
    finally:
        await h.coordinator.aclose()
