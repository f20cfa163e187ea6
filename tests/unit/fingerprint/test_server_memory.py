"""What kvsidecar reads of a running llama-server's model memory: the class from the model file as the
process sees it and from its settings, whether those settings were read whole, and a sliding-window
model's SWA cache figure; a remote server or an unresolvable path is `unknown`, never a guess."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from kvsidecar.backend.base import BackendCapabilities
from kvsidecar.fingerprint.memory_class import HYBRID, PLAIN, SWA, UNKNOWN
from kvsidecar.fingerprint.server_memory import read_server_memory
from tests.unit.memory_helpers import hybrid_gguf, plain_gguf, process_running, swa_gguf


def caps(model: str) -> BackendCapabilities:
    return BackendCapabilities(
        kind="llama.cpp",
        alive=True,
        slots_endpoint=True,
        total_slots=1,
        n_ctx=16384,
        model_path=model,
        build_info="b",
    )


def test_each_class_from_the_running_server(tmp_path: Path) -> None:
    swa = swa_gguf(tmp_path)
    m = read_server_memory(caps(str(swa)), process_running(swa, "-np", "1"))
    assert (m.kind, m.memory.n_swa, m.memory.swa_full, m.settings_read) == (SWA, 128, False, True)
    assert m.swa_without_full and m.swa_cache is not None and m.swa_cache.cells == 768
    assert m.describe() == "sliding-window model (gemma3, window 128) without --swa-full"
    assert m.to_dict()["swa_cache"]["mib_swa_full"] == 20.0
    assert m.to_dict()["snapshot"] == {"bytes_per_token": 272, "fixed_bytes": 128 * (12 + 5 * 256)}
    full = read_server_memory(caps(str(swa)), process_running(swa, environ={"LLAMA_ARG_SWA_FULL": "true"}))
    assert full.memory.swa_full and not full.swa_without_full and full.memory.restore_keeps == "extension"
    hybrid = hybrid_gguf(tmp_path)
    h = read_server_memory(caps(str(hybrid)), process_running(hybrid))
    assert h.kind == HYBRID and h.swa_cache is None and "3 mamba2 layers, 1 attention layers" in h.describe()
    assert h.snapshot is None  # this file names no ssm sizes: its recurrent state, so its cost, is not known
    plain = plain_gguf(tmp_path)
    assert read_server_memory(caps(str(plain)), process_running(plain)).kind == PLAIN


def test_what_cannot_be_read_is_unknown_or_unproven(tmp_path: Path) -> None:
    swa = swa_gguf(tmp_path)
    remote = read_server_memory(caps(str(swa)), None)
    assert remote.kind == UNKNOWN and "remote" in remote.memory.why and not remote.swa_without_full
    relative = read_server_memory(caps("models/m.gguf"), process_running(swa))  # no cwd known
    assert relative.kind == UNKNOWN and "cannot be resolved" in relative.memory.why
    gone = read_server_memory(caps(str(tmp_path / "gone.gguf")), process_running(swa))
    assert gone.kind == UNKNOWN
    # the environment unreadable: --swa-full may be set there, so saves are not proven useless
    hidden = read_server_memory(caps(str(swa)), replace(process_running(swa), environ=None))
    assert hidden.kind == SWA and not hidden.settings_read and not hidden.swa_without_full
    assert "--swa-full unknown" in hidden.describe()
    # the key a change of is said again on: a restart with the same model and settings is not one
    same = read_server_memory(caps(str(swa)), process_running(swa, "-np", "1", pid=43))
    assert same.key == read_server_memory(caps(str(swa)), process_running(swa, "-np", "1")).key
