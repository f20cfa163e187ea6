"""llama.cpp's unified binary, built by scripts/provision-llama-server beside llama-server: `llama serve` is
the same server, and process discovery, the fingerprint, the option reader and doctor recognize it, run
directly (comm `llama`, `/proc/<pid>/cmdline` `llama serve -m ...`) and as a router's child (started so by
the router, with LLAMA_APP_CMD=serve in its environment)."""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsidecar.backend.base import BackendCapabilities
from kvsidecar.fingerprint.file_digests import FileDigestCache, file_digest
from kvsidecar.fingerprint.llama_process import ProcessInfo, find_llama_process
from kvsidecar.fingerprint.runtime import build_fingerprint
from kvsidecar.testing.llama import LlamaServer, complete, free_port, llama_app_binary, words
from kvsidecar.testing.poll import eventually
from tests.integration.test_cli_doctor_real import cli, write_config


@pytest.fixture(scope="module")
def llama_app() -> Path:
    return llama_app_binary()


@pytest.fixture
def serve(llama_app: Path, tiny_model: Path, tmp_path: Path) -> Iterator[LlamaServer]:
    server = LlamaServer(
        binary=llama_app,
        subcommand="serve",
        model=tiny_model,
        slot_save_path=tmp_path / "slots",
        log_path=tmp_path / "llama.log",
        ctx_size=2048,
        extra_args=("--cache-ram", "0"),
    )
    server.start()
    yield server
    server.stop()


def _caps(server: LlamaServer, model: Path) -> BackendCapabilities:
    props = httpx.get(server.base_url + "/props", timeout=10).json()
    return BackendCapabilities(
        kind="llama.cpp",
        alive=True,
        slots_endpoint=True,
        total_slots=1,
        n_ctx=2048,
        model_path=str(model),
        build_info=props.get("build_info"),
        props=props,
    )


def test_llama_serve_is_found_and_read_past_its_subcommand(
    serve: LlamaServer, llama_app: Path, tiny_model: Path, tmp_path: Path
) -> None:
    assert Path(f"/proc/{serve.pid}/comm").read_text().strip() == "llama"
    assert complete(serve.base_url, words("app", 100))["prompt_n"] > 50  # it is the server, decoding
    found = find_llama_process(serve.base_url)
    assert found is not None and found.pid == serve.pid
    assert found.program == "llama serve"
    assert found.cmdline[1] == "serve"
    assert found.settings.effective("ctx-size") == "2048" and found.flags["cache_ram"] == "0"
    assert found.settings.effective("model") == str(tiny_model)
    assert "?positional" not in found.settings.values  # `serve` is no setting
    fp = build_fingerprint(
        caps=_caps(serve, tiny_model),
        process=found,
        runtime_key=None,
        digests=FileDigestCache(tmp_path / "digests.json"),
    )
    assert fp.components["server_binary"] == file_digest(llama_app)[0]  # the unified binary's own bytes
    assert fp.components["process"] == "local" and "arg:?positional" not in fp.components
    assert fp.info["cmdline"].split()[1] == "serve"


def test_doctor_checks_llama_serve(serve: LlamaServer, tmp_path: Path) -> None:
    # (the verdict is not asserted: doctor also reads the host's kernel log, where other servers' crashes
    # on a shared machine show)
    _, out, _ = cli(write_config(tmp_path, serve), "doctor", "--offline")
    assert f"OK    llama-server process: pid {serve.pid} (llama serve)" in out
    assert "OK    model identity" in out  # the model it maps is proven, as for llama-server


@pytest.fixture
def router(
    llama_app: Path, tiny_model: Path, tmp_path: Path
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    models = tmp_path / "models"
    models.mkdir()
    (models / "tiny.gguf").symlink_to(tiny_model)
    port = free_port()
    log = (tmp_path / "router.log").open("wb")
    cmd = [str(llama_app), "serve", "--models-dir", str(models), "--host", "127.0.0.1", "--port", str(port)]
    cmd += ["-c", "1024", "--no-webui", "--cache-ram", "0"]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    try:
        yield f"http://127.0.0.1:{port}", proc
    finally:
        os.killpg(proc.pid, signal.SIGTERM)  # the router and the children it started, by its group id
        proc.wait(timeout=30)


def _child_port(base: str) -> int | None:
    with httpx.Client(timeout=5) as http:
        models: list[dict[str, Any]] = http.get(base + "/models").json()["data"]
    for m in models:
        status = m.get("status") or {}
        args = [str(a) for a in status.get("args") or []]
        if status.get("value") == "loaded" and "--port" in args:
            return int(args[args.index("--port") + 1])
    return None


def test_a_routers_child_is_llama_serve(router: tuple[str, subprocess.Popen[bytes]]) -> None:
    base, _ = router
    eventually(lambda: _up(base), timeout_s=60, what="the router to answer")
    body = {"model": "tiny", "prompt": words("child", 40), "n_predict": 2}
    assert httpx.post(base + "/completion", json=body, timeout=300).status_code == 200
    port = eventually(lambda: _child_port(base), timeout_s=60, what="the child's port in /models")
    child = find_llama_process(f"http://127.0.0.1:{port}")
    assert child is not None and child.program == "llama serve"
    assert child.cmdline[1] == "serve"  # the router re-injects the subcommand
    assert child.environ is not None and child.environ.get("LLAMA_APP_CMD") == "serve"
    assert child.settings.effective("port") == str(port)
    assert isinstance(child, ProcessInfo) and "?positional" not in child.settings.values


def _up(base: str) -> bool:
    try:
        return httpx.get(base + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False
