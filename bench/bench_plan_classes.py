"""Two sessions taking turns on one slot, per memory class: prompt tokens computed three ways.

The script (tests/integration/plan_helpers.py): sessions A and B, a system prompt of about 1.5K tokens each,
`--turns` turns each (A1 B1 A2 B2 ...), a 40-word user message per turn, replies of 8 tokens sent back
verbatim, chat completions with llama.cpp's Qwen3-Coder template, one slot. Per class (the plain tiny model,
the generated `qwen35` hybrid, the generated `gemma3` with a 128-token window with and without
`--swa-full`), each on a fresh llama-server:

  alone           straight to llama-server, its defaults (the RAM cache on)
  alone-no-cache  straight to llama-server, `--cache-ram 0`
  kvsidecar       through the proxy (`X-Session-Id`), llama-server's defaults

Reports the sum of `timings.prompt_n` and the median time to the answer per turn, and each kvsidecar turn's
plan (`X-KV-Outcome` / `X-KV-Plan-Reason`). `--name` writes bench/results/<name>.json (default
`plan_classes`). Nothing is asserted; tests/integration/test_plan_classes_real.py holds the behaviour.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import write

from kvsidecar.testing.daemon import DaemonProcess
from kvsidecar.testing.llama import llama_server_binary, vocab_dir
from kvsidecar.testing.models import TINY, generate_llama_model
from tests.integration.plan_helpers import CLASSES, ClassCase, Driver, Script, Turn, model_for, server

TOKEN = "bench-plan-classes-token-0123456789ab"


def timed(
    base_url: str, script: Script, headers: dict[str, str] | None, ids: bool
) -> tuple[list[Turn], list[float]]:
    driver = Driver(script, headers=headers, session_ids=ids)
    turns, seconds = [], []
    for t in range(script.turns):
        for s in script.sessions:
            started = time.perf_counter()
            turns.append(driver.turn(base_url, s, t))
            seconds.append(time.perf_counter() - started)
    return turns, seconds


def one_way(
    binary: Path, model: Path, work: Path, case: ClassCase, way: str, script: Script
) -> dict[str, Any]:
    flags = case.flags + (("--cache-ram", "0") if way == "alone-no-cache" else ())
    llama = server(binary, model, work, f"{case.label}-{way}", flags).start()
    try:
        if way != "kvsidecar":
            turns, seconds = timed(llama.base_url, script, None, False)
        else:
            daemon = DaemonProcess(
                work / f"kv-{case.label}",
                base_url=llama.base_url,
                snapshot_dir=llama.save_dir,
                token=TOKEN,
                proxy={"enabled": True},
            ).start()
            try:
                auth = {"authorization": f"Bearer {TOKEN}"}
                turns, seconds = timed(daemon.proxy_url, script, auth, True)
            finally:
                daemon.stop()
    finally:
        llama.stop()
    return {
        "computed": sum(t.computed for t in turns),
        "reused": sum(t.reused for t in turns),
        "median_turn_s": round(statistics.median(seconds), 4),
        "turns": [
            {
                "session": t.session,
                "turn": t.turn,
                "computed": t.computed,
                "reused": t.reused,
                "outcome": t.headers.get("x-kv-outcome"),
                "plan": t.headers.get("x-kv-plan"),
                "reason": t.headers.get("x-kv-plan-reason"),
            }
            for t in turns
        ],
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--turns", type=int, default=3)
    parser.add_argument("--name", default="plan_classes")
    args = parser.parse_args()
    binary = llama_server_binary()
    plain = generate_llama_model(TINY, vocab_dir=vocab_dir(binary))
    script = Script(turns=args.turns)
    results: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for case in CLASSES:
            model = model_for(case, binary, plain)
            results[case.label] = {
                way: one_way(binary, model, Path(tmp), case, way, script)
                for way in ("alone", "alone-no-cache", "kvsidecar")
            }
            row = results[case.label]
            print(case.label, {way: row[way]["computed"] for way in row}, flush=True)
    print(write(args.name, {"script": script.__dict__, "classes": results}))


if __name__ == "__main__":
    main()
