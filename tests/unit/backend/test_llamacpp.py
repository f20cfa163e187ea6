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
