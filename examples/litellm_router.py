"""The LiteLLM SDK in front of kvsidecar's proxy, configured by examples/litellm/config.yaml.

Loads the `model_list` that the LiteLLM proxy server would read from that file into the SDK's `Router` and
sends a chat per turn, naming the session in kvsidecar's header (X-Session-Id). LiteLLM returns the
proxy's response headers in `_hidden_params["additional_headers"]` prefixed `llm_provider-`, so
`X-KV-Outcome` shows what kvsidecar did. Needs `pip install litellm`.

    export KVSIDECAR_PROXY_URL=http://127.0.0.1:8378/v1 KVSIDECAR_TOKEN=$(cat /etc/kvsidecar/token)
    python examples/litellm_router.py

The default script "A,A,B,A" on a one-slot llama-server: cold, resident, cold (B), restored (A).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no download of LiteLLM's price list

import litellm  # after the environment it reads at import
import openai
import yaml
from litellm.router import Router

CONFIG = Path(__file__).resolve().parent / "litellm" / "config.yaml"
TEXT = "the a harness keeps its session log and the model keeps a cache of what it read so far"


def user_message(session: str, turn: int, words: int) -> str:
    vocab = TEXT.split()
    body = " ".join(vocab[(i * 7 + turn) % len(vocab)] for i in range(words))
    return f"({session}, turn {turn}) {body}"


def chat_turn(router: Router, model: str, session: str, messages: list[dict[str, str]]) -> dict[str, Any]:
    response = router.completion(
        model=model,
        messages=messages,
        max_tokens=32,
        temperature=0,
        extra_headers={"X-Session-Id": session},  # kvsidecar's proxy.session_header
    )
    assert isinstance(response, litellm.ModelResponse)  # not streamed
    choice = response.choices[0]
    assert isinstance(choice, litellm.Choices)
    messages.append({"role": "assistant", "content": choice.message.content or ""})
    headers = response._hidden_params.get("additional_headers") or {}
    usage = getattr(response, "usage", None)
    details = getattr(usage, "prompt_tokens_details", None)
    return {
        "session": session,
        "outcome": headers.get("llm_provider-x-kv-outcome"),
        "restored_tokens": headers.get("llm_provider-x-kv-restored-tokens"),
        "prompt_tokens": getattr(usage, "prompt_tokens", None),
        "reused": getattr(details, "cached_tokens", None),  # llama-server's timings.cache_n
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--config", type=Path, default=CONFIG, help="a LiteLLM proxy config.yaml")
    parser.add_argument("--model", default="kvsidecar-local", help="a model_name of its model_list")
    parser.add_argument("--script", default="A,A,B,A", help="the sessions' turns, in order")
    parser.add_argument("--words", type=int, default=300, help="words per user message")
    parser.add_argument("--json", action="store_true", help="one JSON object per turn")
    args = parser.parse_args(argv)
    model_list = yaml.safe_load(args.config.read_text())["model_list"]
    router = Router(model_list=model_list, num_retries=0)  # os.environ/ values resolved here
    conversations: dict[str, list[dict[str, str]]] = {}
    try:
        for n, session in enumerate([s for s in args.script.split(",") if s], start=1):
            messages = conversations.setdefault(session, [])
            messages.append({"role": "user", "content": user_message(session, n, args.words)})
            row = {"turn": n} | chat_turn(router, args.model, session, messages)
            print(json.dumps(row) if args.json else "  ".join(f"{k} {v}" for k, v in row.items()), flush=True)
    except openai.APIError as exc:  # LiteLLM's errors are the openai SDK's
        print(f"LiteLLM: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
