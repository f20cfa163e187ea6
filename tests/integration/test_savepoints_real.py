"""Save points at the prompt's end against a real llama-server (coordinator/savepoints.py), on the generated
hybrid `qwen35` model (3 gated-delta-net layers, 1 attention layer), one slot, `--cache-ram 0`.

Two sessions take turns through the proxy (chat completions, `X-Session-Id`). A's turn 1 (prompt P1) gets a
save point at P1's end before it generates; B evicts A (A's end-of-turn point is saved into the other
generation); A's turn 2 sends back an assistant message other than the one generated (a template that drops
the reasoning or re-renders the answer) and a new user message. Its prompt extends the prompt point strictly,
so turn 2 restores it and reuses |P1| - 1 tokens. The control is B: its first turn ran while it was the only
session (no prompt point), and its second, after A evicted it, finds only its end-of-turn point, which its
next prompt diverges from: nothing is restored. (A's end-of-turn save is skipped here by the checkpoint
policy: its few generated tokens are cheaper to recompute than to save, and the prompt point is kept.) The
prefill-only call and the save (ms, from the daemon's log and the `X-KV-Prompt-Point-*` headers) are printed
as each turn's cost."""

from __future__ import annotations

import re
from pathlib import Path

import httpx

from kvsidecar.coordinator import plan
from kvsidecar.testing.llama import LlamaServer
from tests.integration.plan_helpers import CLASSES, Driver, Script, model_for, server
from tests.integration.test_plan_classes_real import AUTH
from tests.integration.test_proxy_real import proxy_daemon

COST = re.compile(r"kv\.session\.prompt_point .*?tokens=(\d+) computed=(\d+)")
COST_MS = re.compile(r"kv\.session\.prompt_point .*?prefill_ms=([\d.]+) save_ms=([\d.]+)")


def _prompt_ids(llama: LlamaServer, messages: list[dict[str, str]]) -> list[int]:
    """The tokens llama-server puts in the slot for `messages` (its template, then its tokenizer)."""
    text = httpx.post(f"{llama.base_url}/apply-template", json={"messages": messages}, timeout=60)
    text.raise_for_status()
    r = httpx.post(
        f"{llama.base_url}/tokenize",
        json={"content": text.json()["prompt"], "add_special": True, "parse_special": True},
        timeout=60,
    )
    r.raise_for_status()
    return [int(t) for t in r.json()["tokens"]]


def test_the_next_turn_restores_the_prompt_point_after_an_eviction(
    llama_bin: Path, tiny_model: Path, tmp_path: Path
) -> None:
    hybrid = next(c for c in CLASSES if c.label == "hybrid-qwen35")
    model = model_for(hybrid, llama_bin, tiny_model)
    llama = server(llama_bin, model, tmp_path, "points", ("--cache-ram", "0")).start()
    try:
        daemon = proxy_daemon(llama, tmp_path / "kv")
        try:
            driver = Driver(Script(turns=2, max_tokens=16), headers=AUTH, session_ids=True)
            b0 = driver.turn(daemon.proxy_url, "B", 0)  # one session known, figures unknown: a (cheap) point
            first = driver.turn(daemon.proxy_url, "A", 0)  # two sessions, one slot: A's prompt point
            p1 = _prompt_ids(llama, driver.convos["A"][:-1])  # the prompt turn 1 sent
            b1 = driver.turn(daemon.proxy_url, "B", 1)  # A is evicted
            generated = driver.convos["A"][-1]["content"]
            driver.convos["A"][-1]["content"] = "A re-rendered answer: " + generated[::-1]
            second = driver.turn(daemon.proxy_url, "A", 1)
            p2 = _prompt_ids(llama, driver.convos["A"][:-1])
            log = daemon.log()
        finally:
            daemon.stop()
    finally:
        llama.stop()
    points = [tuple(int(x) for x in found) for found in COST.findall(log)]  # (tokens, computed) per point
    costs = [(float(p), float(s)) for p, s in COST_MS.findall(log)]
    said = [
        (int(t.headers["x-kv-prompt-point-tokens"]), int(t.headers["x-kv-prompt-point-computed"]))
        for t in (b0, first, b1, second)
    ]
    assert said == points, (said, points)  # the answers tell what the log does
    assert all(t.headers.get("x-kv-prompt-point") == "saved" for t in (b0, first, b1, second))
    print(f"turn 1: computed {first.computed}, reused {first.reused}; {first.headers}")
    print(f"B's turn 2: {b1.headers}")
    print(f"turn 2: computed {second.computed}, reused {second.reused}; {second.headers}")
    print(f"prompt points (tokens, computed): {points}; (prefill ms, save ms): {costs}")
    print(f"|P1| = {len(p1)}, |P2| = {len(p2)}")
    assert len(points) == 4, points  # B's turn 1, A's turn 1, B's turn 2, A's turn 2
    points = points[1:]  # A's turn 1, B's turn 2, A's turn 2
    assert points[0] == (len(p1) - 1, len(p1) - 1), (points, len(p1))
    assert first.computed - points[0][1] <= 2, first  # the request itself extended the point
    # turn 2 restored the prompt point: its own prompt point's prefill reused all of it
    assert second.headers.get("x-kv-plan") == plan.RESTORE, second.headers
    assert second.headers.get("x-kv-restored-tokens") == str(len(p1) - 1), second.headers
    assert points[2] == (len(p2) - 1, len(p2) - len(p1)), (points, len(p1), len(p2))
    assert second.reused >= len(p1) - 1, second  # the restored point, reused by the turn's prefill
    # B, whose reply re-tokenizes (its end-of-turn point diverges), came back on the point its turn 1 took
    # although it was the only session then (a cheap point: a restart could have come)
    assert b1.headers.get("x-kv-plan") == plan.RESTORE, b1.headers
    assert points[1][1] < points[1][0] // 2, points  # its point's prefill computed only the new tokens
