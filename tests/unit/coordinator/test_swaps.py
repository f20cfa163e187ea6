"""ModelSwaps against a fake router: past `--models-max`, the least recently used model of ours is saved,
then unloaded, and only then is the next one loaded; a model not ours, or room to spare, unloads nothing;
each unload is counted once by its cause."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx

from kvsidecar.backend.llama_router import RouterModelBackend
from kvsidecar.config import ServerConfig
from kvsidecar.coordinator.breaker import CircuitBreaker
from kvsidecar.coordinator.pool import SlotPool
from kvsidecar.coordinator.server import ServerRuntime
from kvsidecar.coordinator.swaps import UNLOAD, ModelSwaps
from kvsidecar.metrics import Metrics


class Router:
    """A router of several models, `max_loaded` at once; `log` is what was asked of it, in order."""

    def __init__(
        self, models: list[str], max_loaded: int, aliases: dict[str, list[str]] | None = None
    ) -> None:
        self.loaded: dict[str, int] = {}
        self.aliases = aliases or {}
        self.models, self.max_loaded, self.log = models, max_loaded, list[str]()
        self.port = 41000

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        if path == "/props":
            return httpx.Response(200, json={"role": "router", "max_instances": self.max_loaded})
        if path == "/models":
            data = [
                {
                    "id": m,
                    "aliases": self.aliases.get(m, []),
                    "status": {"value": "loaded", "args": ["--port", str(self.loaded[m])]}
                    if m in self.loaded
                    else {"value": "unloaded"},
                }
                for m in self.models
            ]
            return httpx.Response(200, json={"data": data})
        model = json.loads(request.content)["model"]
        if path == "/models/load":
            assert len(self.loaded) < self.max_loaded or not self.max_loaded, "the router would evict"
            self.port += 1
            self.loaded[model] = self.port
            self.log.append(f"load:{model}")
        elif path == "/models/unload":
            del self.loaded[model]
            self.log.append(f"unload:{model}")
        return httpx.Response(200, json={"success": True})


class Checkpoints:
    def __init__(self, log: list[str]) -> None:
        self.log = log
        self.pool = SlotPool(is_dirty=lambda key: False, monotonic=time.monotonic)

    async def checkpoint_all(self, trigger: str, *, server: str | None = None) -> list[Any]:
        self.log.append(f"save:{server}:{trigger}")
        return []


def runtime(
    name: str, model: str, router: Router, url: str = "http://router", **config: Any
) -> ServerRuntime:
    backend = RouterModelBackend(model=model, base_url=url, transport=httpx.MockTransport(router.handle))
    return ServerRuntime(
        name=name,
        config=ServerConfig(base_url=url, model=model, **config),
        backend=backend,
        breaker=CircuitBreaker(max_consecutive_failures=3, cooldown_s=1.0, clock=lambda: 0.0),
        process_finder=None,
        digests=None,
    )


def swaps_of(servers: list[ServerRuntime], log: list[str]) -> tuple[ModelSwaps, Metrics]:
    metrics = Metrics()
    swaps = ModelSwaps(
        servers={s.name: s for s in servers},
        checkpoints=Checkpoints(log),  # type: ignore[arg-type]
        metrics=metrics,
    )
    return swaps, metrics


async def test_the_least_recently_used_model_is_saved_then_unloaded_before_the_next_loads() -> None:
    router = Router(["a", "b", "c"], max_loaded=2)
    a, b, c = (runtime(n, n, router) for n in "abc")
    swaps, metrics = swaps_of([a, b, c], router.log)
    await swaps.load(a)
    await swaps.load(b)
    a.slots[0].last_used_at, b.slots[0].last_used_at = 20.0, 10.0  # b is the least recently used
    await swaps.load(c)
    assert router.log == ["load:a", "load:b", f"save:b:{UNLOAD}", "unload:b", "load:c"]
    assert swaps.view()["b"]["unloads"] == {"kvsidecar": 1}
    assert metrics.router_unloads.labels("b", "kvsidecar")._value.get() == 1


async def test_room_to_spare_or_a_model_not_ours_unloads_nothing_of_ours() -> None:
    router = Router(["a", "b", "foreign"], max_loaded=2)
    a, b = runtime("a", "a", router), runtime("b", "b", router)
    other = runtime("elsewhere", "a", Router(["a"], 1), url="http://other-router")  # another router's
    swaps, _ = swaps_of([a, b, other], router.log)
    await swaps.load(a)
    await swaps.load(b)  # room for two
    assert router.log == ["load:a", "load:b"]
    await swaps.load(a)  # loaded already: nothing to make room for
    assert router.log == ["load:a", "load:b"]


async def test_no_limit_means_no_unload() -> None:
    router = Router(["a", "b"], max_loaded=0)
    a, b = runtime("a", "a", router), runtime("b", "b", router)
    swaps, _ = swaps_of([a, b], router.log)
    await swaps.load(a)
    await swaps.load(b)
    assert router.log == ["load:a", "load:b"]


async def test_an_unload_kvsidecar_did_not_cause_is_counted_once() -> None:
    router = Router(["a"], max_loaded=1)
    a = runtime("a", "a", router)
    swaps, metrics = swaps_of([a], router.log)
    await swaps.load(a)
    del router.loaded["a"]  # the router's own unload
    await a.backend.probe()
    swaps.observe(a)
    swaps.observe(a)
    view = swaps.view()["a"]
    assert view["unloads"] == {"router": 1} and view["last_unload"]["cause"] == "router"
    assert view["router_status"] == "unloaded"
    assert metrics.router_unloads.labels("a", "router")._value.get() == 1


async def test_a_model_with_a_request_in_flight_is_not_unloaded() -> None:
    """A slot of b runs a request (a lease holds it): making room for c never unloads b under it."""
    router = Router(["a", "b", "c"], max_loaded=3)
    a, b, c = (runtime(n, n, router) for n in "abc")
    swaps, _ = swaps_of([a, b, c], router.log)
    await swaps.load(a)
    await swaps.load(b)
    router.max_loaded = 2
    a.slots[0].last_used_at, b.slots[0].last_used_at = 20.0, 10.0  # b is the least recently used
    b.slots[0].holder = "a lease: a client's request runs on b now"
    await swaps.load(c)
    assert "unload:b" not in router.log and "unload:a" in router.log, router.log


async def test_a_model_named_by_its_alias_is_the_entry_of_that_model() -> None:
    """The router runs a call naming an alias on the aliased model's child: kvsidecar routes it there too
    (once a look at the router has seen the alias), never as an unmanaged pass-through."""
    router = Router(["qwen", "gemma"], max_loaded=2, aliases={"qwen": ["coder", "qwen-latest"]})
    qwen, gemma = runtime("qwen", "qwen", router), runtime("gemma", "gemma", router)
    swaps, _ = swaps_of([qwen, gemma], router.log)
    assert swaps.known_as("gemma", "coder") is None  # nothing seen of the router yet
    await swaps.load(qwen)
    await gemma.refresh()
    assert swaps.known_as("gemma", "coder") is qwen and swaps.known_as("qwen", "qwen-latest") is qwen
    assert swaps.known_as("qwen", "llama") is None and swaps.known_as(None, "coder") is None
