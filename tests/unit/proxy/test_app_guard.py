"""What the proxy refuses to forward, whose credential it adds, and which slot what it forwards runs on
(issue 16, items 9, 10 and 12), in front of a scripted origin with the fake backend behind the coordinator.
The same against a real llama-server: tests/integration/test_proxy_guard_real.py."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest

from kvsidecar.backend.llama_http import ROUTES, RouteKind, classify, llama_path
from kvsidecar.config import config_from_mapping
from kvsidecar.errors import ConfigError
from kvsidecar.proxy.app import Proxy
from tests.unit.coordinator_helpers import make_config, start_harness
from tests.unit.origin import Request, keep_alive_origin
from tests.unit.proxy.test_app import AUTH, TOKEN, Rig, echo, rig
from tests.unit.rawhttp import raw_request

SLOT_ACTION = b'{"filename": "0123456789abcdef0123456789abcdef.a.bin"}'

# Every spelling a client might try to reach llama-server's slot management (and other management)
# through the proxy. llama-server (cpp-httplib) decodes %XX and %uXXXX once, then matches literally.
REFUSED = [
    ("POST", "/slots/0?action=save"),
    ("POST", "/slots/0?action=restore"),
    ("POST", "/slots/0?action=erase"),
    ("POST", "/slots/0/?action=erase"),
    ("POST", "//slots/0?action=erase"),
    ("POST", "/./slots/0?action=erase"),
    ("POST", "/v1/../slots/0?action=erase"),
    ("POST", "/v1/chat/completions/../../slots/0?action=erase"),
    ("POST", "/%73lots/0?action=erase"),
    ("POST", "/%2573lots/0?action=erase"),
    ("POST", "/%u0073lots/0?action=erase"),
    ("POST", "/%2e/slots/0?action=erase"),
    ("POST", "/%2fslots/0?action=erase"),
    ("POST", "/SLOTS/0?action=erase"),
    ("POST", "/Slots/0?action=erase"),
    ("POST", "/slots;x/0?action=erase"),
    ("POST", "/slots/0;x?action=erase"),
    ("POST", "/slots/%30?action=erase"),
    ("POST", "/slots/0?action=erase&action=save"),
    ("POST", "/slots?id_slot=0&action=erase"),
    ("POST", "/slots/0%3Faction=erase"),
    ("POST", "http://127.0.0.1/slots/0?action=erase"),
    ("PUT", "/slots/0?action=erase"),
    ("PATCH", "/slots/0?action=erase"),
    ("DELETE", "/slots/0"),
    ("OPTIONS", "/slots/0"),
    ("GET", "/slots"),
    ("GET", "/slots?fail_on_no_slot=1"),
    ("GET", "/slots/0"),
    ("POST", "/props"),
    ("PUT", "/props"),
    ("POST", "/lora-adapters"),
    ("GET", "/lora-adapters"),
    ("POST", "/models/load"),
    ("POST", "/models/unload"),
    ("DELETE", "/models"),
    ("GET", "/v1/stream?conv_id=x"),
    ("DELETE", "/v1/stream?conv_id=x"),
    ("POST", "/v1/streams/lookup"),
    ("POST", "/v1/chat/completions/control"),
    ("POST", "/predict"),
    ("GET", "/cors-proxy?url=http://127.0.0.1:1/"),
    ("POST", "/tools"),
    ("GET", "/"),
    ("GET", "/index.html"),
    ("GET", "/metrics"),
    ("GET", "/v1/models/"),
    ("POST", "/v1/chat/completions/"),
    ("GET", "/v1/chat/completions"),
    ("POST", "/V1/chat/completions"),
]


@pytest.fixture
async def r(tmp_path: Path) -> AsyncIterator[Rig]:
    async for each in rig(tmp_path, keep_alive_origin(echo)):
        yield each


async def test_slot_management_is_refused_however_it_is_spelled(r: Rig) -> None:
    for method, target in REFUSED:
        resp = await raw_request(r.url, method, target, headers=AUTH, body=SLOT_ACTION)
        assert resp.status == 403, (method, target, resp.status, resp.body)
        assert resp.json()["error"]["code"] == "KV_PROXY_FORBIDDEN", (method, target)
    head = await raw_request(r.url, "HEAD", "/slots", headers=AUTH)
    assert head.status == 403
    assert r.origin.requests == [] and r.origin.connections == 0  # llama-server never heard of any
    refused = r.h.coordinator.metrics.registry.get_sample_value(
        "kvsidecar_proxy_request_total", {"kind": "refused", "result": "KV_PROXY_FORBIDDEN"}
    )
    assert refused == len(REFUSED) + 1


async def test_unauthenticated_management_is_a_401_not_a_hint(r: Rig) -> None:
    resp = await raw_request(r.url, "POST", "/slots/0?action=erase")
    assert resp.status == 401 and resp.json()["error"]["code"] == "KV_UNAUTHORIZED"
    assert r.origin.requests == []


async def test_allowed_routes_reach_llama_server_under_their_canonical_spelling(r: Rig) -> None:
    spellings = {
        ("GET", "/v1/%6dodels"): "/v1/models",
        ("GET", "/%u0070rops?x=1"): "/props?x=1",
        ("POST", "/tokeni%7Ae"): "/tokenize",
        ("GET", "/health"): "/health",
    }
    for (method, target), _ in spellings.items():
        resp = await raw_request(r.url, method, target, headers=AUTH, body=b'{"content": "x"}')
        assert resp.status == 200, (target, resp.body)
    assert [q.target for q in r.origin.requests] == list(spellings.values())


async def test_under_a_base_url_path_prefix(tmp_path: Path) -> None:
    async for each in rig(tmp_path, keep_alive_origin(echo), base_path="/llama"):
        for target in ("/llama/slots/0?action=erase", "/slots/0?action=erase", "/llama/../slots/0"):
            resp = await raw_request(each.url, "POST", target, headers=AUTH, body=SLOT_ACTION)
            assert resp.status == 403 and resp.json()["error"]["code"] == "KV_PROXY_FORBIDDEN", target
        assert (await raw_request(each.url, "GET", "/v1/%6dodels", headers=AUTH)).status == 200
        assert [q.target for q in each.origin.requests] == ["/llama/v1/models"]


def test_llama_path_decodes_like_cpp_httplib() -> None:
    assert llama_path(b"/%73lots/0") == "/slots/0"
    assert llama_path(b"/%u0073lots") == "/slots"
    assert llama_path(b"/%2573lots") == "/%73lots"  # once, not twice
    assert llama_path(b"/%zz%u00") == "/%zz%u00"  # malformed escapes stay as they are
    assert classify("POST", b"/v1/chat/completions") == ("/v1/chat/completions", RouteKind.PINNED)
    assert classify("GET", b"/v1/chat/completions") is None
    assert not any(p.startswith("/slots") or p == "/predict" for p in ROUTES)


# item 10 ---------------------------------------------------------------------------------------------


def test_llama_key_without_a_token_of_our_own_is_a_config_error(tmp_path: Path) -> None:
    key = tmp_path / "llama.key"
    key.write_text("llama-secret-key")
    data: dict[str, Any] = {
        "state_dir": str(tmp_path / "state"),
        "servers": {"local": {"api_key_file": str(key), "snapshot_dir": str(tmp_path / "s")}},
        "proxy": {"enabled": True},
    }
    with pytest.raises(ConfigError) as caught:
        config_from_mapping(data)
    assert caught.value.code == "KV_CONFIG_INVALID"
    assert caught.value.message.startswith("api.token_file: required when the proxy forwards")
    assert "set api.token_file" in caught.value.message
    (tmp_path / "token").write_text(TOKEN)
    config_from_mapping({**data, "api": {"token_file": str(tmp_path / "token")}})  # fine with a token
    config_from_mapping({**data, "proxy": {"enabled": False}})  # and without the proxy


def test_config_check_names_the_missing_token(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvsidecar.cli import main
    from tests.unit.cli.test_cli import write_config

    key = tmp_path / "llama.key"
    key.write_text("llama-secret-key")
    cfg = write_config(
        tmp_path,
        servers={"local": {"snapshot_dir": str(tmp_path / "s"), "api_key_file": str(key)}},
        proxy={"enabled": True, "listen": "127.0.0.1:9"},
    )
    assert main(["-c", str(cfg), "config", "check"]) == 2
    err = capsys.readouterr().err
    assert "api.token_file" in err and "KV_CONFIG_INVALID" in err and "Traceback" not in err


async def test_proxy_will_not_start_with_the_llama_key_and_no_token(tmp_path: Path) -> None:
    key = tmp_path / "llama.key"
    key.write_text("llama-secret-key")
    (tmp_path / "token").write_text(TOKEN)
    config = make_config(
        tmp_path,
        servers={"local": {"api_key_file": str(key)}},
        proxy={"enabled": True},
        api={"token_file": str(tmp_path / "token")},
    )
    h = await start_harness(tmp_path)
    try:
        with pytest.raises(ConfigError):
            Proxy(h.coordinator, config, token=None, check_host=True)
    finally:
        await h.coordinator.aclose()


async def test_llama_key_goes_only_with_clients_that_hold_our_token(tmp_path: Path) -> None:
    key = tmp_path / "llama.key"
    key.write_text("llama-secret-key\n")
    async for each in rig(tmp_path, keep_alive_origin(echo), server={"api_key_file": str(key)}):
        assert (await raw_request(each.url, "GET", "/v1/models")).status == 401
        bad = {"Authorization": "Bearer llama-secret-key"}
        assert (await raw_request(each.url, "GET", "/v1/models", headers=bad)).status == 401
        assert each.origin.requests == []
        assert (await raw_request(each.url, "GET", "/health")).status == 200  # public, forwarded bare
        assert (await raw_request(each.url, "GET", "/v1/models", headers=AUTH)).status == 200
        health, models = each.origin.requests
        assert "authorization" not in health.headers
        assert models.headers["authorization"] == "Bearer llama-secret-key"


# item 12 ---------------------------------------------------------------------------------------------


async def _post(r: Rig, path: str, body: bytes, session: str | None = None) -> Any:
    headers = {**AUTH, "Content-Type": "application/json"}
    if session is not None:
        headers["X-Session-Id"] = session
    async with r.client() as c:
        return await c.post(path, content=body, headers=headers)


PINNED = [p for p, (_, kind) in ROUTES.items() if kind is RouteKind.PINNED]
CLIENT_SLOT_SPELLINGS = [
    b'{"prompt": "x", "id_slot": 0}',
    b'{"prompt": "x", "id\\u005fslot": 0}',
    b'{"id_slot": 0, "prompt": "x", "id_slot": 0}',
    b'{"prompt": "x", "id_slot": "0"}',
]


async def test_sessionless_inference_runs_on_the_aux_slot_whatever_id_slot_it_names(tmp_path: Path) -> None:
    server = {"mode": "managed-slots", "reserve_aux_slot": True}
    async for each in rig(tmp_path, keep_alive_origin(echo), server=server, total_slots=3):
        first = await _post(each, "/completion", b'{"prompt": "a"}', session="A")
        own = each.origin.requests[-1].json()["id_slot"]
        assert first.headers["x-kv-outcome"] == "cold" and own != 2
        for path in PINNED:
            for body in CLIENT_SLOT_SPELLINGS:
                body = body.replace(b"0", str(own).encode())  # the slot A is resident in
                resp = await _post(each, path, body)
                assert resp.status_code == 200 and "x-kv-outcome" not in resp.headers
                sent = each.origin.requests[-1]
                assert sent.target == path and sent.body.count(b"id_slot") == 1, sent.body
                assert sent.json()["id_slot"] == 2, (path, body)  # the reserved aux slot
                assert sent.headers["content-type"] == "application/json"
        again = await _post(each, "/completion", b'{"prompt": "a b"}', session="A")
        assert (
            again.headers["x-kv-outcome"] == "resident" and each.origin.requests[-1].json()["id_slot"] == own
        )
        status = each.h.coordinator.status()
        assert status["leases"] == 0 and status["stats"]["acquires"] == 2 + len(PINNED) * 4


async def test_sessionless_inference_on_a_single_slot_saves_the_owner_first(tmp_path: Path) -> None:
    async for each in rig(tmp_path, keep_alive_origin(echo)):
        await _post(each, "/v1/chat/completions", b'{"messages": []}', session="A")
        each.h.fake.calls.clear()
        resp = await _post(each, "/v1/chat/completions", b'{"messages": [], "id_slot": 0}')
        assert resp.status_code == 200
        assert [c[0] for c in each.h.fake.calls][:1] == ["save"]  # A's work kept before the slot is used
        back = await _post(each, "/v1/chat/completions", b'{"messages": []}', session="A")
        assert back.headers["x-kv-outcome"] != "resident"  # the slot's content is no longer A's


async def test_more_than_one_completion_is_refused(r: Rig) -> None:
    for body in (b'{"prompt": "x", "n": 2}', b'{"prompt": "x", "n_cmpl": 3}', b'{"prompt": "x", "n": true}'):
        for session in (None, "A"):
            resp = await _post(r, "/v1/completions", body, session=session)
            assert resp.status_code == 400 and resp.json()["error"]["code"] == "KV_BAD_REQUEST", body
    assert r.origin.requests == []
    assert (await _post(r, "/v1/completions", b'{"prompt": "x", "n": 1}')).status_code == 200


async def test_a_pinned_route_needs_a_json_object(r: Rig) -> None:
    for body, code in (
        (b"not json", "KV_BAD_REQUEST"),
        (b"[1, 2]", "KV_BAD_REQUEST"),
        (b"[" * 100_000 + b"]" * 100_000, "KV_BODY_LIMIT"),
        (b"", "KV_BAD_REQUEST"),
    ):
        resp = await _post(r, "/completion", body)
        assert resp.status_code == 400 and resp.json()["error"]["code"] == code, body[:20]
    assert r.origin.requests == []
    async with r.client() as c:  # a JSON body sent as a form still reaches llama-server as JSON
        resp = await c.post(
            "/completion",
            content=b'{"prompt": "x"}',
            headers={"Content-Type": "multipart/form-data; boundary=x", "Content-Encoding": "gzip"},
        )
    assert resp.status_code == 200
    sent = r.origin.requests[-1]
    assert sent.headers["content-type"] == "application/json" and "content-encoding" not in sent.headers


async def test_routes_that_ignore_id_slot_need_a_single_slot_server(tmp_path: Path) -> None:
    unpinned = [p for p, (_, kind) in ROUTES.items() if kind is RouteKind.UNPINNED]
    async for each in rig(tmp_path, keep_alive_origin(echo), server={"mode": "managed-slots"}, total_slots=2):
        for path in unpinned:
            for session in (None, "A"):
                resp = await _post(each, path, b'{"input": "x"}', session=session)
                assert resp.status_code == 403, path
                assert resp.json()["error"]["code"] == "KV_PROXY_FORBIDDEN"
        assert each.origin.requests == [] and each.h.coordinator.status()["stats"]["acquires"] == 0


async def test_routes_that_ignore_id_slot_hold_the_only_slot(r: Rig) -> None:
    await _post(r, "/completion", b'{"prompt": "a"}', session="A")
    resp = await _post(r, "/v1/embeddings", b'{"input": "x"}')
    assert resp.status_code == 200 and r.origin.requests[-1].body == b'{"input": "x"}'  # untouched
    back = await _post(r, "/completion", b'{"prompt": "a b"}', session="A")
    assert back.headers["x-kv-outcome"] != "resident"
    assert r.h.coordinator.status()["leases"] == 0


async def test_stream_replay_header_is_not_forwarded(r: Rig) -> None:
    """llama-server keeps generating after the client left when a request has X-Conversation-Id: the
    lease would end while the slot is still busy."""
    async with r.client() as c:
        await c.post("/completion", json={"prompt": "x"}, headers={"X-Conversation-Id": "c1"})
    assert "x-conversation-id" not in r.origin.requests[-1].headers


async def reflect(request: Request) -> tuple[int, bytes, tuple[tuple[str, str], ...]]:
    return 200, json.dumps({"seen": request.json(), "timings": {"prompt_n": 1, "cache_n": 0}}).encode(), ()


async def test_session_request_with_its_own_id_slot_is_pinned_to_its_lease(tmp_path: Path) -> None:
    server = {"mode": "managed-slots"}
    async for each in rig(tmp_path, keep_alive_origin(reflect), server=server, total_slots=2):
        a = await _post(each, "/completion", b'{"prompt": "a"}', session="A")
        own = a.json()["seen"]["id_slot"]
        body = b'{"prompt": "b", "id_slot": %d, "cache_prompt": false}' % own
        b = (await _post(each, "/completion", body, session="B")).json()["seen"]
        assert b["id_slot"] == 1 - own and b["cache_prompt"] is True


def test_proxy_provider_must_route_to_the_proxied_server(tmp_path: Path) -> None:
    """Else its leases would name slots of another server than the one requests go to."""
    data: dict[str, Any] = {
        "state_dir": str(tmp_path / "state"),
        "servers": {"a": {"snapshot_dir": str(tmp_path / "a")}, "b": {"snapshot_dir": str(tmp_path / "b")}},
        "routes": {"pa": "a", "pb": "b"},
        "proxy": {"enabled": True, "server": "a", "provider": "pb"},
    }
    with pytest.raises(ConfigError) as caught:
        config_from_mapping(data)
    assert caught.value.message.startswith("proxy.provider: 'pb' must be routed to proxy.server 'a'")
    assert (
        config_from_mapping({**data, "proxy": {**data["proxy"], "provider": "pa"}}).proxy_provider() == "pa"
    )


# Spellings of routes the proxy knows, and of ones it does not, each sent byte for byte. None: refused (403,
# or 400 from the listener for a target HTTP does not allow) and nothing reaches llama-server; a path: what
# llama-server must get, and nothing else.
SPELLINGS: list[tuple[str, str, str | None]] = [
    ("POST", "/v1/chat/completions/", None),
    ("POST", "//v1/chat/completions", None),
    ("POST", "/v1//chat/completions", None),
    ("POST", "/v1/chat/./completions", None),
    ("POST", "/v1/x/../chat/completions", None),
    ("POST", "/v1/chat/%2e/completions", None),
    ("POST", "/v1/chat/completions%2F", None),
    ("POST", "/v1/chat/completions%00", None),
    ("POST", "/v1/chat/completions%20", None),
    ("POST", "/v1/chat/completions;x", None),
    ("POST", "/v1/chat/completions\\", None),
    ("POST", "/V1/CHAT/COMPLETIONS", None),
    ("POST", "/v1/Messages", None),
    ("POST", "/v1/messages/", None),
    ("POST", "/v1/messages/count_tokens/", None),
    ("POST", "/v1/messages/batches", None),
    ("POST", "/v1/responses/resp_1", None),
    ("POST", "/tokenize/", None),
    ("POST", "/%2e%2e/tokenize", None),
    ("POST", "/v1/chat/compl%u0065tions/", None),
    ("POST", "/v1/chat/completions%3Fx=1", None),
    ("POST", "http://127.0.0.1/v1/chat/completions/", None),
    ("PUT", "/v1/chat/completions", None),
    ("PATCH", "/props", None),
    ("DELETE", "/v1/models", None),
    ("OPTIONS", "/v1/models", None),
    ("TRACE", "/health", None),
    ("GET", "/v1/chat/completions", None),
    ("HEAD", "/v1/chat/completions", None),
    ("GET", "/tokenize", None),
    ("POST", "/health", None),
    ("POST", "/v1/models", None),
    ("POST", "/v1/chat/%63ompletions", "/v1/chat/completions"),
    ("POST", "/v1/chat%2Fcompletions", "/v1/chat/completions"),  # cpp-httplib decodes %2F in a path too
    ("POST", "/v1/chat/completions?x=1&id_slot=3", "/v1/chat/completions?x=1&id_slot=3"),
    ("POST", "http://127.0.0.1/tokenize", "/tokenize"),
    ("GET", "/v1/models?x", "/v1/models?x"),
    ("HEAD", "/v1/models", "/v1/models"),
    ("POST", "/%74okenize", "/tokenize"),
]


async def test_unknown_routes_are_refused_in_any_spelling_and_known_ones_reach_llama_server_as_checked(
    r: Rig,
) -> None:
    body = b'{"messages": [{"role": "user", "content": "x"}], "prompt": "x", "content": "x"}'
    for method, target, reaches in SPELLINGS:
        before = len(r.origin.requests)
        resp = await raw_request(r.url, method, target, headers=AUTH, body=body if method != "HEAD" else b"")
        sent = [q.target for q in r.origin.requests[before:]]
        if reaches is None:
            assert resp.status in (400, 403) and sent == [], (method, target, resp.status, sent)
            if resp.status == 403 and method != "HEAD":
                assert resp.json()["error"]["code"] == "KV_PROXY_FORBIDDEN"
        else:
            assert resp.status == 200 and sent == [reaches], (method, target, resp.status, sent)


HUGE = "1" + "0" * 400


@pytest.mark.parametrize(
    "path,body",
    [
        ("/completion", '{"prompt": "hi", "n_predict": ' + HUGE + "}"),
        ("/completion", '{"prompt": "hi", "seed": 18446744073709551616}'),  # one past uint64
        ("/completion", '{"prompt": "hi", "temperature": -' + HUGE + "}"),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "seed": ' + HUGE + "}"),
        ("/apply-template", '{"messages": [{"role": "user", "content": "x"}], "n": ' + HUGE + "}"),
        ("/completion", '{"prompt": "hi \\ud800"}'),
        ("/completion", '{"prompt": "hi \\uDBFF x"}'),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi \\udc00"}]}'),
        ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "hi"}], "\\ud800": 1}'),
        (
            "/v1/messages",
            '{"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud800"}]}',
        ),
        ("/tokenize", '{"content": ["a", "hi \\ud800"]}'),
        ("/detokenize", '{"tokens": [999999999]}'),
        ("/detokenize", '{"tokens": [-5]}'),
        ("/detokenize", '{"tokens": [1, 2.5]}'),
        ("/detokenize", '{"tokens": [true]}'),
        ("/detokenize", '{"tokens": ["1"]}'),
    ],
)
async def test_what_llama_server_cannot_parse_is_refused_before_it_is_forwarded(
    r: Rig, path: str, body: str
) -> None:
    """llama-server answers these 400 (an integer past 64 bits, a lone surrogate escape) or 500 (an id
    outside its vocabulary on `/detokenize`): the proxy refuses them itself, in the route's shape, before
    any slot is taken."""
    async with r.client() as c:
        resp = await c.post(path, content=body.encode(), headers={"X-Session-Id": "s1", **AUTH})
    assert resp.status_code == 400, resp.text
    if path == "/v1/messages":
        assert resp.json()["type"] == "error" and resp.json()["error"]["type"] == "invalid_request_error"
    else:
        assert resp.json()["error"]["code"] == "KV_BAD_REQUEST"
    assert r.origin.requests == []
    assert r.h.coordinator.status()["leases"] == 0 and not r.h.coordinator.sessions.by_key


async def test_an_escaped_backslash_and_paired_surrogates_and_ids_of_the_vocabulary_pass(r: Rig) -> None:
    bodies = {
        "/completion": '{"prompt": "a \\\\ud800 b \\ud83d\\ude00", "seed": 18446744073709551615, "n_predict": 1}',
        "/detokenize": '{"tokens": [0, 1, 2.0]}',
    }
    async with r.client() as c:
        for path, body in bodies.items():
            resp = await c.post(path, content=body.encode(), headers={"X-Session-Id": "s1", **AUTH})
            assert resp.status_code == 200, resp.text
    assert [q.target for q in r.origin.requests] == ["/completion", "/detokenize"]


@pytest.mark.parametrize("path", ["/tokenize", "/v1/messages/count_tokens", "/apply-template", "/completion"])
async def test_a_content_encoding_on_a_body_read_as_json_never_reaches_llama_server(
    r: Rig, path: str
) -> None:
    """llama-server (no zlib) answers an encoded body 415 with nothing in it: the gate read the body as
    plain JSON, so the header is dropped on every route, pinned or not."""
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "content": "x", "prompt": "x"}
    async with r.client() as c:
        resp = await c.post(path, json=body, headers={"Content-Encoding": "gzip", **AUTH})
    assert resp.status_code == 200, resp.text
    assert "content-encoding" not in r.origin.requests[-1].headers


async def test_an_encoded_form_is_refused(r: Rig) -> None:
    async with r.client() as c:
        resp = await c.post(
            "/v1/audio/transcriptions",
            content=b"--x\r\n\r\n--x--\r\n",
            headers={"Content-Type": "multipart/form-data; boundary=x", "Content-Encoding": "gzip", **AUTH},
        )
    assert resp.status_code == 400 and resp.json()["error"]["code"] == "KV_BAD_REQUEST"
    assert r.origin.requests == []
