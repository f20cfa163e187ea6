"""The official openai SDK through kvsidecar's proxy: session-pinned KV persistence with no hooks.

kvsidecar's proxy (`proxy.enabled: true`, default 127.0.0.1:8378) speaks llama-server's OpenAI-compatible
API. A request that names its session (header `X-Session-Id`, kvsidecar's `proxy.session_header`) runs on
that session's slot; the answer says what kvsidecar did in `X-KV-Outcome`. The api key is kvsidecar's
token (`api.token_file`); llama-server's own key, if any, stays with kvsidecar.

    KVSIDECAR_TOKEN=$(cat /etc/kvsidecar/token) python examples/openai_proxy.py --base-url http://127.0.0.1:8378/v1

The default script "A,A,B,A" on a one-slot llama-server: cold, resident, cold (B), restored (A).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import openai
from openai.types.chat import ChatCompletionMessageParam

TEXT = "the a harness keeps its session log and the model keeps a cache of what it read so far"


def user_message(session: str, turn: int, words: int) -> str:
    vocab = TEXT.split()
    body = " ".join(vocab[(i * 7 + turn) % len(vocab)] for i in range(words))
    return f"({session}, turn {turn}) {body}"


def chat_turn(
    client: openai.OpenAI, model: str, session: str, messages: list[ChatCompletionMessageParam]
) -> dict[str, Any]:
    raw = client.chat.completions.with_raw_response.create(
        model=model,
        messages=messages,
        max_tokens=32,
        temperature=0,
        extra_headers={"X-Session-Id": session},  # kvsidecar's proxy.session_header
    )
    completion = raw.parse()
    reply = completion.choices[0].message.content or ""
    messages.append({"role": "assistant", "content": reply})
    timings = (completion.model_extra or {}).get("timings") or {}  # llama-server's own numbers
    return {
        "session": session,
        "outcome": raw.headers.get("x-kv-outcome"),  # resident | restored | cold | cold_fallback
        "restored_tokens": raw.headers.get("x-kv-restored-tokens"),
        "prompt_tokens": completion.usage.prompt_tokens if completion.usage else None,
        "reused": timings.get("cache_n"),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    default_url = os.environ.get("KVSIDECAR_PROXY_URL", "http://127.0.0.1:8378/v1")
    parser.add_argument("--base-url", default=default_url, help="kvsidecar's proxy, ending in /v1")
    parser.add_argument("--model", default="qwen", help="part of the session's identity")
    parser.add_argument("--script", default="A,A,B,A", help="the sessions' turns, in order")
    parser.add_argument("--words", type=int, default=300, help="words per user message")
    parser.add_argument("--json", action="store_true", help="one JSON object per turn")
    args = parser.parse_args(argv)
    # kvsidecar's token; a proxy without api.token_file takes any key (the SDK insists on one)
    client = openai.OpenAI(base_url=args.base_url, api_key=os.environ.get("KVSIDECAR_TOKEN") or "none")
    conversations: dict[str, list[ChatCompletionMessageParam]] = {}
    try:
        for n, session in enumerate([s for s in args.script.split(",") if s], start=1):
            messages = conversations.setdefault(session, [])
            messages.append({"role": "user", "content": user_message(session, n, args.words)})
            row = {"turn": n} | chat_turn(client, args.model, session, messages)
            line = json.dumps(row) if args.json else "  ".join(f"{k} {v}" for k, v in row.items())
            print(line, flush=True)
    except openai.APIStatusError as exc:  # kvsidecar's refusals carry its stable code
        print(f"proxy answered {exc.status_code}: {exc.message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
