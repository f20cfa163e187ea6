"""The proxy's guards against a real llama-server (issue 16, items 9-12): slot management refused however
it is spelled, llama-server's key only behind our token, a client that stops reading cut, and session-less
requests kept off a session's slot with the session's output still equal to a cold run."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsidecar.testing.daemon import DaemonProcess
from kvsidecar.testing.llama import LlamaServer, words
from tests.conftest import StartServer
from tests.integration.test_proxy_real import TOKEN, Setup, proxy_daemon
from tests.unit.proxy.test_app_guard import REFUSED
from tests.unit.rawhttp import open_socket, raw_request

AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def setup(start_llama: StartServer, tmp_path: Path) -> Iterator[Setup]:
    llama = start_llama(ctx_size=4096)
    daemon = proxy_daemon(llama, tmp_path)
    try:
        yield Setup(llama=llama, proxy=daemon.proxy_url, daemon=daemon)
    finally:
        daemon.stop()


def proxied(setup: Setup, session: str | None, body: dict[str, Any], path: str = "/completion") -> Any:
    headers = dict(AUTH) | ({"X-Session-Id": session} if session else {})
    r = httpx.post(f"{setup.proxy}{path}", json=body, headers=headers, timeout=120)
    assert r.status_code == 200, r.text
    return r


def turn_body(session: str, tokens: int, **extra: Any) -> dict[str, Any]:
    return {"prompt": words(session, tokens), "n_predict": 8, "temperature": 0, **extra}


def digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


# item 9 ----------------------------------------------------------------------------------------------


def test_slot_actions_never_reach_llama_server(setup: Setup) -> None:
    """Saved over kvsidecar's own file, restored from a truncated one (which aborts llama-server), erased:
    every spelling is refused, the files and llama-server are untouched."""
    proxied(setup, "A", turn_body("A", 600))
    proxied(setup, "B", turn_body("B", 600))  # A is saved to make room
    assert setup.llama.slot_save_path is not None
    files = sorted(setup.llama.slot_save_path.glob("*.bin"))
    assert files, "A's snapshot"
    before = {f.name: digest(f) for f in files}
    truncated = setup.llama.slot_save_path / "truncated.bin"
    truncated.write_bytes(files[0].read_bytes()[:4096])

    async def attack() -> list[tuple[str, str, int, str]]:
        out = []
        for method, target in REFUSED:
            for name in (files[0].name, truncated.name, "../escape.bin"):
                body = b'{"filename": "%s"}' % name.encode()
                r = await raw_request(setup.proxy, method, target, headers=AUTH, body=body)
                code = r.json()["error"]["code"] if r.body else ""
                out.append((method, target, r.status, code))
        return out

    for method, target, status, code in asyncio.run(attack()):
        assert (status, code) == (403, "KV_PROXY_FORBIDDEN"), (method, target, status)
    assert setup.llama.alive
    assert {f.name: digest(f) for f in files} == before
    assert not (setup.llama.slot_save_path.parent / "escape.bin").exists()
    slots = httpx.get(f"{setup.llama.base_url}/slots").json()
    assert all(s["id"] == 0 for s in slots)  # still one slot, still answering
    back = proxied(setup, "A", turn_body("A", 800))
    assert back.headers["x-kv-outcome"] == "restored"


# item 10 ---------------------------------------------------------------------------------------------


def test_llama_key_with_no_token_of_our_own_refuses_to_start(
    start_llama: StartServer, tmp_path: Path
) -> None:
    key = tmp_path / "llama.key"
    key.write_text("llama-secret-0123456789")
    llama = start_llama(extra_args=("--cache-ram", "0", "--api-key", "llama-secret-0123456789"))
    with pytest.raises(RuntimeError) as caught:
        DaemonProcess(
            tmp_path / "d1",
            base_url=llama.base_url,
            snapshot_dir=llama.save_dir,
            servers={"local": {"api_key_file": str(key)}},
            api={"token_file": None},
            proxy={"enabled": True},
        ).start()
    assert "KV_CONFIG_INVALID: api.token_file: required when the proxy forwards" in str(caught.value)

    daemon = proxy_daemon(llama, tmp_path / "d2", servers={"local": {"api_key_file": str(key)}})
    try:
        assert httpx.get(f"{daemon.proxy_url}/v1/models").status_code == 401  # no token: no key added
        assert httpx.get(f"{llama.base_url}/v1/models").status_code == 401  # llama-server's own guard
        ok = httpx.get(f"{daemon.proxy_url}/v1/models", headers=AUTH)
        assert ok.status_code == 200 and ok.json()["data"]
    finally:
        daemon.stop()


# item 11 ---------------------------------------------------------------------------------------------


def test_streaming_client_that_stops_reading_is_cut(start_llama: StartServer, tmp_path: Path) -> None:
    llama = start_llama(ctx_size=8192)
    daemon = proxy_daemon(
        llama, tmp_path, proxy={"client_stall_s": 1.0}, servers={"local": {"slot_wait_s": 60}}
    )
    stuck = open_socket(daemon.proxy_url, rcvbuf=4096)
    try:
        host = daemon.proxy_url.removeprefix("http://").split(":")[0]
        # n_probs makes every streamed token about 2 KB: megabytes, more than the socket buffers hold
        body = b'{"prompt": "%s", "n_predict": 3500, "n_probs": 50, "ignore_eos": true, "stream": true}' % (
            words("S", 200).encode()
        )
        stuck.sendall(
            b"POST /completion HTTP/1.1\r\nHost: %s\r\nX-Session-Id: S\r\nAuthorization: Bearer %s\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (host.encode(), TOKEN.encode(), len(body), body)
        )  # and never reads a byte of the stream
        # S holds the only slot; T waits for it (up to slot_wait_s, then 503) and gets it once S is cut
        other = proxied(Setup(llama, daemon.proxy_url, daemon), "T", turn_body("T", 300))
        assert other.headers["x-kv-outcome"] == "cold"
        status = httpx.get(f"{daemon.url}/v1/status", headers=daemon.auth).json()
        assert status["leases"] == 0 and status["stats"]["leases_expired"] == 0
        assert "kv.listener.client_stalled" in daemon.log()
    finally:
        stuck.close()
        daemon.stop()


# item 12 ---------------------------------------------------------------------------------------------


def cold_content(llama: LlamaServer, body: dict[str, Any]) -> str:
    """The same request computed from nothing (no cache reuse), straight on llama-server."""
    r = httpx.post(f"{llama.base_url}/completion", json={**body, "cache_prompt": False}, timeout=120)
    return str(r.json()["content"])


@pytest.mark.parametrize("field", ["id_slot", "id\\u005fslot"])
def test_sessionless_request_does_not_run_on_a_resident_session(setup: Setup, field: str) -> None:
    first = proxied(setup, "A", turn_body("A", 800))
    assert first.headers["x-kv-outcome"] == "cold"
    prompt_n = first.json()["timings"]["prompt_n"]
    raw = b'{"prompt": "%s", "n_predict": 4, "%s": 0}' % (words("Z", 400).encode(), field.encode())
    r = httpx.post(f"{setup.proxy}/completion", content=raw, headers=AUTH, timeout=120)
    assert r.status_code == 200 and "x-kv-outcome" not in r.headers
    follow = turn_body("A", 1000)
    again = proxied(setup, "A", follow)
    timings = again.json()["timings"]
    # the slot ran Z's prompt, so A is not resident there any more: it comes back from its snapshot,
    # and the engine reuses what was restored
    assert again.headers["x-kv-outcome"] == "restored"
    assert timings["cache_n"] >= prompt_n
    assert again.json()["content"] == cold_content(setup.llama, follow)
    assert setup.status()["stats"]["restore_ineffective"] == 0


def test_sessionless_request_goes_to_the_aux_slot_of_a_pool(start_llama: StartServer, tmp_path: Path) -> None:
    llama = start_llama(parallel=2, ctx_size=8192)
    daemon = proxy_daemon(
        llama, tmp_path, servers={"local": {"mode": "managed-slots", "reserve_aux_slot": True}}
    )
    try:
        setup = Setup(llama=llama, proxy=daemon.proxy_url, daemon=daemon)
        first = proxied(setup, "A", turn_body("A", 800))
        own, prompt_n = first.json()["id_slot"], first.json()["timings"]["prompt_n"]
        other = proxied(setup, None, {"prompt": words("Z", 400), "n_predict": 4, "id_slot": own})
        assert other.json()["id_slot"] != own
        follow = turn_body("A", 1000)
        again = proxied(setup, "A", follow)
        assert again.headers["x-kv-outcome"] == "resident"
        assert again.json()["timings"]["cache_n"] >= prompt_n  # resident for real: the engine reused it
        assert again.json()["content"] == cold_content(llama, follow)
    finally:
        daemon.stop()


# issue 26, item 8 ------------------------------------------------------------------------------------


def acquires(setup: Setup) -> int:
    status = httpx.get(f"{setup.daemon.url}/v1/status", headers=AUTH, timeout=10).json()
    return int(status["stats"]["acquires"])


def test_an_oversized_head_is_refused_before_a_session_is_acquired(setup: Setup) -> None:
    """500 headers, or one of 60 KB (llama-server, cpp-httplib, takes 100 of at most 8 KiB a line): refused
    by the proxy in its own shape before the session is acquired or its slot prepared. A head at the
    proxy's limits is one llama-server takes: forwarded and answered."""
    proxied(setup, "A", turn_body("A", 200))
    before = acquires(setup)
    for extra in ({f"x-h{i}": "v" * 100 for i in range(500)}, {"x-big": "v" * 60_000}):
        headers = {**AUTH, "X-Session-Id": "A", **extra}
        r = asyncio.run(raw_request(setup.proxy, "POST", "/completion", headers=headers, body=b"{}"))
        assert r.status == 431, r.body[:200]
        assert r.json()["error"]["code"] == "KV_HEADERS_TOO_LARGE"
    assert acquires(setup) == before  # nothing acquired, nothing restored or evicted for it
    # at the limits: 64 headers in all, three lines of nearly 8 KB, 32 KB of head
    full = {f"x-big{i}": "v" * 7900 for i in range(3)} | {f"x-h{i}": "v" * 90 for i in range(56)}
    body = b'{"prompt": "one two three", "n_predict": 2, "temperature": 0}'
    headers = {**AUTH, "X-Session-Id": "A", **full}
    r = asyncio.run(raw_request(setup.proxy, "POST", "/completion", headers=headers, body=body))
    assert r.status == 200, r.body[:300]
    assert "content" in r.json()
    assert acquires(setup) == before + 1
    assert setup.llama.alive
