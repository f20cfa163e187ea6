"""Claude Code's recorded requests, converted by kvsidecar.proxy_anthropic, against a real llama-server
(`--jinja` with llama.cpp's Qwen3-Coder.jinja, `--parallel 2`): the converted chat completion, pinned with
`id_slot`, computes token for token the prompt llama-server's own `/v1/messages` computes, streamed and
not, and its answers convert to valid Anthropic messages."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsidecar.proxy.anthropic import chat_request_bytes, messages_to_chat
from kvsidecar.proxy.anthropic_answer import chat_to_message
from kvsidecar.proxy.anthropic_stream import StreamTransducer
from kvsidecar.testing.llama import LlamaServer
from kvsidecar.testing.models import chat_template
from tests.anthropic_helpers import accumulate, check_message, parse_sse
from tests.unit.client_fixtures import load

TEMPLATE = "Qwen3-Coder.jinja"  # llama.cpp's own, fetched from its sdist once and cached
CLAUDE = [
    "p_turn1",
    "p_turn2_continue",
    "p_conv2_turn1",
    "tools_turn1",
    "tools_turn1_tool_result",
    "tools_turn2_continue",
    "ui_turn1",
    "ui_title",
    "ui_turn2",
]


@pytest.fixture(scope="module")
def server(llama_bin: Path, tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("anthropic")
    with pytest.MonkeyPatch.context() as env:
        env.setenv("LLAMA_SERVER_SLOTS_DEBUG", "1")  # /slots then shows each slot's prompt
        llama = LlamaServer(
            binary=llama_bin,
            model=tiny_model,
            slot_save_path=None,
            log_path=tmp / "llama.log",
            ctx_size=8192,
            parallel=2,
            extra_args=("--cache-ram", "0", "--jinja", "--chat-template-file", str(chat_template(TEMPLATE))),
        ).start()
    yield llama.base_url
    llama.stop()


def request(name: str, *, stream: bool) -> dict[str, Any]:
    """The recorded body, with a short answer (the prompt is what is compared)."""
    return {**load("claude", name).body, "stream": stream, "max_tokens": 4, "temperature": 0}


def post(client: httpx.Client, path: str, body: bytes | dict[str, Any]) -> httpx.Response:
    content = body if isinstance(body, bytes) else json.dumps(body).encode()
    answer = client.post(path, content=content, headers={"content-type": "application/json"})
    assert answer.status_code == 200, answer.text[:500]
    return answer


def latest_slot(client: httpx.Client) -> dict[str, Any]:
    """The slot that ran the last task (llama-server picks it for `/v1/messages`)."""
    slots = [s for s in client.get("/slots").json() if "id_task" in s]
    return dict(max(slots, key=lambda s: s["id_task"]))


def slot(client: httpx.Client, slot_id: int) -> dict[str, Any]:
    return dict(next(s for s in client.get("/slots").json() if s["id"] == slot_id))


def pinned(client: httpx.Client, body: dict[str, Any], slot_id: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """The converted request on `slot_id`: (the Anthropic message its answer converts to, its timings)."""
    wire = chat_request_bytes(body, slot_id=slot_id, cache_prompt=True)
    if not body["stream"]:
        answer = post(client, "/v1/chat/completions", wire).json()
        return chat_to_message(answer), answer["timings"]
    transducer, out = StreamTransducer(), b""
    headers = {"content-type": "application/json"}
    with client.stream("POST", "/v1/chat/completions", content=wire, headers=headers) as answer:
        assert answer.status_code == 200
        for piece in answer.iter_raw():
            out += transducer.feed(piece)
    out += transducer.close()
    assert not transducer.failed, out[-500:]
    assert transducer.timings is not None
    return accumulate(parse_sse(out)), transducer.timings


def own_answer(client: httpx.Client, body: dict[str, Any]) -> dict[str, Any]:
    """llama-server's own `/v1/messages` answer (as a message, for a stream too)."""
    answer = post(client, "/v1/messages?beta=true", body)
    return accumulate(parse_sse(answer.content)) if body["stream"] else dict(answer.json())


@pytest.mark.parametrize("stream", [False, True], ids=["json", "stream"])
@pytest.mark.parametrize("name", CLAUDE)
def test_pinned_conversion_computes_llama_servers_own_prompt(server: str, name: str, stream: bool) -> None:
    body = request(name, stream=stream)
    with httpx.Client(base_url=server, timeout=120, headers={"connection": "close"}) as client:
        counted = post(client, "/v1/messages/count_tokens", body).json()["input_tokens"]
        own = own_answer(client, body)  # llama-server picks the slot
        check_message(own)
        first = latest_slot(client)
        # the same request, converted and pinned to that slot, reuses all of its prompt
        message, timings = pinned(client, body, first["id"])
        assert timings["prompt_n"] <= 1, timings
        assert timings["cache_n"] + timings["prompt_n"] == counted
        check_message(message)
        usage = message["usage"]
        assert usage["input_tokens"] + usage["cache_read_input_tokens"] == counted
        assert usage["cache_read_input_tokens"] == timings["cache_n"]
        # and pinned to the other slot, it renders the very same prompt there
        other = 1 - first["id"]
        message, timings = pinned(client, body, other)
        check_message(message)
        assert slot(client, other)["prompt"] == first["prompt"]
        assert timings["cache_n"] + timings["prompt_n"] == counted


@pytest.mark.parametrize("name", CLAUDE)
def test_count_tokens_of_the_conversion_equal_llama_servers(server: str, name: str) -> None:
    body = load("claude", name).body
    with httpx.Client(base_url=server, timeout=120, headers={"connection": "close"}) as client:
        theirs = post(client, "/v1/messages/count_tokens", body).json()["input_tokens"]
        ours = post(client, "/v1/chat/completions/input_tokens", messages_to_chat(body)).json()[
            "input_tokens"
        ]
        # the structured-output option does not change the prompt either
        structured = messages_to_chat(body, structured_output=True)
        prompt = post(client, "/apply-template", messages_to_chat(body)).json()["prompt"]
        assert prompt == post(client, "/apply-template", structured).json()["prompt"]
    assert ours == theirs


def test_title_request_structured_output_is_opt_in(server: str) -> None:
    """llama-server's own route drops `output_config.format`, and so does the default conversion: the
    title request is served. As `response_format` (opt-in), this build fails it with this model and
    template ("Failed to initialize samplers"): the reason it is not the default."""
    body = request("ui_title", stream=False)
    with httpx.Client(base_url=server, timeout=120, headers={"connection": "close"}) as client:
        answer = post(client, "/v1/chat/completions", chat_request_bytes(body, slot_id=0)).json()
        check_message(chat_to_message(answer))
        structured = chat_request_bytes(body, slot_id=0, structured_output=True)
        refused = client.post(
            "/v1/chat/completions", content=structured, headers={"content-type": "application/json"}
        )
    assert refused.status_code == 400 and "samplers" in refused.text
