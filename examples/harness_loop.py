"""A minimal agent harness on kvsidecar's hook API, with the blocking client `KvSidecar`.

Each turn: acquire the session's slot -> POST llama-server's /completion at the lease's `base_url`, pinned
to the lease's slot -> release with the engine's own token counts (`lease.report`). The default script
"A,A,B,A" switches sessions on a one-slot llama-server: A's second turn finds its slot `resident`, B
takes the slot (`cold`), and A's third turn comes back `restored` from A's snapshot on disk.

    KVSIDECAR_TOKEN=$(cat /etc/kvsidecar/token) python examples/harness_loop.py --url http://127.0.0.1:8377

Prints one line per turn (`--json`: one JSON object per turn).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import httpx

from kvsidecar.client import KvSidecar, Lease, SidecarError

TEXT = "the a harness keeps its session log and the model keeps a cache of what it read so far"


def user_message(session: str, turn: int, words: int) -> str:
    """A stand-in for what a user or a tool said (deterministic, about `words` words)."""
    vocab = TEXT.split()
    body = " ".join(vocab[(i * 7 + turn) % len(vocab)] for i in range(words))
    return f"\nUser ({session}, turn {turn}): {body}\nAssistant:"


def turn(kv: KvSidecar, session_id: str, prompt: str) -> tuple[Lease, dict[str, Any]]:
    """One model call of a session: the whole conversation so far is `prompt`."""
    # "local": the provider routed to llama-server in kvsidecar's config.yaml (`routes:`); "qwen": your name
    # for the model. Both are part of the session's identity.
    with kv.acquire(session_id, provider="local", model="qwen") as lease:
        # lease.outcome: resident | restored | cold | cold_fallback | bypass
        body = {"prompt": prompt, "id_slot": lease.slot_id, "cache_prompt": True, "n_predict": 64}
        reply = httpx.post(f"{lease.base_url}/completion", json=body, timeout=600).raise_for_status().json()
        t = reply["timings"]
        lease.report(prompt_tokens=t["prompt_n"], cached_tokens=t["cache_n"], prompt_ms=t["prompt_ms"])
    kv.event(session_id, "flush")  # optional lifecycle hints: flush, turn_end, disposed, ...
    return lease, reply


def report(n: int, session: str, lease: Lease, reply: dict[str, Any]) -> dict[str, Any]:
    release = lease.release_result or {}
    return {
        "turn": n,
        "session": session,
        "outcome": lease.outcome,
        "restored_tokens": lease.restored_tokens,
        "computed": reply["timings"]["prompt_n"],
        "reused": reply["timings"]["cache_n"],
        "verification": release.get("restore_verification"),
    }


def run(kv: KvSidecar, script: list[str], words: int, *, as_json: bool) -> None:
    conversations: dict[str, str] = {}
    for n, session in enumerate(script, start=1):
        prompt = conversations.get(session, "") + user_message(session, n, words)
        lease, reply = turn(kv, session, prompt)
        conversations[session] = prompt + reply["content"]  # the session log only grows
        row = report(n, session, lease, reply)
        if as_json:
            print(json.dumps(row), flush=True)
        else:
            print("  ".join(f"{k} {v}" for k, v in row.items() if v is not None), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    parser.add_argument("--url", default=os.environ.get("KVSIDECAR_URL", "http://127.0.0.1:8377"))
    parser.add_argument("--token-file", help="kvsidecar's api.token_file (else $KVSIDECAR_TOKEN)")
    parser.add_argument("--script", default="A,A,B,A", help="the sessions' turns, in order")
    parser.add_argument("--words", type=int, default=300, help="words per user message")
    parser.add_argument("--json", action="store_true", help="one JSON object per turn")
    args = parser.parse_args(argv)
    token = os.environ.get("KVSIDECAR_TOKEN")
    if args.token_file:
        with open(args.token_file) as f:
            token = f.read().strip()
    try:
        with KvSidecar(args.url, token=token) as kv:
            run(kv, [s for s in args.script.split(",") if s], args.words, as_json=args.json)
    except SidecarError as exc:  # the daemon's stable code, e.g. KV_UNAUTHORIZED
        print(f"kvsidecar: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
