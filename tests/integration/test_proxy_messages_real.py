"""Issue 28 item 4, Claude Code on a pool: its recorded requests (tests/fixtures/clients/claude) through the
proxy in front of a real llama-server with `--parallel 2` (`--jinja`, llama.cpp's Qwen3-Coder.jinja,
`--cache-ram 0`, so any reuse is the slot's own KV): two conversations interleaved, each pinned to its
session's slot, the second turn reusing the first's prompt, answers valid Anthropic messages and event
streams, streamed and not; `HEAD /` and `HEAD /api/hello` answered as llama-server answers them; the token
as `X-Api-Key`."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsidecar.testing.daemon import DaemonProcess
from kvsidecar.testing.llama import LlamaServer
from kvsidecar.testing.models import chat_template
from tests.anthropic_helpers import accumulate, check_message, parse_sse
from tests.integration.test_proxy_real import TOKEN, proxy_daemon
from tests.unit.client_fixtures import load

TEMPLATE = "Qwen3-Coder.jinja"
_DROP = {"authorization", "x-api-key", "host", "content-length", "accept-encoding", "connection"}


@dataclass(frozen=True)
class Pool:
    llama: LlamaServer
    daemon: DaemonProcess


@pytest.fixture(scope="module")
def pool(llama_bin: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    tmp = tmp_path_factory.mktemp("messages-pool")
    llama = LlamaServer(
        binary=llama_bin,
        model=tiny_model,
        slot_save_path=tmp / "snapshots",
        log_path=tmp / "llama.log",
        ctx_size=8192,
        parallel=2,
        extra_args=("--cache-ram", "0", "--jinja", "--chat-template-file", str(chat_template(TEMPLATE))),
    ).start()
    try:
        daemon = proxy_daemon(
            llama, tmp / "kv", proxy={"identity": "session"}, servers={"local": {"mode": "managed-slots"}}
        )
        try:
            yield Pool(llama, daemon)
        finally:
            daemon.stop()
    finally:
        llama.stop()


@dataclass(frozen=True)
class Turn:
    message: dict[str, Any]
    headers: dict[str, str]

    @property
    def reused(self) -> int:
        return int(self.message["usage"]["cache_read_input_tokens"])

    @property
    def prompt(self) -> int:
        return self.reused + int(self.message["usage"]["input_tokens"])


def send(pool: Pool, name: str, *, stream: bool, api_key: bool = False) -> Turn:
    """A recorded Claude Code request through the proxy, with its own headers and a short answer."""
    rec = load("claude", name)
    headers = {k: v for k, v in rec.headers if k.lower() not in _DROP}
    headers["content-type"] = "application/json"
    if api_key:
        headers["x-api-key"] = TOKEN  # ANTHROPIC_API_KEY
    else:
        headers["authorization"] = f"Bearer {TOKEN}"  # ANTHROPIC_AUTH_TOKEN
    body = {**rec.body, "stream": stream, "max_tokens": 4, "temperature": 0}
    answer = httpx.post(
        f"{pool.daemon.proxy_url}{rec.path}?{rec.query}",
        content=json.dumps(body).encode(),
        headers=headers,
        timeout=300,
    )
    assert answer.status_code == 200, (name, answer.text[:400])
    if stream:
        assert answer.headers["content-type"].startswith("text/event-stream")
        message = accumulate(parse_sse(answer.content))
    else:
        message = answer.json()
    check_message(message)
    return Turn(message, {k.lower(): v for k, v in answer.headers.items()})


def sessions(pool: Pool) -> dict[str, Any]:
    status = httpx.get(f"{pool.daemon.url}/v1/status", headers=pool.daemon.auth, timeout=30).json()
    return dict(status)


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
def test_claude_code_runs_pinned_on_a_pool(pool: Pool, stream: bool) -> None:
    for probe in ("/", "/api/hello"):  # Claude Code's first request (2.1.197, 2.1.332), no token
        head = httpx.head(f"{pool.daemon.proxy_url}{probe}", timeout=30)
        alone = httpx.head(f"{pool.llama.base_url}{probe}", timeout=30)
        assert head.status_code == alone.status_code == 404 and head.content == alone.content == b""
    # two conversations, interleaved: each turn goes to its own session's slot
    a1 = send(pool, "ui_turn1", stream=stream)
    b1 = send(pool, "p_turn1", stream=stream)
    a2 = send(pool, "ui_turn2", stream=stream, api_key=True)
    b2 = send(pool, "p_turn2_continue", stream=stream)
    for turn in (a1, b1, a2, b2):
        assert turn.headers["x-kv-signal"] == "header:x-claude-code-session-id", turn.headers
    # (module scope: the json run saved or left the sessions; the stream run continues them)
    for first, second in ((a1, a2), (b1, b2)):
        assert second.headers["x-kv-outcome"] == "resident", second.headers
        # the second turn starts from the first one's KV in its slot: the other conversation's, in the
        # other slot, diverges from it within the first few tokens (the billing header)
        assert second.reused >= 0.9 * first.prompt, (first.message["usage"], second.message["usage"])
    stats = sessions(pool)["stats"]
    assert stats["acquires"] >= 4 and sessions(pool)["leases"] == 0
