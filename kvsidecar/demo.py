"""The demo (README's main command): a real llama-server with Gemma 3 270M, the real daemon, a session
switch, a daemon restart, a llama-server restart and a deleted snapshot, printed as a table.

Every number in the table is the engine's own (`timings.prompt_n` computed, `timings.cache_n` reused) or a
wall-clock time to first token measured from before the acquire hook to the first streamed token.
llama-server runs with `--cache-ram 0`, so a warm start can only come from a kvsidecar snapshot on disk.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from kvsidecar.client import KvSidecarClient
from kvsidecar.store.manifest import BadManifest, read_manifest
from kvsidecar.testing.daemon import DaemonProcess
from kvsidecar.testing.llama import LlamaServer, llama_server_binary, words
from kvsidecar.testing.models import gemma3_270m

TOKEN = "demo-token-" + os.urandom(8).hex()


@dataclass
class Row:
    step: str
    session: str
    outcome: str
    calls: str
    computed: int | None
    reused: int | None
    ttft_ms: float | None
    note: str = ""


async def stream_turn(
    kv: KvSidecarClient, llama: str, session: str, prompt: str
) -> tuple[Any, dict[str, Any], float]:
    """acquire -> streamed /completion pinned to the slot -> release with the engine's numbers."""
    started = time.perf_counter()
    ttft: float | None = None
    timings: dict[str, Any] = {}
    async with kv.acquire(session, provider="local", model="gemma-3-270m") as lease:
        body = {
            "prompt": prompt,
            "n_predict": 8,
            "cache_prompt": True,
            "stream": True,
            "id_slot": lease.slot_id,
            "temperature": 0,
        }
        async with (
            httpx.AsyncClient(timeout=600) as http,
            http.stream("POST", f"{llama}/completion", json=body) as r,
        ):
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                chunk = json.loads(line[6:])
                if ttft is None and chunk.get("content"):
                    ttft = (time.perf_counter() - started) * 1000
                if "timings" in chunk:
                    timings = chunk["timings"]
        lease.report(prompt_tokens=timings.get("prompt_n"), cached_tokens=timings.get("cache_n"))
    return lease, timings, ttft if ttft is not None else (time.perf_counter() - started) * 1000


def print_table(rows: list[Row]) -> None:
    head = ["step", "session", "outcome", "management calls", "computed", "reused", "TTFT ms", "note"]
    table = [head] + [
        [
            r.step,
            r.session,
            r.outcome,
            r.calls,
            "" if r.computed is None else f"{r.computed:,}",
            "" if r.reused is None else f"{r.reused:,}",
            "" if r.ttft_ms is None else f"{r.ttft_ms:,.0f}",
            r.note,
        ]
        for r in rows
    ]
    widths = [max(len(str(row[i])) for row in table) for i in range(len(head))]
    right = {4, 5, 6}
    for n, row in enumerate(table):
        cells = [
            str(c).rjust(w) if i in right else str(c).ljust(w)
            for i, (c, w) in enumerate(zip(row, widths, strict=True))
        ]
        print("| " + " | ".join(cells) + " |")
        if n == 0:
            print("|" + "|".join("-" * (w + 2) for w in widths) + "|")


def _servers(work: Path) -> tuple[LlamaServer, DaemonProcess]:
    """llama-server (one slot, snapshots in work/snapshots, no RAM prompt cache) and the daemon beside it."""
    snapshots = work / "snapshots"
    llama = LlamaServer(
        binary=llama_server_binary(),
        model=gemma3_270m(),
        slot_save_path=snapshots,
        log_path=work / "llama.log",
        ctx_size=8192,
        parallel=1,
        extra_args=("--swa-full", "--cache-ram", "0"),
    )
    daemon = DaemonProcess(
        work / "kvsidecar",
        base_url=llama.base_url,
        snapshot_dir=snapshots,
        token=TOKEN,
        servers={"local": {"probe_interval_s": 0.5}},
    )
    return llama, daemon


async def run(work: Path, tokens_a: int, tokens_b: int) -> list[Row]:
    snapshots = work / "snapshots"
    llama, daemon = _servers(work)
    turns = {"A": 0, "B": 0}
    rows: list[Row] = []

    def prompt(session: str) -> str:
        turns[session] += 1
        base = tokens_a if session == "A" else tokens_b
        return words(session, base + 40 * (turns[session] - 1))  # each turn appends a short message

    async def turn(step: str, session: str, note: str = "") -> None:
        async with KvSidecarClient(daemon.url, token=TOKEN) as kv:
            lease, timings, ttft = await stream_turn(kv, llama.base_url, session, prompt(session))
        rows.append(
            Row(
                step,
                session,
                lease.outcome,
                ", ".join(lease.actions) or "none",
                timings.get("prompt_n"),
                timings.get("cache_n"),
                ttft,
                note,
            )
        )
        print(
            f"  step {step}: session {session} -> {lease.outcome} ({ttft:,.0f} ms to first token)",
            file=sys.stderr,
        )

    def event(step: str, what: str) -> None:
        rows.append(Row(step, "", what, "", None, None, None))
        print(f"  step {step}: {what}", file=sys.stderr)

    llama.start()
    daemon.start()
    try:
        await turn("1", "A", "first request: cold prefill")
        await turn("2", "A", "resident: nothing to do")
        await turn("3", "B", "switch: A saved, B cold on its KV")
        await turn("4", "A", "switch back: A restored from disk")
        daemon.stop()
        daemon.start()
        event("5", "kvsidecar restarted (SIGTERM checkpoint)")
        await turn("6", "A", "new daemon trusts no slot: restore")
        removed = _remove_session_files(work / "kvsidecar", snapshots, "A")
        llama.restart()
        await asyncio.sleep(1.5)  # let the probe notice the new llama-server process
        event("7", f"llama-server restarted; A's snapshot deleted by hand ({removed} files)")
        await turn("8", "A", "snapshot gone: cold prefill, still correct")
        await turn("9", "B", "B survived the llama-server restart")
    finally:
        daemon.stop()
        llama.stop()
    return rows


def _remove_session_files(work: Path, snapshots: Path, session: str) -> int:
    removed = 0
    for manifest_file in (work / "state" / "manifests").glob("*.json"):
        try:
            manifest = read_manifest(manifest_file)
        except BadManifest:
            continue
        if manifest.session_id != session:
            continue
        for gen in manifest.generations.values():
            path = snapshots / gen.filename
            if path.exists():
                path.unlink()
                removed += 1
    return removed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="kvsidecar demo on Gemma 3 270M")
    parser.add_argument("--tokens-a", type=int, default=3000, help="approximate prompt size of session A")
    parser.add_argument("--tokens-b", type=int, default=1500, help="approximate prompt size of session B")
    parser.add_argument("--keep", action="store_true", help="keep the work directory (logs, snapshots)")
    args = parser.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="kvsidecar-demo-"))
    print(
        f"kvsidecar demo: llama-server + Gemma 3 270M Q4_K_M (--swa-full, --cache-ram 0), work dir {work}",
        file=sys.stderr,
    )
    try:
        rows = asyncio.run(run(work, args.tokens_a, args.tokens_b))
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print()
    print_table(rows)
    cold = next(r.ttft_ms for r in rows if r.step == "1")
    restored = [r.ttft_ms for r in rows if r.outcome == "restored" and r.session == "A" and r.ttft_ms]
    if cold and restored:
        print(
            f"\nSession A: cold time to first token {cold:,.0f} ms; after a restore from disk "
            f"{min(restored):,.0f}-{max(restored):,.0f} ms ({cold / max(restored):.0f}x faster or better)."
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
