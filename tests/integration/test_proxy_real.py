"""Proxy mode against a real llama-server, with the official openai SDK and with plain httpx."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvsidecar.testing.daemon import DaemonProcess
from kvsidecar.testing.llama import LlamaServer, words
from kvsidecar.testing.poll import eventually
from tests.conftest import StartServer

TOKEN = "proxy-token-0123456789abcdef"


@dataclass
class Setup:
    llama: LlamaServer
    proxy: str
    daemon: DaemonProcess

    def status(self) -> dict[str, Any]:
        return dict(httpx.get(f"{self.daemon.url}/v1/status", headers=self.daemon.auth).json())


def proxy_daemon(
    llama: LlamaServer, work: Path, *, proxy: dict[str, Any] | None = None, **overrides: Any
) -> DaemonProcess:
    return DaemonProcess(
        work,
        base_url=llama.base_url,
        snapshot_dir=llama.save_dir,
        token=TOKEN,
        proxy={"enabled": True, **(proxy or {})},
        **overrides,
    ).start()


@pytest.fixture
def setup(start_llama: StartServer, tmp_path: Path) -> Iterator[Setup]:
    llama = start_llama(ctx_size=4096)
    daemon = proxy_daemon(llama, tmp_path)
    try:
        yield Setup(llama=llama, proxy=daemon.proxy_url, daemon=daemon)
    finally:
        daemon.stop()


def client(setup: Setup) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{setup.proxy}/v1", api_key=TOKEN, max_retries=0)


def chat(setup: Setup, session: str, turn: int, **kw: Any) -> Any:
    messages: Any = [{"role": "user", "content": words(session, 400 * turn)}]
    return client(setup).chat.completions.with_raw_response.create(
        model="tiny",
        messages=messages,
        max_tokens=4,
        temperature=0,
        extra_headers={"X-Session-Id": session},
        **kw,
    )


def test_openai_sdk_switch_and_restore(setup: Setup) -> None:
    first = chat(setup, "A", 1)
    assert first.headers["x-kv-outcome"] == "cold"
    assert chat(setup, "A", 2).headers["x-kv-outcome"] == "resident"
    assert chat(setup, "B", 1).headers["x-kv-outcome"] == "cold"
    back = chat(setup, "A", 3)
    assert back.headers["x-kv-outcome"] == "restored"
    assert int(back.headers["x-kv-restored-tokens"]) > 500 and float(back.headers["x-kv-restore-ms"]) >= 0
    body = json.loads(back.text)
    assert body["choices"][0]["message"]["role"] == "assistant"
    assert body["timings"]["cache_n"] > 500  # the engine reused the restored prefix
    stats = setup.status()["stats"]
    assert stats["restore_hits"] == 1 and stats["restore_ineffective"] == 0 and setup.status()["leases"] == 0


def test_openai_sdk_streaming(setup: Setup) -> None:
    chat(setup, "S", 1)
    chat(setup, "T", 1)
    stream = client(setup).chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": words("S", 800)}],
        max_tokens=8,
        temperature=0,
        stream=True,
        extra_headers={"X-Session-Id": "S"},
    )
    chunks = [c for c in stream]
    assert len(chunks) >= 2 and any(c.choices and c.choices[0].delta.content for c in chunks)
    assert setup.status()["stats"]["restore_hits"] == 1 and setup.status()["leases"] == 0
    # the engine's timings were found in the event stream: the restore was verified, not left unknown
    metrics = httpx.get(f"{setup.daemon.url}/metrics", headers=setup.daemon.auth).text
    assert 'kvsidecar_restore_verified_total{result="effective",server="local"} 1.0' in metrics


def test_unmanaged_requests_pass_through(setup: Setup) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    direct = httpx.get(f"{setup.llama.base_url}/props").json()
    proxied = httpx.get(f"{setup.proxy}/props", headers=auth)
    assert proxied.json() == direct and "x-kv-outcome" not in proxied.headers
    body = {"prompt": "hello there", "n_predict": 6, "temperature": 0, "seed": 1, "cache_prompt": False}
    a = httpx.post(f"{setup.llama.base_url}/completion", json=body).json()
    b = httpx.post(f"{setup.proxy}/completion", json=body, headers=auth)
    assert b.json()["content"] == a["content"] and "x-kv-outcome" not in b.headers
    # it ran on a slot, so it went through the coordinator as an auxiliary request
    assert setup.status()["stats"]["acquires"] == 1 and setup.status()["leases"] == 0


def test_client_cancellation_mid_stream_releases_the_lease(setup: Setup) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}", "X-Session-Id": "C"}
    body = {"prompt": words("C", 300), "n_predict": 400, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{setup.proxy}/completion", json=body, headers=auth, timeout=60) as r:
        assert r.headers["x-kv-outcome"] == "cold"
        first = next(r.iter_lines())
        assert first.startswith("data: ")
    # the release happens when the proxy notices the disconnect
    eventually(lambda: setup.status()["leases"] == 0, timeout_s=5, what="the lease's release")
    r2 = httpx.post(
        f"{setup.proxy}/completion",
        json={"prompt": "after", "n_predict": 2},
        headers={**auth, "X-Session-Id": "D"},
        timeout=60,
    )
    assert r2.status_code == 200 and setup.llama.alive


def test_session_in_a_body_field_and_bad_input(setup: Setup, tmp_path: Path) -> None:
    auth = {"Authorization": f"Bearer {TOKEN}"}
    r = httpx.post(
        f"{setup.proxy}/completion",
        json={"prompt": "x", "n_predict": 1},
        headers={**auth, "X-Session-Id": "../etc/passwd"},
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "KV_INVALID_SESSION_ID"
    r = httpx.post(f"{setup.proxy}/completion", content=b"[1, 2]", headers={**auth, "X-Session-Id": "ok"})
    assert r.status_code == 400 and r.json()["error"]["code"] == "KV_BAD_REQUEST"
    r = httpx.get(f"{setup.proxy}/props")
    assert r.status_code == 401


def test_upstream_down_is_a_clear_502(setup: Setup) -> None:
    setup.llama.stop()
    r = httpx.post(
        f"{setup.proxy}/completion",
        json={"prompt": "x", "n_predict": 1},
        headers={"Authorization": f"Bearer {TOKEN}", "X-Session-Id": "E"},
        timeout=30,
    )
    assert r.status_code == 502 and r.json()["error"]["code"] == "KV_BACKEND_UNAVAILABLE"
    assert setup.status()["leases"] == 0 and setup.daemon.alive


async def test_proxy_over_a_slot_pool_runs_sessions_side_by_side(
    start_llama: StartServer, tmp_path: Path
) -> None:
    """managed-slots behind the proxy: two sessions stream at the same time, each pinned to its own slot,
    and after two other sessions took the slots, both come back restored."""
    llama = start_llama(parallel=2, ctx_size=8192)
    daemon = proxy_daemon(llama, tmp_path, servers={"local": {"mode": "managed-slots"}})
    auth = {"Authorization": f"Bearer {TOKEN}"}

    async def turn(c: httpx.AsyncClient, session: str, n: int) -> tuple[str, float, float, dict[str, Any]]:
        body = {"prompt": words(session, 600 * n), "n_predict": 24, "stream": True, "ignore_eos": True}
        headers = {**auth, "X-Session-Id": session}
        first = end = 0.0
        last: dict[str, Any] = {}
        async with c.stream("POST", f"{daemon.proxy_url}/completion", json=body, headers=headers) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    first = first or time.monotonic()
                    last = json.loads(line[6:])
            end = time.monotonic()
        return r.headers["x-kv-outcome"], first, end, last

    try:
        async with httpx.AsyncClient(timeout=120) as c:
            a, b = await asyncio.gather(turn(c, "A", 1), turn(c, "B", 1))
            assert a[0] == b[0] == "cold"
            assert a[1] < b[2] and b[1] < a[2]  # each streamed while the other was still streaming
            await asyncio.gather(turn(c, "C", 1), turn(c, "D", 1))  # A and B saved, slots taken
            back = await asyncio.gather(turn(c, "A", 2), turn(c, "B", 2))
        for outcome, _first, _end, last in back:
            assert outcome == "restored"
            assert last["timings"]["cache_n"] > 800  # the engine reused the restored prefix
        slots = {s["id_slot"] for *_, s in back}
        assert slots == {0, 1}
        status = dict(httpx.get(f"{daemon.url}/v1/status", headers=daemon.auth).json())
        assert status["leases"] == 0 and status["stats"]["restore_ineffective"] == 0
    finally:
        daemon.stop()


def test_silent_generation_longer_than_the_timeout_is_waited_for(
    start_llama: StartServer, tmp_path: Path
) -> None:
    """A non-streamed request sends nothing until it is done. With a 0.2 s silence timeout the proxy asks
    llama-server's /slots, sees the slot busy, and keeps waiting instead of cutting the request."""
    llama = start_llama(ctx_size=4096)
    daemon = proxy_daemon(llama, tmp_path, proxy={"upstream_timeout_s": 0.2})
    try:
        body = {"prompt": words("L", 300), "n_predict": 800, "ignore_eos": True, "temperature": 0}
        t0 = time.monotonic()
        r = httpx.post(
            f"{daemon.proxy_url}/completion",
            json=body,
            headers={"Authorization": f"Bearer {TOKEN}", "X-Session-Id": "L"},
            timeout=120,
        )
        silent_s = time.monotonic() - t0
        assert r.status_code == 200, r.text
        assert r.json()["tokens_predicted"] == 800
        assert silent_s > 0.2  # the answer really came after more silence than the timeout
    finally:
        daemon.stop()
