"""Two sessions taking turns on one slot, through the proxy or on llama-server alone, for the tests and the
benchmark of what each memory class starts from (tests/integration/test_plan_classes_real.py,
bench/bench_plan_classes.py): chat completions with a long system prompt per session, a few turns each,
the assistant's replies sent back verbatim; the prompt tokens llama-server computed, turn by turn."""

from __future__ import annotations

import time
from dataclasses import dataclass, replace
from pathlib import Path

import httpx

from kvsidecar.testing.arch_models import ARCH_SHAPES, generate_arch_model
from kvsidecar.testing.llama import LlamaServer, vocab_dir, words
from kvsidecar.testing.models import chat_template

TEMPLATE = "Qwen3-Coder.jinja"  # llama.cpp's own (the agent-client tests use it too)
# llama.cpp's Qwen3 thinking template: an assistant message's `reasoning_content` is rendered only after the
# last user message, so a turn's reasoning is gone from the next turn's history
THINKING_TEMPLATE = "Qwen-Qwen3-0.6B.jinja"


@dataclass(frozen=True)
class Script:
    system_words: int = 600  # about 1,500 tokens of system prompt per session
    user_words: int = 40
    turns: int = 3  # per session
    max_tokens: int = 8
    sessions: tuple[str, ...] = ("A", "B")
    # the reply travels back as `reasoning_content` with a short `content`, as a thinking model's client
    # sends it; THINKING_TEMPLATE drops it from the next turn's history (the prompt diverges right after the
    # last assistant message's header, where the point at the prompt's end stops)
    reasoning: bool = False


@dataclass(frozen=True)
class Turn:
    session: str
    turn: int
    computed: int  # timings.prompt_n
    reused: int  # timings.cache_n
    headers: dict[str, str]
    ttft_s: float = 0.0  # the request's wall time less llama-server's generation time (timings.predicted_ms)


@dataclass(frozen=True)
class ClassCase:
    label: str
    arch: str | None  # a generated model of kvsidecar.testing.arch_models (None: the plain tiny model)
    flags: tuple[str, ...] = ()


CLASSES = (
    ClassCase("plain", None),
    ClassCase("hybrid-qwen35", "qwen35"),
    ClassCase("hybrid-mamba2", "granitehybrid"),
    ClassCase("swa-full", "gemma3-swa", ("--swa-full",)),
    ClassCase("swa", "gemma3-swa"),
)


def model_for(case: ClassCase, llama_bin: Path, plain: Path) -> Path:
    if case.arch is None:
        return plain
    return generate_arch_model(replace(ARCH_SHAPES[case.arch]), vocab_dir=vocab_dir(llama_bin))


def server(
    llama_bin: Path,
    model: Path,
    tmp: Path,
    label: str,
    flags: tuple[str, ...],
    *,
    ctx: int = 4096,
    template: str = TEMPLATE,
) -> LlamaServer:
    """llama-server with its defaults (the RAM cache on), one slot, the chat template, `/metrics`, `flags`."""
    return LlamaServer(
        binary=llama_bin,
        model=model,
        slot_save_path=tmp / f"snapshots-{label}",
        log_path=tmp / f"llama-{label}.log",
        ctx_size=ctx,
        parallel=1,
        extra_args=("--jinja", "--chat-template-file", str(chat_template(template)), "--metrics", *flags),
    )


def prompt_tokens_total(llama: LlamaServer) -> int:
    """Every prompt token this llama-server process computed, its own counter (`llamacpp:prompt_tokens_total`
    on `/metrics`, tools/server/server-task.cpp): requests, kvsidecar's prefills and hand-offs alike. It
    starts from 0 with each process: read it before a restart."""
    r = httpx.get(f"{llama.base_url}/metrics", timeout=30)
    assert r.status_code == 200, r.text[:200]
    for line in r.text.splitlines():
        name, _, value = line.partition(" ")
        if name == "llamacpp:prompt_tokens_total":
            return int(float(value))
    raise AssertionError(f"no llamacpp:prompt_tokens_total in /metrics: {r.text[:400]}")


class Driver:
    """The sessions' conversations, one turn at a time (a test can restart llama-server between two)."""

    def __init__(
        self, script: Script, *, headers: dict[str, str] | None = None, session_ids: bool = False
    ) -> None:
        self.script, self.headers, self.session_ids = script, headers, session_ids
        self.convos = {
            s: [{"role": "system", "content": words(f"system-{s}-", script.system_words)}]
            for s in script.sessions
        }

    def turn(self, base_url: str, session: str, t: int) -> Turn:
        convo = self.convos[session]
        convo.append({"role": "user", "content": words(f"{session}-turn{t}-", self.script.user_words)})
        h = dict(self.headers or {})
        if self.session_ids:
            h["X-Session-Id"] = session
        body = {"model": "tiny", "messages": convo, "max_tokens": self.script.max_tokens, "temperature": 0}
        started = time.perf_counter()
        r = httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=h, timeout=600)
        wall = time.perf_counter() - started
        assert r.status_code == 200, r.text[:500]
        data = r.json()
        reply = data["choices"][0]["message"].get("content") or "."
        if self.script.reasoning:
            convo.append({"role": "assistant", "content": f"Done {t}.", "reasoning_content": reply})
        else:
            convo.append({"role": "assistant", "content": reply})
        timings = data["timings"]
        kv = {k.lower(): v for k, v in r.headers.items() if k.lower().startswith("x-kv-")}
        # a save point taken at the prompt's end first computed the prompt but its last token; the request's own
        # timings count only that one and reuse the rest (X-KV-Prompt-Point-Computed says what was computed)
        point = int(kv.get("x-kv-prompt-point-computed", 0))
        ttft = wall - float(timings.get("predicted_ms", 0.0)) / 1000
        return Turn(session, t, int(timings["prompt_n"]) + point, int(timings["cache_n"]) - point, kv, ttft)


def run_script(
    base_url: str, script: Script, *, headers: dict[str, str] | None = None, session_ids: bool = False
) -> list[Turn]:
    """The sessions take turns (A1 B1 A2 B2 ...); each reply goes back into its conversation."""
    driver = Driver(script, headers=headers, session_ids=session_ids)
    return [driver.turn(base_url, s, t) for t in range(script.turns) for s in script.sessions]


def computed(turns: list[Turn]) -> int:
    return sum(t.computed for t in turns)
