"""What knowing a prompt's tokens before it runs costs (docs/MODELS.md, "Knowing a prompt's tokens").

A real llama-server (the generated 4-layer llama, its real tokenizer, `--jinja` with llama.cpp's
Qwen3-Coder.jinja, `--threads 2`). For prompts of about 1K, 10K and 50K tokens:

- a completion prompt: `request_tokens` on `/completion` (one `/tokenize`);
- a chat body (a system prompt, tools, a conversation of user/assistant turns): `request_tokens` on
  `/v1/chat/completions` (`/apply-template`, then `/tokenize`), and each call alone;
- a Responses body of the same conversation: the conversion, then the same two calls.

Then whether the calls slow a generation running beside them: `/tokenize` and `/apply-template` run on
llama-server's HTTP threads, not in its slot loop, so they share the CPU with the decode. A 256-token
generation on slot 0 is timed alone and with a 50K-token chat prediction running in a loop beside it
(llama-server's own `timings.predicted_per_second`), alternately, `--rounds` times each.
"""

from __future__ import annotations

import argparse
import asyncio
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


def chat_of(n_tokens: int) -> dict[str, Any]:
    """A conversation of about `n_tokens` (words() gives about one token per word-ish piece)."""
    turns = max(1, n_tokens // 500)
    messages: list[dict[str, Any]] = [{"role": "system", "content": words("sys", 400)}]
    for t in range(turns):
        messages.append({"role": "user", "content": words(f"u{t}", 250)})
        messages.append({"role": "assistant", "content": words(f"a{t}", 250)})
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


async def timed(
    backend: LlamaCppBackend, path: str, data: dict[str, Any], rounds: int
) -> tuple[list[float], int]:
    costs, n = [], 0
    for _ in range(rounds):
        result = await request_tokens(backend, path, data)
        assert isinstance(result, KnownTokens), result
        costs.append(result.cost_ms)
        n = len(result.tokens)
    return costs, n


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


async def sizes(backend: LlamaCppBackend, rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for size in (1000, 10_000, 50_000):
        chat = chat_of(size)
        text = words("completion", size)
        responses = responses_of(chat)
        completion, n_completion = await timed(backend, "/completion", {"prompt": text}, rounds)
        chat_ms, n_chat = await timed(backend, "/v1/chat/completions", chat, rounds)
        resp_ms, n_resp = await timed(backend, "/v1/responses", responses, rounds)
        started = time.perf_counter()
        responses_to_chat(responses)
        convert_ms = (time.perf_counter() - started) * 1000
        out[str(size)] = {
            "completion": {"tokens": n_completion, "ms": summary(completion)},
            "chat": {"tokens": n_chat, "ms": summary(chat_ms), **await each_call(backend, chat, rounds)},
            "responses": {"tokens": n_resp, "ms": summary(resp_ms), "conversion_ms": convert_ms},
        }
        print(
            size, {k: (v["tokens"], round(v["ms"]["p50"], 1)) for k, v in out[str(size)].items()}, flush=True
        )
    return out


async def generation(base_url: str) -> float:
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
        return float(r.json()["timings"]["predicted_per_second"])


async def beside(backend: LlamaCppBackend, base_url: str, rounds: int) -> dict[str, Any]:
    chat = chat_of(50_000)
    alone, loaded, predictions = [], [], 0

    async def hammer(stop: asyncio.Event) -> None:
        nonlocal predictions
        while not stop.is_set():
            await request_tokens(backend, "/v1/chat/completions", chat)
            predictions += 1

    await generation(base_url)  # warm
    for _ in range(rounds):
        alone.append(await generation(base_url))
        stop = asyncio.Event()
        task = asyncio.create_task(hammer(stop))
        loaded.append(await generation(base_url))
        stop.set()
        await task
    return {
        "alone_tps": summary(alone),
        "beside_tps": summary(loaded),
        "slowdown": 1 - statistics.median(loaded) / statistics.median(alone),
        "predictions_beside": predictions,
    }


async def run(work: Path, rounds: int) -> dict[str, Any]:
    binary = llama_server_binary()
    model = generate_llama_model(TINY, vocab_dir=vocab_dir(binary))
    extra = ("--cache-ram", "0", "--jinja", "--chat-template-file", str(chat_template("Qwen3-Coder.jinja")))
    server = LlamaServer(
        binary=binary, model=model, slot_save_path=None, log_path=work / "llama.log", extra_args=extra
    ).start()
    backend = LlamaCppBackend(base_url=server.base_url, request_timeout_s=120)
    try:
        return {
            "sizes": await sizes(backend, rounds),
            "beside_generation": await beside(backend, server.base_url, rounds),
        }
    finally:
        await backend.aclose()
        server.stop()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        data = asyncio.run(run(Path(tmp), args.rounds))
    print(write("prompt_tokens", data))
    print(data["beside_generation"])
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
