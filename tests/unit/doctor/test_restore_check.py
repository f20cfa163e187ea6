"""The §61 check's verdict per memory class (docs/MODELS.md, "What doctor says"), and the check itself on the
fake engine through `Doctor`: what kvsidecar will and will not restore is said with the evidence, a
sliding-window model without --swa-full gets the fix and its memory figure, and nothing of the probe is
left behind (no file, an erased slot)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from kvsidecar.backend.fake import FakeKvBackend
from kvsidecar.doctor.checks import Doctor
from kvsidecar.doctor.probe import CHECK
from kvsidecar.doctor.restore_check import DIVERGE, Evidence, probe_length, verdict
from kvsidecar.fingerprint.memory_class import HYBRID, PLAIN, RECURRENT, SWA, UNKNOWN, MemoryClass
from kvsidecar.fingerprint.server_memory import ServerMemory
from kvsidecar.fingerprint.swa_cache import SwaCache
from tests.unit.coordinator_helpers import make_config
from tests.unit.memory_helpers import plain_gguf, process_running, swa_gguf

GEMMA_270M_16K = SwaCache(layers=15, streams=1, cells=1024, cells_full=16384, bytes_per_cell=15360)


def memory(kind: str, *, n_swa: int = 0, swa_full: bool = False, read: bool = True) -> ServerMemory:
    m = MemoryClass(
        kind=kind,
        arch={PLAIN: "llama", SWA: "gemma3", HYBRID: "qwen35", RECURRENT: "mamba"}.get(kind, ""),
        n_layer=4,
        attention_layers=0 if kind == RECURRENT else 1 if kind == HYBRID else 4,
        recurrent_layers=3 if kind == HYBRID else 4 if kind == RECURRENT else 0,
        recurrent_kind="gated-delta-net" if kind in (HYBRID, RECURRENT) else None,
        n_swa=n_swa,
        swa_full=swa_full,
        why="model file 1 of 1 is unreadable (OSError)" if kind == UNKNOWN else "",
    )
    cache = GEMMA_270M_16K if kind == SWA else None
    return ServerMemory(memory=m, settings_read=read, swa_cache=cache)


def evidence(
    saved: int, reused: int, divergent: int | None = None, window: tuple[int, int] | None = None
) -> Evidence:
    return Evidence(
        cold=saved,
        saved=saved,
        restored=saved,
        extension=saved + 9,
        extension_reused=reused,
        divergent_reused=divergent,
        window=window,
    )


def test_plain_is_supported_when_the_restore_is_reused() -> None:
    v = verdict(memory(PLAIN), evidence(256, 256, 256 - DIVERGE))
    assert (v.compatibility, v.status) == ("supported", "OK")
    assert "then the same prompt plus 9 tokens: llama-server reused 256 (cache_n)" in v.detail
    assert f"diverging {DIVERGE} tokens before the saved end: reused 253" in v.detail
    assert "kvsidecar restores for any prompt that shares a prefix with the saved tokens" in v.detail
    broken = verdict(memory(PLAIN), evidence(256, 0))
    assert (broken.compatibility, broken.status) == ("broken", "WARN")
    assert "a restore this build does not reuse" in broken.detail and broken.fix


@pytest.mark.parametrize("kind", [HYBRID, RECURRENT])
def test_hybrid_and_recurrent_are_supported_for_exact_extensions(kind: str) -> None:
    v = verdict(memory(kind), evidence(256, 256, 0))
    assert (v.compatibility, v.status) == ("supported", "OK")
    assert (
        "a restore is reused only when the next prompt extends the saved tokens exactly; "
        "kvsidecar restores only then"
    ) in v.detail
    assert "reused 0" in v.detail  # the divergent prompt: the class's rule, measured
    assert verdict(memory(kind), evidence(256, 0)).compatibility == "broken"


def test_swa_with_swa_full_is_supported_and_says_what_is_never_restored() -> None:
    m = memory(SWA, n_swa=512, swa_full=True)
    v = verdict(m, evidence(576, 576, 573, window=(64, 575)))
    assert (v.compatibility, v.status) == ("supported", "OK")
    assert "within one token of the saved end" in v.detail
    # the token recomputed at 573 attends back to 62: the file holds 64-575 only
    assert "hold only positions 64-575" in v.detail and "position 573 attends back to 62" in v.detail
    assert "reused 573 tokens over a window the file does not hold, a wrong context" in v.detail
    assert "never restored" in v.detail
    assert verdict(m, evidence(576, 0)).compatibility == "broken"


def test_swa_without_swa_full_is_broken_with_the_fix_and_its_memory_figure() -> None:
    v = verdict(memory(SWA, n_swa=512), evidence(576, 0))
    assert (v.compatibility, v.status) == ("broken", "WARN")
    assert "sliding-window model (gemma3, window 512) without --swa-full" in v.detail
    assert "kvsidecar saves nothing on this server and restores nothing" in v.detail
    assert v.fix == (
        "add --swa-full to llama-server: --swa-full takes the SWA cache from 15 to 240 MiB "
        "(1,024 -> 16,384 cells, 15 layers)"
    )
    # a build that reused it after all: not claimed from one check, and still nothing saved
    odd = verdict(memory(SWA, n_swa=512), evidence(576, 576))
    assert (odd.compatibility, odd.status) == ("experimental", "WARN") and "saves nothing" in odd.detail


def test_unknown_class_is_experimental_unless_reuse_is_confirmed() -> None:
    v = verdict(memory(UNKNOWN), evidence(256, 0))
    assert (v.compatibility, v.status) == ("experimental", "WARN") and "reused only 0 of 256" in v.detail
    ok = verdict(memory(UNKNOWN), evidence(256, 256))
    assert (ok.compatibility, ok.status) == ("supported", "OK") and "nothing is claimed" in ok.detail
    # --swa-full unknown (an unreadable environment): a reuse shows it is on
    hidden = verdict(memory(SWA, n_swa=512, read=False), evidence(576, 576, 573))
    assert hidden.compatibility == "supported"


def test_the_probe_prompt_outlasts_a_sliding_window_within_the_context() -> None:
    assert probe_length(memory(PLAIN), 4096) == 256
    assert probe_length(memory(SWA, n_swa=512, swa_full=True), 4096) == 576
    assert probe_length(memory(SWA, n_swa=512, swa_full=True), 512) == 448


def _doctor(tmp_path: Path, fake: FakeKvBackend, model: Path, *args: str) -> Doctor:
    (tmp_path / "snaps").mkdir(exist_ok=True)
    fake.model_path = str(model)
    proc = process_running(model, *args)
    return Doctor(config=make_config(tmp_path), server="local", backend=fake, process_finder=lambda _u: proc)


async def test_the_check_on_a_sliding_window_model_without_swa_full(tmp_path: Path) -> None:
    fake = FakeKvBackend(tmp_path / "snaps")
    fake.knobs.restore_reuses_nothing = True  # what llama-server does for it (docs/MODELS.md)
    report = await _doctor(tmp_path, fake, swa_gguf(tmp_path / "m"), "-np", "1").run(deep=True)
    checks = {c.name: c for c in report.checks}
    assert checks["model memory"].status == "WARN" and "--swa-full takes" in checks["model memory"].fix
    check = checks[CHECK]
    assert check.status == "WARN" and check.detail.startswith("broken: sliding-window model (gemma3")
    assert check.fix.startswith("add --swa-full to llama-server: --swa-full takes the SWA cache from 0.94")
    assert report.compatibility is not None and report.compatibility["verdict"] == "broken"
    assert report.compatibility["evidence"]["extension_reused"] == 0
    assert report.compatibility["evidence"]["divergent_reused"] is None  # nothing to show past that
    assert report.to_dict()["compatibility"] == report.compatibility
    assert not list((tmp_path / "snaps").iterdir())  # both probe files are removed
    assert fake.calls[-1][0] == "erase" and fake.slots[0].tokens == []  # nothing of the probe stays


async def test_the_check_with_swa_full_says_what_is_restored(tmp_path: Path) -> None:
    """The fake engine's files have no SWA section: the window is then not claimed, the rule still said
    (the real one: tests/integration/test_doctor_classes_real.py)."""
    fake = FakeKvBackend(tmp_path / "snaps")
    report = await _doctor(tmp_path, fake, swa_gguf(tmp_path / "m"), "--swa-full").run(deep=True)
    check = next(c for c in report.checks if c.name == CHECK)
    assert check.status == "OK" and check.detail.startswith("supported: sliding-window model (gemma3")
    assert "within one token of the saved end" in check.detail
    assert report.compatibility is not None
    ev = report.compatibility["evidence"]
    # the divergent prompt reuses the common prefix in this engine
    assert ev["cold_tokens"] == 256 and ev["divergent_reused"] == 256 - DIVERGE
    assert ev["swa_window_saved"] is None
    assert not list((tmp_path / "snaps").iterdir())


def test_what_a_snapshot_costs_is_measured_from_the_two_probe_saves() -> None:
    """Bytes a token from the difference of the two files, the rest of the first is fixed: the qwen35
    files of docs/MODELS.md (4,003 and 4,106 tokens) give its 540 B a token + 215,208 B fixed."""
    ev = replace(evidence(4003, 4003), files=((4003, 2_376_828), (4106, 2_376_828 + 103 * 540)))
    assert ev.cost == (540, 215_208)
    assert ev.to_dict()["bytes_per_token"] == 540 and ev.to_dict()["fixed_bytes"] == 215_208
    v = verdict(memory(HYBRID), ev)
    assert "a snapshot costs 540 B a token + 215,208 B fixed" in v.detail
    # one file, or no new tokens: not measured, nothing said
    for files in (((4003, 2_376_828),), ((4003, 2_376_828), (4003, 2_376_828))):
        one = replace(ev, files=files)
        assert one.cost is None and one.to_dict()["bytes_per_token"] is None
        assert "a snapshot costs" not in verdict(memory(HYBRID), one).detail


async def test_the_check_measures_the_fake_engines_snapshot_cost(tmp_path: Path) -> None:
    fake = FakeKvBackend(tmp_path / "snaps")
    fake.bytes_per_token = 100
    report = await _doctor(tmp_path, fake, plain_gguf(tmp_path / "m")).run(deep=True)
    assert report.compatibility is not None
    ev = report.compatibility["evidence"]
    # the fake engine writes a 12-byte header and 100 bytes a token (backend/fake.py)
    assert (ev["bytes_per_token"], ev["fixed_bytes"]) == (100, 12)
    saves = [c[2] for c in fake.calls if c[0] == "save"]
    assert len(saves) == 2 and saves[0] is not None and saves[1] == saves[0].replace(".bin", "-2.bin")
    assert not list((tmp_path / "snaps").iterdir())
