"""Doctor's process checks: which program runs the server (llama-server, or the unified binary's `llama
serve`), and the model's memory class (a hybrid model's restore is reused only by an exact extension)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsidecar.backend.base import BackendCapabilities
from kvsidecar.doctor.llama import process_checks
from kvsidecar.doctor.report import Check, DoctorReport
from kvsidecar.fingerprint.llama_process import ProcessInfo
from kvsidecar.fingerprint.llama_settings import parse_flags
from kvsidecar.testing.arch_models import GEMMA3_SWA, QWEN35, generate_arch_model
from tests.unit.gguf_helpers import write_vocab


@pytest.fixture(scope="module")
def vocab(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_vocab(tmp_path_factory.mktemp("vocab"))


def _run(model: str, *argv: str) -> dict[str, Check]:
    caps = BackendCapabilities(
        kind="llama.cpp",
        alive=True,
        slots_endpoint=True,
        total_slots=1,
        n_ctx=4096,
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
        environ={},
        mapped_models=None,
        program="llama serve" if argv[1:2] == ("serve",) else "llama-server",
    )
    report = DoctorReport(server="local", endpoint="http://127.0.0.1:8080")
    process_checks(report, caps, process, "local")
    return {c.name: c for c in report.checks}


def test_a_hybrid_model_is_named_with_what_a_restore_gives(vocab: Path, tmp_path: Path) -> None:
    model = str(generate_arch_model(QWEN35, vocab_dir=vocab, out_dir=tmp_path))
    checks = _run(model, "/opt/llama/llama", "serve")
    assert checks["llama-server process"].detail.startswith("pid 42 (llama serve);")
    memory = checks["model memory"]
    assert memory.status == "WARN"
    assert "hybrid model (qwen35: 3 gated-delta-net layers, 1 attention layers)" in memory.detail
    assert "extends every saved token" in memory.detail and "32 context checkpoints" in memory.detail
    no_ckpt = _run(model, "/usr/bin/llama-server", "--ctx-checkpoints", "0")["model memory"]
    assert "checkpoints" not in no_ckpt.detail


def test_other_classes_and_unreadable_models(vocab: Path, tmp_path: Path) -> None:
    swa = _run(
        str(generate_arch_model(GEMMA3_SWA, vocab_dir=vocab, out_dir=tmp_path)), "/usr/bin/llama-server"
    )
    assert "model memory" not in swa and swa["sliding-window attention"].status == "WARN"
    assert swa["llama-server process"].detail.startswith("pid 42 (llama-server);")
    missing = _run(str(tmp_path / "gone.gguf"), "/usr/bin/llama-server")
    assert missing["model memory"].status == "SKIP"
