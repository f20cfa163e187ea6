"""What kvsidecar itself makes llama-server compute, counted by llama-server: two sessions take turns on one
slot (tests/integration/plan_helpers.py's script: A1 B1 A2 B2 A3 B3, chat completions, the RAM cache on),
once straight to llama-server and once through the proxy, each on a fresh llama-server started with
`--metrics`. The count is `llamacpp:prompt_tokens_total` from GET /metrics (tools/server of 11434: every
prompt token decoded in a batch, for every task): the clients' requests, and kvsidecar's own calls: the
hand-off of a slot's KV to the RAM cache (coordinator/scope.py `park`: one token), a prompt point's prefill
(coordinator/savepoints.py), the runtime canary (coordinator/canary.py, once per llama-server start).

Per turn, against llama-server alone running the same script:
- a turn whose session starts from what the slot holds (kept, or an empty slot) costs exactly what it
  costs alone: kvsidecar computes nothing of its own there (no park: llama-server itself hands the slot's
  KV to its RAM cache when the request keeps less than half of it, as it does alone);
- a turn that restores a point costs at most 2 tokens more (the park's one token, and on SWA with
  `--swa-full` the token that the prompt point, which ends one token before its prompt, lacks against the
  RAM cache's copy of the whole turn);
- on the hybrid `qwen35`, the turns together cost no more than alone;
- before the first turn, kvsidecar computes the canary's tokens and nothing else.

SWA with `--swa-full` and the hybrid run by default (the classes whose sessions kvsidecar hands to the RAM
cache); `KVSIDECAR_SLOW=1` adds plain attention and SWA without `--swa-full`. Each class: two llama-servers
of a tiny generated model, six turns of about 1.6K tokens (about 30 s)."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from kvsidecar.coordinator.canary import CANARY_PROMPT
from kvsidecar.testing.llama import LlamaServer
from kvsidecar.testing.poll import eventually
from tests.integration.plan_helpers import CLASSES, ClassCase, Driver, Script, model_for, server
from tests.integration.test_proxy_real import TOKEN, proxy_daemon

AUTH = {"authorization": f"Bearer {TOKEN}"}
COUNTER = re.compile(r"^llamacpp:prompt_tokens_total\s+([0-9.e+]+)\s*$", re.M)
SLOW = {"plain", "swa"}  # no session of theirs is ever handed to the RAM cache by a park
RESTORE_SLACK = 2  # tokens a restoring turn may cost more than alone (see the module docstring)


def prompt_tokens_total(llama: LlamaServer) -> int:
    """llama-server's own count of the prompt tokens it computed since it started."""
    r = httpx.get(f"{llama.base_url}/metrics", timeout=30)
    r.raise_for_status()
    found = COUNTER.search(r.text)
    assert found is not None, r.text[:500]
    return int(float(found.group(1)))


@dataclass(frozen=True)
class Run:
    start: int  # computed before the first turn (through kvsidecar: its canary)
    turns: list[int]  # what the counter moved by during each turn (A1 B1 A2 ...)
    plans: list[str]  # through kvsidecar: each turn's X-KV-Plan
    total: int  # the counter at the end, once the daemon stopped
    canary: int  # the canary prompt's tokens, as the server tokenizes a text prompt (with its BOS)


def run_counted(
    llama_bin: Path, model: Path, tmp: Path, case: ClassCase, *, through: bool, script: Script
) -> Run:
    way = "behind" if through else "alone"
    llama = server(llama_bin, model, tmp, f"{way}-{case.label}", (*case.flags, "--metrics")).start()
    try:
        # every switch saves the evicted session: the cost-aware policy may skip that save when recomputing
        # the turn's few generated tokens is measured faster, and then the next restore is of the turn's
        # prompt point, 8 tokens short of the RAM cache's copy: a timing decision, not the hand-off's cost
        policy = {"policy": "save-before-evict"}
        daemon = proxy_daemon(llama, tmp / f"kv-{case.label}", checkpoint=policy) if through else None
        try:
            url = daemon.proxy_url if daemon is not None else llama.base_url
            if daemon is not None:  # the canary, measured once the daemon sees the server
                eventually(lambda: prompt_tokens_total(llama) or None, timeout_s=60, what="the canary")
            start = last = prompt_tokens_total(llama)
            driver = Driver(script, headers=AUTH if through else None, session_ids=through)
            turns, plans = [], []
            for t in range(script.turns):
                for s in script.sessions:
                    turn = driver.turn(url, s, t)
                    now = prompt_tokens_total(llama)
                    turns.append(now - last)
                    plans.append(turn.headers.get("x-kv-plan", ""))
                    last = now
        finally:
            if daemon is not None:
                daemon.stop()
        body = {"content": CANARY_PROMPT, "add_special": True}
        canary = len(httpx.post(f"{llama.base_url}/tokenize", json=body, timeout=60).json()["tokens"])
        total = prompt_tokens_total(llama)
        return Run(start=start, turns=turns, plans=plans, total=total, canary=canary)
    finally:
        llama.stop()


CASES = [
    pytest.param(
        c,
        id=c.label,
        marks=pytest.mark.skipif(
            c.label in SLOW and os.environ.get("KVSIDECAR_SLOW") != "1", reason="KVSIDECAR_SLOW=1"
        ),
    )
    for c in CLASSES
]


@pytest.mark.parametrize("case", CASES)
def test_kvsidecar_computes_per_turn_no_more_than_llama_server_alone(
    llama_bin: Path, tiny_model: Path, tmp_path: Path, case: ClassCase
) -> None:
    script = Script()
    model = model_for(case, llama_bin, tiny_model)
    alone = run_counted(llama_bin, model, tmp_path, case, through=False, script=script)
    through = run_counted(llama_bin, model, tmp_path, case, through=True, script=script)
    print(f"{case.label}: alone {alone}\n{case.label}: kvsidecar {through}")
    assert through.total == through.start + sum(through.turns)  # nothing after the last turn
    assert through.start == through.canary, through  # before the first turn: the canary only
    for i, (mine, theirs, plan) in enumerate(zip(through.turns, alone.turns, through.plans, strict=True)):
        if plan == "restore":
            assert mine <= theirs + RESTORE_SLACK, (i, alone, through)
        else:  # kept or empty: kvsidecar computed nothing of its own
            assert mine == theirs, (i, alone, through)
    if case.arch == "qwen35":
        assert sum(through.turns) <= sum(alone.turns), (alone, through)
