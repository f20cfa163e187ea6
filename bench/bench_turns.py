"""A conversation's next turn through the proxy: the agent workload that lost KV (three agents, no session ids).

Each of 3 agents, at once, on `--parallel 2` (`--jinja`, llama.cpp's Qwen3-Coder.jinja): a main context that
grows in steps (a tool result of `step` tokens, the assistant's reply sent back verbatim, each turn sent the
instant the previous answer's stream ends), then two unrelated sub-agent contexts (a 32-token system prompt
and `sub` tokens of their own, one turn each), then back to the main context for one more turn. Sizes by
default as in the report (4K-token steps, 8K-token sub-agents); `--scale` shrinks them.

Two ways, each on a fresh llama-server per run, with the same prompts:

  kvsidecar   through the proxy (content identity), llama-server with `--cache-ram 0` (what is reused is
              the slot's own KV or a snapshot kvsidecar restored)
  alone       straight to llama-server, its RAM prompt cache at its default (the baseline of the report)

Per run: how many main continuations (every main turn after the first, and the turn back after the
sub-agents) were recognized (`X-KV-Signal: content` and `X-KV-Outcome` resident or restored), the tokens
they reused (llama-server's `cache_n`) and their prompts, both ways; the continuations, and the turns back
after the sub-agents, that came back warm (they reused all their conversation had: at least 98% of the
previous turn's prompt). `--name` writes bench/results/<name>.json (default `turns`). Nothing here is
asserted; tests/integration/test_proxy_turns_real.py holds the behaviour.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import write

from kvsidecar.testing.daemon import DaemonProcess
from kvsidecar.testing.llama import LlamaServer, llama_server_binary, vocab_dir, words
from kvsidecar.testing.models import ModelShape, chat_template, generate_llama_model
from tests.integration.turns_helpers import Answer, Conversation, streamed_turn

TOKEN = "bench-turns-token-0123456789abcdef"
TEMPLATE = "Qwen3-Coder.jinja"
MODEL = ModelShape(n_ctx=32768, seed=2828)  # the agent-clients tests' model: tiny weights, 32K tokens a slot
TOKENS_PER_WORD = 2.66  # `words()` as this model's vocabulary tokenizes it (measured)
SUB_SYSTEM = "You are a sub-agent. Read the text below and report what matters in it, briefly and exactly."


@dataclass(frozen=True)
class Sizes:
    first: int  # tokens of a main context's first message
    step: int  # tokens of each later main message (a tool result)
    main_turns: int  # main turns before the sub-agents
    sub: int  # tokens of a sub-agent's context
    reply: int  # max_tokens of every answer

    @classmethod
    def scaled(cls, scale: float, main_turns: int) -> Sizes:
        return cls(
            first=int(4096 * scale),
            step=int(4096 * scale),
            main_turns=main_turns,
            sub=int(8192 * scale),
            reply=32,
        )


def text(seed: str, tokens: int) -> str:
    return words(seed, max(4, int(tokens / TOKENS_PER_WORD)))


@dataclass(frozen=True)
class Step:
    agent: int
    kind: str  # main (a continuation), back (the main turn after the sub-agents), first, sub
    answer: Answer
    before: int | None = None  # a continuation: the prompt of its conversation's previous turn

    @property
    def warm(self) -> bool:
        """It reused all its conversation had before (that turn's prompt; its reply may tokenize anew)."""
        return self.before is not None and (self.answer.reused or 0) >= 0.98 * self.before


async def agent(client: httpx.AsyncClient, n: int, run: int, sizes: Sizes) -> list[Step]:
    main = Conversation("chat", system=f"You are agent {n}. Work through the task step by step.")
    main.max_tokens = sizes.reply
    main.add("user", text(f"r{run}a{n}main", sizes.first))
    out: list[Step] = []
    before: int | None = None
    for k in range(sizes.main_turns):
        answer = await streamed_turn(client, main)
        out.append(Step(n, "main" if k else "first", answer, before))
        before = answer.prompt
        main.add("assistant", answer.text or ".")
        main.add("user", text(f"r{run}a{n}tool{k}", sizes.step))
    for s in range(2):
        sub = Conversation("chat", system=SUB_SYSTEM)
        sub.max_tokens = sizes.reply
        sub.add("user", text(f"r{run}a{n}sub{s}", sizes.sub))
        out.append(Step(n, "sub", await streamed_turn(client, sub)))
    out.append(Step(n, "back", await streamed_turn(client, main), before))
    return out


async def workload(base_url: str, headers: dict[str, str], run: int, sizes: Sizes) -> list[Step]:
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=3600) as client:
        done = await asyncio.gather(*(agent(client, n, run, sizes) for n in range(3)))
    return [step for steps in done for step in steps]


def start_llama(binary: Path, model: Path, work: Path, label: str, cache_ram: str | None) -> LlamaServer:
    extra = ["--jinja", "--chat-template-file", str(chat_template(TEMPLATE))]
    if cache_ram is not None:
        extra += ["--cache-ram", cache_ram]
    return LlamaServer(
        binary=binary,
        model=model,
        slot_save_path=work / f"snapshots-{label}",
        log_path=work / f"llama-{label}.log",
        ctx_size=2 * MODEL.n_ctx,
        parallel=2,
        extra_args=tuple(extra),
    ).start()


def through_kvsidecar(binary: Path, model: Path, work: Path, run: int, sizes: Sizes) -> list[Step]:
    llama = start_llama(binary, model, work, "kvsidecar", "0")
    try:
        daemon = DaemonProcess(
            work / "kv",
            base_url=llama.base_url,
            snapshot_dir=llama.save_dir,
            token=TOKEN,
            proxy={"enabled": True, "identity": "session"},
            servers={"local": {"mode": "managed-slots"}},
        ).start()
        try:
            return asyncio.run(workload(daemon.proxy_url, {"authorization": f"Bearer {TOKEN}"}, run, sizes))
        finally:
            daemon.stop()
    finally:
        llama.stop()


def alone(binary: Path, model: Path, work: Path, run: int, sizes: Sizes, cache_ram: str | None) -> list[Step]:
    llama = start_llama(binary, model, work, "alone", cache_ram)
    try:
        return asyncio.run(workload(llama.base_url, {}, run, sizes))
    finally:
        llama.stop()


def continuations(steps: list[Step]) -> list[Step]:
    return [s for s in steps if s.kind in ("main", "back")]


def tally(steps: list[Step], *, proxied: bool) -> dict[str, Any]:
    cont = continuations(steps)
    recognized = [
        s
        for s in cont
        if s.answer.headers.get("x-kv-signal") == "content" and s.answer.outcome in ("resident", "restored")
    ]
    back = [s for s in cont if s.kind == "back"]
    return {
        "continuations": len(cont),
        "recognized": len(recognized) if proxied else None,
        "outcomes": [s.answer.outcome for s in cont] if proxied else None,
        "reused": sum(s.answer.reused or 0 for s in cont),
        "prompt": sum(s.answer.prompt or 0 for s in cont),
        "min_ratio": min((s.answer.ratio for s in cont), default=0.0),
        "warm": sum(s.warm for s in cont),
        "back_warm": sum(s.warm for s in back),
        "back": len(back),
        "sub_reused": sum(s.answer.reused or 0 for s in steps if s.kind == "sub"),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--runs", type=int, default=9)
    parser.add_argument(
        "--scale", type=float, default=1.0, help="token sizes x this (1: 4K steps, 8K sub-agents)"
    )
    parser.add_argument("--main-turns", type=int, default=3, help="main turns before the sub-agents")
    parser.add_argument(
        "--alone-cache-ram", default=None, help="llama-server alone's --cache-ram (default: its own)"
    )
    parser.add_argument("--no-alone", action="store_true", help="kvsidecar only (the baseline is the same)")
    parser.add_argument("--name", default="turns")
    args = parser.parse_args()
    sizes = Sizes.scaled(args.scale, args.main_turns)
    binary = llama_server_binary()
    model = generate_llama_model(MODEL, vocab_dir=vocab_dir(binary))
    runs: list[dict[str, Any]] = []
    for run in range(args.runs):
        with tempfile.TemporaryDirectory(prefix="bench-turns-") as tmp:
            started = time.monotonic()
            kv = tally(through_kvsidecar(binary, model, Path(tmp), run, sizes), proxied=True)
            kv_s = time.monotonic() - started
            base = (
                tally(alone(binary, model, Path(tmp), run, sizes, args.alone_cache_ram), proxied=False)
                if not args.no_alone
                else tally([], proxied=False)
            )
        runs.append({"run": run, "kvsidecar": kv, "alone": base, "kvsidecar_s": round(kv_s, 1)})
        print(
            f"run {run}: recognized {kv['recognized']}/{kv['continuations']} {kv['outcomes']}; reused "
            f"{kv['reused']}/{kv['prompt']} (alone {base['reused']}/{base['prompt']}); warm {kv['warm']} "
            f"(alone {base['warm']}); back warm "
            f"{kv['back_warm']}/{kv['back']} (alone {base['back_warm']}/{base['back']}); {kv_s:.0f} s",
            flush=True,
        )
    every = [r["kvsidecar"]["recognized"] == r["kvsidecar"]["continuations"] for r in runs]
    result = {
        "sizes": sizes.__dict__,
        "runs": runs,
        "runs_all_recognized": sum(every),
        "reused_kvsidecar": sum(r["kvsidecar"]["reused"] for r in runs),
        "reused_alone": sum(r["alone"]["reused"] for r in runs),
        "prompt": sum(r["kvsidecar"]["prompt"] for r in runs),
        "median_min_ratio": statistics.median(r["kvsidecar"]["min_ratio"] for r in runs),
    }
    print(
        f"{sum(every)}/{len(runs)} runs with every main continuation recognized; reused "
        f"{result['reused_kvsidecar']} (alone {result['reused_alone']}) of {result['prompt']} prompt tokens"
    )
    print(write(args.name, result))


def section(d: dict[str, Any]) -> list[str]:
    """The docs/BENCHMARKS.md section for a result of this script."""
    m, sz, runs = d["machine"], d["sizes"], d["runs"]

    def total(way: str, field: str) -> int:
        return sum(r[way][field] for r in runs)

    lines = [
        "## A conversation's next turn with no session ids: the agent workload, kvsidecar vs llama-server alone",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['date']}; `bench/bench_turns.py`, {len(runs)} runs. Three "
        f"agents at once on `--parallel 2` (`--jinja`, Qwen3-Coder's template), no session ids: each grows a main "
        f"context from {sz['first']:,} tokens in {sz['main_turns']} steps of {sz['step']:,} (replies of "
        f"{sz['reply']} tokens sent back verbatim, each next turn sent the instant the previous stream ends), then "
        f"two unrelated {sz['sub']:,}-token sub-agent contexts, then back to its main context. kvsidecar: the "
        "proxy (content identity) with llama-server at `--cache-ram 0`; alone: llama-server with its defaults. A "
        "continuation is warm when it reused at least 98% of the previous turn's prompt.",
        "",
        "| way | runs with every continuation recognized | continuations warm | main contexts warm after "
        "their sub-agents | tokens reused of the continuations' prompt tokens |",
        "|---|---:|---:|---:|---:|",
    ]
    for way, label in (("kvsidecar", "kvsidecar"), ("alone", "llama-server alone")):
        recognized = f"{d['runs_all_recognized']} / {len(runs)}" if way == "kvsidecar" else "—"
        lines.append(
            f"| {label} | {recognized} | {total(way, 'warm')} / {total(way, 'continuations')} "
            f"| {total(way, 'back_warm')} / {total(way, 'back')} "
            f"| {total(way, 'reused'):,} / {total(way, 'prompt'):,} |"
        )
    return [*lines, ""]


if __name__ == "__main__":
    main()
