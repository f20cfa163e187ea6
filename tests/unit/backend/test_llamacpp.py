"""LlamaCppBackend against httpx.MockTransport: every transport failure becomes one of our codes."""

from __future__ import annotations

import json
from collections.abc import Callable

import httpx
import pytest

from kvsidecar.backend.llamacpp import LlamaCppBackend
from kvsidecar.errors import (
    BackendUnavailable,
    BackendUnsupported,
    BadRequest,
    EraseFailed,
    KvError,
    OperationTimeout,
    RestoreFailed,
    SaveFailed,
    SlotNotFound,
)

Handler = Callable[[httpx.Request], httpx.Response]
SLOTS = [{"id": 0, "n_ctx": 4096, "is_processing": False, "n_prompt_tokens": 12}]


def backend(handler: Handler) -> LlamaCppBackend:
    return LlamaCppBackend(base_url="http://llama", transport=httpx.MockTransport(handler))


def routes(*, slots: object = SLOTS, fail_action: str | None = None) -> Handler:
    """A small llama-server: /props, /slots and the three slot actions; `fail_action` answers 400."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/slots" and request.method == "GET":
            return httpx.Response(200, json=slots)
        if request.url.path == "/props":
            return httpx.Response(
                200,
                json={
                    "total_slots": 1,
                    "model_path": "/m.gguf",
                    "build_info": "b1",
                    "default_generation_settings": {"n_ctx": 4096},
                },
            )
        action = request.url.params.get("action")
        body = json.loads(request.content or b"{}")
        if action == fail_action:
            return httpx.Response(400, json={"error": {"code": 400, "message": "Unable to restore slot"}})
        if action == "save":
            return httpx.Response(
                200,
                json={
                    "id_slot": 0,
                    "filename": body["filename"],
                    "n_saved": 12,
                    "n_written": 999,
                    "timings": {"save_ms": 1.5},
                },
            )
        if action == "restore":
            return httpx.Response(
                200,
                json={
                    "id_slot": 0,
                    "filename": body["filename"],
                    "n_restored": 12,
                    "n_read": 999,
                    "timings": {"restore_ms": 0.5},
                },
            )
        if action == "erase":
            return httpx.Response(200, json={"id_slot": 0, "n_erased": 12})
        return httpx.Response(404)

    return handle


async def test_typed_results() -> None:
    b = backend(routes())
    caps = await b.probe()
    assert (caps.total_slots, caps.n_ctx, caps.model_path, caps.build_info) == (1, 4096, "/m.gguf", "b1")
    saved = await b.save_slot(0, "k.a.bin")
    assert (saved.tokens, saved.bytes_written, saved.server_ms) == (12, 999, 1.5)
    assert saved.measured_ms >= 0
    restored = await b.restore_slot(0, "k.a.bin")
    assert (restored.tokens, restored.bytes_read, restored.server_ms) == (12, 999, 0.5)
    assert (await b.erase_slot(0)).tokens == 12
    await b.aclose()


async def test_schema_drift_is_tolerated() -> None:
    weird = [{"id": 0}, {"id": "x"}, "junk", {"id": 1, "n_ctx": "big", "is_processing": True, "extra": [1]}]
    b = backend(routes(slots=weird))
    slots = await b.inspect_slots()
    assert [(s.id, s.n_ctx, s.is_processing) for s in slots] == [(0, None, False), (1, None, True)]
    await b.aclose()


def raise_(exc: Exception) -> Handler:
    def handle(request: httpx.Request) -> httpx.Response:
        raise exc

    return handle


@pytest.mark.parametrize(
    ("handler", "expected"),
    [
        (raise_(httpx.ConnectError("refused")), BackendUnavailable),
        (raise_(httpx.ReadTimeout("slow")), OperationTimeout),
        (raise_(httpx.RemoteProtocolError("eof")), BackendUnavailable),
        (lambda r: httpx.Response(500, text="boom"), BackendUnavailable),
        (lambda r: httpx.Response(200, text="not json"), BackendUnavailable),
        (
            lambda r: httpx.Response(501, json={"error": {"message": "Start it with `--slots`"}}),
            BackendUnsupported,
        ),
    ],
)
async def test_probe_failures_are_converted(handler: Handler, expected: type[KvError]) -> None:
    b = backend(handler)
    with pytest.raises(expected) as info:
        await b.probe()
    assert info.value.code.startswith("KV_")
    assert not isinstance(info.value.__cause__, KvError) or info.value.__cause__ is None
    await b.aclose()


@pytest.mark.parametrize(
    ("action", "expected"),
    [("save", SaveFailed), ("restore", RestoreFailed), ("erase", EraseFailed)],
)
async def test_slot_action_errors_carry_the_server_message(action: str, expected: type[KvError]) -> None:
    b = backend(routes(fail_action=action))
    with pytest.raises(expected, match="Unable to restore slot"):
        if action == "erase":
            await b.erase_slot(0)
        else:
            await getattr(b, f"{action}_slot")(0, "k.a.bin")
    await b.aclose()


async def test_unknown_slot_is_refused_before_any_action() -> None:
    calls: list[str] = []

    def record(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        return routes()(request)

    b = backend(record)
    with pytest.raises(SlotNotFound):
        await b.erase_slot(3)
    assert "/slots/3" not in calls
    await b.aclose()


async def test_api_key_is_sent() -> None:
    seen: list[str | None] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.headers.get("authorization"))
        return routes()(request)

    b = LlamaCppBackend(base_url="http://llama", api_key="sekrit", transport=httpx.MockTransport(handle))
    await b.inspect_slots()
    await b.aclose()
    assert seen == ["Bearer sekrit"]


# -- a prompt's tokens: /tokenize, /apply-template, /v1/models -----------------------------------------------
def models(n_vocab: object = 32000, modalities: tuple[str, ...] = ("text",)) -> dict[str, object]:
    """llama-server's GET /v1/models, the two fields the tokenizer reads."""
    return {
        "object": "list",
        "data": [
            {
                "id": "m",
                "architecture": {"input_modalities": list(modalities)},
                "meta": {"n_vocab": n_vocab, "n_ctx": 4096},
            }
        ],
    }


class Tokenizer:
    """A llama-server's prompt routes: what it was sent, answers the test sets."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes]] = []
        self.tokens: object = [1, 2, 3]
        self.prompt: object = "<|im_start|>user\nhi<|im_end|>\n"
        self.vocab: list[dict[str, object]] = [models()]
        self.nonce = "<__media_" + "a" * 20 + "__>"

    def __call__(self, request: httpx.Request) -> httpx.Response:
        self.sent.append((request.url.path, request.content))
        if request.url.path == "/v1/models":
            return httpx.Response(200, json=self.vocab[0] if len(self.vocab) == 1 else self.vocab.pop(0))
        if request.url.path == "/props":
            settings = {"n_ctx": 4096}
            props = {"media_marker": self.nonce, "total_slots": 1, "endpoint_slots": True}
            return httpx.Response(200, json={**props, "default_generation_settings": settings})
        if request.url.path == "/tokenize":
            return httpx.Response(200, json={"tokens": self.tokens})
        if request.url.path == "/apply-template":
            return httpx.Response(200, json={"prompt": self.prompt})
        return httpx.Response(404)

    def paths(self) -> list[str]:
        return [path for path, _ in self.sent]


async def test_tokenize_sends_the_flags_and_returns_the_ids() -> None:
    server = Tokenizer()
    b = backend(server)
    assert await b.tokenize(["é", 5], add_special=True, parse_special=False) == [1, 2, 3]
    path, content = server.sent[0]
    assert path == "/tokenize"
    assert content == '{"content":["é",5],"add_special":true,"parse_special":false}'.encode()
    assert await b.tokenize("x", add_special=False, parse_special=True) == [1, 2, 3]
    assert server.paths().count("/v1/models") == 1  # the vocabulary is asked once
    await b.aclose()


@pytest.mark.parametrize(
    "answer", [None, "1 2", [1, "2"], [1, True], [1, 2.0], [-1], {"tokens": 1}, [[1]], [2**31]]
)
async def test_a_tokenize_answer_that_is_not_vocabulary_ids_is_refused(answer: object) -> None:
    server = Tokenizer()
    server.tokens = answer
    b = backend(server)
    with pytest.raises(BackendUnavailable, match="tokenize"):
        await b.tokenize("x", add_special=True, parse_special=True)
    await b.aclose()


async def test_an_id_beyond_the_vocabulary_asks_it_again_once() -> None:
    server = Tokenizer()
    server.tokens = [5, 40000]
    server.vocab = [models(32000), models(50000)]  # another model loaded under the same address
    b = backend(server)
    assert await b.tokenize("x", add_special=True, parse_special=True) == [5, 40000]
    assert server.paths().count("/v1/models") == 2
    server.tokens = [60000]
    with pytest.raises(BackendUnavailable, match="beyond the vocabulary"):
        await b.tokenize("x", add_special=True, parse_special=True)
    assert server.paths().count("/v1/models") == 3  # asked again, once, then refused
    await b.aclose()


async def test_the_vocabulary_is_asked_again_after_a_restart() -> None:
    server = Tokenizer()
    server.vocab = [models(32000, ("text",)), models(32000, ("text", "image"))]
    b = backend(server)
    assert (await b.tokenizer_info()).multimodal is False
    await b.instance_state()  # the first nonce seen: the info may predate it
    assert (await b.tokenizer_info()).multimodal is True
    await b.instance_state()
    assert (await b.tokenizer_info()).multimodal is True
    assert server.paths().count("/v1/models") == 2  # the same start: cached
    server.nonce = "<__media_" + "b" * 20 + "__>"
    await b.probe()
    await b.tokenizer_info()
    assert server.paths().count("/v1/models") == 3
    await b.aclose()


@pytest.mark.parametrize(
    "answer",
    [
        {},
        {"data": []},
        {"data": [{"meta": {"n_vocab": 0}, "architecture": {"input_modalities": ["text"]}}]},
        {"data": [{"meta": {"n_vocab": True}, "architecture": {"input_modalities": ["text"]}}]},
        {"data": [{"meta": {"n_vocab": 10}, "architecture": {}}]},
        {"data": [{"meta": {"n_vocab": 10}}]},
    ],
)
async def test_a_models_answer_without_the_vocabulary_is_refused(answer: object) -> None:
    b = backend(lambda r: httpx.Response(200, json=answer))
    with pytest.raises(BackendUnavailable, match="/v1/models"):
        await b.tokenizer_info()
    await b.aclose()


async def test_apply_template_sends_bytes_as_they_are_and_a_mapping_compact() -> None:
    server = Tokenizer()
    b = backend(server)
    raw = b'{ "messages" : [ {"role": "user", "content": "hi"} ], "id_slot": 0 }'
    assert await b.apply_template(raw) == server.prompt
    assert await b.apply_template({"messages": [{"role": "user", "content": "🙂"}]}) == server.prompt
    assert [c for p, c in server.sent] == [raw, '{"messages":[{"role":"user","content":"🙂"}]}'.encode()]
    server.prompt = None
    with pytest.raises(BackendUnavailable, match="no prompt"):
        await b.apply_template(raw)
    await b.aclose()


@pytest.mark.parametrize(
    ("status", "expected"),
    [(400, BadRequest), (404, BadRequest), (500, BackendUnavailable), (501, BackendUnsupported)],
)
async def test_a_prompt_the_server_refuses_is_a_bad_request(status: int, expected: type[KvError]) -> None:
    said = {"error": {"code": status, "message": "Cannot have 2 or more assistant messages"}}
    b = backend(lambda r: httpx.Response(status, json=said))
    for call in (b.apply_template(b"{}"), b.tokenize("x", add_special=True, parse_special=True)):
        with pytest.raises(expected, match="2 or more assistant"):
            await call
    await b.aclose()


@pytest.mark.parametrize(
    ("failure", "expected"),
    [
        (httpx.ConnectError("refused"), BackendUnavailable),
        (httpx.ReadTimeout("slow"), OperationTimeout),
        (httpx.RemoteProtocolError("eof"), BackendUnavailable),
    ],
)
async def test_prompt_call_failures_are_converted(failure: Exception, expected: type[KvError]) -> None:
    b = backend(raise_(failure))
    with pytest.raises(expected):
        await b.apply_template({"messages": []})
    with pytest.raises(expected):
        await b.tokenize("x", add_special=True, parse_special=True)
    await b.aclose()


async def test_text_json_cannot_carry_is_refused_before_any_call() -> None:
    server = Tokenizer()
    b = backend(server)
    with pytest.raises(BadRequest, match="lone surrogate"):
        await b.tokenize("\ud800", add_special=True, parse_special=True)
    with pytest.raises(BadRequest, match="JSON"):
        await b.apply_template({"messages": [], "x": float("inf")})
    assert server.sent == []
    await b.aclose()


async def test_prompt_calls_are_bounded_by_the_request_timeout() -> None:
    seen: list[object] = []

    def handle(request: httpx.Request) -> httpx.Response:
        seen.append(request.extensions["timeout"])
        return Tokenizer()(request)

    b = LlamaCppBackend(base_url="http://llama", request_timeout_s=3.5, transport=httpx.MockTransport(handle))
    await b.apply_template({"messages": []})
    await b.tokenize("x", add_special=True, parse_special=True)
    assert seen and all(t == {"connect": 2.0, "read": 3.5, "write": 3.5, "pool": 3.5} for t in seen)
    await b.aclose()
