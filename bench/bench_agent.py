"""Agent workload at the KV sizes users have (issue 15, items 1 and 4).

Model: a generated llama with Llama-3-8B's KV geometry (`LLAMA3_8B_GEOMETRY`: 32 layers, 8 KV heads of 128
dims, 128 KiB of KV per token in f16; tiny weights, so a CPU runs it). Several agent sessions each alternate a
model call with think time (a tool run: lognormal, seeded), every call appending a few hundred tokens (the
previous reply plus a tool result) to an append-only history of a few thousand tokens. Workloads:

  think-1slot    3 sessions on one slot, think time (the case the policies are for)
  zero-1slot     the same sessions with no think time (the worst case: every call waits for the slot)
  think-2slots   4 sessions on `--parallel 2` (a save stops the other slot's stream too)
  fits-2slots    2 sessions on `--parallel 2`: each keeps its slot and calls more often than `idle_s`, the
                 case of issue 26 (without a staleness bound nothing is ever saved; a crash costs all of it)

Policies, each on its own fresh llama-server (and daemon) with the same sessions and seeds:

  save-before-evict  kvsidecar, `checkpoint.policy: save-before-evict` (the behaviour before issue 15)
  cost-aware         kvsidecar, `checkpoint.policy: cost-aware` (skipped if this build's config refuses it)
  cost-aware-busy    the same with `checkpoint.clean_ahead_while_busy: true` (the opt-in: a background save
                     may stall the other slot's stream); run only where there is another slot (--parallel 2)
  unbounded          fits-2slots only: cost-aware with `max_unsaved_s: 0, max_unsaved_turns: 0`, the
                     behaviour before issue 26 (a session that keeps its slot is saved only after idle_s)
  bound-20s          fits-2slots only: cost-aware with `max_unsaved_s: 20`, so that the forced saves of the
                     bound happen within a short run (the default bound, 300 s, is longer than one)
  cache-ram          no kvsidecar: llama-server's own host-memory prompt cache (`--cache-ram 8192`)
  cold               no kvsidecar, `--cache-ram 0`: every switch recomputes the whole history

kvsidecar runs use `--cache-ram 0 --no-cache-idle-slots`, a real daemon (`kvsidecar serve`, JSON logs) and the
python client; the baselines use a small slot pool in this script (a session keeps its slot while it is
free, otherwise it waits FIFO for the least recently used one). Every session starts from a prebuilt
history (one cold prefill per session, kept under the cache root for later runs; restored into the slot
before the measured calls, and the kvsidecar runs then save it once: every policy starts with all sessions
saved, and none of that is counted).

Per switch (a call whose session was not in its slot): the wait for the slot (other sessions' calls), the
saves on its critical path (the eviction save its own acquire did, and any background save it waited for),
the restore, kvsidecar's own work in the acquire (verification, manifests, HTTP), the prefill of the new
tokens (llama-server's prompt_ms), "switch" (TTFT minus the wait) and the time to first token (streamed,
from the moment the call is ready). Saves and their triggers come from the daemon's `kv.session.save.*`
and `kv.session.switch` log events, restores from the acquire answers, bytes from `/metrics`. The physical
limit of a switch: the restored bytes over the page-cache read bandwidth measured in the same run, plus the
prefill of its new tokens (cost per token fitted on this run's warm single-slot calls, a + b x context).
Per run: bytes written and read per call, against one full snapshot per response (hearth-llm's way, item 4),
the time the server was stalled by saves, other sessions' calls in flight during a save, and calls that
waited for a background save of their own session; and, sampled every second from `/metrics`
(`kvsidecar_unsaved_*`), what a llama-server crash would have cost at that moment (issue 26): the oldest
unsaved work and the most unsaved tokens of one session. `--name` writes bench/results/<name>.json.

Sizes: cold prefill of this model is ~270 tokens/s at 2K tokens and ~110 tokens/s at 5K on 2 cores, and a
call that appends 150-300 tokens (plus the previous 8-token reply) to a 2-5K history costs 2-3 s. So the
histories start at 2-3.5K tokens (0.27-0.47 GB snapshots) and grow to at most ~5.4K (0.7 GB) over 6 calls
per session, and the think time has a mean of 10 s, which leaves the server idle about 40% of the time with 3
sessions on one slot (a shorter think time saturates it: then every call queues, as in zero-1slot). The cold
baseline, which recomputes 2-5K tokens per switch, runs 2 calls per session. The whole benchmark takes 15-25
minutes on 2 cores (prebuilt histories are kept under the cache root; the first run adds ~2 minutes).
`--quick` (2-2.5K tokens, 2 calls per session, think mean 6 s, single-slot workloads, cold with one call per
session) takes 2-4 minutes; its results go to bench/results/agent-quick.json. Medians and ratios from one
run; nothing here is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import calendar
import contextlib
import json
import math
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psutil
import xxhash

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import machine, summary, write

from kvsidecar.client import KvSidecarClient
from kvsidecar.config import CheckpointConfig, config_from_mapping
from kvsidecar.errors import ConfigError
from kvsidecar.store.naming import short_id
from kvsidecar.testing.daemon import DaemonProcess
from kvsidecar.testing.llama import LlamaServer, llama_server_binary, vocab_dir
from kvsidecar.testing.models import LLAMA3_8B_GEOMETRY, cache_root, generate_llama_model

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-agent-token-0123456789abcdef"
MODEL = "llama3-8b-geometry"
WORKLOADS: dict[str, tuple[int, bool]] = {  # name -> (llama-server --parallel, think time on)
    "think-1slot": (1, True),
    "zero-1slot": (1, False),
    "think-2slots": (2, True),
    "fits-2slots": (2, True),
}
FITS_SESSIONS = {"fits-2slots": 2}  # the workloads where every session keeps its own slot
POLICIES = (
    "save-before-evict",
    "cost-aware",
    "cost-aware-busy",
    "unbounded",
    "bound-20s",
    "cache-ram",
    "cold",
)
KV_POLICIES = ("save-before-evict", "cost-aware", "cost-aware-busy", "unbounded", "bound-20s")
FITS_POLICIES = ("unbounded", "cost-aware", "bound-20s")  # what fits-2slots compares (no switch: no baseline)
UNSAVED_POLL_S = 1.0  # how often a kvsidecar run samples its unsaved-work gauges
QUEUED_MS = 50.0  # a switch that waited longer than this for other sessions' calls found the server busy
CACHE_RAM_MIB = 8192  # llama-server's default, stated explicitly


@dataclass(frozen=True, kw_only=True)
class Params:
    histories: tuple[int, ...]  # initial history tokens of each session (the 2-slot workload uses all)
    sessions_1slot: int
    turns: int
    cold_turns: int
    new_tokens: tuple[int, int]  # tool output appended per call, uniform
    reply_tokens: int  # n_predict
    think_mean_s: float
    think_sigma: float
    seed: int
    workloads: tuple[str, ...]
    policies: tuple[str, ...]
    cold_workloads: tuple[str, ...]
    hint: str | None

    @property
    def ctx_per_slot(self) -> int:
        need = max(self.histories) + self.turns * (self.new_tokens[1] + self.reply_tokens + 2) + 256
        return int(math.ceil(need / 256) * 256)


FULL = Params(
    histories=(2048, 2560, 3072, 3584),
    sessions_1slot=3,
    turns=6,
    cold_turns=2,
    new_tokens=(150, 300),
    reply_tokens=8,
    think_mean_s=10.0,
    think_sigma=0.75,
    seed=15,
    workloads=tuple(WORKLOADS),
    policies=POLICIES,
    cold_workloads=("think-1slot", "think-2slots"),
    hint=None,
)
QUICK = Params(
    histories=(2048, 2304, 2560),
    sessions_1slot=3,
    turns=2,
    cold_turns=1,
    new_tokens=(150, 250),
    reply_tokens=8,
    think_mean_s=6.0,
    think_sigma=0.75,
    seed=15,
    workloads=("think-1slot", "zero-1slot"),
    policies=POLICIES,
    cold_workloads=("think-1slot",),
    hint=None,
)


# the workload -------------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class SessionPlan:
    name: str
    history: list[int]  # the prebuilt history (its KV is in seed_file)
    new: list[list[int]]  # tokens appended before each call (after the previous reply)
    think_s: list[float]  # think time after each call
    start_s: float  # first call's offset (think workloads)
    seed_file: str = ""


def plans(p: Params) -> list[SessionPlan]:
    """Every session's tokens and think times, drawn once from the seed: the same for every policy."""
    mu = math.log(p.think_mean_s) - p.think_sigma**2 / 2  # lognormal with mean think_mean_s
    out = []
    for i, n in enumerate(p.histories):
        rng = random.Random(p.seed * 1000 + i)
        out.append(
            SessionPlan(
                name=f"agent-{i}",
                history=[rng.randrange(1000, 31000) for _ in range(n)],
                new=[
                    [rng.randrange(1000, 31000) for _ in range(rng.randint(*p.new_tokens))]
                    for _ in range(p.turns)
                ],
                think_s=[rng.lognormvariate(mu, p.think_sigma) for _ in range(p.turns)],
                start_s=rng.uniform(0, p.think_mean_s),
            )
        )
    return out


@dataclass(kw_only=True)
class Turn:
    session: str
    turn: int
    reusable: int  # tokens of the prompt the session's KV already covers (what a restore brings back)
    new: int  # tokens to compute on a perfect warm start
    t_ready: float  # wall clock (time.time), comparable with the daemon's log timestamps
    t_acquired: float = 0.0
    t_first: float = 0.0
    t_end: float = 0.0
    switched: bool = False
    outcome: str = ""
    actions: list[str] = field(default_factory=list)
    restore_ms: float | None = None  # kvsidecar's timing of llama-server's restore call
    restore_server_ms: float | None = None  # llama-server's own timings.restore_ms
    prompt_n: int = 0
    cache_n: int = 0
    prompt_ms: float = 0.0
    reply: list[int] = field(default_factory=list)

    @property
    def ttft_ms(self) -> float:
        return (self.t_first - self.t_ready) * 1000

    @property
    def acquire_ms(self) -> float:
        return (self.t_acquired - self.t_ready) * 1000


# llama-server -----------------------------------------------------------------------------------------
async def stream_completion(
    http: httpx.AsyncClient, base_url: str, slot_id: int, tokens: list[int], n_predict: int, turn: Turn
) -> dict[str, Any]:
    """A streamed, slot-pinned /completion over a token list; fills the turn's first-token time and reply."""
    body = {
        "prompt": tokens,
        "n_predict": n_predict,
        "cache_prompt": True,
        "id_slot": slot_id,
        "stream": True,
        "temperature": 0,
        "return_tokens": True,
    }
    final: dict[str, Any] = {}
    async with http.stream("POST", f"{base_url}/completion", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"/completion answered {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[6:])
            if not turn.t_first:
                turn.t_first = time.time()
            turn.reply += [int(t) for t in chunk.get("tokens") or []]
            if chunk.get("stop"):
                final = chunk
    turn.t_end = time.time()
    timings = final.get("timings") or {}
    turn.prompt_n, turn.cache_n = int(timings.get("prompt_n", 0)), int(timings.get("cache_n", 0))
    turn.prompt_ms = float(timings.get("prompt_ms", 0.0))
    return timings


def llama(
    binary: Path, model: Path, work: Path, *, parallel: int, ctx: int, extra: Iterable[str]
) -> LlamaServer:
    return LlamaServer(
        binary=binary,
        model=model,
        slot_save_path=work / "snaps",
        log_path=work / "llama.log",
        ctx_size=ctx * parallel,
        parallel=parallel,
        extra_args=tuple(extra),
    )


def slot_action(base_url: str, slot: int, action: str, filename: str) -> dict[str, Any]:
    r = httpx.post(f"{base_url}/slots/{slot}?action={action}", json={"filename": filename}, timeout=600)
    r.raise_for_status()
    data: dict[str, Any] = r.json()
    return data


def prebuild(
    binary: Path, model: Path, sessions: list[SessionPlan], parallel: int
) -> tuple[Path, dict[str, Any]]:
    """One cold prefill per session, saved by llama-server itself: every run starts from these files. They
    depend only on the model, the seeded tokens and --parallel (a file saved with --parallel 1 is refused
    by a --parallel 2 server: "n_stream mismatch"), so they are kept under the cache root for later runs."""
    key = xxhash.xxh3_64_hexdigest(repr([model.name, parallel, [s.history for s in sessions]]).encode())
    seeds = cache_root() / "bench-agent" / key
    if not (seeds / "prebuild.json").exists():
        _build_seeds(binary, model, seeds, sessions, parallel)
    out: dict[str, Any] = json.loads((seeds / "prebuild.json").read_text())
    files = {s.name: seeds / f"seed-{s.name}.bin" for s in sessions}
    sizes = {k: f.stat().st_size for k, f in files.items()}
    biggest = max(files.values(), key=lambda f: f.stat().st_size)
    read_gbps(biggest)  # into the page cache, as a file just saved is
    out["read_gbps"] = statistics.median(read_gbps(biggest) for _ in range(3))
    two = sorted(sessions, key=lambda s: len(s.history))[-2:]
    out["file_bytes_per_token"] = (sizes[two[1].name] - sizes[two[0].name]) / (
        len(two[1].history) - len(two[0].history)
    )
    out["seed_bytes"] = sizes
    return seeds, out


def _build_seeds(binary: Path, model: Path, seeds: Path, sessions: list[SessionPlan], parallel: int) -> None:
    ctx = int(math.ceil((max(len(s.history) for s in sessions) + 256) / 256) * 256)
    tmp = seeds.with_name(seeds.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    server = llama(binary, model, tmp, parallel=parallel, ctx=ctx, extra=("--cache-ram", "0"))
    server.start()
    cold = []
    try:
        for s in sessions:
            r = httpx.post(
                f"{server.base_url}/completion",
                json={"prompt": s.history, "n_predict": 1, "cache_prompt": True, "id_slot": 0},
                timeout=900,
            )
            r.raise_for_status()
            t = r.json()["timings"]
            saved = slot_action(server.base_url, 0, "save", f"seed-{s.name}.bin")
            cold.append(
                {"tokens": t["prompt_n"], "prompt_ms": t["prompt_ms"], "save_ms": saved["timings"]["save_ms"]}
            )
            print(
                f"  prebuilt {s.name}: {t['prompt_n']} tokens cold in {t['prompt_ms'] / 1000:.1f} s",
                file=sys.stderr,
            )
    finally:
        server.stop()
    for f in (tmp / "snaps").iterdir():
        f.replace(tmp / f.name)
    (tmp / "prebuild.json").write_text(json.dumps({"cold_prefill": cold, "built": machine()["date"]}))
    shutil.rmtree(tmp / "snaps")
    (tmp / "llama.log").unlink(missing_ok=True)
    seeds.parent.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(seeds, ignore_errors=True)
    tmp.rename(seeds)


def read_gbps(path: Path) -> float:
    """Plain read of a snapshot file from the page cache (it was just written): the restore's limit."""
    buf = bytearray(8 << 20)
    fd = os.open(path, os.O_RDONLY)
    t0, total = time.perf_counter(), 0
    try:
        while n := os.readv(fd, [buf]):
            total += n
    finally:
        os.close(fd)
    return total / (time.perf_counter() - t0) / 1e9


def llama_client() -> httpx.AsyncClient:
    """A fresh connection per call: llama-server closes keep-alive connections idle for 5 s, and a call
    after a think time of about that long would race the close ("Server disconnected")."""
    return httpx.AsyncClient(timeout=900, limits=httpx.Limits(max_keepalive_connections=0))


# drivers: kvsidecar, or this script's own slot pool ---------------------------------------------------
class BenchClient(KvSidecarClient):
    """The project's client, plus the raw acquire answer (restore_server_ms, actions) and /metrics."""

    async def acquire_answer(self, session_id: str) -> dict[str, Any]:
        answer: dict[str, Any] = await self._call(
            "POST", f"/v1/sessions/{session_id}/acquire", {"provider": "local", "model": MODEL}
        )
        return answer

    async def metrics_text(self) -> str:
        r = await self._http.get("/metrics")
        r.raise_for_status()
        return r.text


class KvDriver:
    def __init__(self, kv: BenchClient, hint: str | None, *, prefill: bool = False) -> None:
        self.kv, self.hint, self.prefill = kv, hint, prefill  # prefill: report prompt_ms, as the proxy does
        self.leases: dict[str, str] = {}

    async def acquire(self, turn: Turn) -> tuple[str, int]:
        a = await self.kv.acquire_answer(turn.session)
        turn.outcome, turn.actions = str(a["outcome"]), list(a.get("actions") or [])
        turn.restore_ms, turn.restore_server_ms = a.get("restore_ms"), a.get("restore_server_ms")
        turn.switched = turn.outcome != "resident"
        self.leases[turn.session] = str(a["lease_id"])
        return str(a["base_url"]), int(a["slot_id"])

    async def release(self, turn: Turn, ok: bool) -> None:
        await self.kv.release(
            self.leases.pop(turn.session),
            status="ok" if ok else "aborted",
            prompt_tokens=turn.prompt_n if ok else None,
            cached_tokens=turn.cache_n if ok else None,
            prompt_ms=turn.prompt_ms if ok and self.prefill and turn.prompt_ms > 0 else None,
        )
        if ok and self.hint:
            await self.kv.event(turn.session, self.hint)


class LocalPool:
    """Slots for the baselines: a session keeps its slot while it is free; otherwise FIFO, LRU slot."""

    def __init__(self, base_url: str, n: int) -> None:
        self.base_url = base_url
        self.owner: list[str | None] = [None] * n
        self.busy = [False] * n
        self.used = [0.0] * n
        self.cond = asyncio.Condition()
        self.queue: list[str] = []

    def _pick(self, session: str) -> int | None:
        if session in self.owner:
            i = self.owner.index(session)
            return None if self.busy[i] else i
        free = [i for i in range(len(self.busy)) if not self.busy[i]]
        return min(free, key=lambda i: self.used[i]) if free else None

    async def acquire(self, turn: Turn) -> tuple[str, int]:
        async with self.cond:
            self.queue.append(turn.session)
            while self.queue[0] != turn.session or (slot := self._pick(turn.session)) is None:
                await self.cond.wait()
            self.queue.pop(0)
            turn.switched = self.owner[slot] != turn.session
            turn.outcome = "switch" if turn.switched else "resident"
            self.owner[slot], self.busy[slot] = turn.session, True
            self.cond.notify_all()
            return self.base_url, slot

    async def release(self, turn: Turn, ok: bool) -> None:
        async with self.cond:
            slot = self.owner.index(turn.session)
            self.busy[slot], self.used[slot] = False, time.monotonic()
            self.cond.notify_all()


Driver = KvDriver | LocalPool


# one run ----------------------------------------------------------------------------------------------
async def one_turn(
    driver: Driver, http: httpx.AsyncClient, plan: SessionPlan, i: int, history: list[int], n_predict: int
) -> Turn:
    prompt = history + plan.new[i]
    reusable = len(history) - (1 if i > 0 else 0)  # the last reply token was sampled, never evaluated
    turn = Turn(session=plan.name, turn=i, reusable=reusable, new=len(prompt) - reusable, t_ready=time.time())
    base_url, slot = await driver.acquire(turn)
    turn.t_acquired = time.time()
    ok = False
    try:
        await stream_completion(http, base_url, slot, prompt, n_predict, turn)
        ok = True
    finally:
        await driver.release(turn, ok)
    return turn


async def run_session(
    driver: Driver,
    http: httpx.AsyncClient,
    plan: SessionPlan,
    p: Params,
    think: bool,
    turns: int,
    out: list[Turn],
) -> None:
    history = list(plan.history)
    if think:
        await asyncio.sleep(plan.start_s)
    for i in range(turns):
        turn = await one_turn(driver, http, plan, i, history, p.reply_tokens)
        out.append(turn)
        history = history + plan.new[i] + turn.reply
        if think and i + 1 < turns:  # the run ends with the last call: nothing after it is counted
            await asyncio.sleep(plan.think_s[i])


async def seed_sessions(
    driver: Driver, base_url: str, sessions: list[SessionPlan], kv: BenchClient | None
) -> None:
    """Bring every session's prebuilt history into a slot (restored by llama-server, not measured)."""
    async with llama_client() as http:
        for s in sessions:
            turn = Turn(session=s.name, turn=-1, reusable=0, new=0, t_ready=time.time())
            _, slot = await driver.acquire(turn)
            try:
                if kv is None and turn.switched:
                    # llama-server's RAM cache keeps a slot's prompt when a task with another prompt starts
                    # on it, not when a restore overwrites it: one token of this session first
                    scratch = Turn(session=s.name, turn=-1, reusable=0, new=0, t_ready=time.time())
                    await stream_completion(http, base_url, slot, s.history[:1], 1, scratch)
                await asyncio.to_thread(slot_action, base_url, slot, "restore", s.seed_file)
                await stream_completion(http, base_url, slot, s.history, 1, turn)
            finally:
                await driver.release(turn, True)
            if kv is not None:
                await kv.save(s.name)  # every kvsidecar run starts with all sessions saved


async def drive(
    driver: Driver, sessions: list[SessionPlan], p: Params, think: bool, turns: int
) -> list[Turn]:
    out: list[Turn] = []
    async with llama_client() as http:
        await asyncio.gather(*(run_session(driver, http, s, p, think, turns, out) for s in sessions))
    return out


def policy_config(policy: str) -> dict[str, Any] | None:
    """The checkpoint section for a kvsidecar policy, or None if this build's config does not know it."""
    if "policy" not in CheckpointConfig.model_fields:
        return {} if policy == "save-before-evict" else None  # before issue 15 that was the only behaviour
    section: dict[str, Any] = {"policy": policy}
    if policy == "cost-aware-busy":
        section = {"policy": "cost-aware", "clean_ahead_while_busy": True}
    elif policy == "unbounded":
        if "max_unsaved_s" not in CheckpointConfig.model_fields:
            return {"policy": "cost-aware"}  # before issue 26 that was the only behaviour
        section = {"policy": "cost-aware", "max_unsaved_s": 0, "max_unsaved_turns": 0}
    elif policy == "bound-20s":
        section = {"policy": "cost-aware", "max_unsaved_s": 20}
    try:
        config_from_mapping({"checkpoint": section})
    except ConfigError:
        return None
    return section


async def run_kvsidecar(
    server: LlamaServer,
    work: Path,
    sessions: list[SessionPlan],
    p: Params,
    think: bool,
    checkpoint: dict[str, Any],
    *,
    prefill: bool = False,
) -> dict[str, Any]:
    mode = "managed-slots" if server.parallel > 1 else "single-slot"
    daemon = DaemonProcess(
        work / "kvsidecar",
        base_url=server.base_url,
        snapshot_dir=server.save_dir,
        token=TOKEN,
        servers={"local": {"mode": mode, "persist_timeout_s": 600, "request_timeout_s": 60}},
        checkpoint=checkpoint,
        logging={"level": "info", "format": "json"},
    ).start(timeout_s=120)
    try:
        # the daemon closes a connection idle for api.header_timeout_s (10 s): never reuse one that old
        transport = httpx.AsyncHTTPTransport(limits=httpx.Limits(keepalive_expiry=4.0))
        kv = BenchClient(daemon.url, token=TOKEN, timeout_s=900, transport=transport)
        try:
            driver = KvDriver(kv, p.hint, prefill=prefill)
            await seed_sessions(driver, server.base_url, sessions, kv)
            unlink_seeds(server, sessions)
            assert daemon.proc is not None
            proc = psutil.Process(daemon.proc.pid)
            before, t0, cpu0 = await kv.metrics_text(), time.time(), proc.cpu_times()
            samples: list[dict[str, float]] = []
            sampler = asyncio.ensure_future(sample_unsaved(kv, samples))
            try:
                turns = await drive(driver, sessions, p, think, p.turns)
            finally:
                sampler.cancel()
            t1, cpu1, after = time.time(), proc.cpu_times(), await kv.metrics_text()
            status = await kv.status()
        finally:
            await kv.aclose()
    finally:
        daemon.kill()  # the measured phase is over; a shutdown checkpoint would only cost time
    return {
        "turns": turns,
        "t0": t0,
        "t1": t1,
        "metrics": metrics_delta(before, after),
        # the daemon's own CPU over the measured phase (on 2 cores it is taken from llama-server's)
        "daemon_cpu_s": (cpu1.user + cpu1.system) - (cpu0.user + cpu0.system),
        "saves": save_intervals(events := log_events(daemon.log_path.read_text(errors="replace")), t0, t1),
        "switch_events": switch_events(events, t0, t1),
        "status_stats": status.get("stats"),
        "unsaved_samples": samples,
        "status": {k: v for k, v in status.items() if k not in ("sessions", "servers")},
    }


async def run_baseline(
    server: LlamaServer, sessions: list[SessionPlan], p: Params, think: bool, *, seed: bool, turns: int
) -> dict[str, Any]:
    pool = LocalPool(server.base_url, server.parallel)
    if seed:
        await seed_sessions(pool, server.base_url, sessions, None)
    unlink_seeds(server, sessions)
    t0 = time.time()
    out = await drive(pool, sessions, p, think, turns)
    return {"turns": out, "t0": t0, "t1": time.time(), "metrics": {}, "saves": [], "switch_events": []}


async def sample_unsaved(kv: BenchClient, out: list[dict[str, float]]) -> None:
    """The unsaved-work gauges (issue 26) every UNSAVED_POLL_S: what a crash at that moment would cost."""
    names = ("kvsidecar_unsaved_max_age_seconds", "kvsidecar_unsaved_max_tokens", "kvsidecar_unsaved_tokens")
    while True:
        with contextlib.suppress(httpx.HTTPError):
            m = parse_metrics(await kv.metrics_text())
            if any(n in m for n in names):
                out.append(
                    {"at": time.time(), **{n.removeprefix("kvsidecar_"): m.get(n, 0.0) for n in names}}
                )
        await asyncio.sleep(UNSAVED_POLL_S)


def unlink_seeds(server: LlamaServer, sessions: list[SessionPlan]) -> None:
    for s in sessions:
        with contextlib.suppress(FileNotFoundError):
            (server.save_dir / s.seed_file).unlink()


def link_seeds(server: LlamaServer, seeds: Path, sessions: list[SessionPlan]) -> None:
    snaps = server.slot_save_path
    assert snaps is not None
    snaps.mkdir(parents=True, exist_ok=True)
    for s in sessions:
        try:
            os.link(seeds / s.seed_file, snaps / s.seed_file)  # same file system: no copy
        except OSError:
            shutil.copyfile(seeds / s.seed_file, snaps / s.seed_file)


def session_count(p: Params, parallel: int) -> int:
    return len(p.histories) if parallel > 1 else p.sessions_1slot


def run_one(
    binary: Path, model: Path, work: Path, seeds: Path, p: Params, workload: str, policy: str
) -> dict[str, Any]:
    parallel, think = WORKLOADS[workload]
    n_sessions = FITS_SESSIONS.get(workload) or session_count(p, parallel)
    sessions = [s for s in plans(p)[:n_sessions]]
    for s in sessions:
        s.seed_file = f"seed-{s.name}.bin"
    checkpoint = policy_config(policy) if policy in KV_POLICIES else {}
    base: dict[str, Any] = {
        "workload": workload,
        "policy": policy,
        "sessions": n_sessions,
        "parallel": parallel,
    }
    if checkpoint is None:
        return {**base, "available": False, "reason": "this build's config does not accept the policy"}
    flags = {
        "cache-ram": ("--cache-ram", str(CACHE_RAM_MIB)),
        "cold": ("--cache-ram", "0"),
    }.get(policy, ("--cache-ram", "0", "--no-cache-idle-slots"))
    run_dir = Path(tempfile.mkdtemp(dir=work, prefix=f"{workload}-{policy}-"))
    server = llama(binary, model, run_dir, parallel=parallel, ctx=p.ctx_per_slot, extra=flags)
    link_seeds(server, seeds, sessions)
    started = time.time()
    server.start()
    try:
        if policy in KV_POLICIES:
            # fits-2slots reports llama-server's prompt_ms at release (as the proxy does): the cost model then
            # knows what recomputing unsaved tokens costs (the other workloads keep their earlier protocol)
            prefill = workload in FITS_SESSIONS
            raw = asyncio.run(run_kvsidecar(server, run_dir, sessions, p, think, checkpoint, prefill=prefill))
        else:
            turns = p.cold_turns if policy == "cold" else p.turns
            raw = asyncio.run(run_baseline(server, sessions, p, think, seed=policy != "cold", turns=turns))
    except Exception as exc:  # one broken run must not cost the others: reported with its logs
        tail = server.log_tail(80)
        print(f"  FAILED: {exc!r}\n{tail}", file=sys.stderr)
        return {**base, "available": False, "reason": f"failed: {exc!r}", "llama_log_tail": tail}
    finally:
        server.stop()
        shutil.rmtree(run_dir, ignore_errors=True)
    return {
        **base,
        "available": True,
        "llama_flags": f"--parallel {parallel} --ctx-size {p.ctx_per_slot * parallel} {' '.join(flags)}",
        "checkpoint_config": checkpoint,
        "wall_s": time.time() - started,
        **raw,
    }


# what the daemon said ---------------------------------------------------------------------------------
def _ts(value: str) -> float:
    head, _, frac = value.rstrip("Z").partition(".")
    return calendar.timegm(time.strptime(head, "%Y-%m-%dT%H:%M:%S")) + float(f"0.{frac or 0}")


def log_events(log_text: str) -> list[dict[str, Any]]:
    """The daemon's JSON log lines that carry an event, with `at` (epoch seconds) from their timestamp."""
    out = []
    for line in log_text.splitlines():
        try:
            e = json.loads(line)
        except ValueError:
            continue
        if isinstance(e, dict) and isinstance(e.get("event"), str) and isinstance(e.get("ts"), str):
            out.append(e | {"at": _ts(e["ts"])})
    return out


def save_intervals(events: list[dict[str, Any]], t0: float, t1: float) -> list[dict[str, Any]]:
    """Every save the daemon did in [t0, t1]: session (short id), trigger, start, end, bytes, outcome."""
    open_: dict[str, dict[str, Any]] = {}
    out: list[dict[str, Any]] = []
    for e in events:
        name, session = e["event"], str(e.get("session"))
        if name == "kv.session.save.start":
            open_[session] = {"session": session, "trigger": e.get("trigger"), "start": e["at"]}
        elif name.startswith("kv.session.save.") and session in open_:
            rec = open_.pop(session) | {"end": e["at"], "outcome": name.rsplit(".", 1)[1]}
            rec["bytes"], rec["save_ms"] = e.get("bytes"), e.get("save_ms")
            rec["server_ms"] = e.get("server_ms")  # llama-server's own save_ms, if the daemon logs it
            # llama-server's loop is held by the slot save call alone (`slot_ms`), not by the checksum and
            # manifest after it; a switch's save commits while the next session restores, so only that call
            # is on the switch's path (a background save holds its slot to the end: a waiter waits for all)
            slot_ms = e.get("slot_ms")
            stall_end = rec["end"] if slot_ms is None else min(rec["end"], rec["start"] + slot_ms / 1000)
            rec["stall_end"] = stall_end
            rec["path_end"] = stall_end if rec["trigger"] == "switch" else rec["end"]
            if rec["end"] >= t0 and rec["start"] <= t1:
                out.append(rec)
    return out


def switch_events(events: list[dict[str, Any]], t0: float, t1: float) -> list[dict[str, Any]]:
    """`kv.session.switch` (logged after the eviction, before the restore): to, evicted, at."""
    return [
        {"to": e.get("to"), "evicted": e.get("evicted"), "at": e["at"]}
        for e in events
        if e["event"] == "kv.session.switch" and t0 - 1 <= e["at"] <= t1
    ]


def parse_metrics(text: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if not s.name.startswith("kvsidecar_") or s.name.endswith(("_created", "_bucket")):
                continue
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "server")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


def metrics_delta(before: str, after: str) -> dict[str, float]:
    a, b = parse_metrics(before), parse_metrics(after)
    return {k: v - a.get(k, 0.0) for k, v in b.items() if v - a.get(k, 0.0)}


def metric_sum(m: dict[str, float], prefix: str) -> float:
    return sum(v for k, v in m.items() if k == prefix or k.startswith(prefix + "{"))


# analysis ---------------------------------------------------------------------------------------------
def overlap(a0: float, a1: float, b0: float, b1: float) -> float:
    return max(0.0, min(a1, b1) - max(a0, b0))


def union_length(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, -math.inf
    for s, e in sorted(intervals):
        if e > end:
            total += e - max(s, end)
            end = e
    return total


def attribute(
    turn: Turn, saves: list[dict[str, Any]], switches: list[dict[str, Any]], mine: str
) -> dict[str, float]:
    """Split a call's acquire: waiting for the slot (other sessions' calls), saves on its critical path
    (the eviction save its own acquire did, listed in its `actions`, and any other save that ran while it
    waited), the restore, and kvsidecar's own work (verification, manifests, HTTP); and whether it waited
    for a background save of its own session."""
    listed = {a.split(" ", 1)[1] for a in turn.actions if a.startswith("save ")}
    evict = [s for s in saves if s["trigger"] == "switch" and s["session"] in listed]
    evict = [s for s in evict if overlap(turn.t_ready, turn.t_acquired, s["start"], s["path_end"]) > 0]
    others = [s for s in saves if s["trigger"] != "switch"]
    # when the slot was handed to this call: its eviction save began, or else its switch was logged
    switch = [
        e["at"] for e in switches if e["to"] == mine and turn.t_ready - 0.002 <= e["at"] <= turn.t_acquired
    ]
    granted = min([s["start"] for s in evict] + switch[-1:]) if (evict or switch) else None
    restore = (turn.restore_ms or 0.0) / 1000
    evict_s = sum(overlap(turn.t_ready, turn.t_acquired, s["start"], s["path_end"]) for s in evict)
    bg = [(s, overlap(turn.t_ready, turn.t_acquired, s["start"], s["end"])) for s in others]
    bg_s = sum(o for _, o in bg)
    own_s = sum(o for s, o in bg if s["session"] == mine)
    acquire = turn.t_acquired - turn.t_ready
    if granted is None:  # resident, or a baseline: all but the restore is waiting
        wait = max(0.0, acquire - evict_s - bg_s - restore)
    else:
        wait = max(
            0.0,
            granted - turn.t_ready - sum(overlap(turn.t_ready, granted, s["start"], s["end"]) for s, _ in bg),
        )
    own_work = max(0.0, acquire - wait - evict_s - bg_s - restore)
    return {
        "wait_ms": wait * 1000,
        "save_ms": (evict_s + bg_s) * 1000,
        "kvsidecar_ms": own_work * 1000,
        "own_save_ms": own_s * 1000,
    }


def fit_prefill(turns: list[Turn]) -> tuple[float, float]:
    """prompt_ms ~ n x (a + b x context): per-token cost of appended tokens, from warm calls."""
    import numpy as np

    rows = [t for t in turns if t.cache_n > 0 and 0 < t.prompt_n <= 1024 and t.prompt_ms > 0]
    if len(rows) < 2:
        return (float("nan"), float("nan"))
    x = np.array([[t.prompt_n, t.prompt_n * (t.cache_n + t.prompt_n / 2)] for t in rows])
    y = np.array([t.prompt_ms for t in rows])
    (a, b), *_ = np.linalg.lstsq(x, y, rcond=None)
    return float(a), float(b)


def limit_ms(t: Turn, bpt: float, gbps: float, fit: tuple[float, float]) -> float:
    a, b = fit
    restore = t.reusable * bpt / (gbps * 1e9) * 1000
    return restore + t.new * (a + b * (t.reusable + t.new / 2))


def p50(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def analyse(run: dict[str, Any], bpt: float, gbps: float, fit: tuple[float, float]) -> dict[str, Any]:
    turns: list[Turn] = run["turns"]
    saves, switches = run["saves"], run["switch_events"]
    rows = []
    for t in sorted(turns, key=lambda t: t.t_ready):
        parts = attribute(t, saves, switches, short_id(t.session))
        rows.append(
            {
                **{k: v for k, v in asdict(t).items() if k != "reply"},
                "reply_n": len(t.reply),
                "ttft_ms": t.ttft_ms,
                "acquire_ms": t.acquire_ms,
                "switch_ms": t.ttft_ms - parts["wait_ms"],  # TTFT without queueing behind other calls
                **parts,
                "limit_ms": limit_ms(t, bpt, gbps, fit),
                "hearth_bytes": (t.reusable + t.new + len(t.reply)) * bpt,
            }
        )
    return {k: v for k, v in run.items() if k != "turns"} | {"rows": rows, "summary": summarise(run, rows)}


def summarise(run: dict[str, Any], rows: list[dict[str, Any]]) -> dict[str, Any]:
    sw = [r for r in rows if r["switched"]]
    m, n = run["metrics"], max(1, len(rows))
    saves = run["saves"]
    save_spans = [(s["start"], s.get("stall_end", s["end"])) for s in saves]
    stalled_other = sum(
        overlap(r["t_acquired"], r["t_end"], s["start"], s.get("stall_end", s["end"]))
        for s in saves
        for r in rows
        if short_id(r["session"]) != s["session"]
    )
    triggers: dict[str, int] = {}
    for s in saves:
        if s["outcome"] == "success":
            triggers[s["trigger"]] = triggers.get(s["trigger"], 0) + 1
    keys = (
        "wait_ms",
        "save_ms",
        "restore_ms",
        "kvsidecar_ms",
        "prompt_ms",
        "switch_ms",
        "ttft_ms",
        "limit_ms",
    )
    col = {k: [r[k] for r in sw if r[k] is not None] for k in keys}
    return {
        "calls": len(rows),
        "switches": len(sw),
        "switches_with_save_on_path": sum(1 for r in sw if r["save_ms"] > 0.5),
        # the switches that found the server free (no other session's call to wait for): the ones a
        # background save can serve without skipping the save; a queued switch must pay its victim's save
        "unqueued_switches": sum(1 for r in sw if r["wait_ms"] <= QUEUED_MS),
        "unqueued_with_save_on_path": sum(1 for r in sw if r["wait_ms"] <= QUEUED_MS and r["save_ms"] > 0.5),
        "p50": {k: p50(v) for k, v in col.items()},
        "ttft_ms": summary(col["ttft_ms"]) if col["ttft_ms"] else None,
        "all_calls_ttft_p50_ms": p50([r["ttft_ms"] for r in rows]),
        "switch_over_limit_p50": p50([r["switch_ms"] / r["limit_ms"] for r in sw if r["limit_ms"] > 0]),
        "switch_over_restore_plus_prefill_p50": p50(
            [r["switch_ms"] / ((r["restore_ms"] or 0) + r["prompt_ms"]) for r in sw if r["prompt_ms"] > 0]
        ),
        "bytes_written_per_call": metric_sum(m, "kvsidecar_save_bytes_total") / n,
        "bytes_read_per_call": metric_sum(m, "kvsidecar_restore_bytes_total") / n,
        "hearth_bytes_per_call": statistics.fmean(r["hearth_bytes"] for r in rows) if rows else 0.0,
        "full_snapshots_per_call": sum(triggers.values()) / n,
        "saves_by_trigger": triggers,
        "saves_skipped": {k: v for k, v in m.items() if k.startswith("kvsidecar_save_skipped")},
        # llama-server's own timings where the daemon passes them on (restore: the acquire answer; save:
        # the log event's server_ms, if this build logs it), and kvsidecar's wall time of each save
        "llama_restore_ms_p50": p50(
            [r["restore_server_ms"] for r in sw if r["restore_server_ms"] is not None]
        ),
        "llama_save_ms_p50": p50([s["server_ms"] for s in saves if s.get("server_ms") is not None]),
        "save_ms_p50": p50([s["save_ms"] for s in saves if s.get("save_ms") is not None]),
        "save_mb_per_s_p50": p50(
            [s["bytes"] / s["save_ms"] / 1000 for s in saves if s.get("bytes") and s.get("save_ms")]
        ),
        "save_stall_s": union_length(save_spans),
        "other_calls_stalled_by_saves_s": stalled_other,
        "own_save_waits": sum(1 for r in rows if r["own_save_ms"] > 0),
        "own_save_wait_s": sum(r["own_save_ms"] for r in rows) / 1000,
        "makespan_s": (max(r["t_end"] for r in rows) - min(r["t_ready"] for r in rows)) if rows else 0.0,
        # llama-server's prefill speed in this run (its own prompt_ms per new token): how fast the machine
        # was, which moves from run to run by more than the policies differ
        "prefill_ms_per_token_p50": p50([r["prompt_ms"] / r["prompt_n"] for r in rows if r["prompt_n"] > 20]),
        "daemon_cpu_s": run.get("daemon_cpu_s"),
        # what a llama-server crash would have cost, sampled every UNSAVED_POLL_S (issue 26): the oldest
        # unsaved work and the most unsaved tokens of one session, and their medians over the samples
        **unsaved_summary(run.get("unsaved_samples") or []),
        "own_save_ttft_p50_ms": p50([r["ttft_ms"] for r in rows if r["own_save_ms"] > 0]),
        "unaffected_ttft_p50_ms": p50([r["ttft_ms"] for r in rows if r["own_save_ms"] <= 0]),
    }


def unsaved_summary(samples: list[dict[str, float]]) -> dict[str, float | None]:
    ages = [s["unsaved_max_age_seconds"] for s in samples]
    tokens = [s["unsaved_max_tokens"] for s in samples]
    return {
        "unsaved_age_max_s": max(ages) if ages else None,
        "unsaved_age_p50_s": p50(ages),
        "unsaved_tokens_max": max(tokens) if tokens else None,
        "unsaved_tokens_p50": p50(tokens),
    }


# plot and main ----------------------------------------------------------------------------------------
def plot(runs: list[dict[str, Any]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in runs if r.get("available") and r["summary"]["switches"]]
    if not ok:
        return
    fig, axes = plt.subplots(1, 3, figsize=(17, 4.8))
    _plot_parts(axes[0], [r for r in ok if r["workload"] == ok[0]["workload"]])
    _plot_bars(axes[1], ok, "switch")
    _plot_bars(axes[2], ok, "bytes")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=100)
    plt.close(fig)


def _plot_parts(ax: Any, runs: list[dict[str, Any]]) -> None:
    """One workload: where a switch's time goes (medians), against the physical limit; cold is off scale."""
    parts = (
        ("save_ms", "save on the path"),
        ("restore_ms", "restore"),
        ("kvsidecar_ms", "kvsidecar's own work"),
        ("prompt_ms", "prefill of the new tokens"),
    )
    shown = [r for r in runs if r["policy"] != "cold"]
    for i, r in enumerate(shown):
        med, bottom = r["summary"]["p50"], 0.0
        for j, (key, label) in enumerate(parts):
            v = med.get(key) or 0.0
            ax.bar(i, v, bottom=bottom, color=f"C{j}", label=label if i == 0 else None)
            bottom += v
        ax.plot(
            [i - 0.4, i + 0.4], [med["switch_ms"]] * 2, "k-", lw=2, label="switch (p50)" if i == 0 else None
        )
        ax.plot(
            [i - 0.4, i + 0.4],
            [med["limit_ms"]] * 2,
            "r--",
            lw=2,
            label="physical limit (p50)" if i == 0 else None,
        )
    ax.set_xticks(range(len(shown)), [r["policy"] for r in shown])
    cold = [r for r in runs if r["policy"] == "cold"]
    note = f"; cold: {cold[0]['summary']['p50']['switch_ms'] / 1000:.1f} s" if cold else ""
    ax.set_ylabel("ms, medians over switches")
    ax.set_title(f"A switch without the queueing ({runs[0]['workload']}{note})", fontsize=10)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.35)
    ax.legend(fontsize=7, loc="upper left", ncol=2)


def _plot_bars(ax: Any, runs: list[dict[str, Any]], key: str) -> None:
    """Per workload and policy: switch p50 against the limit, or MB written per call against one full
    snapshot per response."""
    workloads = [w for w in WORKLOADS if any(r["workload"] == w for r in runs)]
    policies = [p for p in POLICIES if any(r["policy"] == p for r in runs)]
    width = 0.8 / len(policies)
    for k, pol in enumerate(policies):
        xs, ys = [], []
        for i, w in enumerate(workloads):
            found = [r["summary"] for r in runs if r["workload"] == w and r["policy"] == pol]
            if found:
                xs.append(i + k * width)
                ys.append(
                    found[0]["p50"]["switch_ms"]
                    if key == "switch"
                    else found[0]["bytes_written_per_call"] / 1e6
                )
        ax.bar(xs, ys, width, label=pol, color=f"C{k + 4}")
    for i, w in enumerate(workloads):
        sums = [r["summary"] for r in runs if r["workload"] == w]
        ref = statistics.median(
            s["p50"]["limit_ms"] if key == "switch" else s["hearth_bytes_per_call"] / 1e6 for s in sums
        )
        label = "physical limit" if key == "switch" else "one full snapshot per response"
        ax.plot([i - width / 2, i + 0.8 - width / 2], [ref, ref], "r--", label=label if i == 0 else None)
    ax.set_xticks([i + 0.4 - width / 2 for i in range(len(workloads))], workloads)
    if key == "switch":
        ax.set_yscale("log")
        ax.set_ylabel("switch p50: TTFT minus queueing (ms, log)")
        ax.set_title("Switch time vs the physical limit", fontsize=10)
    else:
        ax.set_ylim(0, ax.get_ylim()[1] * 1.3)
        ax.set_ylabel("MB written per call")
        ax.set_title("Bytes written per call (kvsidecar; the baselines write none)", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", ncol=2)


def run_all(p: Params, binary: Path, model: Path, work: Path) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    seeds: dict[int, Path] = {}
    pre: dict[str, Any] = {}
    for parallel in sorted({WORKLOADS[w][0] for w in p.workloads}):
        sessions = plans(p)[: session_count(p, parallel)]
        print(f"prebuilding {len(sessions)} histories for --parallel {parallel} ...", file=sys.stderr)
        seeds[parallel], pre[f"parallel_{parallel}"] = prebuild(binary, model, sessions, parallel)
    first = pre[min(pre)]
    pre |= {k: first[k] for k in ("read_gbps", "file_bytes_per_token")}
    runs = []
    for workload in p.workloads:
        for policy in p.policies:
            if policy == "cold" and workload not in p.cold_workloads:
                continue
            if policy == "cost-aware-busy" and WORKLOADS[workload][0] == 1:
                continue  # one slot: no other slot to stall, the same as cost-aware
            if (workload in FITS_SESSIONS) != (policy in FITS_POLICIES) and policy != "cost-aware":
                continue  # the staleness bounds are compared where sessions keep their slots, and only there
            print(f"{workload} / {policy} ...", file=sys.stderr)
            run = run_one(binary, model, work, seeds[WORKLOADS[workload][0]], p, workload, policy)
            runs.append(run)
            if run.get("available"):
                done = run["turns"]
                print(f"  {len(done)} calls in {run['wall_s']:.0f} s", file=sys.stderr)
    return pre, runs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="single-slot workloads, 2 calls per session")
    parser.add_argument("--policies", help=f"comma-separated subset of {','.join(POLICIES)}")
    parser.add_argument("--workloads", help=f"comma-separated subset of {','.join(WORKLOADS)}")
    parser.add_argument(
        "--hint", choices=["step_end", "turn_end", "flush"], help="send this event after each call"
    )
    parser.add_argument("--turns", type=int, help="calls per session")
    parser.add_argument("--name", help="results file name (default: agent, or agent-quick with --quick)")
    args = parser.parse_args()
    p = QUICK if args.quick else FULL
    if args.policies:
        p = Params(**{**asdict(p), "policies": tuple(args.policies.split(","))})
    if args.workloads:
        p = Params(**{**asdict(p), "workloads": tuple(args.workloads.split(","))})
    if args.hint:
        p = Params(**{**asdict(p), "hint": args.hint})
    if args.turns:
        p = Params(**{**asdict(p), "turns": args.turns})
    binary = llama_server_binary()
    model = generate_llama_model(LLAMA3_8B_GEOMETRY, vocab_dir=vocab_dir(binary))
    started = time.time()
    with tempfile.TemporaryDirectory(prefix="bench-agent-") as tmp:
        pre, runs = run_all(p, binary, model, Path(tmp))
    done = [r for r in runs if r.get("available")]
    single = [t for r in done if r["parallel"] == 1 and r["policy"] != "cold" for t in r["turns"]]
    fit = fit_prefill(single or [t for r in done for t in r["turns"]])
    bpt, gbps = pre["file_bytes_per_token"], pre["read_gbps"]
    analysed = [analyse(r, bpt, gbps, fit) if r.get("available") else r for r in runs]
    name = args.name or ("agent-quick" if args.quick else "agent")
    img = f"agent_switch{name.removeprefix('agent')}.png"
    try:
        plot(analysed, ROOT / "docs" / "img" / img)
    except ImportError as exc:  # matplotlib is a bench extra: the numbers do not need it
        print(f"no plot: {exc}", file=sys.stderr)
        img = ""
    result = {
        "variant": "quick" if args.quick else "full",
        "params": asdict(p) | {"ctx_per_slot": p.ctx_per_slot},
        "model": {
            "shape": asdict(LLAMA3_8B_GEOMETRY),
            "kv_bytes_per_token_f16": LLAMA3_8B_GEOMETRY.kv_bytes_per_token_f16,
            "file_bytes_per_token": bpt,
            "gguf_bytes": model.stat().st_size,
        },
        "prebuild": pre,
        "read_gbps": gbps,
        "prefill_fit_ms": {"a_per_token": fit[0], "b_per_token_per_context_token": fit[1]},
        "runs": analysed,
        "plot": img,
        "elapsed_s": time.time() - started,
        "machine": machine(),
    }
    print(write(name, result))
    for r in analysed:
        s = r.get("summary")
        if s:
            print(
                f"{r['workload']:13} {r['policy']:18} switches {s['switches']:3} save-on-path "
                f"{s['switches_with_save_on_path']:3} TTFT p50 {s['p50']['ttft_ms'] or 0:9.0f} ms "
                f"limit {s['p50']['limit_ms'] or 0:7.0f} MB/call {s['bytes_written_per_call'] / 1e6:6.0f} "
                f"all-calls TTFT p50 {s['all_calls_ttft_p50_ms'] or 0:7.0f} ms, own-save waits "
                f"{s['own_save_waits']} ({s['own_save_wait_s']:.1f} s), other calls stalled "
                f"{s['other_calls_stalled_by_saves_s']:.1f} s, unsaved max {s['unsaved_age_max_s']} s / "
                f"{s['unsaved_tokens_max']} tokens, saves {s['saves_by_trigger']}"
            )
    print(f"elapsed {time.time() - started:.0f} s", file=sys.stderr)
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    raise SystemExit(main())
