"""Fleet routing vs a round-robin balancer over three hosts (issue 18).

Three hosts on one machine (`kvsidecar.testing.fleet.LocalFleet`: a real llama-server and a real `kvsidecar
serve` each, one shared snapshot directory, one Redis), twelve agent sessions, each a few turns of
append-only history: every turn sends the whole history plus a few hundred new tokens (a tool result) and
appends the reply. Sessions start at staggered times and think between turns (lognormal, seeded), so their
turns interleave; twelve sessions on 3 x `--parallel 2` = 6 slots, so the slots are contended. The same
sessions, tokens and think times run in three modes, one after the other, each on fresh servers:

  fleet          kvsidecar's fleet routing: the harness calls a random host's kvsidecar to acquire (another
                 one if that one does not answer), sends the model call to the answer's `base_url` with
                 `id_slot`, and releases at the kvsidecar it called, with llama-server's timings.
                 llama-server `--cache-ram 0`.
  round-robin    no kvsidecar: each request goes to the next of the three llama-servers in turn, without
                 `id_slot` (llama-server picks the slot); `--cache-ram 0`.
  rr-cache-ram   the same round-robin, llama-server's own host-memory prompt cache on (`--cache-ram 256`).

Per mode: the hit rate (turns after a session's first that did not prefill their history: llama-server's
`timings.cache_n` reaches the history the turn carries, within 16 tokens; a turn that reused part of it is
counted as partial), the share of history tokens reused, time to first token (streamed: from the moment the
turn is ready, before the acquire or the balancer's pick, to the first streamed chunk), llama-server's
`prompt_ms`, and the snapshot bytes written and read (the kvsidecars' `/metrics`; the RAM cache moves bytes
inside llama-server, which nothing here counts).

Failover (fleet only): after the measured turns the sessions go on for a few more turns on the same fleet;
once `kill_after` of those have completed, the host that served the last turn of the most sessions loses its
llama-server and its kvsidecar (SIGKILL both). Its sessions' think time is cut short, so each issues its next
turn at once (a turn in flight on it fails and is retried); per session: the time from the kill until its
next turn's lease, first token and end, the calls that failed on the way, where it was served and what it
cost (restored with its whole history, restored from an older generation, or cold). The kvsidecars run with
the daemon's default fleet timings (heartbeat, host TTL, owner lease TTL), as a deployment would.

Model: the generated 4-layer, 256-wide llama (`TINY`) with a 16K trained context (the 4K one caps a slot at
4,096 tokens). Sizes: histories start at 3,000-4,500 tokens and grow by 200-400 a turn (6,600 at most in 8
turns here); on one thread a cold prefill of 4,000 tokens takes ~1.2 s and of 6,000 ~2.3 s, 300 new tokens on
a warm 6,000 ~0.25 s, and a restore of the 26 MB snapshot ~5 ms. Each llama-server runs one thread (three
servers share the machine's cores). Twelve sessions with a 3 s mean think time keep the round-robin servers
busy prefilling, so their requests queue. The whole benchmark takes about 4 minutes on 2 cores; `--quick` (6
sessions, shorter histories, 2 turns) under 1. Results go to bench/results/fleet.json (fleet-quick.json), and
the docs/BENCHMARKS.md section is printed (`section()` renders it from the JSON); medians and ratios come from
one run; nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import json
import math
import random
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from common import pct, write

from kvsidecar.config import FleetConfig
from kvsidecar.testing.fleet import FleetHost, LocalFleet
from kvsidecar.testing.llama import LlamaServer, llama_server_binary, vocab_dir
from kvsidecar.testing.models import TINY, generate_llama_model
from tests.fleet_helpers import RedisServer

MODEL_NAME = "llama-gen-16k"
MODES = ("fleet", "round-robin", "rr-cache-ram")
HIT_SLACK = 16  # a turn that recomputed at most this many tokens of its history did not prefill it
MODEL_SHAPE = replace(TINY, n_ctx=16384)


@dataclass(frozen=True, kw_only=True)
class Params:
    hosts: int
    parallel: int
    sessions: int
    turns: int  # measured turns per session, every mode
    failover_turns: int  # fleet only, after the measured turns; the kill happens among them
    kill_after: int  # completed failover-phase turns before the kill
    history: tuple[int, int]  # initial history tokens, uniform
    new_tokens: tuple[int, int]  # appended before each turn, uniform
    reply_tokens: int  # n_predict
    think_mean_s: float
    think_sigma: float
    start_spread_s: float  # first turns start uniformly within this
    threads: int  # per llama-server
    cache_ram_mib: int
    seed: int

    @property
    def ctx_per_slot(self) -> int:
        turns = self.turns + self.failover_turns
        need = self.history[1] + turns * (self.new_tokens[1] + self.reply_tokens + 1) + 64
        return int(math.ceil(need / 512) * 512)


FULL = Params(
    hosts=3,
    parallel=2,
    sessions=12,
    turns=5,
    failover_turns=3,
    kill_after=12,
    history=(3000, 4500),
    new_tokens=(200, 400),
    reply_tokens=8,
    think_mean_s=3.0,
    think_sigma=0.75,
    start_spread_s=8.0,
    threads=1,
    cache_ram_mib=256,
    seed=18,
)
QUICK = replace(
    FULL,
    sessions=6,
    turns=2,
    failover_turns=2,
    kill_after=4,
    history=(1500, 2500),
    start_spread_s=4.0,
)


# the workload -----------------------------------------------------------------------------------------
@dataclass(kw_only=True)
class SessionPlan:
    name: str
    history: list[int]
    new: list[list[int]]  # appended before each turn (after the previous reply)
    think_s: list[float]  # before each turn after the first of a phase
    start_s: float


def plans(p: Params) -> list[SessionPlan]:
    """Every session's tokens and think times, drawn once from the seed: the same in every mode."""
    mu = math.log(p.think_mean_s) - p.think_sigma**2 / 2  # lognormal with mean think_mean_s
    n_turns = p.turns + p.failover_turns + 1  # a spare: a dead host's session that had finished
    out = []
    for i in range(p.sessions):
        rng = random.Random(p.seed * 1000 + i)
        out.append(
            SessionPlan(
                name=f"agent-{i:02d}",
                history=[rng.randrange(1000, 31000) for _ in range(rng.randint(*p.history))],
                new=[
                    [rng.randrange(1000, 31000) for _ in range(rng.randint(*p.new_tokens))]
                    for _ in range(n_turns)
                ],
                think_s=[rng.lognormvariate(mu, p.think_sigma) for _ in range(n_turns)],
                start_s=rng.uniform(0, p.start_spread_s),
            )
        )
    return out


@dataclass(kw_only=True)
class Turn:
    mode: str
    phase: str  # "measured" or "failover"
    session: str
    turn: int
    history: int  # tokens of the prompt that earlier turns already computed (what a warm slot holds)
    prompt: int
    t_ready: float  # time.time(): the turn is ready (before the acquire, or the balancer's pick)
    t_attempt: float = 0.0  # start of the attempt that succeeded
    t_acquired: float = 0.0
    t_first: float = 0.0
    t_end: float = 0.0
    attempts: int = 0
    errors: list[str] = field(default_factory=list)
    host: str = ""  # the host whose llama-server served it
    called: str = ""  # fleet: the kvsidecar the harness called
    outcome: str = ""  # fleet: the acquire's outcome
    restored_tokens: int | None = None
    restore_ms: float | None = None
    prompt_n: int = 0
    cache_n: int = 0
    prompt_ms: float = 0.0
    reply: list[int] = field(default_factory=list)

    @property
    def ttft_ms(self) -> float:
        return (self.t_first - self.t_ready) * 1000

    @property
    def reuse(self) -> str:
        """full: the history was not prefilled; partial: some of it was; none: all of it (first turns: -)."""
        if self.turn == 0:
            return "-"
        if self.cache_n >= self.history - HIT_SLACK:
            return "full"
        return "partial" if self.cache_n > 0 else "none"

    def record(self) -> dict[str, Any]:
        out = asdict(self)
        out["reply"] = len(self.reply)
        out["ttft_ms"] = self.ttft_ms
        out["reuse"] = self.reuse
        return out


class TurnFailed(Exception):
    pass


# the model call ---------------------------------------------------------------------------------------
async def stream_completion(
    http: httpx.AsyncClient, base_url: str, slot_id: int | None, tokens: list[int], n_predict: int, turn: Turn
) -> None:
    """A streamed /completion over a token list (pinned to `slot_id` if given): first-token time, reply and
    llama-server's timings go into the turn."""
    body: dict[str, Any] = {
        "prompt": tokens,
        "n_predict": n_predict,
        "cache_prompt": True,
        "stream": True,
        "temperature": 0,
        "return_tokens": True,
    }
    if slot_id is not None:
        body["id_slot"] = slot_id
    final: dict[str, Any] = {}
    async with http.stream("POST", f"{base_url}/completion", json=body) as r:
        if r.status_code != 200:
            raise TurnFailed(
                f"/completion at {base_url} answered {r.status_code}: {(await r.aread())[:300]!r}"
            )
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[6:])
            if not turn.t_first:
                turn.t_first = time.time()
            turn.reply += [int(t) for t in chunk.get("tokens") or []]
            if chunk.get("stop"):
                final = chunk
    if not final:
        raise TurnFailed(f"/completion at {base_url}: the stream ended without its last chunk")
    turn.t_end = time.time()
    timings = final.get("timings") or {}
    turn.prompt_n, turn.cache_n = int(timings.get("prompt_n", 0)), int(timings.get("cache_n", 0))
    turn.prompt_ms = float(timings.get("prompt_ms", 0.0))


def llama_client() -> httpx.AsyncClient:
    """A fresh connection per call: llama-server closes idle keep-alive connections after 5 s, and a turn
    after a think time of about that long would race the close."""
    return httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_keepalive_connections=0))


# balancers --------------------------------------------------------------------------------------------
class Balancer(Protocol):
    async def run(self, http: httpx.AsyncClient, turn: Turn, prompt: list[int], n_predict: int) -> None: ...


class RoundRobin:
    """Each request to the next llama-server in turn, without `id_slot`."""

    def __init__(self, base_urls: list[str]) -> None:
        self.base_urls = base_urls
        self.next = 0

    async def run(self, http: httpx.AsyncClient, turn: Turn, prompt: list[int], n_predict: int) -> None:
        i = self.next % len(self.base_urls)
        self.next += 1
        turn.host, turn.t_acquired = f"h{i + 1}", time.time()
        await stream_completion(http, self.base_urls[i], None, prompt, n_predict, turn)


class FleetRouter:
    """Acquire at a random host's kvsidecar (the others in random order if it does not answer), the model
    call where the answer says, release at the kvsidecar that answered the acquire."""

    def __init__(self, hosts: list[FleetHost], rng: random.Random) -> None:
        self.urls = {h.host_id: h.url for h in hosts}
        self.auth = hosts[0].auth
        self.rng = rng
        self.last_host: dict[str, str] = {}  # session -> host of its latest acquire answer
        self.kv = httpx.AsyncClient(
            timeout=httpx.Timeout(300, connect=2.0),
            # the daemon closes a connection idle for api.header_timeout_s (10 s): never reuse one that old
            limits=httpx.Limits(keepalive_expiry=4.0),
        )

    async def aclose(self) -> None:
        await self.kv.aclose()

    def order(self) -> list[str]:
        ids = list(self.urls)
        self.rng.shuffle(ids)
        return ids

    async def run(self, http: httpx.AsyncClient, turn: Turn, prompt: list[int], n_predict: int) -> None:
        answer: dict[str, Any] | None = None
        for host_id in self.order():
            try:
                r = await self.kv.post(
                    f"{self.urls[host_id]}/v1/sessions/{turn.session}/acquire",
                    json={"provider": "local", "model": MODEL_NAME},
                    headers=self.auth,
                )
            except httpx.TransportError as e:
                turn.errors.append(f"acquire via {host_id}: {type(e).__name__}")
                continue
            if r.status_code != 200:
                turn.errors.append(f"acquire via {host_id}: {r.status_code} {r.text[:300]}")
                continue
            answer, turn.called = r.json(), host_id
            break
        if answer is None:
            raise TurnFailed("no kvsidecar gave a lease")
        turn.t_acquired = time.time()
        turn.host, turn.outcome = str(answer.get("host", "")), str(answer["outcome"])
        turn.restored_tokens, turn.restore_ms = answer.get("restored_tokens"), answer.get("restore_ms")
        self.last_host[turn.session] = turn.host
        ok = False
        try:
            await stream_completion(
                http, str(answer["base_url"]), int(answer["slot_id"]), prompt, n_predict, turn
            )
            ok = True
        finally:
            await self.release(turn, str(answer["lease_id"]), ok)

    async def release(self, turn: Turn, lease_id: str, ok: bool) -> None:
        body: dict[str, Any] = {"status": "ok" if ok else "aborted"}
        if ok:
            body |= {
                "prompt_tokens": turn.prompt_n,
                "cached_tokens": turn.cache_n,
                "prompt_ms": turn.prompt_ms,
            }
        for host_id in [turn.called] + [h for h in self.order() if h != turn.called]:
            try:
                r = await self.kv.post(
                    f"{self.urls[host_id]}/v1/leases/{lease_id}/release", json=body, headers=self.auth
                )
            except httpx.TransportError as e:
                turn.errors.append(f"release via {host_id}: {type(e).__name__}")
                continue
            if r.status_code == 200:
                return
            turn.errors.append(f"release via {host_id}: {r.status_code} {r.text[:300]}")
            if not ok:
                return  # an aborted turn's lease may be gone with its host: nothing more to do


# the run ----------------------------------------------------------------------------------------------
@dataclass
class SessionState:
    history: list[int]
    next_turn: int = 0
    wake: asyncio.Event = field(default_factory=asyncio.Event)


class Phase:
    """One phase's turns, and the failover hook: `on_done` counts completed turns."""

    def __init__(self, mode: str, name: str, p: Params, retry_for_s: float) -> None:
        self.mode, self.name, self.p, self.retry_for_s = mode, name, p, retry_for_s
        self.turns: list[Turn] = []
        self.kill_at: int | None = None
        self.kill_task: asyncio.Task[None] | None = None
        # a dead host's session that had finished its turns before the kill gets one more, at once
        self.one_more: Callable[[str], asyncio.Task[None]] | None = None
        self.extra: list[asyncio.Task[None]] = []
        self.on_kill: Callable[[], Coroutine[Any, Any, None]] | None = None

    def done(self, turn: Turn) -> None:
        self.turns.append(turn)
        if self.kill_at is not None and len(self.turns) == self.kill_at and self.on_kill is not None:
            self.kill_task = asyncio.create_task(self.on_kill())


async def think(state: SessionState, seconds: float) -> None:
    """Sleep, unless woken (the failover cuts a dead host's sessions' think time short)."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(state.wake.wait(), timeout=seconds)
    state.wake.clear()


async def run_session(
    bal: Balancer,
    http: httpx.AsyncClient,
    plan: SessionPlan,
    state: SessionState,
    upto: int,
    phase: Phase,
    *,
    start_s: float | None = None,
) -> None:
    p = phase.p
    await think(state, plan.start_s if start_s is None else start_s)
    first = state.next_turn
    while state.next_turn < upto:
        i = state.next_turn
        if i > first:
            await think(state, plan.think_s[i])
        prompt = state.history + plan.new[i]
        history = len(state.history) - (
            1 if i > 0 else 0
        )  # the last reply token was sampled, never evaluated
        turn = Turn(
            mode=phase.mode,
            phase=phase.name,
            session=plan.name,
            turn=i,
            history=history,
            prompt=len(prompt),
            t_ready=time.time(),
        )
        while True:
            turn.attempts += 1
            turn.t_attempt, turn.t_first, turn.reply = time.time(), 0.0, []
            try:
                await bal.run(http, turn, prompt, p.reply_tokens)
                break
            except (httpx.HTTPError, TurnFailed, KeyError, ValueError) as e:
                turn.errors.append(f"attempt {turn.attempts}: {type(e).__name__}: {str(e)[:300]}")
                if time.time() - turn.t_ready > phase.retry_for_s:
                    raise TurnFailed(f"{plan.name} turn {i}: {turn.errors}") from e
                await asyncio.sleep(0.05)
        phase.done(turn)
        state.history = prompt + turn.reply
        state.next_turn += 1


async def drive(
    bal: Balancer, sessions: list[SessionPlan], states: dict[str, SessionState], upto: int, phase: Phase
) -> float:
    """Every session's turns up to `upto`, concurrently; returns the makespan in seconds."""
    t0 = time.time()
    async with llama_client() as http:
        by_name = {s.name: s for s in sessions}

        def one_more(name: str) -> asyncio.Task[None]:
            state = states[name]
            return asyncio.create_task(
                run_session(bal, http, by_name[name], state, state.next_turn + 1, phase, start_s=0.0)
            )

        phase.one_more = one_more
        await asyncio.gather(*(run_session(bal, http, s, states[s.name], upto, phase) for s in sessions))
        if phase.kill_task is not None:
            await phase.kill_task
        await asyncio.gather(*phase.extra)
    return time.time() - t0


# measurements -----------------------------------------------------------------------------------------
def parse_metrics(text: str) -> dict[str, float]:
    """kvsidecar_* samples of a Prometheus text page, summed over labels."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line.startswith("kvsidecar_"):
            continue
        name_labels, _, value = line.rpartition(" ")
        name = name_labels.split("{", 1)[0]
        if name.endswith(("_bucket", "_created")):
            continue
        with contextlib.suppress(ValueError):
            out[name] = out.get(name, 0.0) + float(value)
    return out


def scrape(host: FleetHost) -> dict[str, float]:
    r = httpx.get(f"{host.url}/metrics", headers=host.auth, timeout=10)
    r.raise_for_status()
    return parse_metrics(r.text)


def delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    return {k: v - before.get(k, 0.0) for k, v in after.items() if v - before.get(k, 0.0)}


def summarize(turns: list[Turn], makespan_s: float, metrics: dict[str, float] | None) -> dict[str, Any]:
    later = [t for t in turns if t.turn > 0]
    reuse = Counter(t.reuse for t in later)
    ttft = [t.ttft_ms for t in turns]
    ttft_later = [t.ttft_ms for t in later]
    by_session: dict[str, list[Turn]] = {}
    for t in sorted(turns, key=lambda t: (t.session, t.turn)):
        by_session.setdefault(t.session, []).append(t)
    moves = sum(1 for ts in by_session.values() for a, b in itertools.pairwise(ts) if a.host != b.host)
    out: dict[str, Any] = {
        "turns": len(turns),
        "later_turns": len(later),
        "hit": reuse["full"],
        "partial": reuse["partial"],
        "none": reuse["none"],
        "hit_rate": reuse["full"] / len(later) if later else float("nan"),
        "history_tokens": sum(t.history for t in later),
        "history_reused": sum(min(t.cache_n, t.history) for t in later),
        "ttft_ms": {"p50": statistics.median(ttft), "p95": pct(ttft, 95), "n": len(ttft)},
        "ttft_later_ms": {
            "p50": statistics.median(ttft_later),
            "p95": pct(ttft_later, 95),
            "n": len(ttft_later),
        },
        "prompt_ms_later": {
            "p50": statistics.median([t.prompt_ms for t in later]) if later else float("nan")
        },
        "host_moves": moves,
        "makespan_s": makespan_s,
        "errors": sum(len(t.errors) for t in turns),
        "outcomes": dict(Counter(t.outcome for t in turns if t.outcome)),
    }
    if metrics is not None:
        out["save_bytes"] = metrics.get("kvsidecar_save_bytes_total", 0.0)
        out["restore_bytes"] = metrics.get("kvsidecar_restore_bytes_total", 0.0)
        out["metrics"] = metrics
    return out


def failover_records(turns: list[Turn], victims: list[str], t_kill: float) -> list[dict[str, Any]]:
    """Each of the dead host's sessions: its first turn that succeeded after the kill."""
    out: list[dict[str, Any]] = []
    for s in victims:
        after = sorted((t for t in turns if t.session == s and t.t_end > t_kill), key=lambda t: t.t_end)
        if not after:
            out.append({"session": s, "turn": None})
            continue
        t = after[0]
        out.append(
            {
                "session": s,
                "turn": t.turn,
                "in_flight_at_kill": t.t_ready < t_kill,
                "attempts": t.attempts,
                "errors": t.errors,
                "acquired_after_s": t.t_acquired - t_kill,
                "first_token_after_s": t.t_first - t_kill,
                "done_after_s": t.t_end - t_kill,
                "ttft_ms": t.ttft_ms,
                "host": t.host,
                "called": t.called,
                "outcome": t.outcome,
                "restored_tokens": t.restored_tokens,
                "history": t.history,
                "cache_n": t.cache_n,
                "prompt_n": t.prompt_n,
                "prompt_ms": t.prompt_ms,
                "reuse": t.reuse,
            }
        )
    return out


# the modes --------------------------------------------------------------------------------------------
def llama_args(p: Params, cache_ram_mib: int) -> tuple[str, ...]:
    # LlamaServer passes --threads 2 first: a second --threads overrides it
    return ("--cache-ram", str(cache_ram_mib), "--threads", str(p.threads))


async def run_round_robin(
    binary: Path, model: Path, work: Path, p: Params, sessions: list[SessionPlan], mode: str
) -> dict[str, Any]:
    cache_ram = p.cache_ram_mib if mode == "rr-cache-ram" else 0
    servers = [
        LlamaServer(
            binary=binary,
            model=model,
            slot_save_path=None,
            log_path=work / mode / f"h{i + 1}" / "llama.log",
            ctx_size=p.ctx_per_slot * p.parallel,
            parallel=p.parallel,
            extra_args=llama_args(p, cache_ram),
        )
        for i in range(p.hosts)
    ]
    try:
        await asyncio.gather(*(asyncio.to_thread(s.start) for s in servers))
        states = {s.name: SessionState(list(s.history)) for s in sessions}
        phase = Phase(mode, "measured", p, retry_for_s=0.0)
        makespan = await drive(RoundRobin([s.base_url for s in servers]), sessions, states, p.turns, phase)
    finally:
        for s in servers:
            s.stop()
    return {"mode": mode, "llama_flags": " ".join(llama_args(p, cache_ram)), **collect(phase, makespan, None)}


def collect(phase: Phase, makespan: float, metrics: dict[str, float] | None) -> dict[str, Any]:
    return {"summary": summarize(phase.turns, makespan, metrics), "turns": [t.record() for t in phase.turns]}


async def run_fleet(
    binary: Path, model: Path, work: Path, p: Params, sessions: list[SessionPlan]
) -> dict[str, Any]:
    redis = RedisServer(work / "fleet" / "redis").start()
    try:
        fleet = LocalFleet(
            work / "fleet",
            redis.url,
            binary=binary,
            model=model,
            n_hosts=p.hosts,
            parallel=p.parallel,
            ctx_size=p.ctx_per_slot * p.parallel,
            extra_args=llama_args(p, 0),
            fleet={},  # the daemon's own heartbeat, host TTL and owner lease TTL, as a deployment has them
            daemon_overrides={
                "servers": {
                    "local": {"mode": "managed-slots", "persist_timeout_s": 600, "request_timeout_s": 120}
                },
                "logging": {"level": "info", "format": "json"},
            },
        )
        with fleet:
            await asyncio.to_thread(fleet.wait_live)
            return await fleet_phases(fleet, p, sessions)
    finally:
        redis.stop()


async def fleet_phases(fleet: LocalFleet, p: Params, sessions: list[SessionPlan]) -> dict[str, Any]:
    router = FleetRouter(fleet.hosts, random.Random(p.seed))
    states = {s.name: SessionState(list(s.history)) for s in sessions}
    try:
        before = {h.host_id: await asyncio.to_thread(scrape, h) for h in fleet.hosts}
        measured = Phase("fleet", "measured", p, retry_for_s=0.0)
        makespan = await drive(router, sessions, states, p.turns, measured)
        after = {h.host_id: await asyncio.to_thread(scrape, h) for h in fleet.hosts}
        metrics: dict[str, float] = {}
        for h in fleet.hosts:
            for k, v in delta(before[h.host_id], after[h.host_id]).items():
                metrics[k] = metrics.get(k, 0.0) + v
        result: dict[str, Any] = {
            "mode": "fleet",
            "llama_flags": " ".join(llama_args(p, 0)),
            "fleet_config": fleet_timing(),
            **collect(measured, makespan, metrics),
        }
        result["failover"] = await failover_phase(fleet, router, p, sessions, states)
    finally:
        await router.aclose()
    return result


async def failover_phase(
    fleet: LocalFleet,
    router: FleetRouter,
    p: Params,
    sessions: list[SessionPlan],
    states: dict[str, SessionState],
) -> dict[str, Any]:
    phase = Phase("fleet", "failover", p, retry_for_s=120.0)
    phase.kill_at = p.kill_after
    info: dict[str, Any] = {}
    upto = p.turns + p.failover_turns
    leader_before = await asyncio.to_thread(leader_of, fleet.hosts)

    async def kill() -> None:
        load = Counter(router.last_host.values())
        victim = fleet.host(max(sorted(load), key=lambda h: load[h]))
        victims = sorted(s for s, h in router.last_host.items() if h == victim.host_id)
        info.update(victim=victim.host_id, victims=victims, sessions_per_host=dict(load))
        info["victim_metrics_before_kill"] = await asyncio.to_thread(scrape, victim)
        info["t_kill"] = time.time()
        await asyncio.to_thread(victim.kill)
        info["kill_took_s"] = time.time() - info["t_kill"]
        for s in victims:
            states[s].wake.set()
            if states[s].next_turn >= upto and phase.one_more is not None:
                phase.extra.append(phase.one_more(s))

    phase.on_kill = kill
    makespan = await drive(router, sessions, states, upto, phase)
    if "t_kill" not in info:
        raise RuntimeError(f"the kill never happened: {len(phase.turns)} turns < kill_after {p.kill_after}")
    t_kill = info["t_kill"]
    survivors = [h for h in fleet.hosts if h.host_id != info["victim"]]
    info["leader_before"], info["leader_after"] = (
        leader_before,
        await asyncio.to_thread(leader_of, survivors),
    )
    info["records"] = failover_records(phase.turns, info["victims"], t_kill)
    after_kill = [t for t in phase.turns if t.t_ready >= t_kill or t.t_end > t_kill]
    info["after_kill"] = summarize(after_kill, makespan, None) if after_kill else {}
    info["turns"] = [t.record() | {"t_kill_offset_s": t.t_ready - t_kill} for t in phase.turns]
    info["victim_metrics_before_kill"] = {
        k: v for k, v in info["victim_metrics_before_kill"].items() if k.startswith("kvsidecar_fleet")
    }
    info["survivor_fleet_metrics"] = {
        h.host_id: {
            k: v for k, v in (await asyncio.to_thread(scrape, h)).items() if k.startswith("kvsidecar_fleet")
        }
        for h in survivors
    }
    return info


def fleet_timing() -> dict[str, float]:
    defaults = FleetConfig()
    return {k: float(getattr(defaults, k)) for k in ("heartbeat_s", "host_ttl_s", "owner_lease_ttl_s")}


def leader_of(hosts: list[FleetHost]) -> str | None:
    """The host whose status says it holds the fleet's leader lease."""
    for host in hosts:
        r = httpx.get(f"{host.url}/v1/status", headers=host.auth, timeout=10)
        r.raise_for_status()
        if (r.json().get("fleet") or {}).get("leader") is True:
            return host.host_id
    return None


# the report -------------------------------------------------------------------------------------------
def fmt_ms(v: float) -> str:
    return f"{v:,.0f}"


def mb(v: float | None) -> str:
    return "-" if v is None else f"{v / 1e6:,.0f}"


def section(d: dict[str, Any]) -> list[str]:
    """The docs/BENCHMARKS.md section for a result of this script."""
    p, m = d["params"], d["machine"]
    rows = {r["mode"]: r for r in d["modes"]}
    fs = rows["fleet"]["summary"]
    rr, rc = rows["round-robin"]["summary"], rows["rr-cache-ram"]["summary"]
    label = {
        "fleet": "kvsidecar fleet routing",
        "round-robin": "round-robin, `--cache-ram 0`",
        "rr-cache-ram": f"round-robin, `--cache-ram {p['cache_ram_mib']}`",
    }
    lines = [
        "## Fleet routing vs round-robin over three hosts (generated 4-layer model)",
        "",
        f"Machine: {m['cpu']}, {m['cores']} cores, {m['date']}; `bench/bench_fleet.py`, "
        f"{d['elapsed_s'] / 60:.1f} minutes. Three hosts on one machine (`kvsidecar.testing.fleet.LocalFleet`), "
        f"each a llama-server (`--parallel {p['parallel']} --ctx-size {p['ctx_per_slot'] * p['parallel']:,} "
        f"--threads {p['threads']}`; the generated 4-layer, 256-wide llama with a 16K context) and, in the fleet "
        f"mode, a kvsidecar (its default fleet timings), with one shared snapshot directory and one Redis. "
        f"{p['sessions']} agent sessions on {p['hosts'] * p['parallel']} slots: histories start at "
        f"{p['history'][0]:,}-{p['history'][1]:,} tokens, each turn appends {p['new_tokens'][0]}-"
        f"{p['new_tokens'][1]} tokens plus the previous {p['reply_tokens']}-token reply, {p['turns']} turns per "
        f"session, think time lognormal with mean {p['think_mean_s']:g} s, starts spread over "
        f"{p['start_spread_s']:g} s; the same tokens and times in every mode (seeded). Fleet: the harness "
        "acquires at a random host's kvsidecar, sends the model call to the answer's `base_url` with `id_slot` "
        "and releases with llama-server's timings. Round-robin: each request goes to the next llama-server, "
        "without `id_slot`.",
        "",
        "Hit: a turn after a session's first whose history was not prefilled (llama-server's `cache_n` covers "
        f"the history it carries, within {HIT_SLACK} tokens); partial: part of it was reused. TTFT: streamed, "
        "from the turn being ready (before the acquire, or the balancer's pick) to the first chunk, over the "
        "turns after the first (first turns are cold in every mode); prefill: llama-server's `prompt_ms` of the "
        "same turns. MB: snapshot bytes written and read (the kvsidecars' `/metrics`); llama-server's RAM cache "
        "copies within its own memory, which nothing here counts.",
        "",
        "| mode | hit rate | partial | history tokens reused | TTFT p50 (ms) | TTFT p95 (ms) | prefill p50 (ms) "
        "| turns on another host than the last | MB written | MB read | makespan (s) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for mode in MODES:
        s = rows[mode]["summary"]
        lines.append(
            f"| {label[mode]} | {s['hit_rate']:.0%} ({s['hit']}/{s['later_turns']}) | {s['partial']} "
            f"| {s['history_reused'] / max(1, s['history_tokens']):.0%} | {fmt_ms(s['ttft_later_ms']['p50'])} "
            f"| {fmt_ms(s['ttft_later_ms']['p95'])} | {fmt_ms(s['prompt_ms_later']['p50'])} "
            f"| {s['host_moves']} | {mb(s.get('save_bytes'))} | {mb(s.get('restore_bytes'))} "
            f"| {s['makespan_s']:.0f} |"
        )
    out = fs["outcomes"]
    later_cold = out.get("cold", 0) + out.get("cold_fallback", 0) - p["sessions"]
    lines += [
        "",
        f"**TTFT p50, round-robin / fleet: {ratio(rr, fs)}; round-robin with the RAM cache / fleet: "
        f"{ratio(rc, fs)}** (same run).",
        "",
        f"Fleet acquires: {out.get('restored', 0)} restored from the shared directory, {out.get('resident', 0)} "
        f"resident, {out.get('cold', 0)} cold ({p['sessions']} of them first turns, {later_cold} "
        f"later turn{'' if later_cold == 1 else 's'}); "
        f"with {p['sessions']} sessions on {p['hosts'] * p['parallel']} slots most hits are restores: "
        f"{fs.get('save_bytes', 0) / 1e6 / fs['turns']:.1f} MB written and "
        f"{fs.get('restore_bytes', 0) / 1e6 / fs['turns']:.1f} MB read per turn. Round-robin reuses a history only "
        "when a request lands on the host and slot that still hold it; the RAM cache adds each host's earlier "
        "copies, often a turn old (partial). TTFT beyond the prefill is waiting: the round-robin servers spend "
        "their time prefilling histories, so requests queue.",
        "",
    ]
    lines += section_failover(rows["fleet"]["failover"])
    return lines


def ratio(a: dict[str, Any], b: dict[str, Any]) -> str:
    return f"{a['ttft_later_ms']['p50'] / b['ttft_later_ms']['p50']:.1f}x"


def error_kinds(records: list[dict[str, Any]]) -> str:
    """The failed calls of the dead host's sessions' next turns, by kind."""
    kinds: Counter[str] = Counter()
    for r in records:
        for e in r.get("errors") or []:
            if "ConnectError" in e:
                kinds["connection to the dead kvsidecar refused"] += 1
            elif e.startswith("release") and " 404 " in e:
                kinds["release of the cut turn answered 404 (its lease died with the host)"] += 1
            elif e.startswith("attempt"):
                kinds["model call cut by the kill"] += 1
            elif e.startswith("acquire") and " 500 " in e:
                kinds["acquire answered 500 by a surviving kvsidecar"] += 1
            elif e.startswith("acquire"):
                kinds["acquire cut by the kill"] += 1
            else:
                kinds["other"] += 1
    return "; ".join(f"{k}: {v}" for k, v in kinds.most_common()) or "none"


def section_failover(f: dict[str, Any]) -> list[str]:
    recs = [r for r in f["records"] if r.get("turn") is not None]
    cfg = f.get("fleet_config") or {}
    lines = [
        "### Failover (fleet mode)",
        "",
        f"After the measured turns the sessions went on; once {f.get('kill_after', '?')} more turns had "
        f"completed, host {f['victim']} (the host that had served the last turn of the most sessions: "
        f"{len(f['victims'])}) lost its llama-server and its kvsidecar (SIGKILL both). Its sessions' think time "
        "was cut short, so each issued its next turn at once; a turn in flight on it failed and was retried, "
        "the harness trying another kvsidecar when one did not answer. Times are from the kill; failed calls: "
        "the calls of that turn that failed. Leader before the kill: "
        f"{f['leader_before']}, after: {f['leader_after']}.",
        "",
        "| session | at the kill | failed calls | lease after (s) | first token after (s) | done after (s) "
        "| served by | outcome | history reused | prefill (ms) |",
        "|---|---|---:|---:|---:|---:|---|---|---:|---:|",
    ]
    for r in recs:
        lines.append(
            f"| {r['session']} | {'in flight' if r['in_flight_at_kill'] else 'thinking'} | {len(r['errors'])} "
            f"| {r['acquired_after_s']:.2f} | {r['first_token_after_s']:.2f} | {r['done_after_s']:.2f} "
            f"| {r['host']} | {r['outcome']} | {min(r['cache_n'], r['history']):,} / {r['history']:,} "
            f"| {fmt_ms(r['prompt_ms'])} |"
        )
    if recs:
        firsts = [r["first_token_after_s"] for r in recs]
        full = sum(1 for r in recs if r["reuse"] == "full")
        timing = (
            f" (fleet heartbeat {cfg['heartbeat_s']:g} s, host TTL {cfg['host_ttl_s']:g} s, owner lease TTL "
            f"{cfg['owner_lease_ttl_s']:g} s)"
            if cfg
            else ""
        )
        lines += [
            "",
            f"From the kill to each of its sessions' next first token: median {statistics.median(firsts):.2f} s, "
            f"max {max(firsts):.2f} s{timing}; {full} of {len(recs)} came back with their whole history (restored "
            f"from its last saved generation on another host), {len(recs) - full} recomputed some or all of it. "
            f"Failed calls by kind: {error_kinds(recs)}.",
        ]
    missing = [r["session"] for r in f["records"] if r.get("turn") is None]
    if missing:
        lines.append(f"Sessions with no successful turn after the kill: {', '.join(missing)}.")
    lines.append("")
    return lines


# main -------------------------------------------------------------------------------------------------
@contextlib.contextmanager
def workdir(keep: Path | None) -> Iterator[Path]:
    if keep is not None:
        keep.mkdir(parents=True, exist_ok=True)
        yield keep
        return
    with tempfile.TemporaryDirectory(prefix="bench-fleet-") as tmp:
        yield Path(tmp)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0] if __doc__ else None)
    ap.add_argument("--quick", action="store_true", help="6 sessions, short histories, 2 turns")
    ap.add_argument("--modes", default=",".join(MODES), help="comma-separated subset of " + ",".join(MODES))
    ap.add_argument("--workdir", type=Path, help="keep the servers' files and logs here")
    args = ap.parse_args(argv)
    p = QUICK if args.quick else FULL
    modes = [m for m in args.modes.split(",") if m]
    if unknown := set(modes) - set(MODES):
        ap.error(f"unknown modes: {sorted(unknown)}")
    binary = llama_server_binary()
    model = generate_llama_model(MODEL_SHAPE, vocab_dir=vocab_dir(binary))
    sessions = plans(p)
    started = time.time()
    results: list[dict[str, Any]] = []
    with workdir(args.workdir) as work:
        for mode in modes:
            t0 = time.time()
            if mode == "fleet":
                r = asyncio.run(run_fleet(binary, model, work, p, sessions))
                r["failover"]["fleet_config"] = r["fleet_config"]
                r["failover"]["kill_after"] = p.kill_after
            else:
                r = asyncio.run(run_round_robin(binary, model, work, p, sessions, mode))
            s = r["summary"]
            print(
                f"{mode}: hit {s['hit']}/{s['later_turns']}, partial {s['partial']}, "
                f"TTFT p50 {s['ttft_later_ms']['p50']:,.0f} ms p95 {s['ttft_later_ms']['p95']:,.0f} ms, "
                f"makespan {s['makespan_s']:.0f} s, errors {s['errors']} ({time.time() - t0:.0f} s)",
                file=sys.stderr,
            )
            results.append(r)
    data: dict[str, Any] = {
        "params": asdict(p) | {"ctx_per_slot": p.ctx_per_slot},
        "model": {"shape": asdict(MODEL_SHAPE), "file": model.name},
        "modes": results,
        "elapsed_s": time.time() - started,
    }
    path = write("fleet-quick" if args.quick else "fleet", data)
    print(path)
    if set(modes) == set(MODES):
        print("\n".join(section(json.loads(path.read_text()))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
