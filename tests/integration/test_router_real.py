"""A llama-server router's models swap without losing a turn, on a real llama-server 11434 router (two
generated models, `--models-max 1`, `--parallel 2`) and the real daemon with its proxy.

Each model is a server entry of its own (`servers.NAME.model`). Sessions name their model in the body, as
the router routes; the proxy pins each to a slot of that model's child. A request for the other model makes
kvsidecar save the loaded model's dirty slots, unload it and load the other; back on the first model, each
session is restored and llama-server reuses its whole earlier prompt. A child killed with kill -9 is
reported (log event, status, metric) and its session comes back from its last snapshot."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvsidecar.client import KvSidecar
from kvsidecar.testing.daemon import DaemonProcess
from kvsidecar.testing.llama import vocab_dir, words
from kvsidecar.testing.poll import eventually
from kvsidecar.testing.router import LlamaRouter, models_dir

TURN_TOKENS = 300
LONG_TOKENS = 200  # a turn still generating when the other client's request arrives


@pytest.fixture
def router(llama_bin: Path, tmp_path: Path) -> Any:
    models = models_dir(tmp_path / "models", llama_bin, vocab_dir(llama_bin), {"alpha": 1234, "beta": 99})
    rt = LlamaRouter(
        binary=llama_bin,
        models_dir=models,
        slot_save_path=tmp_path / "snap",
        log_path=tmp_path / "router.log",
    ).start()
    yield rt
    rt.stop()


def daemon_for(rt: LlamaRouter, work: Path) -> DaemonProcess:
    entry = {"base_url": rt.base_url, "snapshot_dir": str(rt.slot_save_path), "mode": "managed-slots"}
    return DaemonProcess(
        work,
        base_url=rt.base_url,
        snapshot_dir=rt.slot_save_path,
        servers={"local": {**entry, "model": "alpha"}, "beta": {**entry, "model": "beta"}},
        proxy={"enabled": True, "server": "local"},
        # only a swap saves here: no idle save, no background save
        checkpoint={"idle_s": None, "max_unsaved_s": 0, "policy": "save-before-evict"},
    )


class Sessions:
    """Agent turns through the proxy: each session's prompt grows by TURN_TOKENS a turn."""

    def __init__(self, daemon: DaemonProcess) -> None:
        self.daemon, self.n = daemon, dict[str, int]()

    def turn(self, session: str, model: str) -> tuple[str, int, int]:
        self.n[session] = self.n.get(session, 0) + 1
        body = {
            "model": model,
            "prompt": words(session, TURN_TOKENS * self.n[session]),
            "n_predict": 2,
            "cache_prompt": True,
            "temperature": 0,
        }
        headers = {**self.daemon.auth, "X-Session-Id": session}
        r = httpx.post(f"{self.daemon.proxy_url}/completion", json=body, headers=headers, timeout=300)
        assert r.status_code == 200, r.text
        t = r.json()["timings"]
        return r.headers["x-kv-outcome"], t["prompt_n"], t["cache_n"]

    def status(self) -> dict[str, Any]:
        data = httpx.get(f"{self.daemon.url}/v1/status", headers=self.daemon.auth, timeout=30).json()
        assert isinstance(data, dict)
        return data


def test_a_swap_saves_before_the_unload_and_restores_after_the_load(
    router: LlamaRouter, tmp_path: Path
) -> None:
    daemon = daemon_for(router, tmp_path / "d").start()
    try:
        s = Sessions(daemon)
        first = {x: s.turn(x, "alpha") for x in ("A1", "A2")}
        assert all(o == "cold" for o, _, _ in first.values()), first
        assert router.states() == {"alpha": "loaded", "beta": "unloaded"}
        assert not list(router.slot_save_path.glob("*.bin"))  # nothing saved yet: both turns unsaved

        outcome, _, _ = s.turn("B1", "beta")  # the router can hold one model: alpha goes
        assert outcome == "cold"
        assert router.states() == {"alpha": "unloaded", "beta": "loaded"}
        assert len(list(router.slot_save_path.glob("*.bin"))) >= 2  # A1 and A2, saved before the unload

        for x in ("A1", "A2"):  # alpha comes back (beta saved, unloaded): each session restored warm
            outcome, prompt_n, cache_n = s.turn(x, "alpha")
            resident = first[x][1] + first[x][2]  # what a resident slot would have reused: the whole prompt
            assert outcome == "restored", (x, outcome)
            assert cache_n >= 0.95 * resident, (x, cache_n, resident)
            assert prompt_n + cache_n > resident, (x, prompt_n)  # the turn's new words computed on top
        assert router.states() == {"alpha": "loaded", "beta": "unloaded"}
        outcome, _, cache_n = s.turn("B1", "beta")  # and beta's session, saved at its unload
        assert outcome == "restored" and cache_n > TURN_TOKENS, (outcome, cache_n)  # > 1 token a word

        views = s.status()["router_models"]
        assert views["local"]["unloads"] == {"kvsidecar": 2} and views["beta"]["unloads"] == {"kvsidecar": 1}
    finally:
        daemon.stop()


def test_a_child_killed_is_reported_and_its_session_comes_back(router: LlamaRouter, tmp_path: Path) -> None:
    daemon = daemon_for(router, tmp_path / "d").start()
    try:
        s = Sessions(daemon)
        _, p1, c1 = s.turn("A1", "alpha")
        s.turn("B1", "beta")  # A1 saved, alpha unloaded by kvsidecar
        assert s.turn("A1", "alpha")[0] == "restored"

        router.kill_child("alpha")  # a crash: the router did not unload it, nor did kvsidecar

        def crash_seen() -> dict[str, Any] | None:
            view = s.status()["router_models"]["local"]
            return view if view["unloads"].get("crash") == 1 else None

        view = eventually(crash_seen, timeout_s=60, what="the crash of alpha's child in status")
        assert view["last_unload"]["cause"] == "crash" and view["last_unload"]["exit_code"] not in (None, 0)
        assert "kv.router.model_unloaded" in daemon.log() and "cause=crash" in daemon.log()
        metrics = httpx.get(f"{daemon.url}/metrics", headers=daemon.auth, timeout=30).text
        assert 'kvsidecar_router_unloads_total{cause="crash",server="local"} 1.0' in metrics

        # its next turn loads alpha again and restores A1's last snapshot (its first turn): the second
        # turn, never saved, is what the crash cost (the unsaved bound)
        outcome, _, cache_n = s.turn("A1", "alpha")
        assert outcome == "restored", outcome
        assert cache_n >= 0.95 * (p1 + c1), (cache_n, p1 + c1)

        router.unload("alpha")  # an operator's POST /models/unload: neither kvsidecar's nor a crash
        eventually(
            lambda: s.status()["router_models"]["local"]["unloads"].get("router") == 1,
            timeout_s=60,
            what="the operator's unload of alpha in status",
        )
    finally:
        daemon.stop()


def test_the_hook_api_names_the_model_its_lease_is_for(router: LlamaRouter, tmp_path: Path) -> None:
    """An acquire over the hook API names the model: its lease is a slot of that model's child, which a
    request to the router with that `model` and the lease's `id_slot` runs on."""
    daemon = daemon_for(router, tmp_path / "d").start()
    try:
        prompt = words("H", TURN_TOKENS)
        for turn in (1, 2):
            with (
                KvSidecar(daemon.url, token=daemon.token) as kv,
                kv.acquire("H", provider="local", model="beta") as lease,
            ):
                body = {
                    "model": "beta",
                    "prompt": prompt,
                    "n_predict": 2,
                    "cache_prompt": True,
                    "id_slot": lease.slot_id,
                }
                t = httpx.post(f"{router.base_url}/completion", json=body, timeout=300).json()["timings"]
                lease.report(prompt_tokens=t["prompt_n"], cached_tokens=t["cache_n"])
            assert router.states() == {"alpha": "unloaded", "beta": "loaded"}  # loaded for the lease
            if turn == 2:
                assert lease.outcome == "resident" and t["cache_n"] >= t["prompt_n"], (lease, t)
        views = httpx.get(f"{daemon.url}/v1/sessions", headers=daemon.auth, timeout=30).json()["sessions"]
        assert [v["server"] for v in views] == ["beta"], views
    finally:
        daemon.stop()


def test_a_model_added_to_the_routers_directory_is_discovered_and_swaps_without_loss(
    router: LlamaRouter, llama_bin: Path, tmp_path: Path
) -> None:
    """An entry that discovers its router's models (`discover_models`, no `model:`): a model put in the
    models directory after kvsidecar started is listed (kvsidecar asks the router to re-read it), managed
    and routed by the body's `model`, saved before kvsidecar unloads it and restored after it loads again."""
    printed = subprocess.run(
        [sys.executable, "-m", "kvsidecar", "config", "router", router.base_url, "--discover"],
        capture_output=True,
        check=True,
        timeout=60,
    )
    entry = yaml.safe_load(printed.stdout)["servers"]["router"]  # the entry `config router --discover` prints
    assert entry == {
        "base_url": router.base_url,
        "discover_models": True,
        "snapshot_dir": str(router.slot_save_path),
        "mode": "managed-slots",
    }
    daemon = DaemonProcess(
        tmp_path / "d",
        base_url=router.base_url,
        snapshot_dir=router.slot_save_path,
        servers={"local": {**entry, "reload_models": True, "probe_interval_s": 1}},
        proxy={"enabled": True, "server": "local"},
        checkpoint={"idle_s": None, "max_unsaved_s": 0, "policy": "save-before-evict"},
    ).start()
    try:
        s = Sessions(daemon)
        assert s.turn("A1", "alpha")[0] == "cold"  # a model listed at the start: managed
        models_dir(router.models_dir, llama_bin, vocab_dir(llama_bin), {"gamma": 4321})  # added now
        eventually(
            lambda: "gamma" in s.status()["router_discovery"]["local"]["models"],
            timeout_s=60,
            what="gamma discovered",
        )
        first = s.turn("G1", "gamma")  # alpha saved and unloaded, gamma loaded
        assert first[0] == "cold", first
        assert s.turn("A1", "alpha")[0] == "restored"  # gamma's slot saved before its unload
        outcome, prompt_n, cache_n = s.turn("G1", "gamma")
        assert outcome == "restored", outcome
        assert cache_n >= 0.95 * (first[1] + first[2]), (cache_n, first)
        assert prompt_n + cache_n > first[1] + first[2]
        views = s.status()["router_models"]
        assert views["local.gamma"]["unloads"] == {"kvsidecar": 1}, views
        assert "kv.router.model_discovered" in daemon.log()
    finally:
        daemon.stop()


def stream(daemon: DaemonProcess, session: str, model: str, started: threading.Event) -> dict[str, Any]:
    """A long streamed turn through the proxy; `started` is set once its first tokens arrived (the request
    is then running on the model's child). Returns its last event (`stop`, `tokens_predicted`, timings)."""
    body = {
        "model": model,
        "prompt": words(session, TURN_TOKENS),
        "n_predict": LONG_TOKENS,
        "ignore_eos": True,
        "stream": True,
        "cache_prompt": True,
        "temperature": 0,
    }
    headers = {**daemon.auth, "X-Session-Id": session}
    last: dict[str, Any] = {}
    with httpx.stream("POST", f"{daemon.proxy_url}/completion", json=body, headers=headers, timeout=300) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if line.startswith("data: "):
                last = json.loads(line[6:])
                started.set()
    return last


def test_two_clients_on_two_models_at_once_wait_for_each_other(router: LlamaRouter, tmp_path: Path) -> None:
    """Two clients at the same moment on two models, `--models-max 1`: the request for beta arrives while
    alpha's is generating. It waits until alpha's is released; then alpha is saved and unloaded by kvsidecar
    and beta loaded. Neither request fails, the router never unloads a model on its own (no `cause=router`:
    nothing unsaved, nothing under a request), and alpha's session comes back restored."""
    daemon = daemon_for(router, tmp_path / "d").start()
    try:
        s = Sessions(daemon)
        started = threading.Event()
        with ThreadPoolExecutor(max_workers=2) as pool:
            long = pool.submit(stream, daemon, "A1", "alpha", started)
            assert started.wait(timeout=120), "alpha's streamed turn never started"
            other = pool.submit(s.turn, "B1", "beta")  # alpha's request is still generating
            last = long.result(timeout=300)
            assert other.result(timeout=300)[0] == "cold"
        assert last.get("stop") is True and last["tokens_predicted"] == LONG_TOKENS, last  # never cut
        assert router.states() == {"alpha": "unloaded", "beta": "loaded"}
        views = s.status()["router_models"]
        assert views["local"]["unloads"] == {"kvsidecar": 1} and views["beta"]["unloads"] == {}, views
        assert [views[n]["in_use"] for n in ("local", "beta")] == [0, 0], views  # both leases released
        # alpha's session was saved before its unload: its next turn restores it, its prompt reused
        outcome, _, cache_n = s.turn("A1", "alpha")
        assert outcome == "restored" and cache_n >= 0.95 * last["timings"]["prompt_n"], (outcome, cache_n)
    finally:
        daemon.stop()
