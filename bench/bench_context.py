"""Cold prefill vs kvsidecar restore vs llama-server's own RAM prompt cache, across context sizes, with
the page cache warm and dropped, next to the hardware's limits (issue 10). Writes bench/results/context.json
and PNG plots in docs/img/.

Per context size and model: session A with N prompt tokens is run cold, session B takes the only slot,
then A comes back. Three ways to come back, same model and server flags otherwise:
  - cold: no persistence (llama-server --cache-ram 0, no kvsidecar): A is prefilled again;
  - ram-cache: llama-server's own host-memory prompt cache (--cache-ram 8192), no kvsidecar;
  - kvsidecar: --cache-ram 0, kvsidecar saves A on the switch and restores it (page cache warm), and once
    more after POSIX_FADV_DONTNEED on the snapshot file (page cache dropped).
Time to first token is measured from before the acquire hook to the first token (n_predict 1).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, write

from kvsidecar.backend.llamacpp import LlamaCppBackend
from kvsidecar.config import config_from_mapping
from kvsidecar.coordinator.core import Coordinator
from kvsidecar.coordinator.state import AcquireResult
from kvsidecar.fingerprint.file_digests import FileDigestCache
from kvsidecar.fingerprint.llama_process import find_llama_process
from kvsidecar.store.snapshots import SnapshotStore
from kvsidecar.testing.llama import LlamaServer, Timings, complete, llama_server_binary, vocab_dir, words
from kvsidecar.testing.models import ModelShape, gemma3_270m, generate_llama_model

ROOT = Path(__file__).resolve().parents[1]
WORDS_PER_TOKEN = {"llama-gen": 0.54, "gemma-3-270m": 0.59}  # generated prompt words -> tokens, measured


def drop_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def read_gbps(path: Path, *, cold: bool) -> float:
    if cold:
        drop_cache(path)
    buf = bytearray(8 << 20)
    fd = os.open(path, os.O_RDONLY)
    t0, total = time.perf_counter(), 0
    try:
        while n := os.readv(fd, [buf]):
            total += n
    finally:
        os.close(fd)
    return total / (time.perf_counter() - t0) / 1e9


def timed_complete(base_url: str, prompt: str, slot_id: int) -> tuple[float, Timings]:
    t0 = time.perf_counter()
    t = complete(base_url, prompt, slot_id=slot_id, n_predict=1)
    return (time.perf_counter() - t0) * 1000, t


async def with_kvsidecar(server: LlamaServer, work: Path, prompt_a: str, prompt_b: str) -> dict[str, Any]:
    cfg = config_from_mapping(
        {
            "state_dir": str(work / "state"),
            "logging": {"level": "warning"},
            "servers": {
                "local": {
                    "base_url": server.base_url,
                    "snapshot_dir": str(server.save_dir),
                    "probe_interval_s": 3600,
                    "persist_timeout_s": 600,
                }
            },
            "checkpoint": {"idle_s": None},
        }
    )
    store = SnapshotStore(state_dir=cfg.state_dir, snapshot_dirs={"local": server.save_dir})
    store.open()
    c = Coordinator(
        config=cfg,
        store=store,
        backends={"local": LlamaCppBackend(base_url=server.base_url, persist_timeout_s=600)},
        process_finder=find_llama_process,
        digests=FileDigestCache(cfg.state_dir / "d.json"),
    )
    await c.start()
    out: dict[str, Any] = {}

    async def turn(session: str, prompt: str) -> tuple[float, AcquireResult, Timings]:
        t0 = time.perf_counter()
        r = await c.acquire(session, provider="local", model="m")
        assert r.slot_id is not None and r.lease_id is not None
        _, t = await asyncio.to_thread(timed_complete, server.base_url, prompt, r.slot_id)
        await c.release(r.lease_id, status="ok", prompt_tokens=t["prompt_n"], cached_tokens=t["cache_n"])
        return (time.perf_counter() - t0) * 1000, r, t

    try:
        out["cold_ms"], _, t = await turn("A", prompt_a)
        out["tokens"] = t["prompt_n"] + t["cache_n"]
        for label, cold_cache in (("warm", False), ("dropped", True)):
            await turn("B", prompt_b)  # saves A (first time), takes the slot
            manifest = c.store.get(next(iter(c.sessions.by_session_id["A"])))
            assert manifest is not None and manifest.current is not None
            # the generation the restore will read
            snap = server.save_dir / manifest.generations[manifest.current].filename
            if cold_cache:
                drop_cache(snap)
            ms, r, t = await turn("A", prompt_a + f" again {label}")
            out[f"restored_{label}_ttft_ms"] = ms
            out[f"restore_{label}_ms"] = r.restore_ms
            out[f"restore_{label}_server_ms"] = r.restore_server_ms
            out[f"reused_{label}"] = t["cache_n"]
        out["snapshot_bytes"] = snap.stat().st_size
        out["read_cold_gbps"] = read_gbps(snap, cold=True)
        out["read_warm_gbps"] = read_gbps(snap, cold=False)
    finally:
        await c.aclose()
    return out


def with_ram_cache(server: LlamaServer, prompt_a: str, prompt_b: str) -> float:
    timed_complete(server.base_url, prompt_a, 0)
    timed_complete(server.base_url, prompt_b, 0)
    ms, _ = timed_complete(server.base_url, prompt_a + " again ram", 0)
    return ms


def run_size(binary: Path, model: Path, kind: str, tokens: int, work: Path) -> dict[str, Any]:
    words_a = int(tokens * WORDS_PER_TOKEN[kind])
    prompt_a, prompt_b = words("A", words_a), words("B", 200)
    ctx = int(tokens * 1.15) + 512
    row: dict[str, Any] = {"model": kind, "target_tokens": tokens, "ctx": ctx}
    server = LlamaServer(
        binary=binary,
        model=model,
        slot_save_path=work / f"snaps-{kind}-{tokens}",
        log_path=work / f"llama-{kind}-{tokens}.log",
        ctx_size=ctx,
        extra_args=("--cache-ram", "0", "--swa-full"),
    )
    server.start(timeout_s=300)
    try:
        row.update(asyncio.run(with_kvsidecar(server, work / f"kv-{kind}-{tokens}", prompt_a, prompt_b)))
    finally:
        server.stop()
    server = LlamaServer(
        binary=binary,
        model=model,
        slot_save_path=None,
        log_path=work / f"ram-{kind}-{tokens}.log",
        ctx_size=ctx,
        extra_args=("--cache-ram", "8192", "--swa-full"),
    )
    server.start(timeout_s=300)
    try:
        row["ram_cache_ttft_ms"] = with_ram_cache(server, prompt_a, prompt_b)
    finally:
        server.stop()
    row["kv_bytes_per_token"] = row["snapshot_bytes"] / row["tokens"]
    print(
        f"  {kind} {row['tokens']:>6} tokens: cold {row['cold_ms']:,.0f} ms, ram-cache {row['ram_cache_ttft_ms']:,.0f} ms, "
        f"kvsidecar {row['restored_warm_ttft_ms']:,.0f} ms (page cache dropped {row['restored_dropped_ttft_ms']:,.0f} ms)",
        file=sys.stderr,
    )
    return row


def plots(rows: list[dict[str, Any]], out_dir: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_dir.mkdir(parents=True, exist_ok=True)
    made = []
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for ax, kind in zip(axes, ("llama-gen", "gemma-3-270m"), strict=True):
        rs = sorted((r for r in rows if r["model"] == kind), key=lambda r: r["tokens"])
        if not rs:
            continue
        x = [r["tokens"] for r in rs]
        for key, label, style in (
            ("cold_ms", "cold prefill (no persistence)", "o-"),
            ("ram_cache_ttft_ms", "llama-server --cache-ram 8192", "s-"),
            ("restored_dropped_ttft_ms", "kvsidecar restore, page cache dropped", "v-"),
            ("restored_warm_ttft_ms", "kvsidecar restore, page cache warm", "^-"),
        ):
            ax.plot(x, [r[key] for r in rs], style, label=label)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("prompt tokens of the session switched back to")
        ax.set_ylabel("time to first token (ms, log)")
        ax.set_title(f"Switch back to a session: {kind}")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "ttft_vs_context.png", dpi=110)
    made.append("ttft_vs_context.png")
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7, 4.5))
    rs = sorted(rows, key=lambda r: r["snapshot_bytes"])
    mb = [r["snapshot_bytes"] / 1e6 for r in rs]
    ax.plot(mb, [r["restore_warm_server_ms"] for r in rs], "^", label="restore_ms, page cache warm")
    ax.plot(mb, [r["restore_dropped_server_ms"] for r in rs], "v", label="restore_ms, page cache dropped")
    ax.plot(
        mb,
        [r["snapshot_bytes"] / (r["read_warm_gbps"] * 1e6) for r in rs],
        "--",
        label="bytes / page-cache read bandwidth",
    )
    ax.plot(
        mb,
        [r["snapshot_bytes"] / (r["read_cold_gbps"] * 1e6) for r in rs],
        ":",
        label="bytes / disk read bandwidth",
    )
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("snapshot size (MB, log)")
    ax.set_ylabel("ms (log)")
    ax.set_title("llama-server restore time vs snapshot size, and the hardware's limit")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_dir / "restore_vs_bytes.png", dpi=110)
    made.append("restore_vs_bytes.png")
    plt.close(fig)
    return made


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--llama-sizes", default="2048,8192,16384,32768")
    parser.add_argument("--gemma-sizes", default="2048,8192,16384,28000")  # 28,000 + margin fits 32K
    args = parser.parse_args()
    binary = llama_server_binary()
    shape = ModelShape(n_layer=4, n_embd=256, n_head=4, n_head_kv=4, n_ff=512, n_ctx=40960, seed=11)
    llama_model = generate_llama_model(shape, vocab_dir=vocab_dir(binary))
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        for tokens in (int(t) for t in args.llama_sizes.split(",") if t):
            rows.append(run_size(binary, llama_model, "llama-gen", tokens, work))
        for tokens in (int(t) for t in args.gemma_sizes.split(",") if t):
            rows.append(run_size(binary, gemma3_270m(), "gemma-3-270m", tokens, work))
    analytic = shape.kv_bytes_per_token_f16
    for r in rows:
        if r["model"] == "llama-gen":
            r["kv_bytes_per_token_analytic"] = analytic
    made = plots(rows, ROOT / "docs" / "img")
    print(
        write(
            "context",
            {
                "rows": rows,
                "plots": made,
                "llama_gen_shape": shape.__dict__,
                "analytic_bytes_per_token": analytic,
                "machine": machine(),
            },
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
