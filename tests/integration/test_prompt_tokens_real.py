"""A prompt's tokens, predicted before the request runs (kvsidecar.proxy.prompt_tokens), against what a real
llama-server put in its slot: each request runs pinned to slot 0 with a 2-token answer, the slot is saved,
and the state file's token list (kvsidecar.store.state_format) must start with exactly the prediction and
hold at most one generated token more; llama-server's own counts (`prompt_n + cache_n`, or its `usage`)
must equal the prediction's length, and for Responses `/v1/responses/input_tokens` too.

The corpus: every recorded agent-client request (Claude Code through llama-server's own `/v1/messages`,
Codex through its own `/v1/responses`, opencode and aider chat completions), completion prompts in every form
llama-server reads (texts, ids, texts and ids mixed, `prompt_string`, special-token text, Unicode), and chat
bodies that exercise the render: tools, tool calls and results, `parallel_tool_calls`, the assistant prefill,
`add_generation_prompt`, a thinking template that drops reasoning from history with `enable_thinking` and
`reasoning_effort`, Responses reasoning/function items. Two servers: llama.cpp's Qwen3-Coder.jinja and its
Qwen3 thinking template, on the generated llama (real tokenizer, `--jinja`)."""

from __future__ import annotations

import itertools
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsidecar.backend.llama_http import find_timings, token_counts
from kvsidecar.backend.llamacpp import LlamaCppBackend
from kvsidecar.backend.prompts import INFILL, MULTIMODAL, SEVERAL_PROMPTS, KnownTokens, UnknownTokens
from kvsidecar.proxy.prompt_tokens import request_tokens
from kvsidecar.store.state_format import parse, text_tokens
from kvsidecar.testing.llama import LlamaServer, vocab_dir
from kvsidecar.testing.models import ModelShape, chat_template, generate_llama_model
from tests.unit.client_fixtures import posts

MODEL = ModelShape(n_ctx=32768, seed=2828)  # the agent-client replays' model: cached once for both
_NAMES = itertools.count()
USER = {"role": "user", "content": "what is in calc.py?"}
PARAMETERS = {
    "type": "object",
    "properties": {"path": {"type": "string", "minimum": 0.1}},
    "required": ["path"],
}
TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "read",
            "description": "Read a file",
            "parameters": PARAMETERS,
        },
    }
]
CALL = {"id": "call_1", "type": "function", "function": {"name": "read", "arguments": '{"path": "calc.py"}'}}


def start(binary: Path, model: Path, tmp: Path, template: str) -> LlamaServer:
    extra = ("--cache-ram", "0", "--jinja", "--chat-template-file", str(chat_template(template)))
    return LlamaServer(
        binary=binary,
        model=model,
        slot_save_path=tmp / "snapshots",
        log_path=tmp / "llama.log",
        ctx_size=8192,
        extra_args=extra,
    ).start()


@pytest.fixture(scope="module")
def model(llama_bin: Path) -> Path:
    return generate_llama_model(MODEL, vocab_dir=vocab_dir(llama_bin))


@pytest.fixture(scope="module")
def coder(llama_bin: Path, model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    server = start(llama_bin, model, tmp_path_factory.mktemp("coder"), "Qwen3-Coder.jinja")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def thinking(llama_bin: Path, model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[LlamaServer]:
    server = start(llama_bin, model, tmp_path_factory.mktemp("thinking"), "Qwen-Qwen3-0.6B.jinja")
    yield server
    server.stop()


def short(path: str, body: dict[str, Any]) -> dict[str, Any]:
    """The body with a 2-token deterministic answer, not streamed, pinned to slot 0."""
    out = {**body, "stream": False, "temperature": 0, "id_slot": 0, "cache_prompt": True}
    if path.endswith("/responses"):
        out["max_output_tokens"] = 2
    elif path.endswith(("/completion", "/completions")) and "messages" not in body:
        out["n_predict"] = 2
    else:
        out["max_tokens"] = 2
        out.pop("max_completion_tokens", None)
    return out


async def prove(server: LlamaServer, path: str, body: dict[str, Any]) -> tuple[int, ...]:
    """Predict, run, save, compare (see the module docstring); returns the prediction."""
    sent = short(path, body)
    raw = json.dumps(sent).encode()
    backend = LlamaCppBackend(base_url=server.base_url, request_timeout_s=60)
    try:
        predicted = await request_tokens(backend, path, sent, body=raw)
    finally:
        await backend.aclose()
    assert isinstance(predicted, KnownTokens), (path, predicted)
    tokens = predicted.tokens
    async with httpx.AsyncClient(base_url=server.base_url, timeout=300) as c:
        r = await c.post(path, content=raw, headers={"content-type": "application/json"})
        assert r.status_code == 200, (path, r.status_code, r.text[:300])
        prompt_n, cache_n = token_counts(find_timings(r.text))
        assert prompt_n is not None and cache_n is not None, r.text[:300]
        assert prompt_n + cache_n == len(tokens), (path, prompt_n, cache_n, len(tokens))
        if path.endswith("/responses"):
            counted = await c.post(path + "/input_tokens", json=body)
            assert counted.json()["input_tokens"] == len(tokens)
        name = f"proof-{next(_NAMES)}.bin"
        saved = await c.post("/slots/0", params={"action": "save"}, json={"filename": name})
        assert saved.status_code == 200, saved.text
    with (server.save_dir / name).open("rb") as f:
        held = text_tokens(parse(f))
    assert held[: len(tokens)] == tokens, (path, first_difference(held, tokens))
    assert len(tokens) <= len(held) <= len(tokens) + 1  # 2 asked: the second is sampled, never decoded
    return tokens


def first_difference(held: tuple[int, ...], predicted: tuple[int, ...]) -> str:
    for i, (a, b) in enumerate(zip(held, predicted, strict=False)):
        if a != b:
            return f"at {i}: held {held[i : i + 5]}, predicted {predicted[i : i + 5]}"
    return f"lengths: held {len(held)}, predicted {len(predicted)}"


@pytest.mark.parametrize("rec", posts(), ids=lambda r: f"{r.client}-{r.name}")
async def test_recorded_agent_requests(coder: LlamaServer, rec: Any) -> None:
    tokens = await prove(coder, rec.path, dict(rec.body))
    assert len(tokens) > 200


COMPLETIONS: list[Any] = [
    "Hello world",
    "",  # the BOS alone
    "a <s> b </s> c",  # this vocabulary's special tokens, parsed
    "<|im_start|>user\nhi<|im_end|>",  # another vocabulary's: plain text here
    "héllo 世界 🙂 e\u0301 \ufb01 \t\n  two  spaces \u0000 nul",
    [1, 15043, 3186],
    ["Hello", 29871, 13, " world"],
    [13, "no BOS before an id"],
    {"prompt_string": "the object form"},
    {"prompt_string": [15043, " mixed"]},
    ["one prompt in an array"],
]


@pytest.mark.parametrize("path", ["/completion", "/completions", "/v1/completions"])
@pytest.mark.parametrize("prompt", COMPLETIONS, ids=range(len(COMPLETIONS)))
async def test_completion_prompts(coder: LlamaServer, path: str, prompt: Any) -> None:
    await prove(coder, path, {"prompt": prompt})


CHATS: list[dict[str, Any]] = [
    {"messages": [USER]},
    {
        "messages": [
            {"role": "system", "content": "be brief <s> now"},
            USER,
            {"role": "assistant", "content": "ok"},
            USER,
        ]
    },
    {"messages": [USER], "tools": TOOLS},
    {"messages": [USER], "tools": TOOLS, "parallel_tool_calls": False},
    {
        "messages": [
            USER,
            {"role": "assistant", "content": None, "tool_calls": [CALL, {**CALL, "id": "call_2"}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "def add(a, b):\n    return a + b\n"},
            {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "same"}]},
        ],
        "tools": TOOLS,
    },
    {"messages": [USER, {"role": "assistant", "content": "The file holds"}]},  # the assistant prefill
    {"messages": [USER], "add_generation_prompt": False},
    {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": "ünï"}, {"type": "text", "text": "cødé"}]}
        ]
    },
]


@pytest.mark.parametrize("chat", CHATS, ids=range(len(CHATS)))
async def test_chat_bodies(coder: LlamaServer, chat: dict[str, Any]) -> None:
    await prove(coder, "/v1/chat/completions", chat)


HISTORY = [
    USER,
    {"role": "assistant", "content": "It adds.", "reasoning_content": "the file defines add"},
    {"role": "user", "content": "and now?"},
]
THINKING: list[dict[str, Any]] = [
    {"messages": HISTORY},  # the template drops the earlier reasoning
    {"messages": HISTORY, "chat_template_kwargs": {"enable_thinking": False}},
    {"messages": HISTORY, "reasoning_effort": "none"},
    {"messages": HISTORY, "tools": TOOLS},
    {"messages": [*HISTORY, {"role": "assistant", "content": "", "reasoning_content": "step one"}]},
]


@pytest.mark.parametrize("chat", THINKING, ids=range(len(THINKING)))
async def test_a_thinking_template(thinking: LlamaServer, chat: dict[str, Any]) -> None:
    await prove(thinking, "/v1/chat/completions", chat)


RESPONSES: list[dict[str, Any]] = [
    {"input": "hi", "instructions": "be brief"},
    {
        "instructions": "you are a coding agent",
        "input": [
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "rules"}]},
            {"type": "message", "role": "user", "content": "read calc.py"},
            {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "use read"}]},
            {
                "type": "message",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Reading."}],
            },
            {"type": "function_call", "name": "read", "arguments": '{"path":"calc.py"}', "call_id": "c1"},
            {"type": "function_call", "name": "read", "arguments": '{"path":"b.py"}', "call_id": "c2"},
            {"type": "function_call_output", "call_id": "c1", "output": "def add(a, b): ..."},
            {
                "type": "function_call_output",
                "call_id": "c2",
                "output": [{"type": "input_text", "text": "x"}],
            },
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "thanks"}]},
        ],
        "tools": [
            {"type": "function", "name": "read", "parameters": PARAMETERS},
            {"type": "web_search"},
        ],
        "tool_choice": "auto",
        "parallel_tool_calls": True,
        "reasoning": {"effort": "low", "summary": "auto"},
    },
]


@pytest.mark.parametrize("body", RESPONSES, ids=range(len(RESPONSES)))
async def test_responses_bodies(coder: LlamaServer, thinking: LlamaServer, body: dict[str, Any]) -> None:
    for server in (coder, thinking):
        await prove(server, "/v1/responses", body)


async def test_what_cannot_be_known_is_unknown(coder: LlamaServer) -> None:
    backend = LlamaCppBackend(base_url=coder.base_url)
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AA"}}
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": [image]}]}, MULTIMODAL),
        ("/completion", {"prompt": ["one", "two"]}, SEVERAL_PROMPTS),
        ("/infill", {"input_prefix": "def f(", "input_suffix": ")"}, INFILL),
    ]
    try:
        for path, body, reason in cases:
            result = await request_tokens(backend, path, body)
            assert isinstance(result, UnknownTokens) and result.reason == reason, (path, result)
    finally:
        await backend.aclose()


@pytest.mark.parametrize(("n_predict", "generated"), [(0, 0), (1, 0), (3, 2)])
async def test_a_prefill_only_call_leaves_exactly_the_prompt(
    coder: LlamaServer, n_predict: int, generated: int
) -> None:
    """`run_prompt(n_predict=0)` (and 1): the server samples one token and stops before decoding it, so
    the slot holds exactly the prompt, the save point a planner makes at a prompt's end; with k > 1 the
    prompt and k - 1 generated tokens (GET /slots and the saved file agree)."""
    backend = LlamaCppBackend(base_url=coder.base_url, request_timeout_s=60)
    prompt = "a prompt whose end is a save point " * 20
    try:
        predicted = await request_tokens(backend, "/completion", {"prompt": prompt})
        assert isinstance(predicted, KnownTokens)
        await backend.erase_slot(0)
        result = await backend.run_prompt(0, prompt, n_predict=n_predict)
        assert result.computed + result.reused == len(predicted.tokens)
        [slot] = await backend.inspect_slots()
        assert slot.n_tokens == len(predicted.tokens) + generated
        name = f"prefill-{n_predict}.bin"
        saved = await backend.save_slot(0, name)
        assert saved.tokens == len(predicted.tokens) + generated
    finally:
        await backend.aclose()
    with (coder.save_dir / name).open("rb") as f:
        held = text_tokens(parse(f))
    assert held[: len(predicted.tokens)] == predicted.tokens and len(held) == saved.tokens
