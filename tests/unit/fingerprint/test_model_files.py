"""Issue 26 A: the fingerprint describes the weights the process has loaded, not what its path names now.

Every shard of a split GGUF; the file the process maps (device and inode in /proc/<pid>/maps, read through
/proc/<pid>/map_files/ once replaced); a model it does not map is bound to the process, or never matches
when the process can load it again (sleep mode); and a reload in the same process (the model mapped anew)
or a sleep seen in /props is a new runtime. The mapped-file cases use this test process' own mappings.
"""

from __future__ import annotations

import json
import mmap
import os
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import httpx
import pytest

from kvsidecar.backend.base import BackendCapabilities
from kvsidecar.backend.fake import FakeKvBackend
from kvsidecar.backend.llamacpp import LlamaCppBackend
from kvsidecar.coordinator.state import Outcome
from kvsidecar.coordinator.views import server_view
from kvsidecar.doctor.checks import Doctor
from kvsidecar.fingerprint.file_digests import FileDigestCache, file_digest
from kvsidecar.fingerprint.llama_process import MappedFile, ProcessInfo, model_mappings
from kvsidecar.fingerprint.llama_settings import parse_flags
from kvsidecar.fingerprint.model_files import model_paths, model_proof
from kvsidecar.fingerprint.runtime import RuntimeFingerprint, build_fingerprint
from tests.unit.coordinator_helpers import Harness, make_config

CAPS = BackendCapabilities(
    kind="llama.cpp",
    alive=True,
    slots_endpoint=True,
    total_slots=1,
    n_ctx=4096,
    model_path=None,
    build_info="b",
)


def caps(path: Path | str, **props: object) -> BackendCapabilities:
    return replace(CAPS, model_path=str(path), props=dict(props))


def proc(
    *args: str, pid: int = 10, mapped: tuple[MappedFile, ...] | None = (), config: tuple[str, ...] = ()
) -> ProcessInfo:
    argv = ("/usr/bin/llama-server", "-m", "/models/m.gguf", *args)
    return ProcessInfo(
        pid=pid,
        create_time=1.0,
        exe=None,
        cmdline=argv,
        flags=parse_flags(argv, {}),
        environ={},
        libraries=(),
        config_files=config,
        mapped_models=mapped,
    )


def fp(c: BackendCapabilities, process: ProcessInfo | None, digests: FileDigestCache) -> RuntimeFingerprint:
    return build_fingerprint(caps=c, process=process, runtime_key=None, digests=digests)


@pytest.fixture
def digests(tmp_path: Path) -> FileDigestCache:
    return FileDigestCache(tmp_path / "d.json", racy_window_s=0)


def test_model_paths_of_a_split_gguf() -> None:
    assert model_paths("/m/x-00001-of-00003.gguf") == [
        "/m/x-00001-of-00003.gguf",
        "/m/x-00002-of-00003.gguf",
        "/m/x-00003-of-00003.gguf",
    ]
    assert model_paths("/m/x.gguf") == ["/m/x.gguf"]
    assert model_paths("/m/x-00002-of-00003.gguf") == ["/m/x-00002-of-00003.gguf"]  # llama.cpp refuses it
    assert model_paths("/m/x-00001-of-99999.gguf") == ["/m/x-00001-of-99999.gguf"]  # hostile count: capped
    # any count llama.cpp can load (split.count is a uint16): every shard, not shard 1 alone
    assert len(model_paths("/m/x-00001-of-05000.gguf")) == 5000
    assert model_paths("/m/x-00001-of-65535.gguf")[-1] == "/m/x-65535-of-65535.gguf"
    # names llama.cpp does not read as a split (it formats the suffix as -%05d-of-%05d.gguf exactly)
    for name in ("x-1-of-3.gguf", "x-00001-OF-00003.gguf", "x-00001-of-00003.GGUF", "x-00001-of-00001.gguf"):
        assert model_paths(f"/m/{name}") == [f"/m/{name}"]


def test_every_shard_of_a_split_model_is_digested(tmp_path: Path, digests: FileDigestCache) -> None:
    shards = [tmp_path / f"x-{i:05d}-of-00003.gguf" for i in (1, 2, 3)]
    for i, shard in enumerate(shards):
        shard.write_bytes(b"GGUF" + bytes([i]) * 4096)
    base = fp(caps(shards[0]), None, digests)
    assert json.loads(base.components["model_file"]) == [file_digest(s)[0] for s in shards]
    shards[1].write_bytes(b"GGUF" + b"\x07" * 4096)  # only the second shard: the weights, not the metadata
    after = fp(caps(shards[0]), None, digests)
    assert after.mismatch_reason(base.components) == "MODEL_FINGERPRINT_CHANGED"
    shards[2].unlink()
    assert json.loads(fp(caps(shards[0]), None, digests).components["model_file"])[2] == "absent"


@pytest.fixture
def mapped_model(tmp_path: Path) -> Iterator[Path]:
    """A GGUF this process maps the way llama.cpp does (shared, read-only)."""
    path = tmp_path / "m.gguf"
    path.write_bytes(b"GGUF" + b"a" * 20000)
    with path.open("rb") as f, mmap.mmap(f.fileno(), 0, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ) as m:
        yield path
        m.close()


def this_process(path: Path) -> ProcessInfo:
    mapped = model_mappings(os.getpid())
    assert mapped is not None and any(m.path == str(path) for m in mapped)
    return replace(proc(pid=os.getpid()), mapped_models=mapped)


def test_the_mapped_file_is_digested_not_what_the_path_names_now(
    tmp_path: Path, mapped_model: Path, digests: FileDigestCache
) -> None:
    original = file_digest(mapped_model)[0]
    before = fp(caps(mapped_model), this_process(mapped_model), digests)
    assert json.loads(before.components["model_file"])[0] == original
    other = tmp_path / "other.gguf"
    other.write_bytes(b"GGUF" + b"b" * 20000)
    os.replace(other, mapped_model)  # renamed over the path: the process still maps the old file
    process = this_process(mapped_model)
    assert any(m.deleted for m in process.mapped_models or ())
    after = fp(caps(mapped_model), process, digests)
    entries = json.loads(after.components["model_file"])
    if os.geteuid() == 0:  # /proc/<pid>/map_files/ reads the deleted file (CAP_SYS_ADMIN)
        assert after.components["model_file"] == before.components["model_file"]
    else:  # cannot be read: bound to this process and mapping, never the new file's digest
        assert entries[0].startswith("mapped:")
    assert file_digest(mapped_model)[0] not in entries


def test_a_model_rewritten_in_place_under_its_mapping_changes_it(
    mapped_model: Path, digests: FileDigestCache
) -> None:
    before = fp(caps(mapped_model), this_process(mapped_model), digests)
    with mapped_model.open("r+b") as f:  # the process sees the new bytes through its shared mapping
        f.seek(100)
        f.write(b"changed")
    after = fp(caps(mapped_model), this_process(mapped_model), digests)
    assert after.mismatch_reason(before.components) == "MODEL_FINGERPRINT_CHANGED"


def test_an_unmapped_model_is_bound_to_its_process_or_never_matches(
    tmp_path: Path, digests: FileDigestCache
) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"GGUF" + b"c" * 1000)
    c = caps(model)
    # --no-mmap, no sleep mode: what it read at its start, the same for this process only
    once = fp(c, proc("--no-mmap", mapped=()), digests)
    assert fp(c, proc("--no-mmap", mapped=()), digests).digest == once.digest
    assert fp(c, proc("--no-mmap", pid=11, mapped=()), digests).digest != once.digest
    assert fp(c, proc("--no-mmap", mapped=None), digests).digest == once.digest  # maps unreadable
    # it can load the model again (sleep mode, or a config file that may set it): never equal to anything
    for process in (
        proc("--no-mmap", "--sleep-idle-seconds", "30", mapped=()),
        proc("--no-mmap", mapped=(), config=(str(model),)),
    ):
        first, second = fp(c, process, digests), fp(c, process, digests)
        assert first.digest != second.digest
        assert json.loads(first.components["model_file"])[0].startswith("unproven:")
    assert (
        fp(c, proc("--sleep-idle-seconds", "-1", mapped=()), digests).digest
        == fp(c, proc("--sleep-idle-seconds", "-1", mapped=()), digests).digest
    )


def test_a_router_never_matches(digests: FileDigestCache) -> None:
    router = caps("none", role="router")
    assert fp(router, None, digests).digest != fp(router, None, digests).digest


# -------------------------------------------------------------------- reloads in the same process


MAPPED = MappedFile(path="/models/m.gguf", deleted=False, dev=1, ino=2, ranges=((4096, 8192),))


async def test_a_model_mapped_again_in_the_same_process_is_a_new_runtime(h: Harness) -> None:
    h.process[0] = replace(proc(), mapped_models=(MAPPED,))
    srv = h.coordinator.servers["local"]
    srv.mappings = lambda _pid: (MAPPED,)
    await h.coordinator.guard.refresh(srv)
    await h.turn("A")
    await h.turn("B")  # A saved
    assert await srv.same_instance() is True
    reloaded = replace(MAPPED, ranges=((65536, 69632),))  # a wake from sleep mode maps it anew
    srv.mappings = lambda _pid: (reloaded,)
    assert await srv.same_instance() is False
    h.process[0] = replace(proc(), mapped_models=(reloaded,))
    epoch = h.coordinator.guard.epoch(srv)
    await h.coordinator.guard.refresh(srv)
    assert h.coordinator.guard.epoch(srv) == epoch + 1  # every slot's residency forgotten


async def test_a_mapped_model_rewritten_in_place_voids_the_bracket(h: Harness, mapped_model: Path) -> None:
    """Same inode, same address ranges (a wake maps it where it was, or no reload at all): the process sees
    the new bytes through MAP_SHARED, so the next restore's bracket must not trust the old digest."""
    h.process[0] = this_process(mapped_model)
    srv = h.coordinator.servers["local"]
    srv.mappings = model_mappings  # the real /proc/<pid>/maps of this test process
    await h.coordinator.guard.refresh(srv, force=True)
    await h.turn("A")
    assert await srv.same_instance() is True
    with mapped_model.open("r+b") as f:
        f.seek(100)
        f.write(b"changed")
    assert await srv.same_instance() is False
    h.process[0] = this_process(mapped_model)
    epoch = h.coordinator.guard.epoch(srv)
    await h.coordinator.guard.refresh(srv)
    assert h.coordinator.guard.epoch(srv) == epoch + 1  # seen by the probe too, and fingerprinted again


async def test_the_probe_leaves_a_sleeping_server_asleep(h: Harness) -> None:
    await h.turn("A")
    h.fake.sleep()
    srv = h.coordinator.servers["local"]
    epoch = h.coordinator.guard.epoch(srv)
    await h.coordinator.guard.refresh(srv)
    assert h.fake.sleeping and h.fake.wakes == 0
    assert srv.fingerprint is None  # the KV in its slots is gone
    assert h.coordinator.guard.epoch(srv) == epoch + 1


@pytest.mark.parametrize("other_weights", [False, True])
async def test_after_a_wake_the_runtime_is_fingerprinted_again_before_a_restore(
    h: Harness, other_weights: bool
) -> None:
    await h.turn("A")
    await h.turn("B")  # A saved
    h.fake.sleep(model_on_wake="/models/renamed-over.gguf" if other_weights else None)
    h.calls()
    r, _, _, cache_n = await h.turn("A")  # no probe in between: the acquire's bracket sees the sleep
    assert h.fake.wakes == 1
    if other_weights:  # the canary, measured again after the wake, differs: A's KV is not restored
        assert r.outcome is Outcome.COLD_FALLBACK and "restore" not in h.calls()
        assert r.reason == "KV_CANARY_CHANGED"
    else:
        assert r.outcome is Outcome.RESTORED and cache_n == 50


# -------------------------------------------------------------------- the probe (llama-server's HTTP API)


def props_only_server(props: dict[str, object], seen: list[str]) -> LlamaCppBackend:
    """A llama-server whose /slots would wake it: records every path asked."""

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(f"{request.method} {request.url.path}")
        if request.url.path == "/props":
            return httpx.Response(200, json=props)
        return httpx.Response(200, json=[{"id": 0, "n_ctx": 4096}])

    return LlamaCppBackend(base_url="http://llama", transport=httpx.MockTransport(handle))


PROPS: dict[str, object] = {
    "total_slots": 2,
    "model_path": "/m.gguf",
    "endpoint_slots": True,
    "default_generation_settings": {"n_ctx": 4096},
    "media_marker": "<__media_" + "a" * 20 + "__>",
}


@pytest.mark.parametrize("sleeping", [False, True])
async def test_the_probe_asks_props_only(sleeping: bool) -> None:
    """GET /slots wakes a sleeping llama-server and, awake, resets its idle timer: never asked by a probe
    when /props says enough (this build's /props always does, asleep or awake)."""
    seen: list[str] = []
    b = props_only_server({**PROPS, "is_sleeping": sleeping}, seen)
    try:
        caps = await b.probe()
        state = await b.instance_state()
    finally:
        await b.aclose()
    assert seen == ["GET /props", "GET /props"]
    assert caps.sleeping is sleeping and state.sleeping is sleeping
    assert caps.total_slots == 2 and caps.n_ctx == 4096 and caps.slots_endpoint


async def test_an_older_props_still_learns_the_slots() -> None:
    seen: list[str] = []
    b = props_only_server({"model_path": "/m.gguf"}, seen)
    try:
        caps = await b.probe()
    finally:
        await b.aclose()
    assert seen == ["GET /props", "GET /slots"] and caps.total_slots == 1 and caps.n_ctx == 4096


@pytest.mark.parametrize("value", ["false", "true", 0, None, [], {}])
async def test_an_is_sleeping_that_is_not_a_boolean_proves_no_loaded_model(value: object) -> None:
    """Only `false` says a model is loaded; anything else is asleep (no fingerprint, no restore), and
    the probe still does not ask /slots (which would wake a server that really is asleep)."""
    seen: list[str] = []
    b = props_only_server({**PROPS, "is_sleeping": value}, seen)
    try:
        caps = await b.probe()
        state = await b.instance_state()
    finally:
        await b.aclose()
    assert caps.sleeping and state.sleeping
    assert seen == ["GET /props", "GET /props"]


@pytest.mark.parametrize(
    "path", ["/m/x\x00y.gguf", "/m/x\x00-00001-of-00002.gguf", "\n/m/x.gguf", "/m/" + "x" * 20000]
)
def test_a_hostile_model_path_is_a_fingerprint_not_a_crash(path: str, digests: FileDigestCache) -> None:
    """A NUL (os.stat raises ValueError, not OSError), a newline, an over-long name, in /props or in a
    setting: the fingerprint is built, and names no digest."""
    hostile = proc("--lora", path, "--mmproj", path, mapped=())
    for process in (None, hostile, replace(hostile, mapped_models=None)):
        entries = json.loads(fp(caps(path), process, digests).components["model_file"])
        assert entries and all(e.endswith(("absent", "unresolved")) for e in entries)


# -------------------------------------------------------------------- saying why restarts lose snapshots


def test_the_systemd_install_is_told_why_snapshots_do_not_survive_a_restart(
    tmp_path: Path, mapped_model: Path
) -> None:
    """kvsidecar as its own user, llama-server as another (docs/SYSTEMD.md): /proc/<pid>/maps and environ
    are unreadable, so the model is `unproven` (fail closed): the user is told why, with a stable code and
    a fix."""
    systemd = replace(proc(), environ=None, mapped_models=None)
    proof = model_proof(caps(mapped_model), systemd)
    assert proof is not None and proof.code == "KV_MODEL_UNPROVEN"
    assert "maps" in proof.why and "environ" in proof.why and "User=" in proof.fix
    # maps unreadable, environment readable, no sleep mode: bound to the process
    bound = model_proof(caps(mapped_model), replace(proc(), mapped_models=None))
    assert bound is not None and bound.code == "KV_MODEL_BOUND_TO_PROCESS"
    # not mapped (--no-mmap) with sleep mode: unproven, and the fix names the flag
    asleep = model_proof(caps(mapped_model), proc("--no-mmap", "--sleep-idle-seconds", "30", mapped=()))
    assert asleep is not None and asleep.code == "KV_MODEL_UNPROVEN" and "--sleep-idle-seconds" in asleep.fix
    # what the process maps proves it; a router never
    assert model_proof(caps(mapped_model), this_process(mapped_model)) is None
    router = model_proof(caps("x", role="router"), None)
    assert router is not None and router.code == "KV_MODEL_UNPROVEN"


async def test_doctor_and_status_say_why_restores_across_restarts_are_impossible(
    tmp_path: Path, h: Harness
) -> None:
    systemd = replace(proc(), environ=None, mapped_models=None)
    (tmp_path / "snaps").mkdir(exist_ok=True)
    doctor = Doctor(
        config=make_config(tmp_path),
        server="local",
        backend=FakeKvBackend(tmp_path / "snaps"),
        process_finder=lambda _url: systemd,
    )
    report = await doctor.run()
    check = next(c for c in report.checks if c.name == "model identity")
    assert check.status == "WARN" and check.detail.startswith("KV_MODEL_UNPROVEN: ") and "User=" in check.fix
    h.process[0] = systemd
    srv = h.coordinator.servers["local"]
    await h.coordinator.guard.refresh(srv, force=True)
    view = server_view(srv, h.coordinator.sessions)
    assert view["runtime"]["model_identity"]["code"] == "KV_MODEL_UNPROVEN"
    h.process[0] = None
    await h.coordinator.guard.refresh(srv, force=True)
    assert server_view(srv, h.coordinator.sessions)["runtime"]["model_identity"] is None


async def test_doctor_does_not_wake_a_sleeping_server(tmp_path: Path) -> None:
    """`kvsidecar doctor` (and the daemon's /v1/doctor) probes with /props only; GET /slots, which loads the
    model again, is skipped while llama-server sleeps (only --deep runs a round trip, which must)."""
    (tmp_path / "snaps").mkdir(exist_ok=True)
    fake = FakeKvBackend(tmp_path / "snaps")
    fake.sleep()
    doctor = Doctor(
        config=make_config(tmp_path), server="local", backend=fake, process_finder=lambda _u: None
    )
    report = await doctor.run()
    assert fake.sleeping and fake.wakes == 0
    assert next(c for c in report.checks if c.name == "/slots endpoint").status == "SKIP"
