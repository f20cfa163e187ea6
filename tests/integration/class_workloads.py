"""The workloads of the per-class benchmark and tests (bench/bench_plan_classes.py,
tests/integration/test_plan_classes_real.py, tests/integration/test_class_clients_real.py), each run one way
on its own llama-server: alone with its defaults, alone with `--cache-ram 0`, or through kvsidecar's proxy.

- `two_sessions`: sessions A and B take turns on one slot (plan_helpers.Script).
- `restart`: each session's first turn, llama-server stopped and started again (same port, same slot
  directory; through kvsidecar, after its idle checkpoint saved the session that ran last), the second turns.
- `clients`: one client's recorded requests (opencode: two conversations interleaved on one slot,
  tests/fixtures/clients), replayed as recorded.
- `reasoning`: two sessions whose replies go back as `reasoning_content`, which llama.cpp's Qwen3 thinking
  template drops from the next turn's history.

What llama-server computed is counted twice: per request (`timings.prompt_n`, plus a prompt point's
prefill, `X-KV-Prompt-Point-Computed`) and in all, from llama-server's own `llamacpp:prompt_tokens_total`
(`/metrics`), which also counts what kvsidecar itself asks for (its hand-offs, its prefills)."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import httpx

from kvsidecar.coordinator.canary import CANARY_PROMPT
from kvsidecar.testing.daemon import DaemonProcess
from kvsidecar.testing.llama import LlamaServer
from kvsidecar.testing.poll import eventually
from tests.integration.plan_helpers import (
    THINKING_TEMPLATE,
    ClassCase,
    Driver,
    Script,
    Turn,
    prompt_tokens_total,
    server,
)
from tests.unit.client_fixtures import load

WAYS = ("alone", "alone-no-cache", "kvsidecar")
TOKEN = "class-workloads-token-0123456789abcdef"
# opencode's two recorded conversations, interleaved on one slot: each turn after the first evicts the other
CLIENT_STEPS = (
    ("opencode", "run_turn1"),
    ("opencode", "tools_turn1"),
    ("opencode", "run_turn2_continue"),
    ("opencode", "tools_turn1_tool_result"),
    ("opencode", "tools_turn2_continue"),
)
_DROP = {"authorization", "x-api-key", "host", "content-length", "accept-encoding", "connection"}


@dataclass
class Target:
    """One way's llama-server (and proxy), and what its earlier processes computed (restarts)."""

    llama: LlamaServer
    daemon: DaemonProcess | None
    earlier: int = 0  # llamacpp:prompt_tokens_total of the processes before a restart
    processes: int = 1
    turns: list[Turn] = field(default_factory=list)

    @property
    def url(self) -> str:
        return self.llama.base_url if self.daemon is None else self.daemon.proxy_url

    @property
    def auth(self) -> dict[str, str] | None:
        return None if self.daemon is None else {"authorization": f"Bearer {TOKEN}"}

    def driver(self, script: Script) -> Driver:
        return Driver(script, headers=self.auth, session_ids=self.daemon is not None)

    def restart(self) -> None:
        self.earlier += prompt_tokens_total(self.llama)
        self.llama.restart()
        self.processes += 1

    def computed(self) -> int:
        """All prompt tokens llama-server computed for this way, by its own count."""
        return self.earlier + prompt_tokens_total(self.llama)


class Way(NamedTuple):
    """One workload run one way: its requests, all llama-server computed (`llamacpp:prompt_tokens_total`),
    and of that what kvsidecar's runtime canary took (a fixed prompt prefilled once per llama-server process
    that the daemon meets, coordinator/canary.py; 0 alone)."""

    turns: list[Turn]
    computed: int
    canary: int


def canary_tokens(llama: LlamaServer) -> int:
    """The tokens of one runtime canary prefill (its prompt with the model's special tokens)."""
    body = {"content": CANARY_PROMPT, "add_special": True}
    r = httpx.post(f"{llama.base_url}/tokenize", json=body, timeout=30)
    return len(r.json()["tokens"])


def saves(daemon: DaemonProcess) -> int:
    """Saves made, and saves skipped because nothing could restore them (SWA without `--swa-full`): either
    tells that the idle checkpoint has judged the session."""
    r = httpx.get(f"{daemon.url}/v1/status", headers=daemon.auth, timeout=30)
    made = int(r.json()["stats"]["saves"])
    text = httpx.get(f"{daemon.url}/metrics", headers=daemon.auth, timeout=30).text
    skipped = sum(
        int(float(line.rsplit(" ", 1)[1]))
        for line in text.splitlines()
        if line.startswith("kvsidecar_save_skipped_total{")
    )
    return made + skipped


def two_sessions(target: Target, script: Script) -> list[Turn]:
    driver = target.driver(script)
    return [driver.turn(target.url, s, t) for t in range(script.turns) for s in script.sessions]


def restart(target: Target, script: Script) -> list[Turn]:
    """Turn 0 of every session, a restart, turn 1 of every session; only the turns after the restart are
    returned (their reuse is what the restart left)."""
    driver = target.driver(script)
    for s in script.sessions:
        driver.turn(target.url, s, 0)
    if target.daemon is not None:  # the last session's idle checkpoint (the others were judged as evicted)
        daemon, before = target.daemon, saves(target.daemon)
        eventually(lambda: saves(daemon) > before, timeout_s=60, interval_s=0.1, what="the idle checkpoint")
    target.restart()
    return [driver.turn(target.url, s, 1) for s in script.sessions]


def resident_reuse(target: Target, script: Script) -> dict[str, int]:
    """What each session's second turn reuses on a resident slot: its two turns back to back, alone."""
    driver = target.driver(script)
    out = {}
    for s in script.sessions:
        driver.turn(target.url, s, 0)
        out[s] = driver.turn(target.url, s, 1).reused
    return out


def reasoning(target: Target, script: Script) -> list[Turn]:
    return two_sessions(target, replace_reasoning(script))


def replace_reasoning(script: Script) -> Script:
    return Script(**{**script.__dict__, "reasoning": True})


def replay_step(target: Target, client: str, name: str, index: int) -> Turn:
    """One recorded request as the client sent it (not streamed, a 4-token answer)."""
    rec = load(client, name)
    headers = {k: v for k, v in rec.headers if k.lower() not in _DROP}
    headers["content-type"] = "application/json"
    headers.update(target.auth or {})
    body = {**rec.body, "stream": False, "temperature": 0, "max_tokens": 4}
    body.pop("max_completion_tokens", None)
    started = time.perf_counter()
    r = httpx.post(target.url + rec.path, content=json.dumps(body).encode(), headers=headers, timeout=600)
    wall = time.perf_counter() - started
    assert r.status_code == 200, (client, name, r.status_code, r.text[:400])
    timings: dict[str, Any] = r.json()["timings"]
    kv = {k.lower(): v for k, v in r.headers.items() if k.lower().startswith("x-kv-")}
    point = int(kv.get("x-kv-prompt-point-computed", 0))
    ttft = wall - float(timings.get("predicted_ms", 0.0)) / 1000
    return Turn(
        f"{client}/{name}", index, int(timings["prompt_n"]) + point, int(timings["cache_n"]) - point, kv, ttft
    )


def clients(target: Target, script: Script) -> list[Turn]:
    del script  # the recorded requests are the script
    return [replay_step(target, c, n, i) for i, (c, n) in enumerate(CLIENT_STEPS)]


WORKLOADS: dict[str, Callable[[Target, Script], list[Turn]]] = {
    "two-sessions": two_sessions,
    "restart": restart,
    "clients": clients,
    "reasoning": reasoning,
}


# The checkpoint policy of the tests that count tokens (run_way's `policy`): every switch saves.
POLICY = "save-before-evict"


def run_way(
    llama_bin: Path,
    model: Path,
    tmp: Path,
    case: ClassCase,
    way: str,
    work: Callable[[Target], list[Turn]],
    *,
    template: str | None = None,
    ctx: int = 4096,
    idle_s: float | None = None,
    policy: str | None = None,
) -> Way:
    """`work` on a fresh llama-server (and proxy) of `case`, one way. `policy`: kvsidecar's checkpoint policy
    (None: its default, cost-aware, which may skip a switch save it times as dearer than recomputing the turn:
    a few tokens more, decided on a clock, so a test that counts tokens pins `save-before-evict`)."""
    flags = case.flags + (("--cache-ram", "0") if way == "alone-no-cache" else ())
    label = f"{case.label}-{way}-{time.monotonic_ns()}"
    extra: dict[str, Any] = {} if template is None else {"template": template}
    llama = server(llama_bin, model, tmp, label, flags, ctx=ctx, **extra).start()
    daemon = None
    try:
        if way == "kvsidecar":
            daemon = DaemonProcess(
                tmp / f"kv-{label}",
                base_url=llama.base_url,
                snapshot_dir=llama.save_dir,
                token=TOKEN,
                proxy={"enabled": True, "identity": "session"},
                checkpoint={"idle_s": idle_s} | ({} if policy is None else {"policy": policy}),
            ).start()
        target = Target(llama, daemon)
        turns = work(target)
        canary = 0 if daemon is None else canary_tokens(llama) * target.processes
        return Way(turns, target.computed(), canary)
    finally:
        if daemon is not None:
            daemon.stop()
        llama.stop()


def options(workload: str) -> dict[str, Any]:
    """`run_way`'s keywords for a workload: the thinking template, or an idle checkpoint before a restart."""
    if workload == "reasoning":
        return {"template": THINKING_TEMPLATE}
    if workload == "restart":
        return {"idle_s": 0.5}
    return {}
