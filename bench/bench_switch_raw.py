"""Switch-back through kvsidecar vs a harness that drives llama-server's /slots by hand (issue 15).

Same llama-server (Gemma 3 270M Q4_K_M, --parallel 1 --swa-full --cache-ram 0), two sessions of ~8.5K tokens
taking turns on the one slot; each turn appends a few words. The raw harness does what a careful script
would: save the outgoing session's slot to a file, restore the incoming one's file, stream the completion.
kvsidecar does the same through its hook (acquire: save + checksum + manifest of the outgoing session,
verified restore of the incoming one), then the same completion, then release. Measured per switch, from
before the first management call to the first streamed token. Phases run raw, kvsidecar, raw on the one
server (the daemon is stopped during the raw phases, so it never sees slot changes it did not make).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import summary, write

from kvsidecar.client import KvSidecarClient
from kvsidecar.demo import TOKEN
from kvsidecar.testing.daemon import DaemonProcess
from kvsidecar.testing.llama import LlamaServer, llama_server_binary, vocab_dir, words
from kvsidecar.testing.models import LLAMA3_8B_GEOMETRY, gemma3_270m, generate_llama_model

SESSIONS = ("A", "B")
# llama-server may close a kept-alive connection right after a streamed answer or ~5 s idle: a new
# loopback connection per call (~0.1 ms) instead of racing its close
_LIMITS = httpx.Limits(max_keepalive_connections=0)


async def first_token(http: httpx.AsyncClient, base: str, prompt: str, slot: int) -> dict[str, Any]:
    """Stream a one-token completion pinned to the slot; returns llama-server's timings."""
    body = {"prompt": prompt, "n_predict": 1, "cache_prompt": True, "stream": True, "id_slot": slot}
    timings: dict[str, Any] = {}
    marks = {"t_sent": time.perf_counter()}
    async with http.stream("POST", f"{base}/completion", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "timings" in chunk:
                    timings = chunk["timings"]
                if chunk.get("content") is not None and "t_first" not in marks:
                    marks["t_first"] = time.perf_counter()
    return {**timings, **marks}


def completion_figures(timings: dict[str, Any]) -> dict[str, float]:
    """The completion's own part: request sent -> first token, and llama-server's prefill of it."""
    return {
        "first_ms": (timings["t_first"] - timings["t_sent"]) * 1000,
        "prompt_ms": float(timings.get("prompt_ms", 0)),
        "prompt_n": float(timings.get("prompt_n", 0)),
        "cache_n": float(timings.get("cache_n", 0)),
    }


def prompt(session: str, n_words: int, turn: int) -> str:
    return words(session, n_words) + " " + words(f"{session}turn", 8 * (turn + 1))


def drop_cached(snaps: Path | None) -> None:
    """--cold: every slot file out of the page cache (POSIX_FADV_DONTNEED; on a VM the host may keep it)."""
    for f in snaps.glob("*.bin") if snaps is not None else ():
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


async def raw_phase(
    base: str, n_words: int, rounds: int, start_turn: int, cold: Path | None = None
) -> list[dict[str, float]]:
    rows = []
    async with httpx.AsyncClient(timeout=600, limits=_LIMITS) as http:
        for name in SESSIONS:  # each session's history, computed once and saved
            await http.post(f"{base}/slots/0?action=erase")
            await first_token(http, base, prompt(name, n_words, start_turn), 0)
            await http.post(f"{base}/slots/0?action=save", json={"filename": f"raw-{name}.bin"})
        current = SESSIONS[-1]
        for i in range(rounds):
            incoming = SESSIONS[i % 2]
            drop_cached(cold)
            t0 = time.perf_counter()
            s = await http.post(f"{base}/slots/0?action=save", json={"filename": f"raw-{current}.bin"})
            t1 = time.perf_counter()
            r = await http.post(f"{base}/slots/0?action=restore", json={"filename": f"raw-{incoming}.bin"})
            t2 = time.perf_counter()
            s.raise_for_status()
            r.raise_for_status()
            timings = await first_token(http, base, prompt(incoming, n_words, start_turn + i + 1), 0)
            rows.append(
                {
                    "ttft_ms": (timings["t_first"] - t0) * 1000,
                    "manage_ms": (t2 - t0) * 1000,
                    "save_ms": (t1 - t0) * 1000,
                    "restore_ms": (t2 - t1) * 1000,
                    "llama_save_ms": float(s.json()["timings"]["save_ms"]),
                    "llama_restore_ms": float(r.json()["timings"]["restore_ms"]),
                    **completion_figures(timings),
                }
            )
            current = incoming
        await http.post(f"{base}/slots/0?action=erase")
    return rows


async def kvsidecar_phase(
    daemon_url: str, base: str, n_words: int, rounds: int, model: str, cold: Path | None = None
) -> list[dict[str, float]]:
    rows = []
    async with (
        KvSidecarClient(daemon_url, token=TOKEN) as kv,
        httpx.AsyncClient(timeout=600, limits=_LIMITS) as http,
    ):
        for i in range(rounds + 2):  # the first two turns compute each history cold
            incoming = SESSIONS[i % 2]
            drop_cached(cold)
            t0 = time.perf_counter()
            async with kv.acquire(incoming, provider="local", model=model) as lease:
                t1 = time.perf_counter()
                assert lease.slot_id is not None, lease
                timings = await first_token(http, base, prompt(incoming, n_words, i), lease.slot_id)
                lease.report(prompt_tokens=timings.get("prompt_n"), cached_tokens=timings.get("cache_n"))
            if i < 2:
                continue
            assert lease.outcome == "restored", lease
            rows.append(
                {
                    "ttft_ms": (timings["t_first"] - t0) * 1000,
                    "manage_ms": (t1 - t0) * 1000,
                    "restore_ms": float(lease.restore_ms or 0.0),
                    **completion_figures(timings),
                }
            )
    return rows


def med(rows: list[dict[str, float]], key: str) -> float:
    return statistics.median(r[key] for r in rows)


# --model: Gemma 3 270M (the side-by-side, ~34 MB slot files at 8.5K tokens), or the generated
# model with Llama-3-8B's KV geometry (128 KiB per token: ~400 MB slot files at ~3K tokens)
MODELS = {"gemma": ("gemma-3-270m Q4_K_M", 9728), "llama3-8b-geometry": ("llama3-8b-geometry", 4096)}


async def run(
    work: Path, n_words: int, rounds: int, which: str, log_level: str, cold: bool = False
) -> dict[str, Any]:
    snaps = work / "snaps"
    binary = llama_server_binary()
    name, ctx = MODELS[which]
    path = (
        gemma3_270m()
        if which == "gemma"
        else generate_llama_model(LLAMA3_8B_GEOMETRY, vocab_dir=vocab_dir(binary))
    )
    flags = ("--swa-full", "--cache-ram", "0") if which == "gemma" else ("--cache-ram", "0")
    llama = LlamaServer(
        binary=binary,
        model=path,
        slot_save_path=snaps,
        log_path=work / "llama.log",
        ctx_size=ctx,
        extra_args=flags,
    )
    llama.start()
    try:
        dropped = snaps if cold else None
        raw1 = await raw_phase(llama.base_url, n_words, rounds, 0, dropped)
        for f in snaps.glob("raw-*.bin"):
            f.unlink()
        daemon = DaemonProcess(
            work / "kvsidecar",
            base_url=llama.base_url,
            snapshot_dir=snaps,
            token=TOKEN,
            logging={"level": log_level},
            # every switch pays the outgoing save, as the raw harness does (no clean ahead in the gaps)
            checkpoint={"policy": "save-before-evict"},
        )
        daemon.start()
        try:
            side = await kvsidecar_phase(daemon.url, llama.base_url, n_words, rounds, name, dropped)
        finally:
            daemon.stop()
        raw2 = await raw_phase(llama.base_url, n_words, rounds, 0, dropped)
        for f in snaps.glob("raw-*.bin"):
            f.unlink()
    finally:
        llama.stop()
    raw = raw1 + raw2
    return {
        "model": name,
        "llama_flags": f"--ctx-size {ctx} --parallel 1 {' '.join(flags)}",
        "cold": cold,
        "prompt_tokens": med(side, "prompt_n") + med(side, "cache_n"),
        "raw": {k: summary([r[k] for r in raw]) for k in raw[0]},
        "kvsidecar": {k: summary([r[k] for r in side]) for k in side[0]},
        "ratio_ttft_p50": med(side, "ttft_ms") / med(raw, "ttft_ms"),
        "rows": {"raw": raw, "kvsidecar": side},
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", choices=sorted(MODELS), default="gemma")
    parser.add_argument(
        "--words", type=int, help="history size in generated words (default: 4,900 for gemma)"
    )
    parser.add_argument("--rounds", type=int, default=12, help="switches per phase")
    parser.add_argument(
        "--cold", action="store_true", help="drop every slot file from the page cache before each switch"
    )
    parser.add_argument("--log-level", default="warning", help="the daemon's (its log is kept with --work)")
    parser.add_argument("--work", type=Path, help="keep the logs and files here (default: a temporary dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = args.work or Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        words_n = args.words or (4900 if args.model == "gemma" else 1700)
        result = asyncio.run(run(work, words_n, args.rounds, args.model, args.log_level, args.cold))
    name = "switch_raw" if args.model == "gemma" else f"switch_raw_{args.model}"
    print(write(name + ("_cold" if args.cold else ""), result))
    raw, side = result["raw"], result["kvsidecar"]
    print(
        f"{result['prompt_tokens']:,.0f} tokens. raw: TTFT p50 {raw['ttft_ms']['p50']:.1f} ms "
        f"(save {raw['save_ms']['p50']:.1f}, restore {raw['restore_ms']['p50']:.1f}); kvsidecar: TTFT p50 "
        f"{side['ttft_ms']['p50']:.1f} ms (acquire {side['manage_ms']['p50']:.1f}, restore "
        f"{side['restore_ms']['p50']:.1f}); ratio {result['ratio_ttft_p50']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
