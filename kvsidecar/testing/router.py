"""A real llama-server router for the tests and the benchmark: started without a model, `--models-dir` with
generated models, `--models-max`, and what they ask of it (its models' states, a child's pid, kill -9)."""

from __future__ import annotations

import contextlib
import shutil
import signal
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil

from kvsidecar.testing.llama import free_port, serving_args
from kvsidecar.testing.models import ModelShape, generate_llama_model
from kvsidecar.testing.poll import eventually


def models_dir(out: Path, binary: Path, vocab: Path, names: dict[str, int]) -> Path:
    """`out` holding one generated tiny model per name (its value: the weights' seed), as `NAME.gguf`."""
    out.mkdir(parents=True, exist_ok=True)
    for name, seed in names.items():
        src = generate_llama_model(ModelShape(seed=seed), vocab_dir=vocab)
        shutil.copyfile(src, out / f"{name}.gguf")
    return out


@dataclass(kw_only=True)
class LlamaRouter:
    binary: Path
    models_dir: Path
    slot_save_path: Path
    log_path: Path
    models_max: int = 1
    ctx_size: int = 4096
    parallel: int = 2
    threads: int = 2
    extra_args: tuple[str, ...] = ("--cache-ram", "0")
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        return [
            str(self.binary),
            "--models-dir",
            str(self.models_dir),
            "--models-max",
            str(self.models_max),
            *serving_args(self.port, self.ctx_size, self.parallel, self.threads),
            "--slot-save-path",
            str(self.slot_save_path),
            *self.extra_args,
        ]

    def start(self, *, timeout_s: float = 60.0) -> LlamaRouter:
        self.slot_save_path.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(
                self.command(), stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        eventually(lambda: self.states() != {}, timeout_s=timeout_s, what="the router to list its models")
        return self

    def models(self) -> list[dict[str, Any]]:
        with contextlib.suppress(httpx.HTTPError, ValueError):
            data = httpx.get(f"{self.base_url}/models", timeout=5).json()
            return [m for m in data.get("data", []) if isinstance(m, dict)]
        return []

    def states(self) -> dict[str, str]:
        """Each model's status as the router says it: unloaded, loading, loaded, ..."""
        return {m["id"]: m["status"]["value"] for m in self.models()}

    def child_pid(self, model: str) -> int:
        """The pid of the child serving `model` (the router's child with `--alias MODEL`)."""
        assert self.proc is not None
        for child in psutil.Process(self.proc.pid).children():
            args = child.cmdline()
            if "--alias" in args and args[args.index("--alias") + 1] == model:
                return child.pid
        raise AssertionError(f"no child of the router serves {model!r}")

    def kill_child(self, model: str) -> None:
        """kill -9 of the model's child: what a crash looks like."""
        psutil.Process(self.child_pid(model)).send_signal(signal.SIGKILL)

    def unload(self, model: str) -> None:
        httpx.post(f"{self.base_url}/models/unload", json={"model": model}, timeout=30).raise_for_status()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=10)
