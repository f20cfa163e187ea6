"""What each memory class starts from: four workloads per class, three ways, prompt tokens computed and TTFT.

Classes (tests/integration/plan_helpers.py `CLASSES`): the plain tiny model, the generated `qwen35`
(gated-delta-net hybrid) and `granitehybrid` (Mamba2 hybrid), the generated `gemma3` with a 128-token window
with and without `--swa-full`. Workloads (tests/integration/class_workloads.py), one slot, chat completions:

  two-sessions  sessions A and B take turns (A1 B1 A2 B2 ...), a ~1.5K-token system prompt each, a 40-word
                user message per turn, 8-token replies sent back verbatim (llama.cpp's Qwen3-Coder.jinja)
  restart       each session's first turn, llama-server stopped and started again (same port and slot
                directory; through kvsidecar after its idle checkpoint saved), each session's second turn;
                their reuse beside a resident slot's (the two turns back to back on llama-server alone)
  clients       opencode's two recorded conversations interleaved (tests/fixtures/clients), as recorded
  reasoning     two-sessions with llama.cpp's Qwen3 thinking template (Qwen-Qwen3-0.6B.jinja), the replies
                sent back as `reasoning_content`, which the template drops from the next turn's history

Ways, each on a fresh llama-server (`--metrics`): alone (its defaults, the RAM cache on), alone-no-cache
(`--cache-ram 0`), kvsidecar (the proxy, `X-Session-Id` or the client's own session header).

"computed" is llama-server's own `llamacpp:prompt_tokens_total` (`/metrics`, summed over the processes of a
restart): every prompt token it evaluated, kvsidecar's prefills and hand-offs included. Per request:
`timings.prompt_n` plus `X-KV-Prompt-Point-Computed`. TTFT: a request's wall time less llama-server's
generation time (`timings.predicted_ms`). `--name` writes bench/results/<name>.json (default
`plan_classes`). Nothing is asserted; tests/integration/test_plan_classes_real.py and
test_class_clients_real.py hold the behaviour.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import write

from kvsidecar.testing.llama import llama_server_binary, vocab_dir
from kvsidecar.testing.models import TINY, generate_llama_model
from tests.integration.class_workloads import (
    WAYS,
    WORKLOADS,
    Target,
    options,
    resident_reuse,
    run_way,
)
from tests.integration.plan_helpers import CLASSES, ClassCase, Script, Turn, model_for


def record(turns: list[Turn], computed: int) -> dict[str, Any]:
    return {
        "computed": computed,
        "requests_computed": sum(t.computed for t in turns),
        "reused": sum(t.reused for t in turns),
        "median_ttft_s": round(statistics.median(t.ttft_s for t in turns), 4),
        "turns": [
            {
                "session": t.session,
                "turn": t.turn,
                "computed": t.computed,
                "reused": t.reused,
                "ttft_s": round(t.ttft_s, 4),
                "outcome": t.headers.get("x-kv-outcome"),
                "plan": t.headers.get("x-kv-plan"),
                "reason": t.headers.get("x-kv-plan-reason"),
                "prompt_point": t.headers.get("x-kv-prompt-point"),
            }
            for t in turns
        ],
    }


def one_class(binary: Path, model: Path, tmp: Path, case: ClassCase, workloads: list[str], turns: int) -> Any:
    out: dict[str, Any] = {}
    for name in workloads:
        script = Script(turns=2 if name == "restart" else turns)
        work = partial(_call, WORKLOADS[name], script)
        row: dict[str, Any] = {}
        for way in WAYS:
            done, computed, canary = run_way(binary, model, tmp, case, way, work, **options(name))
            row[way] = {**record(done, computed), "canary": canary}
        if name == "restart":
            resident, _, _ = run_way(binary, model, tmp, case, "alone", partial(_call, _resident, script))
            row["resident_reused"] = sum(t.reused for t in resident)
        out[name] = row
        print(case.label, name, {w: row[w]["computed"] for w in WAYS}, flush=True)
    return out


def _call(fn: Callable[[Target, Script], list[Turn]], script: Script, target: Target) -> list[Turn]:
    return fn(target, script)


def _resident(target: Target, script: Script) -> list[Turn]:
    reuse = resident_reuse(target, script)
    return [Turn(s, 1, 0, n, {}) for s, n in reuse.items()]


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--name", default="plan_classes")
    parser.add_argument("--classes", nargs="*", default=[c.label for c in CLASSES])
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS))
    args = parser.parse_args()
    binary = llama_server_binary()
    plain = generate_llama_model(TINY, vocab_dir=vocab_dir(binary))
    started = time.monotonic()
    results: dict[str, Any] = {}
    script = {**Script(turns=args.turns).__dict__, "workloads": args.workloads}
    with tempfile.TemporaryDirectory() as tmp:
        for case in CLASSES:
            if case.label in args.classes:
                model = model_for(case, binary, plain)
                results[case.label] = one_class(binary, model, Path(tmp), case, args.workloads, args.turns)
                elapsed = round(time.monotonic() - started, 1)  # written per class: a long run keeps its part
                write(args.name, {"script": script, "classes": results, "elapsed_s": elapsed})
    elapsed = round(time.monotonic() - started, 1)
    print(write(args.name, {"script": script, "classes": results, "elapsed_s": elapsed}))


TITLES = {
    "two-sessions": "two sessions on one slot",
    "restart": "a llama-server restart between turns",
    "clients": "opencode's recorded conversations",
    "reasoning": "a thinking template that drops reasoning",
}


def section(d: dict[str, Any]) -> list[str]:
    """The docs/BENCHMARKS.md section for a result of this script."""
    m = d["machine"]
    out = [
        "## What each memory class starts from: four workloads, three ways",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['date']}; `bench/bench_plan_classes.py`, one run. Prompt "
        "tokens computed in all, by llama-server's own count (`llamacpp:prompt_tokens_total`, so kvsidecar's "
        "prefills and hand-offs count), and the median TTFT in seconds (a request's wall time less its "
        "generation), alone with llama-server's defaults / alone with `--cache-ram 0` / through kvsidecar. Of "
        "kvsidecar's count: its runtime canary (a fixed prompt prefilled once per llama-server process it meets, "
        "coordinator/canary.py), and what its requests computed by their own timings (`timings.prompt_n` plus "
        "`X-KV-Prompt-Point-Computed`; the rest is its parks, a few tokens per switch). The restart rows time "
        "the turns after the restart.",
        "",
        "| workload | class | alone, defaults | alone, `--cache-ram 0` | through kvsidecar | of which: canary "
        "/ requests | median TTFT s |",
        "|---|---|---:|---:|---:|---:|---|",
    ]
    for workload, title in TITLES.items():
        for label, row in d["classes"].items():
            if workload in row:
                r = row[workload]
                k = r["kvsidecar"]
                ttft = " / ".join(f"{r[w]['median_ttft_s']:.2f}" for w in WAYS)
                counts = " | ".join(f"{r[w]['computed']:,}" for w in WAYS)
                requests = "—" if workload == "restart" else f"{k['requests_computed']:,}"
                out.append(f"| {title} | {label} | {counts} | {k['canary']} / {requests} | {ttft} |")
    out += [
        "",
        "After the restart, what the sessions' second turns reused, beside what they reuse on a resident slot "
        "(the two turns back to back on llama-server alone):",
        "",
        "| class | resident | alone, defaults | alone, `--cache-ram 0` | through kvsidecar |",
        "|---|---:|---:|---:|---:|",
    ]
    for label, row in d["classes"].items():
        if "restart" in row:
            r, resident = row["restart"], row["restart"]["resident_reused"]
            cells = " | ".join(f"{r[w]['reused']:,} ({r[w]['reused'] / max(resident, 1):.0%})" for w in WAYS)
            out.append(f"| {label} | {resident:,} | {cells} |")
    return [*out, ""]


if __name__ == "__main__":
    main()
