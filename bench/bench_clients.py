"""Replay of real agent-client traffic (issue 28 item 6).

The requests Claude Code, Codex CLI, opencode and aider sent (tests/fixtures/clients, recorded against a
capture server; see its README.md) are replayed, streamed, against real llama-servers, three ways in one run:

- `alone`: llama-server by itself, `--cache-ram` at its default (its host-memory prompt cache);
- `cache-ram-0`: llama-server by itself with `--cache-ram 0`;
- `kvsidecar`: the same llama-server flags as `alone`, behind kvsidecar's proxy.

All three run the same build and flags (`--jinja` with llama.cpp's Qwen3-Coder.jinja, `--parallel 1`) on a
generated llama with Llama-3-8B's KV geometry (128 KiB of KV per token). Each step goes to the three ways
back to back, in an order that rotates from step to step. Scenarios:

1. `lifetime`: every client's recorded sequence (as tests/integration/test_agent_clients_real.py replays it)
   in one llama-server process lifetime;
2. `restart`: each client's turn 1, then every llama-server is stopped and started again on the same port
   and slot directory, then turn 2; kvsidecar's idle checkpoint (shortened to 1 s) has saved the session
   before the restart;
3. `evict`: more concurrent conversations than `--cache-ram` holds: variants of aider's and opencode's
   conversations (a distinct first line in the system prompt and, for opencode, a distinct session id),
   turn 1 of each round-robin, then turn 2 of each, with `--cache-ram` small enough that the RAM cache must
   evict (for all three ways; `cache-ram-0` stays at 0).

Per step: the prompt size and the prompt tokens llama-server computed (its `timings.prompt_n`, or for
Anthropic streams the `input_tokens` of `message_start`), and TTFT: from the request going out to the first
streamed event (llama-server sends nothing before its first token). Results in bench/results/clients.json.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import write

from kvsidecar.testing.daemon import DaemonProcess
from kvsidecar.testing.llama import LlamaServer, llama_server_binary, vocab_dir
from kvsidecar.testing.models import LLAMA3_8B_GEOMETRY, chat_template, generate_llama_model
from kvsidecar.testing.poll import eventually
from tests.integration.test_agent_clients_real import _DROP, SEQUENCES, TEMPLATE, body_of
from tests.unit.client_fixtures import Recorded, load

TOKEN = "bench-clients-token-0123456789"
WAYS = ("alone", "cache-ram-0", "kvsidecar")
CTX = 4096  # the largest recorded prompt is 2,786 tokens
SHAPE = replace(LLAMA3_8B_GEOMETRY, n_ctx=CTX)
RESTART_PAIRS = [
    ("opencode", "run_turn1", "run_turn2_continue"),
    ("claude", "ui_turn1", "ui_turn2"),
    ("codex", "ui_turn1", "ui_turn2"),
    ("aider", "ui_turn1", "ui_turn2"),
]
EVICT_TURNS = {"aider": ("ui_turn1", "ui_turn2"), "opencode": ("run_turn1", "run_turn2_continue")}
EVICT_CACHE_RAM_MIB = 256  # about 2,000 tokens at 128 KiB each: fewer than two of the conversations


@dataclass(frozen=True)
class Request:
    client: str
    name: str
    rec: Recorded
    variant: int | None = None  # scenario 3: which copy of the conversation

    @property
    def label(self) -> str:
        return f"{self.client}/{self.name}" + ("" if self.variant is None else f"#{self.variant}")


def variant(rec: Recorded, i: int) -> Recorded:
    """Conversation i of a recorded one: its system prompt starts with its own line, and a session id in
    the headers (opencode's) gets its own last three characters, so no two variants share more than the
    first few tokens and kvsidecar sees distinct sessions."""
    body = copy.deepcopy(rec.body)
    first = body["messages"][0]
    tag = f"Project: /home/user/project-{i}\n"
    if isinstance(first["content"], str):
        first["content"] = tag + first["content"]
    else:
        first["content"][0]["text"] = tag + first["content"][0]["text"]
    ids = {"x-session-id", "x-session-affinity"}
    headers = [(k, v[:-3] + f"{i:03d}" if k.lower() in ids else v) for k, v in rec.headers]
    return replace(rec, body=body, headers=headers)


def stream_body(rec: Recorded) -> dict[str, Any]:
    body = body_of(rec)  # the recorded body with a 4-token deterministic answer
    body["stream"] = True
    return body


def counts(events: list[dict[str, Any]]) -> tuple[int, int, float | None]:
    """(computed, reused, prompt_ms) from a stream's events: the last `timings` (chat completions,
    Responses), else the last Anthropic usage that has `cache_read_input_tokens` (llama-server's own stream
    has it in `message_start` only, kvsidecar's in `message_delta`: its `message_start` precedes the counts)."""
    for ev in reversed(events):
        t = ev.get("timings")
        if isinstance(t, dict):
            return int(t["prompt_n"]), int(t["cache_n"]), float(t["prompt_ms"])
    for ev in reversed(events):  # kvsidecar's message_delta (it pins the request as a chat completion)
        usage = ev.get("usage") or ev.get("message", {}).get("usage")  # llama-server's message_start
        if isinstance(usage, dict) and "cache_read_input_tokens" in usage:
            return int(usage["input_tokens"]), int(usage["cache_read_input_tokens"]), None
    raise RuntimeError(f"no prompt counts in the stream: {events[-3:]}")


def send(client: httpx.Client, base_url: str, req: Request, *, token: str | None) -> dict[str, Any]:
    rec = req.rec
    headers = {k: v for k, v in rec.headers if k.lower() not in _DROP}
    headers["content-type"] = "application/json"
    if token is not None:
        headers["authorization"] = f"Bearer {token}"
    url = base_url + rec.path + (f"?{rec.query}" if rec.query else "")
    content = json.dumps(stream_body(rec)).encode()
    t0 = time.perf_counter()
    first: float | None = None
    events: list[dict[str, Any]] = []
    buf = b""
    with client.stream("POST", url, content=content, headers=headers) as r:
        if r.status_code != 200:
            r.read()
            raise RuntimeError(f"{req.label}: {r.status_code} {r.text[:400]}")
        kv = {k.lower(): v for k, v in r.headers.items() if k.lower().startswith("x-kv-")}
        for chunk in r.iter_bytes():
            buf += chunk
            *lines, rest = buf.split(b"\n")
            buf = rest
            for raw in lines:
                line = raw.rstrip(b"\r")
                if not line.startswith(b"data:"):
                    continue
                if first is None:
                    first = time.perf_counter()
                data = line[5:].strip()
                if data and data != b"[DONE]":
                    events.append(json.loads(data))
    end = time.perf_counter()
    computed, reused, prompt_ms = counts(events)
    return {
        "computed": computed,
        "prompt": computed + reused,
        "prompt_ms": prompt_ms,
        "ttft_ms": ((first or end) - t0) * 1000,
        "total_ms": (end - t0) * 1000,
        **({"kv": kv} if kv else {}),
    }


class Ways:
    """The three ways, started side by side: two llama-servers alone and one behind a kvsidecar daemon."""

    def __init__(self, work: Path, binary: Path, model: Path, *, cache_ram: str | None, **daemon: Any):
        extra = ["--jinja", "--chat-template-file", str(chat_template(TEMPLATE))]
        flags = {
            "alone": [*extra, *(["--cache-ram", cache_ram] if cache_ram else [])],
            "cache-ram-0": [*extra, "--cache-ram", "0"],
        }
        flags["kvsidecar"] = flags["alone"]
        self.flags = {w: " ".join(flags[w]).replace(extra[2], TEMPLATE) for w in WAYS}
        self.servers = {
            w: LlamaServer(
                binary=binary,
                model=model,
                slot_save_path=work / f"slots-{w}",
                log_path=work / f"llama-{w}.log",
                ctx_size=CTX,
                parallel=1,
                extra_args=tuple(flags[w]),
            )
            for w in WAYS
        }
        for s in self.servers.values():
            s.start()
        behind = self.servers["kvsidecar"]
        self.daemon = DaemonProcess(
            work / "kvsidecar",
            base_url=behind.base_url,
            snapshot_dir=behind.save_dir,
            token=TOKEN,
            logging={"level": "warning"},
            proxy={"enabled": True},
            **daemon,
        ).start()
        self.http = httpx.Client(timeout=600)

    def url(self, way: str) -> str:
        return self.daemon.proxy_url if way == "kvsidecar" else self.servers[way].base_url

    def step(self, req: Request, index: int) -> dict[str, Any]:
        """One request to each way, in an order rotated by the step's index."""
        order = WAYS[index % 3 :] + WAYS[: index % 3]
        out: dict[str, Any] = {"step": req.label, "client": req.client}
        for way in order:
            out[way] = send(self.http, self.url(way), req, token=TOKEN if way == "kvsidecar" else None)
        out["prompt"] = max(out[w]["prompt"] for w in WAYS)
        return out

    def stats(self) -> dict[str, Any]:
        r = self.http.get(f"{self.daemon.url}/v1/status", headers=self.daemon.auth)
        return dict(r.json()["stats"])

    def wait_saved(self, saves: int, timeout_s: float = 60) -> float:
        t0 = time.monotonic()
        eventually(
            lambda: self.stats()["saves"] > saves,
            timeout_s=timeout_s,
            interval_s=0.1,
            what="kvsidecar's idle checkpoint to save the session",
        )
        return time.monotonic() - t0

    def restart_all(self) -> None:
        for s in self.servers.values():
            s.restart()

    def close(self) -> None:
        self.http.close()
        self.daemon.kill()  # no shutdown checkpoint: nothing of this run is kept
        for s in self.servers.values():
            s.stop()


@contextlib.contextmanager
def ways(binary: Path, model: Path, *, cache_ram: str | None, **daemon: Any) -> Iterator[Ways]:
    with tempfile.TemporaryDirectory(prefix="kvs-bench-clients-") as tmp:
        w = Ways(Path(tmp), binary, model, cache_ram=cache_ram, **daemon)
        try:
            yield w
        finally:
            w.close()


def scenario_lifetime(binary: Path, model: Path) -> dict[str, Any]:
    steps = []
    with ways(binary, model, cache_ram=None) as w:
        reqs = [Request(c, n, load(c, n)) for c, names in SEQUENCES.items() for n in names]
        for i, req in enumerate(reqs):
            steps.append(w.step(req, i))
            print(f"lifetime {_line(steps[-1])}", file=sys.stderr)
        flags = w.flags
    return {"flags": flags, "steps": steps}


def scenario_restart(binary: Path, model: Path) -> dict[str, Any]:
    steps = []
    with ways(binary, model, cache_ram=None, checkpoint={"idle_s": 1.0}) as w:
        for i, (client, first, second) in enumerate(RESTART_PAIRS):
            saves = w.stats()["saves"]
            steps.append(w.step(Request(client, first, load(client, first)), 2 * i))
            steps[-1]["save_wait_s"] = w.wait_saved(saves)
            w.restart_all()
            steps.append(w.step(Request(client, second, load(client, second)), 2 * i + 1))
            steps[-1]["turn2"] = True  # the turn after the restart
            for s in steps[-2:]:
                print(f"restart {_line(s)}", file=sys.stderr)
        flags = w.flags
    return {"flags": flags, "steps": steps}


def scenario_evict(binary: Path, model: Path, conversations: int) -> dict[str, Any]:
    clients = list(EVICT_TURNS)
    convs = [(clients[i % len(clients)], i // len(clients)) for i in range(conversations)]
    steps = []
    with ways(binary, model, cache_ram=str(EVICT_CACHE_RAM_MIB)) as w:
        index = 0
        for turn in range(2):
            for client, n in convs:
                name = EVICT_TURNS[client][turn]
                req = Request(client, name, variant(load(client, name), n), variant=n)
                steps.append({**w.step(req, index), **({"turn2": True} if turn else {})})
                index += 1
                print(f"evict {_line(steps[-1])}", file=sys.stderr)
        flags = w.flags
    return {"flags": flags, "conversations": conversations, "steps": steps}


def _line(s: dict[str, Any]) -> str:
    parts = [f"{w} {s[w]['computed']} ({s[w]['ttft_ms']:,.0f} ms)" for w in WAYS]
    kv = s["kvsidecar"].get("kv", {})
    return f"{s['step']}: prompt {s['prompt']}; " + "; ".join(parts) + f" {kv.get('x-kv-outcome', '-')}"


def summarize(steps: list[dict[str, Any]]) -> dict[str, Any]:
    prompt = sum(s["prompt"] for s in steps)
    out: dict[str, Any] = {"steps": len(steps), "prompt_tokens": prompt}
    for way in WAYS:
        computed = sum(s[way]["computed"] for s in steps)
        ttft = [s[way]["ttft_ms"] for s in steps]
        out[way] = {
            "computed": computed,
            "computed_share": computed / prompt if prompt else 0.0,
            "ttft_ms_p50": statistics.median(ttft),
            "ttft_ms_sum": sum(ttft),
            "ttft_over_alone_p50": statistics.median(
                s[way]["ttft_ms"] / s["alone"]["ttft_ms"] for s in steps
            ),
            "computed_over_alone": computed / max(1, sum(s["alone"]["computed"] for s in steps)),
        }
    out["kvsidecar_worse_steps"] = [
        s["step"]
        for s in steps
        if s["kvsidecar"]["computed"] > s["alone"]["computed"] + math.ceil(0.01 * s["prompt"])
    ]
    return out


SCENARIOS = {
    "lifetime": "one process lifetime",
    "restart": "llama-server restarted between turn 1 and turn 2",
    "evict": "more conversations than `--cache-ram` holds",
}


def _outcome(step: dict[str, Any]) -> str:
    kv = step["kvsidecar"].get("kv", {})
    signal = kv.get("x-kv-signal", "")
    outcome = kv.get("x-kv-outcome") or ("auxiliary" if signal else "-")
    return f"{outcome} ({signal})" if signal else outcome


def _step_rows(steps: list[dict[str, Any]]) -> list[str]:
    rows = []
    for s in steps:
        computed = " | ".join(f"{s[w]['computed']:,}" for w in WAYS)
        ttft = " | ".join(f"{s[w]['ttft_ms']:,.0f}" for w in WAYS)
        rows.append(f"| {s['step']} | {s['prompt']:,} | {computed} | {ttft} | {_outcome(s)} |")
    return rows


def section(d: dict[str, Any]) -> list[str]:
    """The docs/BENCHMARKS.md section for a result of this script."""
    m, shape = d["machine"], d["model"]["shape"]
    sc = d["scenarios"]
    lines = [
        "## Real agent clients replayed: llama-server alone, with `--cache-ram 0`, and behind kvsidecar",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['date']}; `bench/bench_clients.py`, "
        f"{d['elapsed_s'] / 60:.1f} minutes. The requests Claude Code, Codex CLI, opencode and aider sent "
        "(`tests/fixtures/clients`, trimmed recordings), replayed streamed, each step to the three ways back to "
        "back in a rotating order: `alone` (llama-server, `--cache-ram` default), `cache-ram-0` (llama-server, "
        "`--cache-ram 0`) and `kvsidecar` (llama-server with `alone`'s flags behind kvsidecar's proxy, its "
        f"defaults). Same build and flags otherwise: `--jinja` with llama.cpp's {d['template']}, `--parallel 1 "
        f"--ctx-size {d['model']['ctx_size']:,}`, a generated llama with Llama-3-8B's KV geometry "
        f"({shape['n_layer']} layers, {shape['n_head_kv']} KV heads x {shape['head_dim']}: "
        f"{d['model']['kv_bytes_per_token_f16']:,} B of KV per token). Scenarios: lifetime, every client's "
        "recorded sequence in one process lifetime; restart, each client's turn 1, every llama-server stopped "
        "and started again (same port and slot directory), turn 2 (kvsidecar's idle checkpoint, 1 s here, "
        f"saved turn 1 first); evict, {sc['evict']['conversations']} conversations (copies of aider's and "
        "opencode's, each with its own first system-prompt line and session id), turn 1 of each round-robin "
        f"and then turn 2, with `--cache-ram {d['evict_cache_ram_mib']}` (about "
        f"{d['evict_cache_ram_mib'] * 1024 * 1024 // d['model']['kv_bytes_per_token_f16']:,} tokens) for `alone` "
        "and `kvsidecar`. Computed: the prompt tokens llama-server computed (`timings.prompt_n`; Anthropic "
        "streams: `input_tokens`); TTFT: from the request going out to the first streamed event, ms.",
        "",
        "| scenario | steps | prompt tokens | computed: alone | cache-ram-0 | kvsidecar | TTFT p50: alone "
        "| cache-ram-0 | kvsidecar | kvsidecar / alone, TTFT p50 of per-step ratios | steps kvsidecar computed "
        "more than alone (+1% of the prompt) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    rows = [(name, label, sc[name]["summary"]) for name, label in SCENARIOS.items()]
    rows += [(n, "its turns 2 only", sc[n]["summary_turn2"]) for n in SCENARIOS if "summary_turn2" in sc[n]]
    for name, label, u in rows:
        computed = " | ".join(f"{u[w]['computed']:,} ({u[w]['computed_share']:.0%})" for w in WAYS)
        ttft = " | ".join(f"{u[w]['ttft_ms_p50']:,.0f}" for w in WAYS)
        worse = ", ".join(u["kvsidecar_worse_steps"]) or "none"
        lines.append(
            f"| {name}: {label} | {u['steps']} | {u['prompt_tokens']:,} | {computed} | {ttft} "
            f"| {u['kvsidecar']['ttft_over_alone_p50']:.2f}x | {worse} |"
        )
    lines.append("")
    for name, label in SCENARIOS.items():
        lines += [
            f"Per step, {name} ({label}); kvsidecar's `X-KV-Outcome` (`X-KV-Signal`):",
            "",
            "| step | prompt | computed: alone | cache-ram-0 | kvsidecar | TTFT ms: alone | cache-ram-0 "
            "| kvsidecar | kvsidecar |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|",
            *_step_rows(sc[name]["steps"]),
            "",
        ]
    return lines


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--conversations", type=int, default=6, help="scenario 3's concurrent conversations")
    ap.add_argument("--out", default="clients", help="results file name under bench/results")
    args = ap.parse_args(argv)
    t0 = time.monotonic()
    binary = llama_server_binary()
    model = generate_llama_model(SHAPE, vocab_dir=vocab_dir(binary))
    scenarios = {
        "lifetime": scenario_lifetime(binary, model),
        "restart": scenario_restart(binary, model),
        "evict": scenario_evict(binary, model, args.conversations),
    }
    for sc in scenarios.values():
        sc["summary"] = summarize(sc["steps"])
        if any(s.get("turn2") for s in sc["steps"]):
            sc["summary_turn2"] = summarize([s for s in sc["steps"] if s.get("turn2")])
    data = {
        "model": {
            "shape": {
                "n_layer": SHAPE.n_layer,
                "n_head_kv": SHAPE.n_head_kv,
                "head_dim": SHAPE.attn_head_dim,
                "n_embd": SHAPE.n_embd,
            },
            "kv_bytes_per_token_f16": SHAPE.kv_bytes_per_token_f16,
            "ctx_size": CTX,
        },
        "template": TEMPLATE,
        "evict_cache_ram_mib": EVICT_CACHE_RAM_MIB,
        "scenarios": scenarios,
        "elapsed_s": time.monotonic() - t0,
    }
    print(write(args.out, data), file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
