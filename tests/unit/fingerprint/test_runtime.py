"""Runtime fingerprint: fail-closed settings parsing (issue 16 item 2), whole-file digests (item 3) and the
digest cache file (item 7)."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import threading
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path

import psutil
import pytest

from kvsidecar.backend.base import BackendCapabilities
from kvsidecar.fingerprint import file_digests as fpmod
from kvsidecar.fingerprint.file_digests import FileDigestCache, file_digest
from kvsidecar.fingerprint.llama_args import BY_NAME, OPTIONS
from kvsidecar.fingerprint.llama_process import MappedFile, ProcessInfo, find_llama_process
from kvsidecar.fingerprint.llama_settings import parse_cmdline, parse_flags, parse_settings
from kvsidecar.fingerprint.reasons import HARMLESS, SETTING_CLASSES
from kvsidecar.fingerprint.runtime import RuntimeFingerprint, build_fingerprint
from kvsidecar.testing.llama import free_port
from kvsidecar.testing.poll import eventually

CAPS = BackendCapabilities(
    kind="llama.cpp",
    alive=True,
    slots_endpoint=True,
    total_slots=1,
    n_ctx=4096,
    model_path=None,
    build_info="b1",
)
BASE = ("-m", "/models/m.gguf", "--port", "8080", "--slot-save-path", "/snaps")


def proc(
    *args: str,
    env: Mapping[str, str] | None = None,
    unreadable_env: bool = False,
    cwd: str | None = None,
    libs: tuple[str, ...] | None = (),
    config: tuple[str, ...] = (),
) -> ProcessInfo:
    argv = ("/usr/bin/llama-server", *BASE, *args)
    environ = None if unreadable_env else dict(env or {})
    return ProcessInfo(
        pid=10,
        create_time=1.0,
        exe=None,
        cmdline=argv,
        flags=parse_flags(argv, environ),
        environ=environ,
        cwd=cwd,
        libraries=libs,
        config_files=config,
    )


def fp(
    process: ProcessInfo | None,
    *,
    digests: FileDigestCache | None = None,
    caps: BackendCapabilities = CAPS,
    canary: str | None = None,
) -> RuntimeFingerprint:
    return build_fingerprint(caps=caps, process=process, runtime_key=None, digests=digests, canary=canary)


def reason(new: RuntimeFingerprint, old: RuntimeFingerprint) -> str:
    assert new.digest != old.digest
    return new.mismatch_reason(old.components)


# ---------------------------------------------------------------------------------- the option table


def test_option_table_is_consistent() -> None:
    canonical = {o.canonical for o in OPTIONS}
    names = [n for o in OPTIONS for n in (*o.names, *o.negated)]
    assert len(names) == len(set(names)) == len(BY_NAME)
    assert len(canonical) == len(OPTIONS)
    assert not HARMLESS - canonical and not set(SETTING_CLASSES) - canonical  # no typo hides a setting
    assert not HARMLESS & set(SETTING_CLASSES)
    assert BY_NAME["-nkvo"][0].canonical == "kv-offload" and BY_NAME["-nkvo"][1]


# ---------------------------------------------------------------------------------- parsing


def test_aliases_spellings_and_environment_share_one_key() -> None:
    base = fp(proc())
    spellings = [
        proc("-ctk", "q8_0"),
        proc("--cache-type-k", "q8_0"),
        proc("--cache-type-k=q8_0"),
        proc("--cache_type_k", "q8_0"),  # llama.cpp turns _ into - in long flags
        proc(env={"LLAMA_ARG_CACHE_TYPE_K": "q8_0"}),
    ]
    digests = {fp(p).digest for p in spellings}
    assert len(digests) == 1 and base.digest not in digests
    assert reason(fp(spellings[-1]), base) == "KV_LAYOUT_CHANGED"


def test_switch_negations_and_their_environment_forms() -> None:
    off = [
        proc("--no-kv-offload"),
        proc("-nkvo"),
        proc("--kv-offload=false"),
        proc(env={"LLAMA_ARG_NO_KV_OFFLOAD": "anything"}),
        proc(env={"LLAMA_ARG_KV_OFFLOAD": "0"}),
        proc(env={"LLAMA_ARG_KV_OFFLOAD": "1", "LLAMA_ARG_NO_KV_OFFLOAD": "1"}),  # NO_ form wins
    ]
    assert len({fp(p).digest for p in off}) == 1
    assert fp(proc("--kv-offload")).digest != fp(off[0]).digest
    assert fp(proc()).digest != fp(off[0]).digest
    # a plain switch set by a falsey variable is ignored by llama.cpp, and so here
    assert fp(proc(env={"LLAMA_ARG_SWA_FULL": "0"})).digest == fp(proc()).digest
    assert fp(proc(env={"LLAMA_ARG_SWA_FULL": "1"})).digest == fp(proc("--swa-full")).digest


def test_repeated_flags_keep_their_order() -> None:
    ab = fp(proc("--lora", "/a.gguf", "--lora", "/b.gguf"))
    ba = fp(proc("--lora", "/b.gguf", "--lora", "/a.gguf"))
    assert ab.digest != ba.digest and reason(ab, ba) == "LORA_CHANGED"
    settings = parse_settings(
        ["llama-server", "-ctk", "f16", "-ctk", "q8_0"], {"LLAMA_ARG_CACHE_TYPE_K": "q4_0"}
    )
    assert settings.values["cache-type-k"] == ("q4_0", "f16", "q8_0")  # environment first, as llama.cpp
    assert settings.effective("cache-type-k") == "q8_0"


def test_unknown_flags_are_fingerprinted_and_do_not_derail_parsing() -> None:
    argv = [
        "llama-server",
        "--future-valued",
        "3",
        "--future-switch",
        "--rope-freq-base",
        "5000",
        "--future-negative",
        "-1",
        "-c",
        "8192",
        "--future-eq=x",
        "stray",
    ]
    parsed = parse_cmdline(argv)
    assert ("rope-freq-base", "5000") in parsed and ("ctx-size", "8192") in parsed
    keys = [k for k, _ in parsed]
    assert keys.count("?--future-valued") == keys.count("?--future-switch") == 1
    assert ("?--future-negative", "=-1") in parsed and ("?positional", "stray") in parsed
    for extra in (("--future-switch",), ("--future-valued", "3"), ("stray",)):
        assert reason(fp(proc(*extra)), fp(proc())) == "RUNTIME_SETTINGS_CHANGED"
    assert fp(proc("--future-valued", "3")).digest != fp(proc("--future-valued", "4")).digest
    secret = fp(proc("--future-token", "hunter2"))
    assert "hunter2" not in json.dumps(secret.components)  # unknown values are stored hashed


def test_a_value_flag_followed_by_a_flag_takes_no_value() -> None:
    # -fa took no value in older llama.cpp: "-fa --port 9000" must still find the port
    flags = parse_flags(["llama-server", "-fa", "--port", "9000", "--lora", "--swa-full"])
    assert flags["port"] == "9000" and flags["flash_attn"] == "" and flags["swa_full"] == "on"


def test_legacy_flags_see_the_environment() -> None:
    env = {"LLAMA_ARG_SWA_FULL": "1", "LLAMA_ARG_PORT": "9100", "LLAMA_ARG_NO_CACHE_IDLE_SLOTS": "1"}
    flags = proc(env=env).flags
    assert flags["swa_full"] == "on" and flags["no_cache_idle_slots"] == "on"
    assert parse_flags(["llama-server"], env)["port"] == "9100"


HARMLESS_ARGS = (
    "--port",
    "9001",
    "--host",
    "0.0.0.0",
    "-t",
    "3",
    "--threads-batch",
    "1",
    "-b",
    "64",
    "-ub",
    "64",
    "--timeout",
    "30",
    "--threads-http",
    "4",
    "-lv",
    "4",
    "--log-file",
    "/tmp/x.log",
    "--api-key",
    "sekrit",
    "--slot-save-path",
    "/elsewhere",
    "--metrics",
    "--slots",
    "--no-slots",
    "-np",
    "4",
    "-c",
    "16384",
    "--cache-ram",
    "0",
    "--no-cache-idle-slots",
    "--temp",
    "0.1",
    "--top-k",
    "5",
    "--seed",
    "7",
    "--chat-template",
    "chatml",
    "--jinja",
    "--no-webui",
    "--alias",
    "x",
    "-v",
    "--load-mode",
    "mmap",
    "--mlock",
)
HARMLESS_ENV = {
    "LLAMA_ARG_THREADS": "2",
    "LLAMA_ARG_PORT": "9002",
    "LLAMA_ARG_CTX_SIZE": "2048",
    "LLAMA_API_KEY": "sekrit",
    "HF_TOKEN": "sekrit",
    "LLAMA_CACHE": "/cache",
    "LLAMA_KV_CACHE_DEBUG": "1",
    "PATH": "/bin",
    "HOME": "/home/x",
}


def test_harmless_settings_do_not_change_the_fingerprint() -> None:
    base = fp(proc())
    changed = fp(proc(*HARMLESS_ARGS, env=HARMLESS_ENV))
    assert changed.digest == base.digest
    assert changed.info["ctx-size"] == "16384" and changed.info["parallel"] == "4"  # recorded, not compared
    text = json.dumps([changed.components, changed.info])
    assert "sekrit" not in text  # nor are the secrets recorded anywhere


@pytest.mark.parametrize(
    ("args", "env", "code"),
    [
        (("--rope-freq-base", "5000"), {}, "ROPE_CHANGED"),
        ((), {"LLAMA_ARG_ROPE_FREQ_BASE": "5000"}, "ROPE_CHANGED"),
        (("--rope-scale", "2"), {}, "ROPE_CHANGED"),
        (("--rope-scaling", "yarn"), {}, "ROPE_CHANGED"),
        (("--rope-freq-scale", "0.5"), {}, "ROPE_CHANGED"),
        (("--yarn-ext-factor", "0.5"), {}, "ROPE_CHANGED"),
        (("--yarn-orig-ctx", "2048"), {}, "ROPE_CHANGED"),
        (("--override-kv", "llama.context_length=int:8192"), {}, "MODEL_OVERRIDE_CHANGED"),
        (("--lora", "/a.gguf"), {}, "LORA_CHANGED"),
        (("--lora-scaled", "/a.gguf:0.5"), {}, "LORA_CHANGED"),
        (("--lora-init-without-apply",), {}, "LORA_CHANGED"),
        (("--control-vector", "/cv.gguf"), {}, "CONTROL_VECTOR_CHANGED"),
        (("--control-vector-scaled", "/cv.gguf:2"), {}, "CONTROL_VECTOR_CHANGED"),
        (("--control-vector-layer-range", "1", "3"), {}, "CONTROL_VECTOR_CHANGED"),
        (("-ctv", "q4_0"), {}, "KV_LAYOUT_CHANGED"),
        (("-fa", "on"), {}, "KV_LAYOUT_CHANGED"),
        ((), {"LLAMA_ARG_FLASH_ATTN": "off"}, "KV_LAYOUT_CHANGED"),
        ((), {"LLAMA_ARG_CACHE_TYPE_V": "q8_0"}, "KV_LAYOUT_CHANGED"),
        (("--swa-full",), {}, "KV_LAYOUT_CHANGED"),
        (("-kvu",), {}, "KV_LAYOUT_CHANGED"),
        (("--no-kv-offload",), {}, "KV_LAYOUT_CHANGED"),
        (("-ngl", "99"), {}, "DEVICE_PLACEMENT_CHANGED"),
        (("-ot", "blk=CPU"), {}, "DEVICE_PLACEMENT_CHANGED"),
        (("--device", "none"), {}, "DEVICE_PLACEMENT_CHANGED"),
        (("--pooling", "mean"), {}, "RUNTIME_SETTINGS_CHANGED"),
        (("--embedding",), {}, "RUNTIME_SETTINGS_CHANGED"),
        (("-md", "/draft.gguf"), {}, "RUNTIME_SETTINGS_CHANGED"),
        (("-m", "/models/other.gguf"), {}, "MODEL_FINGERPRINT_CHANGED"),
        ((), {"LLAMA_ARG_SOMETHING_NEW": "1"}, "ENVIRONMENT_CHANGED"),
        ((), {"LLAMA_ATTN_ROT_DISABLE": "1"}, "ENVIRONMENT_CHANGED"),
        ((), {"GGML_CUDA_DISABLE_FUSION": "1"}, "ENVIRONMENT_CHANGED"),
        ((), {"CUDA_VISIBLE_DEVICES": "1"}, "ENVIRONMENT_CHANGED"),
    ],
)
def test_each_fingerprinted_setting_changes_it(args: tuple[str, ...], env: dict[str, str], code: str) -> None:
    assert reason(fp(proc(*args, env=env)), fp(proc())) == code


def test_unreadable_environment_and_unseen_process_are_recorded() -> None:
    readable, unreadable = fp(proc()), fp(proc(unreadable_env=True))
    assert unreadable.components["environ"] == "unreadable"
    assert reason(unreadable, readable) == "ENVIRONMENT_CHANGED"
    assert fp(proc(unreadable_env=True)).digest == unreadable.digest  # stable
    remote = fp(None)
    assert remote.components["process"] == "not-found"
    assert reason(remote, readable) == "PROCESS_VISIBILITY_CHANGED"


def test_canary_is_a_component_and_the_most_specific_reason_wins() -> None:
    a = fp(proc(), canary="c1")
    assert reason(fp(proc(), canary="c2"), a) == "KV_CANARY_CHANGED"
    assert reason(fp(proc("-ctk", "q8_0"), canary="c2"), a) == "KV_LAYOUT_CHANGED"
    assert fp(proc(), canary="c1").digest == a.digest


def test_mismatch_against_an_older_fingerprint_format() -> None:
    old = {"backend": "llama.cpp", "cache_type_k": "f16", "model_path": "", "runtime_key": ""}
    assert fp(proc()).mismatch_reason(old) == "FINGERPRINT_FORMAT_CHANGED"  # saved by an older kvsidecar
    assert fp(proc()).mismatch_reason({**fp(proc()).components, "extra": 1}) == "FINGERPRINT_CHANGED"
    assert fp(proc()).mismatch_reason(None) == "FINGERPRINT_CHANGED"


# ---------------------------------------------------------------------------------- files named by settings


def rewrite_in_place(path: Path, data: bytes) -> None:
    """Same size, same inode, mtime put back; returns once the ctime has moved (timestamps are coarse)."""
    st = path.stat()
    with path.open("r+b") as f:
        f.write(data)
    while path.stat().st_ctime_ns == st.st_ctime_ns:  # bounded by one timestamp tick
        os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert path.stat().st_mtime_ns == st.st_mtime_ns and path.stat().st_size == st.st_size


def test_adapter_replaced_in_place_changes_the_fingerprint(tmp_path: Path) -> None:
    (tmp_path / "lora.gguf").write_bytes(b"adapter-1" * 100)
    digests = FileDigestCache(tmp_path / "d.json", racy_window_s=0)
    before = fp(proc("--lora", "lora.gguf", cwd=str(tmp_path)), digests=digests)  # relative to its cwd
    assert before.components["file:lora"] != json.dumps(["absent"])
    rewrite_in_place(tmp_path / "lora.gguf", b"adapter-2" * 100)
    after = fp(proc("--lora", "lora.gguf", cwd=str(tmp_path)), digests=digests)
    assert reason(after, before) == "LORA_CHANGED"
    unresolved = fp(proc("--lora", "lora.gguf"), digests=digests)  # cwd unknown: never a silent ""
    assert unresolved.components["file:lora"] == json.dumps(["unresolved"])


def test_config_files_and_libraries_are_digested(tmp_path: Path) -> None:
    digests = FileDigestCache(tmp_path / "d.json", racy_window_s=0)
    conf, lib = tmp_path / "config.ini", tmp_path / "libllama.so"
    lib.write_bytes(b"\x7fELF-1")
    absent = fp(proc(config=(str(conf),), libs=(str(lib),)), digests=digests)
    conf.write_text("[*]\nrope-freq-base = 5000\n")
    present = fp(proc(config=(str(conf),), libs=(str(lib),)), digests=digests)
    assert reason(present, absent) == "LLAMA_CONFIG_CHANGED"
    lib.write_bytes(b"\x7fELF-2")
    assert (
        reason(fp(proc(config=(str(conf),), libs=(str(lib),)), digests=digests), present) == "BUILD_CHANGED"
    )
    deleted = fp(proc(config=(str(conf),), libs=(f"{lib} (deleted)",)), digests=digests)
    assert deleted.components["server_libs"] == json.dumps(["deleted"])
    assert fp(proc(libs=None)).components["server_libs"] == "unreadable"


def test_model_replaced_in_place_changes_the_fingerprint(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"weights" * 1000)
    caps = BackendCapabilities(**{**CAPS.__dict__, "model_path": str(model)})
    digests = FileDigestCache(tmp_path / "d.json", racy_window_s=0)
    base = fp(proc(), caps=caps, digests=digests)
    assert fp(proc(), caps=caps, digests=digests).digest == base.digest
    rewrite_in_place(model, b"replaced" * 875)
    assert reason(fp(proc(), caps=caps, digests=digests), base) == "MODEL_FINGERPRINT_CHANGED"


# ---------------------------------------------------------------------------------- whole-file digests


def test_in_place_rewrite_with_mtime_put_back_gets_a_new_digest(tmp_path: Path) -> None:
    f = tmp_path / "model.gguf"
    f.write_bytes(os.urandom(3 << 20))
    cache = FileDigestCache(tmp_path / "digests.json", racy_window_s=0)
    d1 = cache.digest(f)
    rewrite_in_place(f, os.urandom(1 << 20))
    d2 = cache.digest(f)
    assert d1 is not None and d2 is not None and d1 != d2
    assert FileDigestCache(tmp_path / "digests.json").digest(f) == d2  # the persisted cache agrees


def test_same_size_file_differing_between_the_old_sample_windows(tmp_path: Path) -> None:
    # The old digest read 16 windows of 1 MiB: for 40 MiB the first two were [0, 1) and [2.6, 3.6) MiB.
    data = bytearray(40 << 20)
    f = tmp_path / "model.gguf"
    f.write_bytes(data)
    st = f.stat()
    first = FileDigestCache(tmp_path / "a.json").digest(f)
    data[(3 << 20) // 2] = 1  # 1.5 MiB: outside every old window
    replacement = tmp_path / "model.gguf.new"
    replacement.write_bytes(data)
    os.utime(replacement, ns=(st.st_atime_ns, st.st_mtime_ns))
    replacement.replace(f)
    assert FileDigestCache(tmp_path / "b.json").digest(f) != first


def test_an_unchanged_file_is_hashed_once(tmp_path: Path) -> None:
    f = tmp_path / "big.bin"
    f.write_bytes(os.urandom(3 << 20))
    cache = FileDigestCache(tmp_path / "digests.json", racy_window_s=0)
    d1 = cache.digest(f)
    assert d1 == file_digest(f)[0]
    assert cache.digest(f) == d1 and cache.digest(str(f)) == d1 and cache.computed == 1
    reopened = FileDigestCache(tmp_path / "digests.json")
    assert reopened.digest(f) == d1 and reopened.computed == 0  # persisted across restarts
    assert cache.digest(tmp_path / "missing") is None


def test_a_file_changed_moments_ago_is_not_cached(tmp_path: Path) -> None:
    f = tmp_path / "fresh.bin"
    f.write_bytes(b"x" * 100)
    cache = FileDigestCache(tmp_path / "digests.json", racy_window_s=3600)
    assert cache.digest(f) == cache.digest(f) and cache.computed == 2
    assert not (tmp_path / "digests.json").exists()


def test_a_file_changing_while_hashed_is_hashed_again(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    f = tmp_path / "growing.bin"
    f.write_bytes(b"a" * 1000)
    real_readv = os.readv
    appended: list[int] = []

    def readv_and_append(fd: int, buffers: list[bytearray]) -> int:
        if not appended:
            appended.append(1)
            with f.open("ab") as out:
                out.write(b"more")
        return real_readv(fd, buffers)

    monkeypatch.setattr(os, "readv", readv_and_append)
    cache = FileDigestCache(tmp_path / "digests.json", racy_window_s=0)
    got = cache.digest(f)
    monkeypatch.undo()
    assert got == file_digest(f)[0]  # the digest of the final content, not of a mix


def test_concurrent_calls_hash_a_file_once(tmp_path: Path) -> None:
    f = tmp_path / "big.bin"
    f.write_bytes(os.urandom(8 << 20))
    cache = FileDigestCache(tmp_path / "digests.json", racy_window_s=0)
    results: list[str | None] = []
    threads = [threading.Thread(target=lambda: results.append(cache.digest(f))) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(results)) == 1 and results[0] is not None and cache.computed == 1


def test_special_files_are_not_read(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    cache = FileDigestCache(tmp_path / "digests.json", racy_window_s=0)
    assert cache.digest(fifo) is None and cache.digest(tmp_path) is None


# ---------------------------------------------------------------------------------- the cache file (item 7)


def _valid_cache_text() -> str:
    return json.dumps({"version": 2, "entries": {"1:2:3:4:5": "0" * 32}})


@pytest.mark.parametrize(
    "content",
    [
        b"[" * 200_000,  # RecursionError in json
        b'{"version": 2, "entries": ' + b'{"a":' * 50_000 + b"1" + b"}" * 50_001,
        b'{"version": 2, "entries": {"1:2:3:4:5": 5}}',
        b'{"version": 2, "entries": {"../x|1|2": "' + b"0" * 32 + b'"}}',
        b'{"version": true, "entries": {}}',
        b'{"version": 2, "entries": {}, "extra": 1}',
        b'{"version": 2, "entries": []}',
        b'{"/m.gguf|1|2|3": "abc"}',  # the previous format
        b"\xff\xfe\x00garbage",
        b"",
        b'{"version": 2, "entries": {'
        + b",".join(b'"%d:0:0:0:0": "%s"' % (i, b"0" * 32) for i in range(600))
        + b"}}",
        b" " * (2 << 20) + _valid_cache_text().encode(),  # over the size cap
    ],
)
def test_a_bad_cache_file_starts_an_empty_cache(
    tmp_path: Path, content: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "digests.json"
    path.write_bytes(content)
    with caplog.at_level(logging.WARNING, logger="kvsidecar.fingerprint"):
        cache = FileDigestCache(path, racy_window_s=0)
    assert "kv.digest_cache.ignored" in caplog.text
    f = tmp_path / "m.bin"
    f.write_bytes(b"model")
    assert cache.digest(f) == file_digest(f)[0]  # and the cache still works, rewriting a valid file
    assert fpmod.load_digest_cache(path) == {fpmod.file_identity(f.stat()): file_digest(f)[0]}


def test_a_cache_file_behind_a_symlink_or_a_directory_is_not_read(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    target = tmp_path / "elsewhere.json"
    target.write_text(_valid_cache_text())
    (tmp_path / "link.json").symlink_to(target)
    (tmp_path / "dir.json").mkdir()
    with caplog.at_level(logging.WARNING, logger="kvsidecar.fingerprint"):
        assert fpmod.load_digest_cache(tmp_path / "link.json") == {}
        assert fpmod.load_digest_cache(tmp_path / "dir.json") == {}
    assert caplog.text.count("kv.digest_cache.ignored") == 2
    assert fpmod.load_digest_cache(target) == {"1:2:3:4:5": "0" * 32}
    assert fpmod.load_digest_cache(tmp_path / "absent.json") == {}


# ---------------------------------------------------------------------------------- process discovery


@pytest.fixture
def fake_llama(tmp_path: Path) -> Iterator[Callable[..., subprocess.Popen[bytes]]]:
    """Processes named llama-server (a link to sleep) with the environment given; all killed at the end."""
    link = tmp_path / "llama-server"
    link.symlink_to(shutil.which("sleep") or "/bin/sleep")
    started: list[subprocess.Popen[bytes]] = []

    def start(env: dict[str, str]) -> subprocess.Popen[bytes]:
        child = subprocess.Popen([str(link), "600"], env={**os.environ, **env}, cwd=tmp_path)
        started.append(child)
        return child

    yield start
    for child in started:
        child.kill()
        child.wait()


def test_process_found_by_a_port_given_in_its_environment(
    fake_llama: Callable[..., subprocess.Popen[bytes]], tmp_path: Path
) -> None:
    port = free_port()
    child = fake_llama({"LLAMA_ARG_PORT": str(port), "LLAMA_ARG_CACHE_TYPE_K": "q8_0", "HF_TOKEN": "sekrit"})
    wait_exec(child)
    found = find_llama_process(f"http://127.0.0.1:{port}")
    assert found is not None and found.pid == child.pid
    assert found.environ is not None and "HF_TOKEN" not in found.environ
    assert found.settings.effective("cache-type-k") == "q8_0" and found.cwd == str(tmp_path)
    assert found.binary == f"/proc/{child.pid}/exe"
    comp = fp(found, digests=FileDigestCache(tmp_path / "d.json")).components
    assert comp["arg:cache-type-k"] == '["q8_0"]' and comp["server_binary"] not in ("", "unreadable")
    second = fake_llama({"LLAMA_ARG_PORT": str(port)})  # a second process claims the port: neither is trusted
    wait_exec(second)
    assert find_llama_process(f"http://127.0.0.1:{port}") is None


def wait_exec(child: subprocess.Popen[bytes]) -> None:
    """Until the child runs the fake llama-server (its exec done: psutil reads its new command line)."""
    eventually(lambda: exec_done(child), interval_s=0.001, what="the fake llama-server to start")


def exec_done(child: subprocess.Popen[bytes]) -> bool:
    if child.poll() is not None:
        raise AssertionError("the fake llama-server exited")
    assert isinstance(child.args, list), child.args
    try:
        return psutil.Process(child.pid).cmdline()[:1] == [str(child.args[0])]
    except psutil.Error:
        return False


def test_files_are_read_under_the_process_root(tmp_path: Path) -> None:
    rootfs = tmp_path / "rootfs"
    (rootfs / "models").mkdir(parents=True)
    (rootfs / "models" / "m.gguf").write_bytes(b"inside the container")
    (tmp_path / "exe").write_bytes(b"binary")
    caps = BackendCapabilities(**{**CAPS.__dict__, "model_path": "/models/m.gguf"})
    st = (rootfs / "models" / "m.gguf").stat()
    process = ProcessInfo(
        pid=10,
        create_time=1.0,
        exe="/usr/bin/llama-server",
        cmdline=("llama-server",),
        flags={},
        environ={},
        root=str(rootfs),
        binary=str(tmp_path / "exe"),  # /proc/<pid>/exe: a path of our own view, not under its root
        libraries=(),
        mapped_models=(  # the model as its /proc/<pid>/maps shows it: its device and inode
            MappedFile(
                path="/models/m.gguf", deleted=False, dev=st.st_dev, ino=st.st_ino, ranges=((0, 4096),)
            ),
        ),
    )
    digests = FileDigestCache(tmp_path / "d.json", racy_window_s=0)
    comp = fp(process, caps=caps, digests=digests).components
    assert comp["model_file"] == json.dumps([file_digest(rootfs / "models" / "m.gguf")[0]])
    assert comp["server_binary"] == file_digest(tmp_path / "exe")[0]
