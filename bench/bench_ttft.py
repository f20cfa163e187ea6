"""Time to first token after switching back to a long session (issue 4): Gemma 3 270M, ~8K-token prompt,
cold prefill vs restore by kvsidecar, same run, same server (--swa-full, --cache-ram 0: a warm start can
only come from kvsidecar's snapshot on disk)."""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import summary, write

from kvsidecar.client import KvSidecarClient
from kvsidecar.demo import TOKEN, stream_turn
from kvsidecar.testing.daemon import DaemonProcess
from kvsidecar.testing.llama import LlamaServer, llama_server_binary, words
from kvsidecar.testing.models import gemma3_270m


async def run(work: Path, words_a: int, rounds: int, colds: int) -> dict[str, Any]:
    llama = LlamaServer(
        binary=llama_server_binary(),
        model=gemma3_270m(),
        slot_save_path=work / "snaps",
        log_path=work / "llama.log",
        ctx_size=8192,
        extra_args=("--swa-full", "--cache-ram", "0"),
    )
    daemon = DaemonProcess(
        work / "kvsidecar",
        base_url=llama.base_url,
        snapshot_dir=work / "snaps",
        token=TOKEN,
        logging={"level": "warning"},
    )
    llama.start()
    daemon.start()
    cold, warm, restore_ms, tokens = [], [], [], 0
    try:
        async with KvSidecarClient(daemon.url, token=TOKEN) as kv:
            for i in range(colds):
                await kv.purge("A") if i else None
                await stream_turn(kv, llama.base_url, "B", words("B", 100 + i))  # someone else had the slot
                lease, timings, ttft = await stream_turn(kv, llama.base_url, "A", words("A", words_a))
                assert lease.outcome == "cold", lease
                cold.append(ttft)
                tokens = int(timings["prompt_n"]) + int(timings["cache_n"])
            for i in range(rounds):
                await stream_turn(kv, llama.base_url, "B", words("B", 100 + colds + i))  # switch away
                lease, timings, ttft = await stream_turn(
                    kv, llama.base_url, "A", words("A", words_a + 8 * (i + 1))
                )
                assert lease.outcome == "restored", lease
                warm.append(ttft)
                restore_ms.append(lease.restore_ms)
    finally:
        daemon.stop()
        llama.stop()
    return {
        "model": "gemma-3-270m Q4_K_M",
        "prompt_tokens": tokens,
        "cold_ttft_ms": summary(cold),
        "restored_ttft_ms": summary(warm),
        "restore_ms": summary(restore_ms),
        "ratio_cold_over_restored_p50": statistics.median(cold) / statistics.median(warm),
        "llama_flags": "--ctx-size 8192 --parallel 1 --swa-full --cache-ram 0",
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--words", type=int, default=4600, help="prompt size of A in generated words (~1.7 tok)"
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--colds", type=int, default=2)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = asyncio.run(run(Path(tmp), args.words, args.rounds, args.colds))
    print(write("ttft", result))
    print(
        f"{result['prompt_tokens']:,} tokens: cold TTFT p50 {result['cold_ttft_ms']['p50']:,.0f} ms, "
        f"restored p50 {result['restored_ttft_ms']['p50']:,.0f} ms, ratio {result['ratio_cold_over_restored_p50']:.0f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
