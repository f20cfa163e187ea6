"""The blocking client `KvSidecar` beside `AsyncKvSidecar`: same methods, requests, answers and errors.

The sync client is driven against the daemon served in-process (uvicorn, lifespan, token auth, the fake
backend) on a thread of its own, over TCP and the unix socket; the request building and error mapping both
clients share is checked with httpx's MockTransport, the two side by side.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import tempfile
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import pytest
import uvicorn

from kvsidecar.backend.fake import FakeKvBackend
from kvsidecar.client import AsyncKvSidecar, KvSidecar, KvSidecarClient, Lease, SidecarError
from kvsidecar.daemon.service import Daemon, build_server
from kvsidecar.testing.llama import free_port
from kvsidecar.testing.poll import until
from tests.unit.coordinator_helpers import conversation, make_config

TOKEN = "sync-client-token-0123456789abcdef"
T = TypeVar("T")


@dataclass
class Served:
    url: str
    uds: str
    daemon: Daemon
    fake: FakeKvBackend
    loop: asyncio.AbstractEventLoop

    def on_loop(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the daemon's loop (the fake engine is not thread-safe)."""

        async def call() -> T:
            return fn()

        return asyncio.run_coroutine_threadsafe(call(), self.loop).result(timeout=60)

    def client(self, *, token: str | None = TOKEN) -> KvSidecar:
        return KvSidecar(self.url, token=token)


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Served]:
    """`kvsidecar serve` in-process on a thread with its own loop; the test's thread blocks freely."""
    (tmp_path / "token").write_text(TOKEN)
    with tempfile.TemporaryDirectory(prefix="kvs-") as short:  # a unix socket path is short
        uds = str(Path(short) / "api.sock")
        listen = f"127.0.0.1:{free_port()}"
        api = {"listen": listen, "token_file": str(tmp_path / "token"), "unix_socket": uds}
        config = make_config(tmp_path, api=api)
        fake = FakeKvBackend(tmp_path / "snaps")
        ready = threading.Event()
        holder: list[tuple[uvicorn.Server, Daemon, asyncio.AbstractEventLoop]] = []
        errors: list[BaseException] = []

        async def main() -> None:
            server, socks, daemon = build_server(
                config, backends={"local": fake}, process_finder=None, watch=False
            )
            task = asyncio.ensure_future(server.serve(sockets=socks))
            await until(lambda: server.started or task.done(), timeout_s=60, what="the daemon to serve")
            holder.append((server, daemon, asyncio.get_running_loop()))
            ready.set()
            await task

        def thread_main() -> None:
            try:
                asyncio.run(main())
            except BaseException as exc:
                errors.append(exc)
                ready.set()

        thread = threading.Thread(target=thread_main, name="daemon")
        thread.start()
        assert ready.wait(timeout=60) and not errors, errors
        server, daemon, loop = holder[0]
        assert server.started
        try:
            yield Served(f"http://{listen}", uds, daemon, fake, loop)
        finally:
            loop.call_soon_threadsafe(setattr, server, "should_exit", True)
            thread.join(timeout=60)
            assert not thread.is_alive() and not errors, errors


def test_sync_client_context_manager_releases_and_aborts(served: Served) -> None:
    with served.client() as kv:
        with kv.acquire("A", provider="local", model="m") as lease:
            lease.report(prompt_tokens=5, cached_tokens=0)
        assert lease.release_result is not None and lease.release_result["dirty"] is True
        with pytest.raises(RuntimeError), kv.acquire("A", provider="local", model="m") as lease2:
            raise RuntimeError("harness failed mid-request")
        assert lease2.release_result == {"released": True, "dirty": False}
        assert kv.status()["leases"] == 0
        sessions = kv.sessions()
        assert len(sessions) == 1 and sessions[0]["session"] != "A"  # hashed, never the raw id
        assert kv.status()["servers"][0]["slots"][0]["state"] == "dirty"


@pytest.mark.parametrize("session", [".", "..", "a.b", "..."])
def test_dot_session_ids_stay_one_path_segment(served: Served, session: str) -> None:
    """ "." and ".." are valid session ids: an HTTP client folds them out of a path unless they are escaped
    (session ".." was sent to POST /v1/acquire, an acquire of no session at all)."""
    with served.client() as kv:
        with kv.acquire(session, provider="local", model="m") as lease:
            assert lease.outcome == "cold" and lease.slot_id == 0
            lease.report(prompt_tokens=5, cached_tokens=0)
        assert kv.status()["sessions_in_memory"] == 1 and len(kv.sessions()) == 1


def test_sync_events_save_restore_invalidate_purge(served: Served) -> None:
    with served.client() as kv:
        with kv.acquire("A", provider="local", model="m") as lease:
            slot = lease.slot_id
            assert slot is not None
            served.on_loop(lambda: served.fake.infer(slot, conversation("A", 1)))
        assert kv.event("A", "flush")["saved"] == 1
        with kv.acquire("B", provider="local", model="m"):
            pass
        restored = kv.restore("A", provider="local", model="m")
        assert restored["outcome"] == "restored" and "lease_id" not in restored
        assert kv.save("A")["checked"] == 1
        assert kv.invalidate("A")["invalidated"] == 1
        assert kv.purge("A")["purged"] == 1
        with pytest.raises(SidecarError) as info:
            kv.purge("A")
        assert info.value.code == "KV_NOT_FOUND" and info.value.status == 404


def test_sync_turn_after_a_switch_is_restored_and_verified(served: Served) -> None:
    """A, B, A on one slot through the sync client's `acquire` blocks: the release's reuse check ran."""

    def turn(kv: KvSidecar, session: str, n: int) -> Lease:
        with kv.acquire(session, provider="local", model="m", seq=n) as lease:
            slot = lease.slot_id
            assert slot is not None
            computed, cached = served.on_loop(lambda: served.fake.infer(slot, conversation(session, n)))
            lease.report(prompt_tokens=computed, cached_tokens=cached, prompt_ms=0.5 * computed)
        return lease

    with served.client() as kv:
        assert turn(kv, "A", 1).outcome == "cold"
        assert turn(kv, "B", 1).outcome == "cold"
        again = turn(kv, "A", 2)
    assert again.outcome == "restored" and again.restored_tokens == len(conversation("A", 1))
    assert again.release_result is not None and again.release_result["restore_verification"] == "effective"


def test_sync_client_over_the_unix_socket_and_bypass(served: Served) -> None:
    with KvSidecar(token=TOKEN, uds=served.uds) as kv:
        with kv.acquire("A", provider="openai", model="gpt-5") as lease:
            pass
        assert lease.outcome == "bypass" and lease.lease_id is None and lease.release_result is None
        assert kv.status()["leases"] == 0


def test_sync_client_errors_carry_the_daemons_code(served: Served) -> None:
    with served.client(token="wrong-token-0123456789abcdef") as kv, pytest.raises(SidecarError) as info:
        kv.status()
    assert info.value.status == 401 and info.value.code == "KV_UNAUTHORIZED"
    with served.client() as kv, pytest.raises(SidecarError) as info:
        kv.acquire_lease("a\x00b", provider="local", model="m")
    assert info.value.status == 400 and info.value.code == "KV_INVALID_SESSION_ID"


# --- the two clients side by side -------------------------------------------------------------------


def test_the_clients_have_the_same_methods_and_signatures() -> None:
    assert KvSidecarClient is AsyncKvSidecar  # the async client's first name still works
    renamed = {"aclose": "close", "__aenter__": "__enter__", "__aexit__": "__exit__"}
    names = {n for n in vars(AsyncKvSidecar) if not n.startswith("_") or n in renamed}
    assert {renamed.get(n, n) for n in names} == {
        n for n in vars(KvSidecar) if not n.startswith("_") or n in renamed.values()
    }
    for name in names - set(renamed):
        a, s = inspect.signature(getattr(AsyncKvSidecar, name)), inspect.signature(getattr(KvSidecar, name))
        assert list(a.parameters.values()) == list(s.parameters.values()), name
        if name != "acquire":  # AsyncIterator[Lease] / Iterator[Lease]
            assert a.return_annotation == s.return_annotation, name
    init_a = inspect.signature(AsyncKvSidecar.__init__).parameters
    init_s = inspect.signature(KvSidecar.__init__).parameters
    assert [p for p in init_a if p != "transport"] == [p for p in init_s if p != "transport"]


Sent = tuple[str, str, Any]
Handler = Callable[[httpx.Request], httpx.Response]


def recorder(sent: list[Sent], answer: Handler) -> Handler:
    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content) if request.content else None
        sent.append((request.method, request.url.raw_path.decode(), body))
        assert request.headers["authorization"] == f"Bearer {TOKEN}"
        return answer(request)

    return handle


def drive_sync(answer: Handler, script: Callable[[Any], Any]) -> tuple[list[Sent], Any]:
    sent: list[Sent] = []
    with KvSidecar(token=TOKEN, transport=httpx.MockTransport(recorder(sent, answer))) as kv:
        try:
            result = script(kv)
        except SidecarError as exc:
            result = exc
    return sent, result


def drive_async(answer: Handler, script: Callable[[Any], Any]) -> tuple[list[Sent], Any]:
    """The same script on the async client: each method's coroutine is awaited where the sync one returns."""
    sent: list[Sent] = []

    async def run() -> Any:
        async with AsyncKvSidecar(token=TOKEN, transport=httpx.MockTransport(recorder(sent, answer))) as kv:
            try:
                return await script(kv)
            except SidecarError as exc:
                return exc

    return sent, asyncio.run(run())


def lease_answer(request: httpx.Request) -> httpx.Response:
    if request.url.path.endswith("/acquire"):
        return httpx.Response(200, json={"lease_id": "L/1", "outcome": "cold", "slot_id": 0, "extra": 1})
    if request.url.path == "/v1/sessions":
        return httpx.Response(200, json={"sessions": [{"session": "s1"}]})
    return httpx.Response(200, json={"ok": True})


SCRIPTS: dict[str, Callable[[Any], Any]] = {
    "acquire": lambda kv: kv.acquire_lease("a/../b c", provider="local", model="m", purpose="title", seq=2),
    "anonymous acquire": lambda kv: kv.acquire_lease(None, provider="local", model="m"),
    "release": lambda kv: kv.release("L/1", status="ok", prompt_tokens=10, cached_tokens=3, prompt_ms=1.5),
    "event": lambda kv: kv.event("s?x=1", "turn_end", seq=4),
    "save": lambda kv: kv.save("s#1"),
    "restore": lambda kv: kv.restore("s%2F", provider="local", model="m"),
    "invalidate": lambda kv: kv.invalidate("s"),
    "purge": lambda kv: kv.purge("s"),
    "sessions": lambda kv: kv.sessions(),
    "status": lambda kv: kv.status(),
    "raw": lambda kv: kv._call("GET", "/v1/status"),
}


@pytest.mark.parametrize("name", list(SCRIPTS))
def test_both_clients_send_the_same_request_and_read_the_same_answer(name: str) -> None:
    sync_sent, sync_result = drive_sync(lease_answer, SCRIPTS[name])
    async_sent, async_result = drive_async(lease_answer, SCRIPTS[name])
    assert sync_sent == async_sent and len(sync_sent) == 1
    assert sync_result == async_result and not isinstance(sync_result, SidecarError)
    path = sync_sent[0][1]
    assert path.startswith("/v1/") and path.count("/") <= 4  # a client string stays one path segment
    assert "/../" not in path and "?" not in path and "#" not in path


EMPTY_IDS: dict[str, tuple[Callable[[Any], Any], str]] = {
    "acquire": (lambda kv: kv.acquire_lease("", provider="local", model="m"), "KV_INVALID_SESSION_ID"),
    "event": (lambda kv: kv.event("", "turn_end"), "KV_INVALID_SESSION_ID"),
    "save": (lambda kv: kv.save(""), "KV_INVALID_SESSION_ID"),
    "restore": (lambda kv: kv.restore("", provider="local", model="m"), "KV_INVALID_SESSION_ID"),
    "invalidate": (lambda kv: kv.invalidate(""), "KV_INVALID_SESSION_ID"),
    "purge": (lambda kv: kv.purge(""), "KV_INVALID_SESSION_ID"),
    "release": (lambda kv: kv.release("", status="ok"), "KV_LEASE_NOT_FOUND"),
}


@pytest.mark.parametrize("name", list(EMPTY_IDS))
def test_an_empty_id_is_refused_before_anything_is_sent(name: str) -> None:
    """`/v1/sessions//save` would be "no such route" (404 KV_NOT_FOUND): the client gives the code the
    daemon gives a bad id instead, and sends nothing."""
    script, code = EMPTY_IDS[name]
    for sent, error in (drive_sync(lease_answer, script), drive_async(lease_answer, script)):
        assert sent == [] and isinstance(error, SidecarError), error
        assert error.code == code and error.status == (404 if code == "KV_LEASE_NOT_FOUND" else 400)


def test_the_acquire_block_releases_alike_in_both_clients() -> None:
    def sync_block(kv: KvSidecar) -> Lease:
        with pytest.raises(ValueError), kv.acquire("S", provider="local", model="m") as lease:
            lease.report(prompt_tokens=7, cached_tokens=2, prompt_ms=3.0)
            raise ValueError("the model call failed")
        with kv.acquire("S", provider="local", model="m") as lease:
            lease.report(prompt_tokens=7, cached_tokens=2, prompt_ms=3.0)
        return lease

    async def async_block(kv: AsyncKvSidecar) -> Lease:
        with pytest.raises(ValueError):
            async with kv.acquire("S", provider="local", model="m") as lease:
                lease.report(prompt_tokens=7, cached_tokens=2, prompt_ms=3.0)
                raise ValueError("the model call failed")
        async with kv.acquire("S", provider="local", model="m") as lease:
            lease.report(prompt_tokens=7, cached_tokens=2, prompt_ms=3.0)
        return lease

    sync_sent, sync_lease = drive_sync(lease_answer, sync_block)
    async_sent, async_lease = drive_async(lease_answer, async_block)
    assert sync_sent == async_sent
    assert [s[2]["status"] for s in sync_sent if s[1].endswith("/release")] == ["aborted", "ok"]
    assert sync_sent[-1] == (
        "POST",
        "/v1/leases/L%2F1/release",
        {"status": "ok", "prompt_ms": 3.0, "prompt_tokens": 7, "cached_tokens": 2},
    )
    assert sync_lease == async_lease and sync_lease.release_result == {"ok": True}


@pytest.mark.parametrize(
    ("answer", "status", "code", "message", "hint"),
    [
        (
            httpx.Response(409, json={"error": {"code": "KV_X", "message": "m", "hint": "h"}}),
            409,
            "KV_X",
            "m",
            "h",
        ),
        (httpx.Response(502, text="<html>bad gateway</html>"), 502, "KV_HTTP_ERROR", "<html>bad gateway", ""),
        (httpx.Response(500, text='{"error":"flat string"}'), 500, "KV_HTTP_ERROR", '{"error":"flat', ""),
        (httpx.Response(200, json=["not", "an", "object"]), 200, "KV_BAD_RESPONSE", "POST /v1/", ""),
        (httpx.Response(200, text="not json"), 200, "KV_BAD_RESPONSE", "POST /v1/", ""),
        (httpx.Response(200, json={"lease_id": "L"}), 200, "KV_BAD_RESPONSE", "POST /v1/", ""),
    ],
)
def test_both_clients_map_errors_and_bad_answers_alike(
    answer: httpx.Response, status: int, code: str, message: str, hint: str
) -> None:
    """An answer that is not the daemon's documented shape is a `SidecarError`, never an AttributeError."""

    def reply(_: httpx.Request) -> httpx.Response:
        return httpx.Response(answer.status_code, content=answer.content, headers=answer.headers)

    script = SCRIPTS["acquire"]
    for _, error in (drive_sync(reply, script), drive_async(reply, script)):
        assert isinstance(error, SidecarError), error
        assert (error.status, error.code, error.hint) == (status, code, hint)
        assert error.message.startswith(message), error.message
