"""`doctor --deep` (the specification's §61 check) on a real llama-server, per memory class: a plain model, a
gated-delta-net hybrid (qwen35), a Mamba2 hybrid (granitehybrid), and a sliding-window model (the generated
gemma3-swa, window 128, and Gemma 3 270M, window 512) with and without --swa-full. Each answers its
verdict (supported / broken) with the evidence: what llama-server reused after a restore for the same
prompt plus new tokens and for one diverging before the saved end, the SWA positions the file holds, and
what a snapshot costs a token and fixed (docs/MODELS.md), which the model memory check predicts from the
model."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvsidecar.testing.arch_models import GEMMA3_SWA, GRANITE_HYBRID, QWEN35, generate_arch_model
from kvsidecar.testing.llama import LlamaServer, free_port, vocab_dir
from kvsidecar.testing.models import gemma3_270m
from tests.conftest import StartServer

DIVERGE = 3  # doctor.restore_check.DIVERGE


def deep_doctor(tmp_path: Path, server: LlamaServer) -> tuple[int, dict[str, Any]]:
    """`kvsidecar doctor --deep --offline --json` against `server`: its exit code and its one server."""
    (tmp_path / "token").write_text("doctor-classes-token-0123456789")
    local = {"base_url": server.base_url, "snapshot_dir": str(server.slot_save_path)}
    cfg = {
        "state_dir": str(tmp_path / "state"),
        "servers": {"local": local},
        "api": {"listen": f"127.0.0.1:{free_port()}", "token_file": str(tmp_path / "token")},
    }
    config = tmp_path / "config.yaml"
    config.write_text(yaml.safe_dump(cfg))
    args = [sys.executable, "-m", "kvsidecar", "-c", str(config), "doctor", "--deep", "--offline", "--json"]
    r = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert r.stdout, r.stderr
    servers = json.loads(r.stdout)["servers"]
    assert len(servers) == 1
    assert server.slot_save_path is not None and not list(server.slot_save_path.iterdir())  # probes gone
    return r.returncode, servers[0]


def checks(found: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in found["checks"]}


def test_a_plain_model_is_supported_for_any_common_prefix(start_llama: StartServer, tmp_path: Path) -> None:
    code, found = deep_doctor(tmp_path, start_llama())
    assert code == 0 and found["result"] == "READY", found
    compat = found["compatibility"]
    ev = compat["evidence"]
    assert compat["verdict"] == "supported" and compat["memory"]["class"] == "plain"
    assert ev["extension_reused"] >= ev["saved_tokens"] == ev["cold_tokens"]
    assert ev["divergent_reused"] == ev["saved_tokens"] - DIVERGE  # the common prefix
    # the tiny llama: 4 layers x (K + V) of 512 f16 values a cell, plus the cell's own 16 bytes
    assert (ev["bytes_per_token"], ev["fixed_bytes"]) == (4112, 148)
    memory = checks(found)["model memory"]["detail"]
    assert "any common prefix" in memory and "(a snapshot costs 4,112 B a token + about 0 B fixed)" in memory


@pytest.mark.parametrize(
    ("shape", "recurrent", "per_token", "fixed"),
    [(QWEN35, "gated-delta-net", 540, 215_208), (GRANITE_HYBRID, "mamba2", 528, 416_424)],
    ids=["qwen35", "granitehybrid"],
)
def test_a_hybrid_model_is_supported_for_exact_extensions_only(
    start_llama: StartServer,
    llama_bin: Path,
    tmp_path: Path,
    shape: Any,
    recurrent: str,
    per_token: int,
    fixed: int,
) -> None:
    model = generate_arch_model(shape, vocab_dir=vocab_dir(llama_bin))
    code, found = deep_doctor(tmp_path, start_llama(model=model, ctx_size=2048))
    assert code == 0 and found["result"] == "READY", found  # a hybrid model is no longer a warning
    memory = checks(found)["model memory"]
    assert memory["status"] == "OK" and f"3 {recurrent} layers, 1 attention layers" in memory["detail"]
    # predicted from the model (status says the same) and measured by the check: the same bytes a token
    assert f"(a snapshot costs {per_token} B a token + about " in memory["detail"]
    compat = found["compatibility"]
    ev = compat["evidence"]
    assert compat["verdict"] == "supported" and compat["memory"]["class"] == "hybrid"
    assert ev["extension_reused"] >= ev["saved_tokens"] > 0
    assert ev["divergent_reused"] == 0  # any divergence: llama-server recomputes the whole prompt
    # the one attention layer's cell and the cell's own bytes a token; the recurrent state fixed
    assert (ev["bytes_per_token"], ev["fixed_bytes"]) == (per_token, fixed)
    deep = checks(found)["restore compatibility (deep)"]
    assert f"a snapshot costs {per_token} B a token + {fixed:,} B fixed" in deep["detail"]


def test_a_sliding_window_model_without_swa_full_is_broken_and_saves_nothing(
    start_llama: StartServer, llama_bin: Path, tmp_path: Path
) -> None:
    model = generate_arch_model(GEMMA3_SWA, vocab_dir=vocab_dir(llama_bin))
    code, found = deep_doctor(tmp_path, start_llama(model=model, ctx_size=2048))
    assert code == 4 and found["result"] == "DEGRADED", found
    compat = found["compatibility"]
    ev = compat["evidence"]
    assert compat["verdict"] == "broken" and compat["memory"]["swa_full"] is False
    assert ev["saved_tokens"] > 128 and ev["extension_reused"] == 0  # not even the exact extension
    assert ev["divergent_reused"] is None
    lo, hi = ev["swa_window_saved"]
    assert hi == ev["saved_tokens"] - 1 and hi - lo + 1 == 128  # the window's positions only
    deep = checks(found)["restore compatibility (deep)"]
    assert deep["status"] == "WARN" and deep["fix"].startswith(
        "add --swa-full to llama-server: --swa-full takes"
    )


def test_a_sliding_window_model_with_swa_full_is_supported_and_says_what_is_never_restored(
    start_llama: StartServer, llama_bin: Path, tmp_path: Path
) -> None:
    model = generate_arch_model(GEMMA3_SWA, vocab_dir=vocab_dir(llama_bin))
    server = start_llama(model=model, ctx_size=2048, extra_args=("--cache-ram", "0", "--swa-full"))
    code, found = deep_doctor(tmp_path, server)
    assert code == 0 and found["result"] == "READY", found
    compat = found["compatibility"]
    ev = compat["evidence"]
    assert compat["verdict"] == "supported" and compat["memory"]["swa_full"] is True
    assert ev["extension_reused"] >= ev["saved_tokens"]
    # llama-server reuses the prefix of a divergent prompt over a window the file does not hold
    assert ev["divergent_reused"] == ev["saved_tokens"] - DIVERGE
    lo, hi = ev["swa_window_saved"]
    assert hi == ev["saved_tokens"] - 1 and hi - lo + 1 == 128
    detail = checks(found)["restore compatibility (deep)"]["detail"]
    assert f"hold only positions {lo}-{hi}" in detail and "never restored" in detail


@pytest.mark.parametrize("swa_full", [False, True], ids=["no-swa-full", "swa-full"])
def test_gemma3_270m(start_llama: StartServer, tmp_path: Path, swa_full: bool) -> None:
    extra = ("--cache-ram", "0", "--swa-full") if swa_full else ("--cache-ram", "0")
    code, found = deep_doctor(tmp_path, start_llama(model=gemma3_270m(), ctx_size=2048, extra_args=extra))
    compat = found["compatibility"]
    ev = compat["evidence"]
    assert compat["memory"]["n_swa"] == 512 and ev["saved_tokens"] > 512
    lo, hi = ev["swa_window_saved"]
    assert hi - lo + 1 == 512
    if swa_full:
        assert code == 0 and compat["verdict"] == "supported", found
    else:
        assert code == 4 and compat["verdict"] == "broken" and ev["extension_reused"] == 0, found
        # the fix's memory figure at this context (2,048 cells with it)
        assert "-> 2,048 cells, 15 layers" in checks(found)["model memory"]["fix"]
