"""Prove that a llama-server binary works on this CPU: one real decode of a model with quantized weights.

`llama-server --version` runs no compute kernel, so a build whose kernels die on this CPU (SIGILL in ggml's
AMX matmul on some Intel Xeon VMs, seen in issue 25) looks healthy until its first decode. This module starts
the binary on a loopback port with a small model whose weights are quantized (the crashing kernels are the
q8_0/q4 ones; an f16 model never reaches them), waits for the warm-up decode, runs one completion long enough
to take the batched matmul path, and checks that the process is still alive afterwards.

Used by `scripts/provision-llama-server` (a build that fails is never cached; a cached one that fails is
rebuilt) and by `kvsidecar doctor` (the same check on a user's own binary). Standard library only, so the
build script can run it with any Python 3.11.

    python -m kvsidecar.buildcheck smoke BINARY MODEL    # exit 0: decoded; 1: failed (the reason on stderr)
    python -m kvsidecar.buildcheck smoke llama MODEL --subcommand serve   # llama.cpp's unified binary
    python -m kvsidecar.buildcheck cpu-key               # what the build cache is keyed by on this machine
    python -m kvsidecar.buildcheck isa-flags             # GGML_* CMake options for this CPU, AMX left out
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import http.client
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

# Bumped when the build recipes change, so that every cached build is rebuilt under the new ones.
# 3: the unified binary (`llama`, llama.cpp's llama-app target) is built and cached beside llama-server.
RECIPE_VERSION = "3"

# The CPU features a ggml CPU build can be compiled for; the ones that decide whether a cached build is valid.
_ISA_PREFIXES = ("sse", "ssse3", "avx", "amx", "fma", "f16c", "bmi", "vnni", "vbmi", "vpopcnt", "gfni", "sha")

# /proc/cpuinfo flag -> the GGML_* option that compiles for it (GGML_NATIVE=OFF). AMX is left out on purpose:
# ggml's AMX kernels are what crashed (issue 25), and the other options cover the same matmuls.
_ISA_OPTIONS: tuple[tuple[str, str], ...] = (
    ("sse4_2", "GGML_SSE42"),
    ("avx", "GGML_AVX"),
    ("avx2", "GGML_AVX2"),
    ("fma", "GGML_FMA"),
    ("f16c", "GGML_F16C"),
    ("bmi2", "GGML_BMI2"),
    ("avx_vnni", "GGML_AVX_VNNI"),
    ("avx512f", "GGML_AVX512"),
    ("avx512vbmi", "GGML_AVX512_VBMI"),
    ("avx512_vnni", "GGML_AVX512_VNNI"),
    ("avx512_bf16", "GGML_AVX512_BF16"),
)

# What the smoke completion asks: enough prompt tokens for the batched (prompt-processing) matmul path, and a
# few generated tokens for the vector path.
_SMOKE_PROMPT = " ".join(["The quick brown fox jumps over the lazy dog."] * 24)
_SMOKE_PREDICT = 4


def cpu_info(text: str | None = None) -> tuple[str, frozenset[str]]:
    """(model name, flags) of the first CPU in /proc/cpuinfo; ("", {}) where there is none (not Linux)."""
    if text is None:
        try:
            text = Path("/proc/cpuinfo").read_text(errors="replace")
        except OSError:
            return "", frozenset()
    model, flags = "", frozenset[str]()
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if not sep:
            continue
        key = key.strip().lower()
        if key in ("model name", "cpu model", "uarch") and not model:
            model = value.strip()
        elif key in ("flags", "features") and not flags:
            flags = frozenset(value.split())
    return model, flags


def isa_flags(flags: frozenset[str]) -> list[str]:
    """The CPU's SIMD features, sorted: what an error message names and what the cache key covers."""
    return sorted(f for f in flags if f.startswith(_ISA_PREFIXES))


def cpu_key(machine: str, model: str, flags: frozenset[str]) -> str:
    """16 hex digits naming what makes a build valid here: recipe version, architecture, CPU model, ISA flags.

    Two machines of one kind with different CPUs (an AMD EPYC, an AMX Xeon) get different keys, so a build
    made on one is never taken for the other's."""
    text = "\n".join([RECIPE_VERSION, machine, model, " ".join(isa_flags(flags))])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def isa_cmake_options(flags: frozenset[str]) -> list[str]:
    """`-DGGML_*=ON|OFF` for a GGML_NATIVE=OFF build with exactly the features this CPU lists, AMX off."""
    options = [f"-D{option}={'ON' if flag in flags else 'OFF'}" for flag, option in _ISA_OPTIONS]
    options += ["-DGGML_AMX_TILE=OFF", "-DGGML_AMX_INT8=OFF", "-DGGML_AMX_BF16=OFF"]
    return options


@dataclass(frozen=True, kw_only=True)
class SmokeResult:
    ok: bool
    detail: str
    returncode: int | None = None  # the process's exit status where it died (negative: killed by a signal)
    log_tail: str = ""

    @property
    def signal_name(self) -> str | None:
        if self.returncode is None or self.returncode >= 0:
            return None
        try:
            return signal.Signals(-self.returncode).name
        except ValueError:
            return f"signal {-self.returncode}"


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _request(
    port: int, method: str, path: str, body: dict[str, object] | None, timeout: float
) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        payload = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if payload is not None else {}
        conn.request(method, path, body=payload, headers=headers)
        response = conn.getresponse()
        return response.status, response.read()
    finally:
        conn.close()


def smoke_decode(
    binary: Path | str,
    model: Path | str,
    *,
    timeout_s: float = 180.0,
    threads: int | None = None,
    extra_args: tuple[str, ...] = (),
    subcommand: str | None = None,
) -> SmokeResult:
    """Start `binary` on `model`, wait for its warm-up decode, run one completion, stop it. `subcommand`:
    the server's subcommand of a multi-tool binary (`llama serve`)."""
    port = _free_port()
    cmd = [str(binary), *([subcommand] if subcommand else [])]
    cmd += ["-m", str(model), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-c", "1024", "--parallel", "1", "--no-webui", *extra_args]
    if threads is not None:
        cmd += ["-t", str(threads)]
    deadline = time.monotonic() + timeout_s
    with tempfile.TemporaryFile() as log:
        try:
            proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
        except OSError as e:
            return SmokeResult(ok=False, detail=f"could not start {binary}: {e}")
        try:
            result = _drive(proc, port, deadline)
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        if result.ok:
            return result
        log.seek(0)
        tail = b"".join(deque(log, maxlen=30)).decode(errors="replace")
        return SmokeResult(ok=False, detail=result.detail, returncode=result.returncode, log_tail=tail)


def _died(proc: subprocess.Popen[bytes], when: str) -> SmokeResult:
    code = proc.returncode
    name = SmokeResult(ok=False, detail="", returncode=code).signal_name
    how = f"was killed by {name}" if name else f"exited with status {code}"
    return SmokeResult(ok=False, detail=f"llama-server {how} {when}", returncode=code)


def _drive(proc: subprocess.Popen[bytes], port: int, deadline: float) -> SmokeResult:
    not_ready = _wait_ready(proc, port, deadline)
    if not_ready is not None:
        return not_ready
    body = {"prompt": _SMOKE_PROMPT, "n_predict": _SMOKE_PREDICT, "temperature": 0, "cache_prompt": False}
    try:
        timeout = max(1.0, deadline - time.monotonic())
        status, raw = _request(port, "POST", "/completion", body, timeout=timeout)
    except OSError as e:
        # A dropped connection is most often the process dying: give it a moment to be reaped.
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=2)
        if proc.returncode is not None:
            return _died(proc, "during its first completion")
        return SmokeResult(ok=False, detail=f"the first completion failed: {e}")
    time.sleep(0.2)  # a crash in a worker thread after the answer went out still counts
    if proc.poll() is not None:
        return _died(proc, "right after its first completion")
    if status != 200:
        return SmokeResult(ok=False, detail=f"the first completion answered HTTP {status}: {raw[:200]!r}")
    return _decoded(raw)


def _wait_ready(proc: subprocess.Popen[bytes], port: int, deadline: float) -> SmokeResult | None:
    """None once /health answers 200 (it answers 503 while the model loads and runs its warm-up decode)."""
    while True:
        if proc.poll() is not None:
            return _died(proc, "while loading the model (its warm-up decode)")
        if time.monotonic() > deadline:
            return SmokeResult(ok=False, detail="llama-server did not become ready before the deadline")
        with contextlib.suppress(OSError):
            if _request(port, "GET", "/health", None, timeout=2)[0] == 200:
                return None
        time.sleep(0.1)


def _decoded(raw: bytes) -> SmokeResult:
    try:
        answer = json.loads(raw)
    except ValueError:
        return SmokeResult(ok=False, detail="the first completion's answer is not JSON")
    timings = answer.get("timings") if isinstance(answer, dict) else None
    predicted = timings.get("predicted_n") if isinstance(timings, dict) else None
    prompt_n = timings.get("prompt_n") if isinstance(timings, dict) else None
    if not isinstance(predicted, int) or predicted < 1 or not isinstance(prompt_n, int) or prompt_n < 32:
        return SmokeResult(ok=False, detail=f"the first completion decoded nothing: timings {timings!r}")
    return SmokeResult(ok=True, detail=f"decoded {predicted} tokens after a {prompt_n}-token prompt")


def failure_message(result: SmokeResult, *, binary: str, flags: frozenset[str], model_name: str = "") -> str:
    """What failed, on which CPU, and what to do: for the build script's error and `doctor`."""
    isa = isa_flags(flags)
    lines = [f"{binary}: {result.detail}."]
    lines.append(f"CPU: {model_name or 'unknown'}; SIMD flags: {' '.join(isa) or 'none listed'}.")
    sig = result.signal_name
    if sig in ("SIGILL", "SIGSEGV", "SIGBUS"):
        lines.append(
            f"{sig} at the first decode means the build runs instructions this CPU (or its VM) does not "
            "execute: the binary was compiled for another CPU, or with kernels that crash here (ggml's AMX "
            "kernels on some Xeon VMs)."
        )
    if any(f.startswith("amx") for f in isa):
        lines.append(
            "This CPU lists AMX: build llama.cpp without it (-DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF "
            "-DGGML_AMX_BF16=OFF, and -mno-amx-tile -mno-amx-int8 -mno-amx-bf16 with GGML_NATIVE=ON)."
        )
    lines.append(
        "What to do: rebuild llama-server on this machine (scripts/provision-llama-server builds, checks and "
        "caches one that decodes here), or build with -DGGML_NATIVE=OFF and only the features listed above."
    )
    return "\n".join(lines)


def _main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvsidecar.buildcheck", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    smoke = sub.add_parser("smoke", help="one real decode; exit 1 if it fails")
    smoke.add_argument("binary")
    smoke.add_argument("model")
    smoke.add_argument("--timeout", type=float, default=180.0)
    smoke.add_argument("--subcommand", choices=["serve", "server"], help="for llama.cpp's unified binary")
    sub.add_parser("cpu-key", help="the build cache key for this machine")
    sub.add_parser("isa-flags", help="GGML_* CMake options for this CPU (AMX off)")
    args = parser.parse_args(argv)
    model_name, flags = cpu_info()
    if args.command == "cpu-key":
        print(cpu_key(platform.machine(), model_name, flags))
        return 0
    if args.command == "isa-flags":
        print(" ".join(isa_cmake_options(flags)))
        return 0
    result = smoke_decode(args.binary, args.model, timeout_s=args.timeout, subcommand=args.subcommand)
    if result.ok:
        print(f"smoke: {result.detail}")
        return 0
    print(failure_message(result, binary=args.binary, flags=flags, model_name=model_name), file=sys.stderr)
    if result.log_tail:
        print("--- llama-server log (last lines) ---", file=sys.stderr)
        print(result.log_tail.rstrip(), file=sys.stderr)
    return 1


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(_main())
