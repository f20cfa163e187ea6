"""RouterModelBackend against a fake router (httpx.MockTransport): every call names the model and never
loads it, an unloaded model reads as asleep, a load is waited for, and each unload is seen with its cause."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from kvsidecar.backend.llama_router import (
    RouterModelBackend,
    backend_for,
    parse_models,
    server_entries,
    unload_cause,
)
from kvsidecar.backend.llamacpp import LlamaCppBackend
from kvsidecar.config import ServerConfig
from kvsidecar.errors import BackendUnavailable, BackendUnsupported

PROPS = {"total_slots": 2, "default_generation_settings": {"n_ctx": 2048}, "endpoint_slots": True}


class FakeRouter:
    """The router's `/models`, `/models/load|unload` and the proxied routes, with one model `alpha`."""

    def __init__(self) -> None:
        self.status: dict[str, Any] = {"value": "unloaded", "args": ["llama-server", "--port", "0"]}
        self.port = 40000
        self.calls: list[tuple[str, str, dict[str, str], Any]] = []
        self.loads_fail = False

    def load(self) -> None:
        self.port += 1
        self.status = {
            "value": "loaded",
            "args": ["llama-server", "--port", str(self.port), "--alias", "alpha"],
        }

    def exit(self, code: int) -> None:
        self.status = {"value": "unloaded", "args": ["llama-server", "--port", "0"]}
        if code:
            self.status |= {"failed": True, "exit_code": code}

    def handle(self, request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        params = dict(request.url.params)
        self.calls.append((request.method, request.url.path, params, body))
        path = request.url.path
        if path == "/models":
            return httpx.Response(200, json={"data": [{"id": "alpha", "status": self.status}, {"id": 7}]})
        if path == "/models/load":
            if self.loads_fail:
                self.exit(1)
            else:
                self.load()
            return httpx.Response(200, json={"success": True})
        if path == "/models/unload":
            self.exit(0)
            return httpx.Response(200, json={"success": True})
        if path == "/props" and "model" not in params:
            return httpx.Response(200, json={"role": "router", "max_instances": 1})
        if self.status["value"] != "loaded":
            return httpx.Response(400, json={"error": {"message": "model is not loaded"}})
        if path == "/props":
            return httpx.Response(200, json=PROPS)
        if path == "/slots":
            return httpx.Response(200, json=[{"id": 0, "n_ctx": 2048, "is_processing": False}])
        if path == "/apply-template":
            return httpx.Response(200, json={"prompt": "p"})
        return httpx.Response(200, json={"id_slot": 0, "filename": "f", "n_saved": 3, "n_written": 9})


def backend(router: FakeRouter) -> RouterModelBackend:
    return RouterModelBackend(
        model="alpha",
        base_url="http://router",
        persist_timeout_s=2.0,
        transport=httpx.MockTransport(router.handle),
    )


def test_models_are_read_defensively() -> None:
    models = parse_models(
        {
            "data": [
                {"id": "a", "status": {"value": "loaded", "args": ["x", "--port", "1234"]}},
                {"id": "b", "status": {"value": "unloaded", "failed": True, "exit_code": 9, "args": 3}},
                {"id": "c", "status": {"value": "loaded", "args": ["x", "--port", "99999"]}},
                {"id": "d", "status": {"value": "loaded", "args": ["x", "--port", "0", "--port", "77"]}},
                {"id": "e", "status": {"exit_code": True}},
                {"id": ["not", "a", "name"]},
                "junk",
            ]
        }
    )
    assert sorted(models) == ["a", "b", "c", "d", "e"]
    assert models["a"].running and models["a"].port == 1234
    assert not models["b"].running and models["b"].failed and models["b"].exit_code == 9
    assert models["c"].port is None and not models["c"].running  # not a port
    assert models["d"].port == 77  # the last --port is the one the child parses
    assert models["a"].parallel is None  # no --parallel: llama-server picks (auto), unknown here
    assert models["e"].status == "unknown" and models["e"].exit_code is None
    assert parse_models([1, 2]) == {} and parse_models({"data": "x"}) == {}


def test_the_cause_of_an_unload() -> None:
    (gone,) = parse_models({"data": [{"id": "a", "status": {"value": "unloaded", "exit_code": 0}}]}).values()
    (crashed,) = parse_models(
        {"data": [{"id": "a", "status": {"value": "unloaded", "exit_code": 1}}]}
    ).values()
    assert unload_cause(gone, ours=False) == "router" and unload_cause(crashed, ours=False) == "crash"
    assert unload_cause(crashed, ours=True) == "kvsidecar"


async def test_every_call_names_the_model_and_never_loads_it() -> None:
    router = FakeRouter()
    router.load()
    b = backend(router)
    await b.inspect_slots()
    await b.save_slot(0, "snap.bin")
    await b.apply_template(b'{"model": "other", "messages": []}')
    calls = [c for c in router.calls if not c[1].startswith("/models")]
    assert all(c[2].get("autoload") == "false" for c in calls), calls
    get, save, template = calls
    assert get[2]["model"] == "alpha"
    assert save[3] == {"filename": "snap.bin", "model": "alpha"} and save[2]["action"] == "save"
    assert template[3] == {"model": "alpha", "messages": []}  # the router runs it on our model, no other


async def test_an_unloaded_model_reads_as_asleep_and_a_loaded_one_names_its_child() -> None:
    router = FakeRouter()
    b = backend(router)
    caps = await b.probe()
    assert caps.sleeping and caps.process_url is None and caps.alive
    assert caps.props["slots_known"] is False  # never loaded, no --parallel in its arguments
    assert not [c for c in router.calls if c[1] == "/props"]  # nothing asked of a model not loaded
    router.load()
    caps = await b.probe()
    assert not caps.sleeping and caps.process_url == f"http://127.0.0.1:{router.port}"
    assert caps.total_slots == 2 and caps.n_ctx == 2048
    router.exit(0)
    caps = await b.probe()
    assert caps.total_slots == 2 and caps.props["slots_known"]  # the slots it had, kept while it is away


async def test_the_slots_of_a_model_never_loaded_are_what_its_arguments_say() -> None:
    router = FakeRouter()
    router.status["args"] += ["--parallel", "3"]
    caps = await backend(router).probe()
    assert caps.sleeping and caps.total_slots == 3 and caps.props["slots_known"]


async def test_wake_loads_the_model_and_waits_for_it() -> None:
    router = FakeRouter()
    b = backend(router)
    await b.wake()
    assert router.status["value"] == "loaded" and await b.health()
    assert [c[3] for c in router.calls if c[1] == "/models/load"] == [{"model": "alpha"}]
    await b.wake()  # loaded already: nothing asked
    assert len([c for c in router.calls if c[1] == "/models/load"]) == 1


async def test_a_load_that_fails_is_unavailable() -> None:
    router = FakeRouter()
    router.loads_fail = True
    with pytest.raises(BackendUnavailable, match="exit code 1"):
        await backend(router).wake()


async def test_each_unload_is_seen_once_with_its_cause() -> None:
    router = FakeRouter()
    b = backend(router)
    await b.wake()
    await b.unload()  # ours
    await b.wake()
    router.exit(0)  # the router's LRU, or an operator
    await b.probe()
    await b.wake()
    router.exit(-9)  # a crash
    await b.probe()
    await b.wake()
    router.load()  # unloaded and loaded again between two looks: another port
    await b.probe()
    assert [u.cause for u in b.take_unloads()] == ["kvsidecar", "router", "crash", "router"]
    assert b.take_unloads() == []


async def test_a_model_the_router_does_not_list_is_unavailable() -> None:
    router = FakeRouter()
    b = RouterModelBackend(
        model="beta", base_url="http://router", transport=httpx.MockTransport(router.handle)
    )
    with pytest.raises(BackendUnavailable, match="lists no model"):
        await b.probe()
    assert not await b.health()


def test_a_server_entry_with_a_model_gets_the_router_backend() -> None:
    assert isinstance(backend_for(ServerConfig(model="alpha")), RouterModelBackend)
    plain = backend_for(ServerConfig())
    assert type(plain) is LlamaCppBackend


async def test_a_router_configured_as_one_llama_server_is_refused_with_what_to_do() -> None:
    router = FakeRouter()
    plain = LlamaCppBackend(base_url="http://router", transport=httpx.MockTransport(router.handle))
    with pytest.raises(BackendUnsupported, match=r"is a router .* with `model:`"):
        await plain.probe()


def test_server_entries_of_a_router_s_models() -> None:
    models = parse_models(
        {
            "data": [
                {
                    "id": "org/coder:Q4",
                    "status": {"value": "unloaded", "args": ["--slot-save-path", "/s", "-np", "2"]},
                },
                {"id": "org/coder_Q4", "status": {"value": "loaded", "args": ["--port", "5"]}},
                {"id": "../..", "status": {}},
            ]
        }
    )
    entries = server_entries("http://r:1", models)
    assert list(entries) == [
        "org-coder-Q4",
        "org-coder_Q4",
        "-----",
    ]  # no two alike, nothing but [A-Za-z0-9_-]
    assert entries["org-coder-Q4"] == {
        "base_url": "http://r:1",
        "model": "org/coder:Q4",
        "snapshot_dir": "/s",
        "mode": "managed-slots",
    }
    assert entries["org-coder_Q4"]["mode"] == "single-slot" and "snapshot_dir" not in entries["org-coder_Q4"]


async def test_the_vocabulary_is_the_models_own_entry_of_the_routers_list() -> None:
    """The router answers `GET /v1/models` itself, listing every model; only a running one carries its
    child's `meta`. The model's own entry gives its vocabulary, whatever is listed first."""

    def handle(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/v1/models"
        first = {"id": "other", "architecture": {"input_modalities": ["text"]}}  # unloaded: no meta
        mine = {"id": "m", "meta": {"n_vocab": 321}, "architecture": {"input_modalities": ["text"]}}
        return httpx.Response(200, json={"data": [first, mine]})

    b = RouterModelBackend(model="m", base_url="http://router", transport=httpx.MockTransport(handle))
    assert (await b.tokenizer_info()).n_vocab == 321
