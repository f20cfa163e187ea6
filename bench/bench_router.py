"""Model swaps on llama.cpp's router: two models, `--models-max 1`, two agent sessions per model, the model
alternating at every turn (A1, B1, A2, B2, A1, ...), so that every turn loads its model and unloads the other.

Three ways, each on a fresh router (`--parallel 2`, `--cache-ram 0`, generated 4-layer models):

  alone      straight to the router, each session pinned to its own slot of its model (`id_slot`): every
             unload takes the model's KV with it, so every turn computes its whole prompt again
  kvsidecar  through kvsidecar's proxy (`X-Session-Id`), each model a server entry (docs/SWAPS.md): the
             model going away is saved first, and each session restored when its model comes back
  kill -9    as kvsidecar, with the loaded model's child killed (`kill -9`) after every third turn: what a
             crash costs (the turns not yet saved when it happened)

Per turn: llama-server's prompt tokens computed (`prompt_n`) and reused (`cache_n`), the time to the first
token as the client sees it (the request's wall time with one token asked: it includes the model's load),
and the reuse against what a resident slot would have reused (the session's whole previous prompt).
`--name` writes bench/results/<name>.json (default `router`). Nothing here is asserted;
tests/integration/test_router_real.py holds the behaviour.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import write

from kvsidecar.testing.daemon import DaemonProcess
from kvsidecar.testing.llama import llama_server_binary, vocab_dir, words
from kvsidecar.testing.router import LlamaRouter, models_dir

TOKEN = "bench-router-token-0123456789abcdef"
ORDER = [("A1", "alpha", 0), ("B1", "beta", 0), ("A2", "alpha", 1), ("B2", "beta", 1)]


def turn(url: str, session: str, model: str, slot: int | None, n_words: int) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "prompt": words(session, n_words),
        "n_predict": 1,
        "cache_prompt": True,
        "temperature": 0,
    }
    headers = {"Authorization": f"Bearer {TOKEN}"}
    if slot is None:
        headers["X-Session-Id"] = session
    else:
        body["id_slot"] = slot
    start = time.perf_counter()
    r = httpx.post(f"{url}/completion", json=body, headers=headers, timeout=600)
    wall_ms = (time.perf_counter() - start) * 1000
    r.raise_for_status()
    t = r.json()["timings"]
    return {
        "session": session,
        "model": model,
        "prompt_n": t["prompt_n"],
        "cache_n": t["cache_n"],
        "ttft_ms": round(wall_ms, 1),
        "outcome": r.headers.get("x-kv-outcome"),
    }


def run(way: str, rounds: int, step: int, work: Path) -> list[dict[str, Any]]:
    binary = llama_server_binary()
    models = models_dir(work / "models", binary, vocab_dir(binary), {"alpha": 1234, "beta": 99})
    router = LlamaRouter(
        binary=binary,
        models_dir=models,
        slot_save_path=work / "snap",
        log_path=work / "router.log",
        ctx_size=16384,
    ).start()
    daemon = None
    try:
        url = router.base_url
        if way != "alone":
            entry = {"base_url": url, "snapshot_dir": str(router.slot_save_path), "mode": "managed-slots"}
            daemon = DaemonProcess(
                work / "d",
                base_url=url,
                snapshot_dir=router.slot_save_path,
                token=TOKEN,
                servers={"local": {**entry, "model": "alpha"}, "beta": {**entry, "model": "beta"}},
                proxy={"enabled": True, "server": "local"},
            ).start()
            url = daemon.proxy_url
        out, previous = [], dict[str, int]()
        for r in range(rounds):
            for i, (session, model, slot) in enumerate(ORDER):
                row = turn(url, session, model, slot if way == "alone" else None, step * (r + 1))
                row["round"] = r
                if session in previous:
                    row["reuse_vs_resident"] = round(row["cache_n"] / previous[session], 4)
                previous[session] = row["prompt_n"] + row["cache_n"]
                out.append(row)
                if way == "kill -9" and (r * len(ORDER) + i) % 3 == 2:
                    router.kill_child(model)
        return out
    finally:
        if daemon is not None:
            daemon.stop()
        router.stop()


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    later = [r for r in rows if "reuse_vs_resident" in r]
    return {
        "turns": len(rows),
        "prompt_tokens_computed": sum(r["prompt_n"] for r in rows),
        "prompt_tokens_reused": sum(r["cache_n"] for r in rows),
        "later_turns_reuse_vs_resident_median": statistics.median(r["reuse_vs_resident"] for r in later),
        "later_turns_reuse_vs_resident_min": min(r["reuse_vs_resident"] for r in later),
        "ttft_ms_median": statistics.median(r["ttft_ms"] for r in rows),
        "later_turns_ttft_ms_median": statistics.median(r["ttft_ms"] for r in later),
    }


def section(d: dict[str, Any]) -> list[str]:
    """The BENCHMARKS.md section of a run (bench/report.py; the analysis is bench/notes/router.md)."""
    m = d["machine"]
    rows = []
    for way, v in d["ways"].items():
        s, later = v["summary"], [r for r in v["turns"] if "reuse_vs_resident" in r]
        restored = sum(1 for r in later if r.get("outcome") == "restored")
        rows.append(
            f"| {way} | {s['prompt_tokens_computed']:,} | {s['prompt_tokens_reused']:,} "
            f"| {s['later_turns_reuse_vs_resident_median'] * 100:.0f}% "
            f"| {s['later_turns_reuse_vs_resident_min'] * 100:.0f}% "
            f"| {'-' if way == 'alone' else f'{restored} of {len(later)}'} "
            f"| {s['later_turns_ttft_ms_median']:,.0f} |"
        )
    return [
        "## Model swaps on llama.cpp's router (two models, `--models-max 1`)",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores shared with other jobs, {m['date']}. `bench/bench_router.py`: a "
        "real 11434 router (`--models-dir` with two generated 4-layer models, `--models-max 1`, `--parallel 2`, "
        "`--ctx-size 16384`, `--cache-ram 0`), two sessions per model, the model alternating at every turn (A1, "
        f"B1, A2, B2, {d['rounds']} rounds: every turn loads its model and unloads the other); each session's "
        f"prompt grows by {d['step_words']} words a turn. Three ways, each on a fresh router: straight to the "
        "router with each session pinned to its own slot (`alone`); through kvsidecar's proxy with each model a "
        "server entry (docs/SWAPS.md); and the same with the loaded model's child killed (`kill -9`) after every "
        "third turn. TTFT is the client's wall time of a one-token request, model load included. Results: "
        "`bench/results/router.json`.",
        "",
        "| way | prompt tokens computed | reused | reuse vs resident, later turns (median) | (min) "
        "| later turns restored | TTFT later turns p50 (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
    ]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--step", type=int, default=400, help="words each session's prompt grows by a turn")
    ap.add_argument("--name", default="router")
    args = ap.parse_args()
    result: dict[str, Any] = {"rounds": args.rounds, "step_words": args.step, "ways": {}}
    for way in ("alone", "kvsidecar", "kill -9"):
        with tempfile.TemporaryDirectory() as tmp:
            rows = run(way, args.rounds, args.step, Path(tmp))
        result["ways"][way] = {"summary": summarize(rows), "turns": rows}
        print(way, result["ways"][way]["summary"], flush=True)
    print(write(args.name, result))


if __name__ == "__main__":
    main()
