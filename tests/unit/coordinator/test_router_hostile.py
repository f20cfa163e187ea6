"""Review of router discovery against hostile routers and config (issue 35): a discovered model whose derived
name is another configured entry's never takes that entry's name (nor its snapshot directory); a router that
answers `GET /models` with JSON nested past the parser's depth is a failed look (said in status), never a
crash of the daemon's start or of the discovery loop; a model found just before a stop never hangs the
stop."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from pathlib import Path

import httpx
import pytest

from kvsidecar.backend.base import KvBackend
from kvsidecar.backend.fake import FakeKvBackend
from kvsidecar.backend.llama_router import RouterModel, parse_models
from kvsidecar.backend.llamacpp import LlamaCppBackend
from kvsidecar.config import ServerConfig, config_from_mapping
from kvsidecar.coordinator.core import Coordinator
from kvsidecar.errors import BackendUnavailable
from kvsidecar.store.snapshots import SnapshotStore
from tests.unit.coordinator_helpers import make_config

DEEP = b"[" * 200_000 + b"]" * 200_000  # past CPython's recursion limit in json.loads


def deep_transport() -> httpx.MockTransport:
    return httpx.MockTransport(lambda _req: httpx.Response(200, content=DEEP))


async def coordinator(tmp_path: Path, servers: dict[str, dict[str, object]], lister: object) -> Coordinator:
    data = make_config(tmp_path, checkpoint={"idle_s": None}).model_dump(mode="json")
    config = config_from_mapping({**data, "servers": servers, "routes": {"local": next(iter(servers))}})
    store = SnapshotStore(
        state_dir=config.state_dir,
        snapshot_dirs={n: Path(str(s.snapshot_dir)) for n, s in config.servers.items()},
        verify_checksum=True,
    )
    store.open()
    coord = Coordinator(config=config, store=store, backends={}, monotonic=time.monotonic)
    coord.router_models.lister = lister  # type: ignore[assignment]
    fakes: dict[str, FakeKvBackend] = {}

    def backend(name: str, cfg: ServerConfig) -> KvBackend:
        fakes[name] = FakeKvBackend(Path(str(cfg.snapshot_dir)))
        return fakes[name]

    coord.router_models.backend_for = backend
    await coord.start()
    return coord


async def test_a_discovered_name_that_is_another_entrys_is_taken(tmp_path: Path) -> None:
    """Router `r` lists `x`, whose derived name `r.x` is the name of another discovering entry (a router
    of its own, its own directory). Before the fix `r.x` became a server of router `r` kept in entry `r.x`'s
    snapshot directory (`share_dir` returned early: the name was already the entry's)."""
    a, b = tmp_path / "a", tmp_path / "b"
    lists = {"r": ["x"], "r.x": ["y"]}

    async def lister(entry: str, _cfg: ServerConfig) -> Mapping[str, RouterModel]:
        return {m: RouterModel(id=m, status="loaded", port=41000) for m in lists[entry]}

    servers: dict[str, dict[str, object]] = {
        "r": {"base_url": "http://127.0.0.1:8080", "discover_models": True, "snapshot_dir": str(a)},
        "r.x": {"base_url": "http://127.0.0.1:8081", "discover_models": True, "snapshot_dir": str(b)},
    }
    for s in servers.values():
        s["probe_interval_s"] = 3600
    coord = await coordinator(tmp_path, servers, lister)
    try:
        assert "r.x" not in coord.servers, "router r's model took another entry's name (and directory)"
        assert coord.router_models.entries["r"].names == {}
        assert "'x'" in coord.status()["router_discovery"]["r"]["skipped"]
        assert coord.servers["r.x.y"].config.base_url.startswith("http://127.0.0.1:8081")
        assert coord.store.snapshot_dirs["r.x.y"] == b
        assert coord.router_models.members("r.x") == ["r.x.y"]
    finally:
        await coord.aclose()


async def test_json_nested_too_deep_is_a_backend_error_not_a_crash() -> None:
    backend = LlamaCppBackend(base_url="http://127.0.0.1:8080", transport=deep_transport())
    try:
        with pytest.raises(BackendUnavailable):
            parse_models(await backend._request("GET", "/models", what="router /models"))
    finally:
        await backend.aclose()


async def test_a_router_answering_nested_junk_fails_its_look_and_the_daemon_starts(tmp_path: Path) -> None:
    """The real lister's path (a backend of the router, `GET /models`) on an answer nested past the JSON
    parser's depth: the start goes on, the look is a failure said in status, and the next look works."""
    junk = {"on": True}

    async def lister(entry: str, cfg: ServerConfig) -> Mapping[str, RouterModel]:
        if not junk["on"]:
            return {"alpha": RouterModel(id="alpha", status="loaded", port=41000)}
        backend = LlamaCppBackend(base_url=cfg.base_url, transport=deep_transport())
        try:
            return parse_models(await backend._request("GET", "/models", what="router /models"))
        finally:
            await backend.aclose()

    servers: dict[str, dict[str, object]] = {
        "r": {"base_url": "http://127.0.0.1:8080", "discover_models": True}
        | {"snapshot_dir": str(tmp_path / "a"), "probe_interval_s": 3600},
    }
    coord = await coordinator(tmp_path, servers, lister)
    try:
        assert coord.status()["router_discovery"]["r"]["last_error"] is not None
        junk["on"] = False
        assert [s.name for s in await coord.router_models.sync("r")] == ["r.alpha"]
    finally:
        # the model just found is being probed for the first time: the stop still ends (before the fix the
        # probe loop's cancel could be lost in that probe, and aclose waited on it for ever)
        await asyncio.wait_for(coord.aclose(), 30)


async def test_a_lister_failing_unexpectedly_does_not_end_the_discovery(tmp_path: Path) -> None:
    """Anything a look raises (not only a KvError) is a failed look: `sync` returns, the loop goes on."""
    calls = {"n": 0}

    async def lister(entry: str, cfg: ServerConfig) -> Mapping[str, RouterModel]:
        calls["n"] += 1
        if calls["n"] == 1:
            raise TypeError("a router answer shaped like nothing expected")
        return {"alpha": RouterModel(id="alpha", status="loaded", port=41000)}

    servers: dict[str, dict[str, object]] = {
        "r": {"base_url": "http://127.0.0.1:8080", "discover_models": True}
        | {"snapshot_dir": str(tmp_path / "a"), "probe_interval_s": 3600},
    }
    coord = await coordinator(tmp_path, servers, lister)
    try:
        assert coord.status()["router_discovery"]["r"]["last_error"] is not None
        assert [s.name for s in await coord.router_models.sync("r")] == ["r.alpha"]
    finally:
        # the model just found is being probed for the first time: the stop still ends (before the fix the
        # probe loop's cancel could be lost in that probe, and aclose waited on it for ever)
        await asyncio.wait_for(coord.aclose(), 30)
