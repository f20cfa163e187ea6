"""The runtime fingerprint of real llama-server processes (issue 16 items 2 and 3).

Settings that change the KV (a RoPE flag, a KV cache type given only as LLAMA_ARG_*, a model rewritten in
place) must change the fingerprint; the same command started again, or with only harmless differences
(port, threads, timeout), must not.
"""

from __future__ import annotations

import asyncio
import os
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsidecar.backend.llamacpp import LlamaCppBackend
from kvsidecar.fingerprint.file_digests import FileDigestCache
from kvsidecar.fingerprint.llama_process import find_llama_process
from kvsidecar.fingerprint.runtime import RuntimeFingerprint, build_fingerprint
from kvsidecar.testing.llama import LlamaServer, vocab_dir, words
from kvsidecar.testing.models import ModelShape, generate_llama_model
from tests.conftest import StartServer


async def fingerprint(server: LlamaServer, digests: FileDigestCache) -> RuntimeFingerprint:
    backend = LlamaCppBackend(base_url=server.base_url)
    try:
        caps = await backend.probe()
    finally:
        await backend.aclose()
    process = await asyncio.to_thread(find_llama_process, server.base_url)
    assert process is not None and server.proc is not None and process.pid == server.proc.pid
    return await asyncio.to_thread(
        build_fingerprint, caps=caps, process=process, runtime_key=None, digests=digests
    )


async def top_probs(server: LlamaServer) -> list[Any]:
    body = {"prompt": words("fp", 200), "n_predict": 1, "n_probs": 5, "temperature": 0, "cache_prompt": False}
    async with httpx.AsyncClient(base_url=server.base_url, timeout=120) as client:
        response = await client.post("/completion", json=body)
    response.raise_for_status()
    return list(response.json()["completion_probabilities"])


async def test_kv_settings_on_the_command_line_or_in_the_environment_change_it(
    start_llama: StartServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    digests = FileDigestCache(tmp_path / "digests.json")
    plain = start_llama()
    rope = start_llama(extra_args=("--cache-ram", "0", "--rope-freq-base", "5000"))
    with monkeypatch.context() as env:
        env.setenv("LLAMA_ARG_CACHE_TYPE_K", "q8_0")  # inherited by this llama-server only
        env.setenv("LLAMA_ARG_ROPE_FREQ_BASE", "5000")
        env_rope = start_llama()
    harmless = start_llama(extra_args=("--cache-ram", "0", "--threads", "1", "--timeout", "30"))

    base = await fingerprint(plain, digests)
    with_rope = await fingerprint(rope, digests)
    from_env = await fingerprint(env_rope, digests)
    # the settings really reached the servers: the next-token probabilities of one prompt move
    probs = [await top_probs(s) for s in (plain, rope, env_rope)]
    assert probs[1] != probs[0] and probs[2] != probs[0]
    assert with_rope.digest != base.digest
    assert with_rope.mismatch_reason(base.components) == "ROPE_CHANGED"
    assert from_env.digest not in (base.digest, with_rope.digest)
    assert from_env.mismatch_reason(base.components) == "KV_LAYOUT_CHANGED"
    assert from_env.components["arg:cache-type-k"] == '["q8_0"]'
    # another port, another thread count and timeout: the same runtime
    assert (await fingerprint(harmless, digests)).digest == base.digest


async def test_the_same_command_started_again_gives_the_same_fingerprint(
    start_llama: StartServer, tmp_path: Path
) -> None:
    digests = FileDigestCache(tmp_path / "digests.json")
    server = start_llama()
    first = await fingerprint(server, digests)
    server.restart()
    second = await fingerprint(server, digests)
    assert second.info["pid"] != first.info["pid"]
    assert second.digest == first.digest and second.components == first.components
    assert first.components["model_file"] not in ("", "absent", "unreadable")
    assert first.components["server_libs"] not in ("", "unreadable", "[]")  # libllama*, libggml* mapped


async def test_a_model_rewritten_in_place_with_its_mtime_put_back_changes_it(
    start_llama: StartServer, tmp_path: Path, llama_bin: Path, tiny_model: Path
) -> None:
    model = tmp_path / "model.gguf"
    shutil.copyfile(tiny_model, model)
    digests = FileDigestCache(tmp_path / "digests.json", racy_window_s=0)
    server = start_llama(model=model)
    before = await fingerprint(server, digests)
    server.stop()
    other = generate_llama_model(
        ModelShape(seed=99), vocab_dir=vocab_dir(llama_bin), out_dir=tmp_path / "other"
    )
    assert other.stat().st_size == model.stat().st_size  # same shape: a same-size replacement
    st = model.stat()
    with other.open("rb") as src, model.open("r+b") as dst:  # same path, same inode, same size
        shutil.copyfileobj(src, dst)
    os.utime(model, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert model.stat().st_mtime_ns == st.st_mtime_ns and model.stat().st_ino == st.st_ino
    server.start()
    after = await fingerprint(server, digests)
    assert after.components["model_path"] == before.components["model_path"]
    assert after.mismatch_reason(before.components) == "MODEL_FINGERPRINT_CHANGED"
