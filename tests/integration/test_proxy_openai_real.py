"""The proxy as OpenAI-ecosystem clients see it (issue 17), against a real llama-server with the openai SDK:
`X-KV-Reason`, `proxy.identity: session` (one session whatever the `model` string, and still never a
restore into another runtime), OpenAI-shaped errors, and one of each response header."""

from __future__ import annotations

import json
import shutil
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvsidecar.fingerprint import reasons as fingerprint
from kvsidecar.testing.daemon import DaemonProcess
from kvsidecar.testing.llama import LlamaServer, llama_server_binary, vocab_dir, words
from kvsidecar.testing.models import ModelShape, generate_llama_model
from tests.conftest import StartServer
from tests.integration.test_proxy_real import TOKEN, proxy_daemon

OTHER = ModelShape(seed=4321)  # the same shape and size as TINY, other weights


@pytest.fixture(scope="module")
def other_model() -> Path:
    return generate_llama_model(OTHER, vocab_dir=vocab_dir(llama_server_binary()))


def sdk(daemon: DaemonProcess, key: str = TOKEN) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{daemon.proxy_url}/v1", api_key=key, max_retries=0)


def chat(daemon: DaemonProcess, session: str, tokens: int, model: str) -> Any:
    """One turn of `session` (its prompt grows with `tokens`), its raw answer (headers included)."""
    return sdk(daemon).chat.completions.with_raw_response.create(
        model=model,
        messages=[{"role": "user", "content": words(session, tokens)}],
        max_tokens=4,
        temperature=0,
        extra_headers={"X-Session-Id": session},
    )


def stats(daemon: DaemonProcess) -> dict[str, Any]:
    return dict(httpx.get(f"{daemon.url}/v1/status", headers=daemon.auth).json()["stats"])


def kv(answer: Any) -> tuple[str, str | None]:
    return answer.headers["x-kv-outcome"], answer.headers.get("x-kv-reason")


def test_session_identity_and_reasons_on_a_real_server(
    start_llama: StartServer, tiny_model: Path, other_model: Path, tmp_path: Path
) -> None:
    """`proxy.identity: session`: the model string changes every turn and the session stays one (resident,
    then restored); after llama-server comes back with other weights, the snapshot is not restored into
    it, and the answer says why."""
    model = tmp_path / "model.gguf"
    shutil.copyfile(tiny_model, model)
    llama = start_llama(model=model, ctx_size=4096)
    daemon = proxy_daemon(llama, tmp_path / "kv", proxy={"identity": "session"})
    try:
        assert kv(chat(daemon, "A", 300, "gpt-4o")) == ("cold", "NO_SNAPSHOT")
        assert kv(chat(daemon, "A", 400, "qwen")) == ("resident", None)
        assert kv(chat(daemon, "B", 300, "qwen")) == ("cold", "NO_SNAPSHOT")  # A saved
        back = chat(daemon, "A", 500, "claude")
        assert kv(back) == ("restored", None) and json.loads(back.text)["timings"]["cache_n"] > 300
        assert kv(chat(daemon, "B", 400, "qwen")) == ("restored", None)  # A saved again
        hits = stats(daemon)["restore_hits"]
        llama.stop()
        shutil.copyfile(other_model, model)  # same path, same size, other weights
        llama.start()
        outcome, reason = kv(chat(daemon, "A", 600, "gpt-4o"))
        assert outcome == "cold_fallback"
        assert reason in {*fingerprint.REASON_PRIORITY, "FINGERPRINT_CHANGED"}, reason
        assert stats(daemon)["restore_hits"] == hits  # nothing restored into the other runtime
    finally:
        daemon.stop()


def test_default_identity_splits_a_session_by_model_string(start_llama: StartServer, tmp_path: Path) -> None:
    llama = start_llama(ctx_size=4096)
    daemon = proxy_daemon(llama, tmp_path / "kv")
    try:
        assert kv(chat(daemon, "A", 300, "m1")) == ("cold", "NO_SNAPSHOT")
        assert kv(chat(daemon, "A", 400, "m2")) == ("cold", "NO_SNAPSHOT")  # another identity
    finally:
        daemon.stop()


@pytest.fixture
def small(start_llama: StartServer, tmp_path: Path) -> Iterator[tuple[LlamaServer, DaemonProcess]]:
    llama = start_llama(ctx_size=1024)
    daemon = proxy_daemon(llama, tmp_path / "kv", proxy={"max_body_bytes": "64KiB"})
    try:
        yield llama, daemon
    finally:
        daemon.stop()


def raises(call: Callable[[], Any], kind: type[openai.APIStatusError], status: int, code: str) -> Any:
    with pytest.raises(kind) as caught:
        call()
    err = caught.value
    assert err.status_code == status and err.code == code, (err.status_code, err.body)
    assert isinstance(err.body, dict) and err.type and err.message
    return err


def test_errors_are_openai_errors_on_a_real_server(small: tuple[LlamaServer, DaemonProcess]) -> None:
    llama, daemon = small
    c = sdk(daemon)
    session = {"X-Session-Id": "A"}
    msgs: Any = [{"role": "user", "content": "hi"}]
    raises(lambda: c.models.retrieve("x"), openai.PermissionDeniedError, 403, "KV_PROXY_FORBIDDEN")
    raises(lambda: sdk(daemon, "wrong").models.list(), openai.AuthenticationError, 401, "KV_UNAUTHORIZED")
    raises(
        lambda: c.chat.completions.create(model="m", messages=msgs, n=2),
        openai.BadRequestError,
        400,
        "KV_BAD_REQUEST",
    )
    raises(
        lambda: c.chat.completions.create(model="m", messages=msgs, extra_headers={"X-Session-Id": "../x"}),
        openai.BadRequestError,
        400,
        "KV_INVALID_SESSION_ID",
    )
    big: Any = [{"role": "user", "content": "x" * 70_000}]
    raises(
        lambda: c.chat.completions.create(model="m", messages=big, extra_headers=session),
        openai.APIStatusError,
        413,
        "KV_PAYLOAD_TOO_LARGE",
    )
    # llama-server's own error (a prompt over its context) passes through as llama-server wrote it
    long: Any = [{"role": "user", "content": words("L", 3000)}]
    body = {"model": "m", "messages": long, "max_tokens": 1}
    direct = httpx.post(f"{llama.base_url}/v1/chat/completions", json=body, timeout=60)
    proxied = httpx.post(
        f"{daemon.proxy_url}/v1/chat/completions", json=body, headers={**daemon.auth, **session}, timeout=60
    )
    assert direct.status_code == proxied.status_code == 400 and proxied.json() == direct.json()
    assert not str(proxied.json()["error"].get("code")).startswith("KV_")
    llama.stop()
    raises(
        lambda: c.chat.completions.create(model="m", messages=msgs, extra_headers=session),
        openai.InternalServerError,
        502,
        "KV_BACKEND_UNAVAILABLE",
    )


def raw_headers(url: str, request: bytes) -> tuple[int, list[str]]:
    """Status and every header name of the answer as sent (duplicates kept)."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=60) as s:
        s.sendall(request)
        data = b""
        while b"\r\n\r\n" not in data:
            piece = s.recv(65536)
            if not piece:
                break
            data += piece
    head = data.partition(b"\r\n\r\n")[0].decode("latin-1").split("\r\n")
    return int(head[0].split()[1]), [line.split(":", 1)[0].strip().lower() for line in head[1:]]


def http_request(method: str, path: str, body: dict[str, Any] | None, **headers: str) -> bytes:
    data = json.dumps(body).encode() if body is not None else b""
    lines = [f"{method} {path} HTTP/1.1", "host: 127.0.0.1", f"content-length: {len(data)}"]
    lines += [f"{k.replace('_', '-')}: {v}" for k, v in headers.items()]
    return "\r\n".join(lines).encode() + b"\r\n\r\n" + data


def test_one_of_each_header_on_a_real_server(start_llama: StartServer, tmp_path: Path) -> None:
    llama = start_llama(ctx_size=4096)
    daemon = proxy_daemon(llama, tmp_path / "kv")
    auth = f"Bearer {TOKEN}"
    chat_body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    stream_body = {**chat_body, "stream": True}
    try:
        _, direct = raw_headers(llama.base_url, http_request("GET", "/health", None))
        assert "server" in direct  # llama-server names itself: the proxy must not add a second one
        requests = [
            http_request("POST", "/v1/chat/completions", chat_body, authorization=auth, x_session_id="A"),
            http_request("POST", "/v1/chat/completions", stream_body, authorization=auth, x_session_id="A"),
            http_request("POST", "/v1/chat/completions", chat_body, authorization=auth),
            http_request("GET", "/health", None),
            http_request("GET", "/props", None, authorization=auth, connection="keep-alive"),
            http_request("POST", "/slots/0?action=erase", {}, authorization=auth),
        ]
        for request in requests:
            status, names = raw_headers(daemon.proxy_url, request)
            counted = {n: names.count(n) for n in names}
            assert all(n == 1 for n in counted.values()), (request[:40], names)
            assert counted.get("server") == 1 and counted.get("date") == 1, names
            assert "keep-alive" not in counted and ("content-length" in counted) != (
                "transfer-encoding" in counted
            )
            assert status in (200, 403)
    finally:
        daemon.stop()
