"""RouterModels with the fake backend: a router's models become servers as `GET /models` lists them (at start
and at each look), each with the router entry's snapshot directory; a model gone stays an entry that reads
unavailable and comes back as the same runtime, its snapshot restored; hostile ids never name a server
unchecked; the number of models managed is bounded, and what is left out is said."""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsidecar.api.admin import _doctor
from kvsidecar.backend.base import KvBackend
from kvsidecar.backend.fake import FakeKvBackend
from kvsidecar.backend.llama_router import RouterModel, RouterModelBackend
from kvsidecar.cli.text import render_status
from kvsidecar.config import ServerConfig, config_from_mapping
from kvsidecar.coordinator.core import Coordinator
from kvsidecar.coordinator.router_models import derived_name
from kvsidecar.coordinator.state import Outcome
from kvsidecar.errors import BackendUnavailable, NotFound
from kvsidecar.store.snapshots import SIZE_MISMATCH, SnapshotStore
from tests.unit.coordinator.test_swaps import Router as FakeRouter
from tests.unit.coordinator_helpers import conversation, make_config

SAFE_NAME = re.compile(r"\Arouter\.[A-Za-z0-9._-]{1,64}\Z")


class Router:
    """What the router lists (`GET /models`), and a fake llama-server per model it has served."""

    def __init__(self, snaps: Path, models: list[str]) -> None:
        self.snaps, self.models = snaps, list(models)
        self.fakes: dict[str, FakeKvBackend] = {}
        self.down = False

    async def list(self, entry: str, cfg: ServerConfig) -> Mapping[str, RouterModel]:
        if self.down:
            raise BackendUnavailable("router down")
        return {m: RouterModel(id=m, status="loaded", port=41000) for m in self.models}

    def backend(self, name: str, cfg: ServerConfig) -> KvBackend:
        assert cfg.model is not None and not cfg.discover_models
        fake = self.fakes[cfg.model] = FakeKvBackend(self.snaps)
        return fake


async def coordinator(tmp_path: Path, router: Router, **entry: Any) -> Coordinator:
    snaps = tmp_path / "snaps"
    servers = {
        "router": {"base_url": "http://127.0.0.1:8080", "discover_models": True, "snapshot_dir": str(snaps)}
        | {"probe_interval_s": 3600, **entry},
        # an entry of its own: its model is never discovered
        "pinned": {"base_url": "http://127.0.0.1:8080", "model": "pinned-model", "snapshot_dir": str(snaps)}
        | {"probe_interval_s": 3600},
    }
    data = make_config(tmp_path, checkpoint={"idle_s": None}).model_dump(mode="json")
    config = config_from_mapping({**data, "servers": servers, "routes": {"local": "router"}})
    store = SnapshotStore(
        state_dir=config.state_dir, snapshot_dirs={n: snaps for n in config.servers}, verify_checksum=True
    )
    store.open()
    pinned = FakeKvBackend(snaps)
    coord = Coordinator(config=config, store=store, backends={"pinned": pinned}, monotonic=time.monotonic)
    coord.router_models.lister = router.list
    coord.router_models.backend_for = router.backend
    await coord.start()
    return coord


async def turn(coord: Coordinator, router: Router, session: str, model: str, n: int) -> tuple[Outcome, int]:
    got = await coord.acquire(session, provider="local", model=model)
    assert got.slot_id is not None and got.lease_id is not None, got
    prompt_n, cache_n = router.fakes[model].infer(got.slot_id, conversation(session, n))
    await coord.release(got.lease_id, status="ok", prompt_tokens=prompt_n, cached_tokens=cache_n)
    return got.outcome, cache_n


def test_a_model_id_names_a_server_only_when_it_is_safe() -> None:
    assert derived_name("router", "qwen2.5-coder-7b") == "router.qwen2.5-coder-7b"
    hostile = ["../../etc/passwd", "a/b", "ggml-org/gemma:Q4_K_M", "é", ".", "..", "x" * 65, " space"]
    names = [derived_name("router", h) for h in hostile]
    for h, name in zip(hostile, names, strict=True):
        assert name is not None and SAFE_NAME.match(name), (h, name)
        assert ".." not in name and "/" not in name and name != f"router.{h}"
    assert len(set(names)) == len(names)  # a hash of the whole id: two ids, two names
    assert derived_name("router", "a/b") != derived_name("router", "a-b")
    assert derived_name("router", "bad\x00id") is None  # no call may carry it
    assert derived_name("router", "x" * 257) is None


async def test_each_model_listed_is_a_server_of_its_own_in_the_entrys_directory(tmp_path: Path) -> None:
    router = Router(tmp_path / "snaps", ["alpha", "beta", "pinned-model"])
    coord = await coordinator(tmp_path, router, exclude_models=["beta"])
    try:
        assert sorted(coord.servers) == ["pinned", "router.alpha"]  # excluded; the pinned entry wins its id
        assert coord.store.snapshot_dirs["router.alpha"] == coord.store.snapshot_dirs["router"]
        assert coord.route("local", "alpha") is coord.servers["router.alpha"]
        assert coord.route("local", "pinned-model") is coord.servers["pinned"]
        assert coord.route("local", "unknown") is None  # passes through unmanaged
        outcome, _ = await turn(coord, router, "s1", "alpha", 1)
        assert outcome is Outcome.COLD
        status = coord.status()
        assert status["router_discovery"]["router"]["models"] == {"alpha": "router.alpha"}
        assert "router_models" in status  # the swaps' section (RouterModelBackend runtimes only)
        assert "router.alpha" in [s["name"] for s in status["servers"]]
        doctor = await _doctor(coord, deep=False)  # checked with the entry's settings, never a KeyError
        assert [r["server"] for r in doctor["servers"]] == ["pinned", "router.alpha"]
    finally:
        await coord.aclose()


async def test_a_model_added_later_is_managed_and_one_gone_comes_back_restored(tmp_path: Path) -> None:
    router = Router(tmp_path / "snaps", ["alpha"])
    coord = await coordinator(tmp_path, router)
    try:
        router.models.append("gamma")  # put in the router's models directory after kvsidecar started
        added = await coord.router_models.sync("router")
        assert [s.name for s in added] == ["router.gamma"]
        srv = coord.servers["router.gamma"]
        await turn(coord, router, "s1", "gamma", 1)
        assert (await coord.save("s1"))["saved"] >= 1
        # gone from the list: the entry stays (unavailable), its snapshot stays
        router.models.remove("gamma")
        router.fakes["gamma"].set_unavailable()
        assert await coord.router_models.sync("router") == []
        await coord.guard.refresh(srv)
        assert not srv.available
        assert coord.status()["router_discovery"]["router"]["missing"] == ["router.gamma"]
        assert coord.store.all()  # nothing deleted
        # back, as a new process of the same model: the same runtime, the session restored
        router.models.append("gamma")
        assert await coord.router_models.sync("router") == []  # nothing new: the same runtime
        router.fakes["gamma"].set_unavailable(False)
        router.fakes["gamma"].restart()
        await coord.guard.refresh(srv)
        assert coord.servers["router.gamma"] is srv
        outcome, cache_n = await turn(coord, router, "s1", "gamma", 2)
        assert outcome is Outcome.RESTORED and cache_n > 0
    finally:
        await coord.aclose()


async def test_hostile_ids_are_hashed_or_skipped_and_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    router = Router(tmp_path / "snaps", ["../../escape", "bad\nid"])
    caplog.set_level(logging.WARNING, "kvsidecar.router_models")
    coord = await coordinator(tmp_path, router)
    try:
        names = [n for n in coord.servers if n.startswith("router.")]
        assert len(names) == 1 and SAFE_NAME.match(names[0]) and ".." not in names[0].removeprefix("router.")
        assert coord.route("local", "../../escape") is coord.servers[names[0]]
        skipped = coord.status()["router_discovery"]["router"]["skipped"]
        assert list(skipped) == [ascii("bad\nid")]
        assert "kv.router.discover_skipped" in caplog.text
    finally:
        await coord.aclose()


async def test_the_models_managed_are_bounded_and_the_rest_said(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    router = Router(tmp_path / "snaps", ["m1", "m2", "m3", "m4"])
    caplog.set_level(logging.WARNING, "kvsidecar.router_models")
    coord = await coordinator(tmp_path, router, max_models=2)
    try:
        assert sorted(n for n in coord.servers if n.startswith("router.")) == ["router.m1", "router.m2"]
        view = coord.status()["router_discovery"]["router"]
        assert view["unmanaged_over_max"] == 2 and view["max_models"] == 2
        assert "kv.router.discover_bound" in caplog.text
        assert coord.route("local", "m3") is None
    finally:
        await coord.aclose()


async def test_a_router_that_does_not_answer_adds_nothing_and_is_said(tmp_path: Path) -> None:
    router = Router(tmp_path / "snaps", ["alpha"])
    router.down = True
    coord = await coordinator(tmp_path, router)
    try:
        assert [n for n in coord.servers if n.startswith("router.")] == []
        assert coord.status()["router_discovery"]["router"]["last_error"] == "router down"
        router.down = False
        assert [s.name for s in await coord.router_models.sync("router")] == ["router.alpha"]
    finally:
        await coord.aclose()


async def test_a_discovered_models_snapshot_changed_on_disk_is_seen_in_the_entrys_directory(
    tmp_path: Path,
) -> None:
    """The watcher watches the entry's directory (under the entry's name): a discovered model's file changed
    there is checked against its manifest and invalidated, as a configured server's would be."""
    router = Router(tmp_path / "snaps", ["alpha"])
    coord = await coordinator(tmp_path, router)
    try:
        await turn(coord, router, "s1", "alpha", 1)
        assert (await coord.save("s1"))["saved"] >= 1
        (manifest,) = coord.store.all()
        assert manifest.server == "router.alpha"
        rec = manifest.generation(manifest.current)
        assert rec is not None
        with (tmp_path / "snaps" / rec.filename).open("ab") as f:
            f.write(b"tampered")
        assert coord.store.recheck_file("router", rec.filename) == SIZE_MISMATCH
    finally:
        await coord.aclose()


async def test_a_checkpoint_of_the_routers_entry_saves_every_model_it_discovered(tmp_path: Path) -> None:
    """`kvsidecar checkpoint --server ENTRY --wait` (the shipped unit's ExecStop names the entry): every dirty
    session of every model discovered is saved before the answer."""
    router = Router(tmp_path / "snaps", ["alpha", "beta"])
    coord = await coordinator(tmp_path, router)
    try:
        await turn(coord, router, "s1", "alpha", 1)
        await turn(coord, router, "s2", "beta", 1)
        out = await coord.checkpoint("router", wait=True, timeout_s=30)
        assert out["servers"] == ["router.alpha", "router.beta"] and out["dirty"] == 2 and out["saved"] == 2
        assert not any(rt.dirty for rt in coord.sessions.by_key.values())
        with pytest.raises(NotFound):
            await coord.checkpoint("nope", wait=True, timeout_s=30)
    finally:
        await coord.aclose()


async def test_kvsidecar_status_says_what_discovery_left_out(tmp_path: Path) -> None:
    router = Router(tmp_path / "snaps", ["m1", "m2", "bad\x07id"])
    coord = await coordinator(tmp_path, router, max_models=1)
    try:
        text = render_status(coord.status())
        assert "router router: 1 model(s) discovered, 0 no longer listed" in text
        assert "1 left unmanaged past max_models 1; 1 id(s) skipped" in text
    finally:
        await coord.aclose()


async def test_an_alias_the_router_lists_goes_to_the_discovered_model_it_names(tmp_path: Path) -> None:
    """A request naming a model by its preset's `--alias` runs on that model's child: it goes to the model's
    discovered entry once the router has listed the alias (a RouterModelBackend on a fake router)."""
    fake_router = FakeRouter(["alpha", "beta"], max_loaded=1, aliases={"beta": ["fast"]})
    router = Router(tmp_path / "snaps", ["alpha", "beta"])

    async def listed(entry: str, cfg: ServerConfig) -> Mapping[str, RouterModel]:
        return {
            m: RouterModel(id=m, status="unloaded", aliases=frozenset(fake_router.aliases.get(m, [])))
            for m in router.models
        }

    def backend(name: str, cfg: ServerConfig) -> KvBackend:
        assert cfg.model is not None
        transport = httpx.MockTransport(fake_router.handle)
        return RouterModelBackend(model=cfg.model, base_url=cfg.base_url, transport=transport)

    router.list = listed  # type: ignore[method-assign]
    router.backend = backend  # type: ignore[method-assign]
    coord = await coordinator(tmp_path, router)
    try:
        assert coord.route("local", "fast") is coord.servers["router.beta"]
        assert coord.route("local", "alpha") is coord.servers["router.alpha"]
        assert coord.route("local", "slow") is None
    finally:
        await coord.aclose()
