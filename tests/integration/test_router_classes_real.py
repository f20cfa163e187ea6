"""A real llama-server 11434 router whose two models are a hybrid (generated `qwen35`) and a sliding-window
one (generated `gemma3-swa`, `--swa-full` in the router's arguments: its children inherit it), with
`--models-max 1` and kvsidecar's proxy in front: one session on each model, alternating, so that every turn
unloads the other model. Each session is restored after its model comes back (the plan's restore, proven by
the prompt's tokens under its class rule: never one the rules refuse) and reuses at least 95% of what a
resident slot reuses on the same turn (the router alone, measured first on the same prompts).

The router knows it keeps fewer models loaded than kvsidecar manages on it: each turn takes a save point at
its prompt's end (as for a session that outnumbers its slots), which the next turn's prompt extends strictly,
as a hybrid's and a sliding window's restore need (coordinator/plan.py)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import httpx

from kvsidecar.testing.arch_models import GEMMA3_SWA, QWEN35, generate_arch_model
from kvsidecar.testing.daemon import DaemonProcess
from kvsidecar.testing.llama import vocab_dir, words
from kvsidecar.testing.router import LlamaRouter

MODELS = {"hybrid": QWEN35, "swa": GEMMA3_SWA}
WORDS = 150  # each turn's prompt grows by this many words (about 2 tokens a word)


def turn(
    url: str, model: str, n: int, headers: dict[str, str] | None = None
) -> tuple[int, int, dict[str, str]]:
    """Turn n of the session on `model`: its prompt extends turn n-1's. (computed, reused, x-kv headers),
    the tokens a save point's prefill computed counted as computed (X-KV-Prompt-Point-Computed)."""
    body = {"model": model, "prompt": words(model, WORDS * n), "n_predict": 4, "cache_prompt": True}
    r = httpx.post(f"{url}/completion", json={**body, "temperature": 0}, headers=headers or {}, timeout=300)
    assert r.status_code == 200, r.text[:500]
    t = r.json()["timings"]
    kv = {k.lower(): v for k, v in r.headers.items() if k.lower().startswith("x-kv-")}
    point = int(kv.get("x-kv-prompt-point-computed", 0))
    return int(t["prompt_n"]) + point, int(t["cache_n"]) - point, kv


def test_a_hybrid_and_a_sliding_window_model_each_restored_after_every_swap(
    llama_bin: Path, tmp_path: Path
) -> None:
    models = tmp_path / "models"
    models.mkdir()
    for name, shape in MODELS.items():
        shutil.copyfile(generate_arch_model(shape, vocab_dir=vocab_dir(llama_bin)), models / f"{name}.gguf")
    router = LlamaRouter(
        binary=llama_bin,
        models_dir=models,
        slot_save_path=tmp_path / "snap",
        log_path=tmp_path / "router.log",
        parallel=1,
        extra_args=("--cache-ram", "0", "--swa-full"),
    ).start()
    try:
        # what a resident slot reuses on turn 2: the router alone, each model's two turns back to back
        resident = {}
        for model in MODELS:
            turn(router.base_url, model, 1)
            resident[model] = turn(router.base_url, model, 2)[1]
        router.unload("swa")  # nothing of the reference runs stays loaded
        entry: dict[str, Any] = {"base_url": router.base_url, "snapshot_dir": str(router.slot_save_path)}
        daemon = DaemonProcess(
            tmp_path / "d",
            base_url=router.base_url,
            snapshot_dir=router.slot_save_path,
            servers={"local": {**entry, "model": "hybrid"}, "swa": {**entry, "model": "swa"}},
            proxy={"enabled": True, "server": "local"},
            checkpoint={"idle_s": None, "max_unsaved_s": 0, "policy": "save-before-evict"},
        ).start()
        try:
            h = {m: {**daemon.auth, "X-Session-Id": f"session-{m}"} for m in MODELS}
            first = {m: turn(daemon.proxy_url, m, 1, h[m]) for m in MODELS}  # hybrid, swa: hybrid unloaded
            assert all(kv.get("x-kv-outcome") == "cold" for _, _, kv in first.values()), first
            for model in MODELS:  # each comes back (the other saved and unloaded first): restored
                _, reused, kv = turn(daemon.proxy_url, model, 2, h[model])
                print(f"{model}: resident reuse {resident[model]}, after the swap {reused}; {kv}")
                assert kv["x-kv-outcome"] == "restored" and kv["x-kv-plan"] == "restore", (model, kv)
                assert kv["x-kv-plan-reason"] == "restore_proven", (model, kv)
                assert reused >= 0.95 * resident[model], (model, reused, resident[model])
            status = httpx.get(f"{daemon.url}/v1/status", headers=daemon.auth, timeout=30).json()
            unloads = {name: v["unloads"] for name, v in status["router_models"].items()}
            assert unloads == {"local": {"kvsidecar": 2}, "swa": {"kvsidecar": 1}}, unloads
        finally:
            daemon.stop()
    finally:
        router.stop()
