"""Doctor's process checks: which program runs the server (llama-server, or the unified binary's `llama
serve`), and the model's memory class (a hybrid model's restore is reused only by an exact extension)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvsidecar.backend.base import BackendCapabilities
from kvsidecar.doctor.llama import process_checks
from kvsidecar.doctor.report import Check, DoctorReport
from kvsidecar.fingerprint.llama_process import ProcessInfo
from kvsidecar.fingerprint.llama_settings import parse_flags
from kvsidecar.fingerprint.server_memory import read_server_memory
from kvsidecar.testing.arch_models import GEMMA3_SWA, QWEN35, generate_arch_model
from tests.unit.gguf_helpers import write_vocab
from tests.unit.memory_helpers import plain_gguf


@pytest.fixture(scope="module")
def vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_vocab(tmp_path_factory.mktemp("vocab"))


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    return plain_gguf(tmp_path)


def _run(model: str, *argv: str, environ: dict[str, str] | None = None) -> dict[str, Check]:
    caps = BackendCapabilities(
        kind="llama.cpp",
        alive=True,
        slots_endpoint=True,
        total_slots=1,
        n_ctx=16384,
        model_path=model,
        build_info="b",
    )
    cmdline = (*argv, "-m", model, "--port", "8080")
    process = ProcessInfo(
        pid=42,
        create_time=1.0,
        exe=None,
        cmdline=cmdline,
        flags=parse_flags(cmdline),
        environ={} if environ is None else environ,
        mapped_models=None,
        program="llama serve" if argv[1:2] == ("serve",) else "llama-server",
    )
    if environ is not None and "unreadable" in environ:
        process = replace(process, environ=None)
    report = DoctorReport(server="local", endpoint="http://127.0.0.1:8080")
    process_checks(report, caps, process, "local", read_server_memory(caps, process))
    return {c.name: c for c in report.checks}


def test_a_hybrid_model_is_named_with_what_a_restore_gives(vocab: Path, tmp_path: Path) -> None:
    """A hybrid model is not a warning (it made every hybrid set-up DEGRADED): kvsidecar restores it only
    where llama-server reuses the restore, and says so."""
    model = str(generate_arch_model(QWEN35, vocab_dir=vocab, out_dir=tmp_path))
    checks = _run(model, "/opt/llama/llama", "serve")
    assert checks["llama-server process"].detail.startswith("pid 42 (llama serve);")
    memory = checks["model memory"]
    assert memory.status == "OK"
    assert "hybrid model (qwen35: 3 gated-delta-net layers, 1 attention layers)" in memory.detail
    assert "extends the saved tokens exactly; kvsidecar restores only then" in memory.detail
    assert "32 context checkpoints" in memory.detail
    no_ckpt = _run(model, "/usr/bin/llama-server", "--ctx-checkpoints", "0")["model memory"]
    assert "checkpoints" not in no_ckpt.detail


def test_a_sliding_window_model_without_swa_full_gets_the_fix_and_its_memory_figure(
    vocab: Path, tmp_path: Path
) -> None:
    model = str(generate_arch_model(GEMMA3_SWA, vocab_dir=vocab, out_dir=tmp_path))
    swa = _run(model, "/usr/bin/llama-server", "-np", "1")
    assert "sliding-window attention" not in swa  # one check says it all
    memory = swa["model memory"]
    assert memory.status == "WARN"
    assert "sliding-window model (gemma3, window 128) without --swa-full" in memory.detail
    assert "kvsidecar saves nothing on this server" in memory.detail
    # the generated model's 5 SWA layers of 1 KV head of 64 (f16): 768 cells without, 16K with it
    assert memory.fix == (
        "add --swa-full to llama-server: --swa-full takes the SWA cache from 0.94 to 20 MiB "
        "(768 -> 16,384 cells, 5 layers)"
    )
    full = _run(model, "/usr/bin/llama-server", "--swa-full")["model memory"]
    assert full.status == "OK" and "within one token of their end" in full.detail
    from_env = _run(model, "/usr/bin/llama-server", environ={"LLAMA_ARG_SWA_FULL": "1"})["model memory"]
    assert from_env.status == "OK"
    # the environment unreadable: --swa-full may be set there; nothing is claimed, nothing switched off
    hidden = _run(model, "/usr/bin/llama-server", environ={"unreadable": ""})["model memory"]
    assert hidden.status == "WARN" and "until it can tell" in hidden.detail


def test_other_classes_and_unreadable_models(vocab: Path, tmp_path: Path, tiny_gguf: Path) -> None:
    plain = _run(str(tiny_gguf), "/usr/bin/llama-server")["model memory"]
    assert plain.status == "OK" and "any common prefix" in plain.detail
    missing = _run(str(tmp_path / "gone.gguf"), "/usr/bin/llama-server")
    assert missing["model memory"].status == "SKIP"
