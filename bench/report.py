"""Write docs/BENCHMARKS.md from bench/results/*.json and the hand-written bench/notes/*.md (run by bench/run)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench" / "results"


def load(name: str) -> dict[str, Any] | None:
    path = RESULTS / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def ms(d: dict[str, float], key: str = "p50") -> str:
    return f"{d[key]:,.2f}"


def section_hooks(h: dict[str, Any]) -> list[str]:
    r, s = h["resident"], h["restore"]
    return [
        "## Hook path (real daemon over loopback HTTP, real llama-server, generated 4-layer model)",
        "",
        f"Machine: {h['machine']['cpu']}, {h['machine']['cores']} cores, {h['machine']['date']}.",
        "",
        "| measure | p50 | p99 | target |",
        "|---|---:|---:|---|",
        f"| resident acquire or release, one call (ms) | {ms(r['per_call_ms'])} | {ms(r['per_call_ms'], 'p99')} "
        f"| p50 < 1, p99 < 3 |",
        f"| resident acquire + release pair (ms) | {ms(r['acquire_plus_release_ms'])} "
        f"| {ms(r['acquire_plus_release_ms'], 'p99')} | |",
        f"| daemon CPU per call (ms, psutil, {r['calls']:,} pairs) | {r['daemon_cpu_ms_per_call']:.3f} | | < 0.2 |",
        f"| acquire that restores {s['snapshot_bytes']:,} B / {s['restored_tokens']:,} tokens (ms) "
        f"| {ms(s['acquire_ms'])} | {ms(s['acquire_ms'], 'p99')} | |",
        f"| llama-server's own restore_ms | {ms(s['llama_restore_ms'])} | {ms(s['llama_restore_ms'], 'p99')} | |",
        f"| overhead = acquire - restore_ms (ms) | {ms(s['overhead_ms'])} | {ms(s['overhead_ms'], 'p99')} "
        f"| < 2 + checksum |",
        f"| of which xxh3 checksum of the file (ms) | {ms(s['checksum_ms'])} | {ms(s['checksum_ms'], 'p99')} | |",
        f"| of which llama-server's HTTP around restore_ms (ms) | {s['backend_call_ms']['p50'] - s['llama_restore_ms']['p50']:.2f} | | |",
        "",
        f"Decomposition of the p50 acquire ({s['acquire_ms']['p50']:.2f} ms): llama-server's restore call as kvsidecar "
        f"timed it {s['backend_call_ms']['p50']:.2f} ms (its own restore_ms {s['llama_restore_ms']['p50']:.2f} ms plus "
        f"{s['backend_call_ms']['p50'] - s['llama_restore_ms']['p50']:.2f} ms of its HTTP and task queue), checksum "
        f"{s['checksum_ms']['p50']:.2f} ms, and {s['acquire_ms']['p50'] - s['backend_call_ms']['p50'] - s['checksum_ms']['p50']:.2f} ms "
        f"for everything else kvsidecar does, including the hook's own HTTP round trip ({ms(r['per_call_ms'])} ms).",
        "",
    ]


def section_ttft(t: dict[str, Any]) -> list[str]:
    return [
        "## Time to first token after switching back (Gemma 3 270M Q4_K_M, CPU)",
        "",
        f"llama-server `{t['llama_flags']}`; session A has {t['prompt_tokens']:,} prompt tokens; between A's "
        "turns session B takes the slot. TTFT is measured by the client from before the acquire hook to the "
        "first streamed token, so it includes kvsidecar's save/restore work.",
        "",
        "| | p50 (ms) | min | max | n |",
        "|---|---:|---:|---:|---:|",
        f"| cold prefill | {t['cold_ttft_ms']['p50']:,.0f} | {t['cold_ttft_ms']['min']:,.0f} "
        f"| {t['cold_ttft_ms']['max']:,.0f} | {t['cold_ttft_ms']['n']} |",
        f"| restored by kvsidecar | {t['restored_ttft_ms']['p50']:,.0f} | {t['restored_ttft_ms']['min']:,.0f} "
        f"| {t['restored_ttft_ms']['max']:,.0f} | {t['restored_ttft_ms']['n']} |",
        f"| of which the restore call | {t['restore_ms']['p50']:,.1f} | {t['restore_ms']['min']:,.1f} "
        f"| {t['restore_ms']['max']:,.1f} | {t['restore_ms']['n']} |",
        "",
        f"**Ratio cold / restored (p50): {t['ratio_cold_over_restored_p50']:.0f}x.**",
        "",
    ]


def _switch_raw_table(d: dict[str, Any]) -> list[str]:
    raw, side = d["raw"], d["kvsidecar"]

    def row(name: str, r: dict[str, Any], save: str, restore: str) -> str:
        return (
            f"| {name} | {r['ttft_ms']['p50']:,.1f} | {r['manage_ms']['p50']:,.1f} | {save} | {restore} "
            f"| {r['first_ms']['p50']:,.1f} | {r['prompt_n']['p50']:,.0f} | {r['ttft_ms']['n']} |"
        )

    return [
        "| path | TTFT | management | save | restore | first token | new tokens | n |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
        row("raw /slots", raw, f"{raw['save_ms']['p50']:,.1f}", f"{raw['restore_ms']['p50']:,.1f}"),
        row("kvsidecar", side, "", f"{side['restore_ms']['p50']:,.1f}"),
        "",
        f"**kvsidecar / raw, TTFT p50: {d['ratio_ttft_p50']:.2f}x** (management alone: "
        f"{side['manage_ms']['p50'] / raw['manage_ms']['p50']:.2f}x).",
        "",
    ]


def section_switch_raw(d: dict[str, Any]) -> list[str]:
    big = load("switch_raw_llama3-8b-geometry")
    return [
        "## Switch-back through kvsidecar vs driving `/slots` by hand (Gemma 3 270M, CPU)",
        "",
        f"Machine: {d['machine']['cpu']}, {d['machine']['cores']} cores, {d['machine']['date']}. "
        f"`bench/bench_switch_raw.py`: one llama-server (`{d['llama_flags']}`), two sessions of "
        f"{d['prompt_tokens']:,.0f} tokens taking turns on the one slot, each turn appending a few words. The raw "
        "harness saves the outgoing slot to a file, restores the incoming one's file and streams the completion; "
        "kvsidecar does the same through its acquire hook (save, checksum and manifest of the outgoing session, "
        "verified restore of the incoming one; `save-before-evict`, so every switch pays the save). Phases run "
        "raw, kvsidecar, raw on the same server. TTFT is from before the first management call to the first "
        "streamed token; management is the save + restore calls (raw) or the acquire hook (kvsidecar); first "
        "token is the completion call alone. Medians in ms.",
        "",
        *_switch_raw_table(d),
        "Where the rest of kvsidecar's management time goes (the acquire instrumented separately, 2026-11-30, "
        "p50 per switch): llama-server's save ~21 ms and restore ~10 ms as in the raw path; the runtime bracket "
        "(process check plus the `/props` nonce) ~1.5 ms at each of the four ends of the save and the restore; "
        "choosing and clearing the save's target generation (a durable manifest write; the old file is moved "
        "aside and deleted beside the save, see below) ~4 ms; the commit (xxh3 of the 34 MB file, the manifest "
        "write) ~6 ms, which runs while the incoming session restores instead of before it.",
        "",
        *(
            [
                "### The same at Llama-3-8B KV sizes",
                "",
                f"Machine: {big['machine']['cpu']}, {big['machine']['cores']} cores, {big['machine']['date']}. "
                "`bench/bench_switch_raw.py --model llama3-8b-geometry`: the generated model with Llama-3-8B's KV "
                f"geometry (`{big['llama_flags']}`), two sessions of {big['prompt_tokens']:,.0f} tokens "
                f"(~{big['prompt_tokens'] * 131088 / 1e6:,.0f} MB slot files). Medians in ms.",
                "",
                *_switch_raw_table(big),
            ]
            if big is not None
            else []
        ),
        *(
            [
                f"With every slot file dropped from the page cache before each switch (`--cold`, "
                f"{cold['machine']['date']}; kvsidecar reads the incoming file ahead while the outgoing one "
                "saves, the raw harness reads it when it restores):",
                "",
                *_switch_raw_table(cold),
            ]
            if (cold := load("switch_raw_llama3-8b-geometry_cold")) is not None
            else []
        ),
    ]


def section_save_target(d: dict[str, Any]) -> list[str]:
    runs = [r for r in (d, load("save_target_dirty")) if r is not None]
    ways = {
        "unlink-first": "unlink-first (kvsidecar before)",
        "aside": "**aside** (kvsidecar now)",
        "overwrite": "overwrite (raw /slots)",
        "keep-until-after": "keep-until-after",
    }
    rows = []
    for r in runs:
        for way, label in ways.items():
            p = r["p50"][way]
            rows.append(
                f"| {label} | {r['state']} | {p['path_ms']:,.1f} | {p['save_ms']:,.1f} | {p['llama_save_ms']:,.1f} "
                f"| {p['restore_ms']:,.1f} |"
            )
    ratios = ", ".join(
        f"{r['p50']['aside']['path_ms'] / r['p50']['unlink-first']['path_ms']:.2f}x ({r['state']})"
        for r in runs
    )
    cold = load("save_target_dirty_cold_incoming")
    cold_rows = (
        [
            f"| {way} | {p['path_ms']:,.1f} | {p['save_ms']:,.1f} | {p['restore_ms']:,.1f} |"
            for way, p in cold["p50"].items()
        ]
        if cold is not None
        else []
    )
    cold_part = (
        [
            f"The incoming file cold (`--incoming cold --state {cold['state']}`, {cold['machine']['date']}, "
            f"{cold['rounds']} rounds per way): dropped from the page cache before each round; aside+preread "
            "first asks the kernel to read it (POSIX_FADV_WILLNEED), as kvsidecar does before a switch's "
            "save, so the read overlaps the save. Medians in ms.",
            "",
            "| way | save + restore | save | restore |",
            "|---|---:|---:|---:|",
            *cold_rows,
            "",
        ]
        if cold is not None
        else []
    )
    return [
        "## Clearing a save's target (Llama-3-8B geometry)",
        "",
        f"Machine: {d['machine']['cpu']}, {d['machine']['cores']} cores, {d['machine']['date']}. "
        f"`bench/bench_save_target.py` ({d['rounds']} rounds per way, interleaved): a save writes a session's older "
        f"generation again, so the name holds a {d['file_bytes'] / 1e6:,.0f} MB file that must go. Timed from "
        "the first file operation to the end of the incoming session's restore (the part of a switch before its "
        "prefill). Ways: unlink-first, delete the old file then save; aside, rename it to a fresh name and delete "
        "it in a thread while llama-server saves; overwrite, let llama-server's save truncate it (a harness "
        "driving `/slots` by hand); keep-until-after, rename it aside and delete it after the save. Old file "
        "`clean`: the disk synced before each round (a generation written a while ago); `dirty`: not (written "
        "seconds ago). Medians in ms.",
        "",
        "| way | old file | save + restore | save | llama-server's save_ms | restore |",
        "|---|---|---:|---:|---:|---:|",
        *rows,
        "",
        f"**Aside / unlink-first, save + restore p50: {ratios}.**",
        "",
        *cold_part,
    ]


def section_store(s: dict[str, Any]) -> list[str]:
    r, c, w = s["reconcile"], s["checksum"], s["manifest_write"]
    return [
        "## Snapshot store",
        "",
        "| measure | p50 | p99 / max | target |",
        "|---|---:|---:|---|",
        f"| startup reconcile, {r['manifests']:,} manifests + {r['files']:,} files (ms) | {ms(r['ms'])} "
        f"| {ms(r['ms'], 'max')} | < 2,000 |",
        f"| xxh3-128 checksum, 1 GiB from page cache (GB/s) | {c['xxh3_gbps']['p50']:.2f} "
        f"| min {c['xxh3_gbps']['min']:.2f} | >= 5 |",
        f"| plain read of the same file, same run (GB/s) | {c['plain_read_gbps']['p50']:.2f} | | |",
        f"| manifest write, tmp + fsync + rename + dir fsync (ms) | {ms(w['fsync_ms'])} | {ms(w['fsync_ms'], 'p99')} "
        f"| |",
        f"| manifest write without fsync (ms) | {ms(w['no_fsync_ms'])} | {ms(w['no_fsync_ms'], 'p99')} | |",
        "",
        f"Checksum speed is {c['ratio_hash_vs_read_p50']:.0%} of a plain read of the same cached file: "
        "verification costs little more than reading the bytes once.",
        "",
    ]


def section_digest(d: dict[str, Any]) -> list[str]:
    r, c, e = d["random"], d["cache"], d["event_loop"]
    gib = d["bytes"] / (1 << 30)
    return [
        "## Model digest for the runtime fingerprint",
        "",
        f"xxh3-128 of every byte of a {gib:.0f} GiB file (random data; {d['block_bytes'] >> 20} MiB reads), as the "
        "fingerprint hashes a model file once per change of its (device, inode, size, mtime, ctime).",
        "",
        "| measure | p50 | min | max |",
        "|---|---:|---:|---:|",
        f"| page cache dropped (GB/s) | {r['cold_gbps']['p50']:.2f} | {r['cold_gbps']['min']:.2f} "
        f"| {r['cold_gbps']['max']:.2f} |",
        f"| plain read, page cache dropped (GB/s) | {r['plain_read_cold_gbps']['p50']:.2f} "
        f"| {r['plain_read_cold_gbps']['min']:.2f} | {r['plain_read_cold_gbps']['max']:.2f} |",
        f"| in the page cache (GB/s) | {r['warm_gbps']['p50']:.2f} | {r['warm_gbps']['min']:.2f} "
        f"| {r['warm_gbps']['max']:.2f} |",
        f"| plain read, in the page cache (GB/s) | {r['plain_read_warm_gbps']['p50']:.2f} "
        f"| {r['plain_read_warm_gbps']['min']:.2f} | {r['plain_read_warm_gbps']['max']:.2f} |",
        f"| sparse file of the same size (GB/s) | {d['sparse_gbps']['p50']:.2f} | {d['sparse_gbps']['min']:.2f} "
        f"| {d['sparse_gbps']['max']:.2f} |",
        f"| later call, file unchanged (µs) | {c['cached_call_us']['p50']:.1f} | {c['cached_call_us']['min']:.1f} "
        f"| {c['cached_call_us']['max']:.1f} |",
        f"| first call after a daemon restart, cache file read back (µs) | {c['after_restart_us']['p50']:.0f} "
        f"| {c['after_restart_us']['min']:.0f} | {c['after_restart_us']['max']:.0f} |",
        f"| 1 ms event-loop timer lateness while hashing in a worker thread (ms, p99) "
        f"| {e['timer_late_ms']['p99']:.2f} | | {e['timer_late_ms']['max']:.2f} |",
        f"| the same, nothing hashing (ms, p99) | {e['timer_late_idle_ms']['p99']:.2f} | "
        f"| {e['timer_late_idle_ms']['max']:.2f} |",
        "",
        f"A {gib:.0f} GiB model costs {r['cold_s_p50']:.1f} s when read from this machine's disk and "
        f"{r['warm_s_p50']:.2f} s from the page cache, once per change of the file; every later fingerprint "
        "stats it. Hashing keeps up with reading, so on a slower disk the time is the file size over the "
        "disk's bandwidth (about 24 s for 4 GiB at 180 MB/s). On this VM the dropped page cache may still be "
        "served by the host's cache.",
        "",
    ]


def section_retention(r: dict[str, Any]) -> list[str]:
    p, g = r["plan"], r["gc_pass"]
    return [
        "## Retention",
        "",
        "| measure | value | target |",
        "|---|---:|---|",
        f"| plan over {p['snapshots']:,} snapshots / {p['files']:,} files, p50 (ms) | {p['ms']['p50']:,.1f} | < 200 |",
        f"| GC pass deleting {g['files_deleted']:,} files of {g['snapshots']:,} snapshots (ms) | {g['ms']:,.0f} "
        f"({g['ms_per_file']:.2f} per file) | |",
        "",
        "Each deletion rewrites or removes a manifest with fsync before unlinking the file, which is most of the "
        "per-file cost.",
        "",
    ]


def section_pool(r: dict[str, Any]) -> list[str]:
    rows = [
        f"| {x['slots']} | {x['sessions']} | {x['pairs_per_s']:,.0f} | {x['acquire_ms']['p50']:.2f} "
        f"| {x['acquire_ms']['p99']:.2f} | {', '.join(f'{k} {v}' for k, v in sorted(x['outcomes'].items()))} |"
        for x in r["runs"]
    ]
    return [
        "## Slot pool (coordinator with the fake backend, 64 concurrent clients)",
        "",
        "| slots | sessions | acquire+release /s | acquire p50 (ms) | acquire p99 (ms) | outcomes |",
        "|---:|---:|---:|---:|---:|---|",
        *rows,
        "",
        "With 200 sessions nearly every acquire is a switch: kvsidecar's bookkeeping per switch (two fsync'd "
        "manifest writes, a checksum of the new file, the integrity checks of the restored one) costs a few "
        "milliseconds, and throughput is bounded by it. Acquire latency here is queueing: 64 clients wait, "
        "first come first served, for the slots (or, with as many sessions as slots, for their own "
        "session's slot), so it shows fairness rather than per-call cost (that is in the hook path table).",
        "",
    ]


def _proxy_rows(o: dict[str, Any], big: dict[str, Any]) -> list[str]:
    rows = []
    for m, label in (
        ("direct", "direct to llama-server, /completion"),
        ("proxy_managed", "proxy, managed (X-Session-Id, resident), /completion"),
        ("direct_tokenize", "direct to llama-server, /tokenize"),
        ("proxy_passthrough", "proxy, pass-through, /tokenize"),
    ):
        if m not in o:  # results from before pass-through was measured on /tokenize
            continue
        cpu = o.get(f"{m}_daemon_cpu_ms")
        cpu_cells = (
            f"{cpu['whole']:.2f} | {cpu['stream']:.1f}"
            if cpu and "ttfc" in o[m]
            else (f"{cpu['whole']:.2f} | -" if cpu else "- | -")
        )
        stream_cells = f"{o[m]['ttfc']['p50']:.2f} | {o[m]['end']['p50']:.1f}" if "ttfc" in o[m] else "- | -"
        rows.append(
            f"| {label} | {o[m]['whole']['p50']:.2f} | {stream_cells} | {big[m]['whole']['p50']:.2f} | {cpu_cells} |"
        )
    return rows


def _client_rows(o: dict[str, Any]) -> list[str]:
    names = {
        "kvsidecar_upstream": "kvsidecar.upstream (used)",
        "httpx": "httpx.AsyncClient",
        "aiohttp": "aiohttp",
    }
    return [
        f"| {names.get(n, n)} | {c['whole']['p50']:.2f} | {c['ttfc']['p50']:.2f} | {c['end']['p50']:.1f} | "
        f"{c['client_cpu_ms']['whole']:.2f} | {c['client_cpu_ms']['stream']:.2f} |"
        for n, c in o.get("clients", {}).items()
    ]


def section_proxy(r: dict[str, Any]) -> list[str]:
    o, a, big = r["overhead"], r["aba"], r["overhead_large"]
    k, h = a["kvsidecar"], a["hearth"]
    man, pas = o["proxy_managed_added_ms_p50"], o["proxy_passthrough_added_ms_p50"]
    worst = max(man["whole"], man["ttfc"], pas["whole"], pas.get("ttfc", pas["whole"]))
    rounds = o["direct"]["whole"]["n"]
    clients = _client_rows(o)
    client_table = (
        [
            "Upstream-client candidates for the proxy's hop, same run, interleaved, on uvloop as in the daemon: "
            "the same pinned `/completion` requests straight to llama-server from one process; client CPU is "
            "that process' own time per request.",
            "",
            "| client | whole request p50 (ms) | first chunk p50 (ms) | stream end p50 (ms) "
            "| client CPU per request (ms) | client CPU per 64-token stream (ms) |",
            "|---|---:|---:|---:|---:|---:|",
            *clients,
            "",
        ]
        if clients
        else []
    )
    return [
        "## Proxy mode",
        "",
        f"Machine: {r['machine']['cpu']}, {r['machine']['cores']} cores, {r['machine']['date']}. Tiny generated model, {rounds} interleaved rounds; a 1-token "
        f"request (whole) and a 64-token stream (first chunk, end of stream), on a resident "
        f"{o.get('prompt_tokens_engine', o['prompt_tokens']):,}-token prompt. Pass-through is measured on "
        "`/tokenize` (a route that runs on no slot): a session-less `/completion` runs under an auxiliary "
        "lease. The large column repeats the "
        f"whole request with an agent-sized body ({big['request_body_bytes']:,} bytes, a "
        f"{big.get('prompt_tokens_engine', big['prompt_tokens']):,}-token prompt; "
        f"{big['direct']['whole']['n']} rounds). "
        "Daemon CPU is the kvsidecar process' own time per request (scheduler counters).",
        "",
        "| path | whole request p50 (ms) | first chunk p50 (ms) | stream end p50 (ms) | large body p50 (ms) "
        "| daemon CPU per request (ms) | daemon CPU per 64-token stream (ms) |",
        "|---|---:|---:|---:|---:|---:|---:|",
        *_proxy_rows(o, big),
        "",
        f"Added by the proxy (p50, same run): managed {man['whole']:+.2f} ms per request and "
        f"{man['ttfc']:+.2f} ms to the first chunk; pass-through {pas['whole']:+.2f} ms. "
        f"Target p50 < 2 ms: {'met' if worst < 2 else 'MISSED'} (worst {worst:.2f} ms). With the large body: managed "
        f"{big['proxy_managed_added_ms_p50']['whole']:+.2f} ms, pass-through "
        f"{big['proxy_passthrough_added_ms_p50']['whole']:+.2f} ms; there llama-server's own time for the "
        f"same request spreads from {big['direct']['whole']['min']:.0f} to {big['direct']['whole']['p90']:.0f} ms "
        "(min to p90), so differences of a few milliseconds are within its noise (they change sign and size "
        f"from run to run); the daemon's CPU is the steadier gauge: {big['proxy_managed_daemon_cpu_ms']['whole']:.2f} ms managed, "
        f"{big['proxy_passthrough_daemon_cpu_ms']['whole']:.2f} ms pass-through per request. "
        "The first streamed chunk arrives at "
        f"{o['proxy_managed']['ttfc']['p50']:.1f} ms, long before the stream ends at "
        f"{o['proxy_managed']['end']['p50']:.1f} ms: nothing is buffered. Each streamed chunk costs the "
        f"daemon about {o['proxy_managed_daemon_cpu_ms']['stream'] / 64 * 1000:.0f} µs of CPU, which on "
        "these 2 cores is taken from llama-server's own generation threads: the stream ends "
        f"{man.get('stream_end', 0):.1f} ms later than direct over 64 tokens.",
        "",
        "The upstream hop is kvsidecar's own HTTP/1.1 client (kvsidecar/proxy/upstream.py: an asyncio protocol "
        "with the httptools parser uvicorn already brings, kept-alive connections, one write per request); "
        "managed request bodies get `id_slot` and `cache_prompt` spliced in rather than re-encoded.",
        "",
        *client_table,
        "### A/B/A switch, kvsidecar proxy vs hearth-llm 0.1.1 (attach mode)",
        "",
        f"{a['setup']}; A is ~5K tokens, B ~700; A's second turn carries A's first reply plus a question.",
        "",
        "| | A cold (ms) | B (ms) | back to A (ms) |",
        "|---|---:|---:|---:|",
        f"| kvsidecar proxy | {k['A_cold_ms']:,.0f} | {k['B_ms']:,.0f} | {k['A_back_ms']:,.0f} |",
        f"| hearth-llm | {h['A_cold_ms']:,.0f} | {h['B_ms']:,.0f} | {h['A_back_ms']:,.0f} |",
        "",
        "Time to first token, client-measured. hearth saves after every response and keys snapshots by message "
        "content; kvsidecar saves A only when B takes the slot and restores by session.",
        "",
    ]


def section_context(r: dict[str, Any]) -> list[str]:
    rows = []
    for x in sorted(r["rows"], key=lambda x: (x["model"], x["tokens"])):
        rows.append(
            f"| {x['model']} | {x['tokens']:,} | {x['cold_ms']:,.0f} | {x['ram_cache_ttft_ms']:,.0f} | "
            f"{x['restored_warm_ttft_ms']:,.0f} | {x['restored_dropped_ttft_ms']:,.0f} | "
            f"{x['cold_ms'] / x['restored_warm_ttft_ms']:.0f}x | {x['snapshot_bytes'] / 1e6:,.1f} | "
            f"{x['restore_warm_server_ms']:,.1f} / {x['restore_dropped_server_ms']:,.1f} | "
            f"{x['snapshot_bytes'] / (x['read_warm_gbps'] * 1e6):,.1f} / {x['snapshot_bytes'] / (x['read_cold_gbps'] * 1e6):,.1f} |"
        )
    kv = [x for x in r["rows"] if x["model"] == "llama-gen"]
    shape = r["llama_gen_shape"]
    lines = [
        "## Cold prefill vs kvsidecar vs llama-server's RAM cache, across context sizes",
        "",
        "![TTFT vs context](img/ttft_vs_context.png)",
        "",
        "Session A is run cold, session B takes the only slot, then A comes back. `cold`: no persistence "
        "(`--cache-ram 0`); `ram-cache`: llama-server's own host-memory prompt cache (`--cache-ram 8192`, no "
        "kvsidecar); `kvsidecar`: `--cache-ram 0`, restored from kvsidecar's snapshot, with the page cache warm "
        "and after `POSIX_FADV_DONTNEED` on the file. TTFT in ms, from before the acquire hook to the first "
        f"token. `llama-gen` is a generated {shape['n_layer']}-layer, {shape['n_embd']}-wide llama model.",
        "",
        "| model | tokens | cold | ram-cache | kvsidecar (warm) | kvsidecar (dropped) | cold / kvsidecar | snapshot MB "
        "| restore_ms warm / dropped | limit ms: page cache / disk |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *rows,
        "",
        "The last column is the physical limit for reading the snapshot once: its size divided by the read "
        "bandwidth of the same file measured in the same run, from the page cache and after dropping it.",
        "",
        "![restore vs bytes](img/restore_vs_bytes.png)",
        "",
        "llama-server's RAM cache is the fastest way back while it holds the session (same process, within "
        "`--cache-ram`); kvsidecar's restores survive restarts, exceed RAM, live under a disk quota and are "
        "what remains when the RAM cache has been evicted or the server restarted.",
        "",
    ]
    if kv:
        measured = sorted(x["kv_bytes_per_token"] for x in kv)[len(kv) // 2]
        lines += [
            f"KV bytes per token (generated model, f16 cache): measured {measured:,.0f} B (file size / tokens, "
            f"median over sizes), analytic 2 x {shape['n_layer']} layers x {shape['n_head_kv']} kv heads x "
            f"{shape['n_embd'] // shape['n_head']} head dim x 2 B = {r['analytic_bytes_per_token']:,} B.",
            "",
        ]
    return lines


def section_rss(r: dict[str, Any]) -> list[str]:
    return [
        "## Daemon memory",
        "",
        f"RSS after start-up: {r['empty_rss_mb']:.0f} MB knowing no snapshot, {r['rss_mb']:.0f} MB knowing "
        f"{r['snapshots']:,} ({r['per_snapshot_kb']:.1f} KB per known snapshot).",
        "",
    ]


def _n(v: float | None, fmt: str = ",.0f") -> str:
    return "-" if v is None or v != v else format(v, fmt)


def _agent_switch_rows(runs: list[dict[str, Any]]) -> list[str]:
    rows = []
    for r in runs:
        label = f"| {r['workload']} | {r['policy']} |"
        if not r.get("available"):
            rows.append(f"{label} {r.get('reason', 'not run')} |" + " |" * 12)
            continue
        s, m = r["summary"], r["summary"]["p50"]
        free = (
            f"{s['unqueued_with_save_on_path']} / {s['unqueued_switches']}"
            if "unqueued_switches" in s
            else "-"
        )
        rows.append(
            f"{label} {s['calls']} | {s['switches']} | {s['switches_with_save_on_path']} | {free} | {_n(m['wait_ms'])} "
            f"| {_n(m['save_ms'])} | {_n(m['restore_ms'], ',.1f')} | {_n(m.get('kvsidecar_ms'), ',.1f')} "
            f"| {_n(m['prompt_ms'])} | {_n(m['switch_ms'])} "
            f"| {_n(m['ttft_ms'])} | {_n(m['limit_ms'])} | {_n(s['switch_over_limit_p50'], '.2f')} |"
        )
    return rows


def _agent_run_rows(runs: list[dict[str, Any]]) -> list[str]:
    rows = []
    for r in runs:
        if not r.get("available"):
            continue
        s = r["summary"]
        triggers = ", ".join(f"{k} {v}" for k, v in sorted(s["saves_by_trigger"].items())) or "-"
        skipped = int(sum(s["saves_skipped"].values()))
        rows.append(
            f"| {r['workload']} | {r['policy']} | {s['bytes_written_per_call'] / 1e6:,.0f} "
            f"| {s['bytes_read_per_call'] / 1e6:,.0f} | {s['hearth_bytes_per_call'] / 1e6:,.0f} "
            f"| {s['full_snapshots_per_call']:.2f} | {triggers} | {skipped} | {s['save_stall_s']:.1f} "
            f"| {s['other_calls_stalled_by_saves_s']:.1f} | {s['own_save_waits']} ({s['own_save_wait_s']:.1f} s) "
            f"| {s['makespan_s']:.0f} | {_n(s.get('prefill_ms_per_token_p50'), '.2f')} "
            f"| {_n(s.get('daemon_cpu_s'), '.1f')} |"
        )
    return rows


def _agent_checks(runs: list[dict[str, Any]]) -> list[str]:
    """The issue's done-when figures, read off this run (no threshold is asserted anywhere)."""
    by = {(r["workload"], r["policy"]): r["summary"] for r in runs if r.get("available")}
    lines = []
    for workload in ("think-1slot", "think-2slots"):
        new, old = by.get((workload, "cost-aware")), by.get((workload, "save-before-evict"))
        if not (new and old and new["switches"]):
            continue
        free = 1 - new["switches_with_save_on_path"] / new["switches"]
        ratio = new["switch_over_restore_plus_prefill_p50"]
        written = (
            new["bytes_written_per_call"] / old["bytes_written_per_call"]
            if old["bytes_written_per_call"]
            else None
        )
        ttft = new["p50"]["ttft_ms"] / old["p50"]["ttft_ms"] if old["p50"]["ttft_ms"] else None
        lines.append(
            f"With think time ({workload}), cost-aware vs save-before-evict: {free:.0%} of switches paid no save "
            f"(target >= 80%); p50 of switch / (restore + prefill of the new tokens) {_n(ratio, '.2f')} (target "
            f"<= 1.3); bytes written per call {_n(written, '.2f')}x of save-before-evict's (target <= 0.5); "
            f"TTFT p50 {_n(ttft, '.2f')}x."
        )
    for workload in ("think-1slot", "think-2slots"):
        parts = []
        for policy in ("save-before-evict", "cost-aware", "cost-aware-busy"):
            s = by.get((workload, policy))
            if s and s.get("unqueued_switches"):
                free = 1 - s["unqueued_with_save_on_path"] / s["unqueued_switches"]
                parts.append(f"{policy} {free:.0%} ({s['unqueued_switches']} switches)")
        if parts:
            lines.append(
                f"{workload}, switches that found the server free (waited at most 50 ms for other "
                f"calls) and paid no save: {'; '.join(parts)}. A switch that queued behind another call must "
                "pay its victim's save unless the save is skipped."
            )
    new, old = by.get(("zero-1slot", "cost-aware")), by.get(("zero-1slot", "save-before-evict"))
    if new and old and old["p50"]["ttft_ms"]:
        runs_by = {(r["workload"], r["policy"]): r for r in runs if r.get("available")}
        managed = [
            _switch_less_prefill(runs_by[("zero-1slot", p)]) for p in ("cost-aware", "save-before-evict")
        ]
        speed = [s.get("prefill_ms_per_token_p50") for s in (new, old)]
        lines.append(
            f"Zero think time (zero-1slot): cost-aware's p50 TTFT is {new['p50']['ttft_ms'] / old['p50']['ttft_ms']:.2f}x "
            f"save-before-evict's and its makespan {new['makespan_s'] / old['makespan_s']:.2f}x (target: no worse, 1.0). "
            f"Both made the same saves; the part of a switch that is not llama-server's prefill (switch minus prompt_ms, "
            f"p50) was {_n(managed[0])} ms against {_n(managed[1])} ms, while llama-server's own prefill ran at "
            f"{_n(speed[0], '.2f')} against {_n(speed[1], '.2f')} ms per token."
        )
    return [*(f"- {x}" for x in lines), ""] if lines else []


def _switch_less_prefill(run: dict[str, Any]) -> float | None:
    """p50 over a run's switches of the switch time less llama-server's own prefill: what kvsidecar and
    its policy control (saves on the path, the restore, management), whatever the machine's speed."""
    v = [
        r["switch_ms"] - r["prompt_ms"]
        for r in run["rows"]
        if r.get("switched") and r.get("switch_ms") is not None
    ]
    return statistics.median(v) if v else None


def _agent_io_line(runs: list[dict[str, Any]]) -> list[str]:
    r = next((r for r in runs if r.get("available") and r["policy"] == "save-before-evict"), None)
    if r is None or r["summary"].get("save_ms_p50") is None:
        return []
    s = r["summary"]
    own = s.get("llama_save_ms_p50")
    return [
        f"Saves and restores ({r['workload']}, save-before-evict): a save took {s['save_ms_p50']:,.0f} ms p50 as "
        f"kvsidecar timed it ({s['save_mb_per_s_p50']:,.0f} MB/s"
        + (f"; llama-server's own save_ms {own:,.0f} ms" if own is not None else "")
        + f"); a restore {_n(s['p50']['restore_ms'], ',.1f')} ms (llama-server's own restore_ms "
        f"{_n(s.get('llama_restore_ms_p50'), ',.1f')} ms) of about as many bytes"
        + (
            f": a save costs {s['save_ms_p50'] / s['p50']['restore_ms']:.0f}x a restore here."
            if s["p50"]["restore_ms"]
            else "."
        ),
        "",
    ]


def section_agent(d: dict[str, Any]) -> list[str]:
    p, m = d["params"], d["model"]
    shape = m["shape"]
    fit = d["prefill_fit_ms"]
    quick = d["variant"] == "quick"
    return [
        "## Agent workload at the KV sizes users have (Llama-3-8B geometry)"
        + (" - quick variant" if quick else ""),
        "",
        f"Machine: {d['machine']['cpu']}, {d['machine']['cores']} cores, {d['machine']['date']}; "
        f"`bench/bench_agent.py{' --quick' if quick else ''}`, {d['elapsed_s'] / 60:.1f} minutes. Model: generated "
        f"llama, {shape['n_layer']} layers, {shape['n_head_kv']} KV heads x head_dim {shape['head_dim']}, n_embd "
        f"{shape['n_embd']} ({m['gguf_bytes'] / 1e6:,.0f} MB GGUF): {m['kv_bytes_per_token_f16']:,} B of KV per token "
        f"(f16), {m['file_bytes_per_token']:,.0f} B per token in a slot file, as Llama-3-8B. Sessions start at "
        f"{min(p['histories']):,}-{max(p['histories']):,} tokens and each call appends "
        f"{p['new_tokens'][0]}-{p['new_tokens'][1]} tool-output tokens plus the previous {p['reply_tokens']}-token "
        f"reply (calls per session: {p['turns']}, cold: {p['cold_turns']}); think time lognormal, mean "
        f"{p['think_mean_s']:.0f} s (sigma {p['think_sigma']}), seeded. Workloads: think-1slot ({p['sessions_1slot']} "
        f"sessions, one slot), zero-1slot (the same with no think time), think-2slots ({len(p['histories'])} "
        "sessions, `--parallel 2`). kvsidecar runs: a real daemon, `--cache-ram 0 --no-cache-idle-slots`; "
        "cost-aware-busy (where there is a second slot): cost-aware with `checkpoint.clean_ahead_while_busy: "
        "true`; "
        f"cache-ram: llama-server's own RAM cache (`--cache-ram 8192`), no kvsidecar; cold: `--cache-ram 0`, no "
        "kvsidecar. Every policy starts from the same prebuilt histories, all saved, none of it counted.",
        "",
        f"![agent switches](img/{d['plot']})",
        "",
        "Per switch (a call whose session was not in its slot), medians in ms. wait: for the slot (other "
        "sessions' calls); save: saves on this call's critical path (its own eviction's, and any other save it "
        "waited for); restore: kvsidecar's restore call; kvsidecar: the rest of the acquire (verification, "
        "manifests, HTTP; from the daemon's switch event); prefill: llama-server's prompt_ms; switch: TTFT minus "
        "the wait; TTFT: from the call being ready to the first streamed token. server free: the switches "
        "that waited at most 50 ms for other sessions' calls (the ones a background save can serve), and how "
        "many of them still had a save on the path. limit: the restored bytes over "
        f"the page-cache read bandwidth measured in this run ({d['read_gbps']:.1f} GB/s) plus the prefill of the "
        f"new tokens at this run's fitted cost ({fit['a_per_token']:.2f} ms + {fit['b_per_token_per_context_token'] * 1000:.3f} "
        "ms per 1,000 tokens of context, per token).",
        "",
        "| workload | policy | calls | switches | with a save on the path | server free: with a save / switches "
        "| wait | save | restore | kvsidecar | prefill | switch | TTFT | limit | switch / limit |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        *_agent_switch_rows(d["runs"]),
        "",
        "Per run: MB written and read per call (kvsidecar's `/metrics`), against one full snapshot per "
        "response as hearth-llm writes; saves by trigger (the daemon's log); time the server was stalled by "
        "saves (their union: llama-server runs a save in its one main loop); other sessions' calls in flight "
        "during a save (stopped with it); calls that waited for a background save of their own session; "
        "the time from the first call to the last token; llama-server's own prefill time per new token (p50: "
        "how fast the machine ran this policy); and the daemon's own CPU time over the run.",
        "",
        "| workload | policy | MB written / call | MB read / call | one snapshot per response (MB / call) "
        "| full snapshots / call | saves | skipped | save stall (s) | other calls stalled (s) | own-save waits "
        "| makespan (s) | prefill ms / token | daemon CPU (s) |",
        "|---|---|---:|---:|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|",
        *_agent_run_rows(d["runs"]),
        "",
        *_agent_io_line(d["runs"]),
        *_agent_checks(d["runs"]),
    ]


def section_fleet(d: dict[str, Any]) -> list[str]:
    from bench_fleet import section  # bench/ is on sys.path when this script runs

    return section(d)


def section_clients(d: dict[str, Any]) -> list[str]:
    from bench_clients import section  # bench/ is on sys.path when this script runs

    return section(d)


def section_turns(d: dict[str, Any]) -> list[str]:
    from bench_turns import section  # bench/ is on sys.path when this script runs

    return section(d)


def section_router(d: dict[str, Any]) -> list[str]:
    from bench_router import section  # bench/ is on sys.path when this script runs

    return section(d)


def section_plan_classes(d: dict[str, Any]) -> list[str]:
    from bench_plan_classes import section  # bench/ is on sys.path when this script runs

    return section(d)


def notes(name: str) -> list[str]:
    """The hand-written analysis of a section (bench/notes/<name>.md), kept beside the generated tables."""
    path = ROOT / "bench" / "notes" / f"{name}.md"
    return [path.read_text().rstrip("\n"), ""] if path.exists() else []


def render() -> str:
    parts = [
        "# kvsidecar benchmarks",
        "",
        "Produced by `bench/run` (which writes `bench/results/*.json` and then this file). Medians and ratios "
        "come from one run on one machine; these machines are noisy, so compare figures from the same run.",
        "",
    ]
    sections = (  # (results file, its section, the notes that follow it)
        ("context", section_context, "context"),
        ("ttft", section_ttft, "ttft"),
        ("switch_raw", section_switch_raw, "switch_raw"),
        ("save_target_clean", section_save_target, "save_target"),
        ("hooks", section_hooks, "hooks"),
        ("store", section_store, "store"),
        ("digest", section_digest, "digest"),
        ("retention", section_retention, "retention"),
        ("pool", section_pool, "pool"),
        ("proxy", section_proxy, "proxy"),
        ("rss", section_rss, "rss"),
        ("agent", section_agent, "agent"),
        ("fleet", section_fleet, "fleet"),
        ("clients", section_clients, "clients"),
        ("turns", section_turns, "turns"),
        ("router", section_router, "router"),
        ("plan_classes", section_plan_classes, "plan_classes"),
    )
    for name, fn, note in sections:
        data = load(name)
        if data is None and name in ("agent", "turns"):  # until the full variant has been run
            data = load(f"{name}-quick")
        if data is not None:
            parts += fn(data)
            parts += notes(note)
    return "\n".join(parts)


def main() -> int:
    out = ROOT / "docs" / "BENCHMARKS.md"
    out.write_text(render())
    print(out, file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
