"""What knowing a prompt's tokens before it runs costs (docs/MODELS.md, "Knowing a prompt's tokens").

A real llama-server (the generated 4-layer llama, its real tokenizer, `--jinja` with llama.cpp's
Qwen3-Coder.jinja, `--threads 2`). For prompts of about 1K, 10K and 50K tokens:

- a completion prompt: `request_tokens` on `/completion` (one `/tokenize`);
- a chat body (a system prompt, tools, a conversation of user/assistant turns): `request_tokens` on
  `/v1/chat/completions` (`/apply-template`, then `/tokenize`), and each call alone;
- a Responses body of the same conversation: the conversion, then the same two calls.

With each figure, the CPU time llama-server itself spent per prediction (its utime + stime from /proc, over
all rounds): what a prediction takes from a generation that shares the cores, whatever else loads the box.

Then whether the calls slow a generation running beside them: `/tokenize` and `/apply-template` run on
llama-server's HTTP threads, not in its slot loop, so they share the CPU with the decode. A 256-token
generation on slot 0 is timed (llama-server's own `timings`), alternately, `--rounds` times each: alone,
with one 50K-token chat prediction made as it starts (what one proxied turn adds), and with predictions
back to back (the worst case).
"""

from __future__ import annotations

import argparse
import asyncio
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

from kvsidecar.backend.llamacpp import LlamaCppBackend
from kvsidecar.backend.prompts import KnownTokens
from kvsidecar.proxy.prompt_tokens import request_tokens
from kvsidecar.proxy.responses_chat import responses_to_chat
from kvsidecar.testing.llama import LlamaServer, llama_server_binary, vocab_dir, words
from kvsidecar.testing.models import TINY, chat_template, generate_llama_model

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": f"tool_{i}",
            "description": f"tool number {i}",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string"}},
                "required": ["path"],
            },
        },
    }
    for i in range(8)
]


_TOKENS_PER_WORD = 1.6  # words() with this vocabulary, measured; the results carry the exact counts


def chat_of(n_tokens: int) -> dict[str, Any]:
    """A conversation of about `n_tokens`: a system prompt (a fifth), then user/assistant turns of about
    1,000 tokens each, the tools (about 500 tokens) and a last user message."""
    budget = int(n_tokens / _TOKENS_PER_WORD)
    messages: list[dict[str, Any]] = [{"role": "system", "content": words("sys", budget // 5)}]
    turns = max(1, (budget - budget // 5 - 300) // 600)
    per = max(4, (budget - budget // 5 - 300) // (2 * turns))
    for t in range(turns):
        messages.append({"role": "user", "content": words(f"u{t}", per)})
        messages.append({"role": "assistant", "content": words(f"a{t}", per)})
    messages.append({"role": "user", "content": "and now?"})
    return {"messages": messages, "tools": TOOLS}


def responses_of(chat: dict[str, Any]) -> dict[str, Any]:
    items: list[dict[str, Any]] = []
    for m in chat["messages"][1:]:
        kind = "output_text" if m["role"] == "assistant" else "input_text"
        items.append(
            {"type": "message", "role": m["role"], "content": [{"type": kind, "text": m["content"]}]}
        )
    tools = [{"type": "function", **t["function"]} for t in chat["tools"]]
    return {"instructions": chat["messages"][0]["content"], "input": items, "tools": tools}


def server_cpu_ms(pid: int) -> float:
    """The CPU time (user + system) the process has used so far, in ms."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000.0 / os.sysconf("SC_CLK_TCK")


async def timed(
    backend: LlamaCppBackend, path: str, data: dict[str, Any], rounds: int, pid: int
) -> dict[str, Any]:
    costs, n = [], 0
    cpu = server_cpu_ms(pid)
    for _ in range(rounds):
        result = await request_tokens(backend, path, data)
        assert isinstance(result, KnownTokens), result
        costs.append(result.cost_ms)
        n = len(result.tokens)
    return {"tokens": n, "ms": summary(costs), "server_cpu_ms": (server_cpu_ms(pid) - cpu) / rounds}


async def each_call(backend: LlamaCppBackend, chat: dict[str, Any], rounds: int) -> dict[str, Any]:
    render, tokenize = [], []
    for _ in range(rounds):
        started = time.perf_counter()
        prompt = await backend.apply_template(chat)
        render.append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        await backend.tokenize(prompt, add_special=True, parse_special=True)
        tokenize.append((time.perf_counter() - started) * 1000)
    return {
        "apply_template_ms": summary(render),
        "tokenize_ms": summary(tokenize),
        "prompt_chars": len(prompt),
    }


async def sizes(backend: LlamaCppBackend, rounds: int, pid: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for size in (1000, 10_000, 50_000):
        chat = chat_of(size)
        responses = responses_of(chat)
        text = words("completion", int(size / _TOKENS_PER_WORD))
        started = time.perf_counter()
        responses_to_chat(responses)
        convert_ms = (time.perf_counter() - started) * 1000
        out[str(size)] = {
            "completion": await timed(backend, "/completion", {"prompt": text}, rounds, pid),
            "chat": {
                **await timed(backend, "/v1/chat/completions", chat, rounds, pid),
                **await each_call(backend, chat, rounds),
            },
            "responses": {
                **await timed(backend, "/v1/responses", responses, rounds, pid),
                "conversion_ms": convert_ms,
            },
        }
        row = {
            k: (v["tokens"], round(v["ms"]["p50"], 1), round(v["server_cpu_ms"], 1))
            for k, v in out[str(size)].items()
        }
        print(size, row, flush=True)
    return out


async def generation(base_url: str) -> tuple[float, float]:
    """A 256-token generation on slot 0: (tokens per second, ms) of its decode, as llama-server times it."""
    body = {
        "prompt": words("gen", 400),
        "n_predict": 256,
        "id_slot": 0,
        "temperature": 0,
        "cache_prompt": False,
    }
    body["ignore_eos"] = True
    async with httpx.AsyncClient(timeout=600) as c:
        r = await c.post(f"{base_url}/completion", json=body)
        r.raise_for_status()
        timings = r.json()["timings"]
        return float(timings["predicted_per_second"]), float(timings["predicted_ms"])


async def beside(backend: LlamaCppBackend, base_url: str, rounds: int) -> dict[str, Any]:
    """A generation alone; with one 50K-token chat prediction made as it starts (what one proxied turn
    adds); and with predictions back to back for its whole length (the worst case)."""
    chat = chat_of(50_000)
    alone: list[tuple[float, float]] = []
    one: list[tuple[float, float]] = []
    loaded: list[tuple[float, float]] = []
    predictions = 0

    async def hammer(stop: asyncio.Event) -> None:
        nonlocal predictions
        while not stop.is_set():
            await request_tokens(backend, "/v1/chat/completions", chat)
            predictions += 1

    await generation(base_url)  # warm
    for _ in range(rounds):
        alone.append(await generation(base_url))
        running = asyncio.create_task(generation(base_url))
        await request_tokens(backend, "/v1/chat/completions", chat)
        one.append(await running)
        stop = asyncio.Event()
        task = asyncio.create_task(hammer(stop))
        loaded.append(await generation(base_url))
        stop.set()
        await task
    return {
        "alone_tps": summary([t for t, _ in alone]),
        "one_prediction_tps": summary([t for t, _ in one]),
        # the decode's extra time, pair by pair (each pair ran back to back: the box's load mostly cancels)
        "one_prediction_extra_ms": summary([b - a for (_, a), (_, b) in zip(alone, one, strict=True)]),
        "back_to_back_tps": summary([t for t, _ in loaded]),
        "back_to_back_slowdown": 1
        - statistics.median(t for t, _ in loaded) / statistics.median(t for t, _ in alone),
        "predictions_back_to_back": predictions,
    }


async def run(work: Path, rounds: int, beside_only: bool) -> dict[str, Any]:
    binary = llama_server_binary()
    model = generate_llama_model(TINY, vocab_dir=vocab_dir(binary))
    extra = ("--cache-ram", "0", "--jinja", "--chat-template-file", str(chat_template("Qwen3-Coder.jinja")))
    server = LlamaServer(
        binary=binary, model=model, slot_save_path=None, log_path=work / "llama.log", extra_args=extra
    ).start()
    backend = LlamaCppBackend(base_url=server.base_url, request_timeout_s=120)
    try:
        measured = {} if beside_only else {"sizes": await sizes(backend, rounds, server.pid)}
        return {**measured, "beside_generation": await beside(backend, server.base_url, rounds)}
    finally:
        await backend.aclose()
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--beside-only", action="store_true", help="only the generation beside predictions")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = asyncio.run(run(Path(tmp), args.rounds, args.beside_only))
    print(write("prompt_tokens_beside" if args.beside_only else "prompt_tokens", data))
    print(data["beside_generation"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
