"""Path parameters are one raw segment each, percent-decoded after matching (issue 17, D7): a session id
the clients percent-encode into one segment (`a%2Fb`) is that id, refused 400 `KV_INVALID_SESSION_ID` as
the document's pattern promises, never 404 "no such route" nor a path outside the route. In-process (ASGI)
and over a real listener alike."""

from __future__ import annotations

from pathlib import Path

import httpx

from kvsidecar.client.wire import _session_path as session_path
from tests.unit.coordinator_helpers import Harness
from tests.unit.http.test_listener import TOKEN, serve_api
from tests.unit.http.test_router import asgi, assert_nothing_changed, listening
from tests.unit.rawhttp import raw_request

ACQUIRE = b'{"provider": "local", "model": "m"}'
# Each is one segment on the wire; decoded once it is not a valid session id.
HOSTILE = [
    "a%2Fb",  # a/b
    "%2F",
    "..%2F..%2Fetc%2Fpasswd",
    "a%00b",
    "a%252Fb",  # double-encoded: decoded once to `a%2Fb`, never twice
    "%252e%252e",
    "%FF",  # not UTF-8
    "%C3%28",  # not UTF-8 either
    "a%",  # a dangling `%`
    "%zz",
    "%C3%A9",  # é: UTF-8, but not in the alphabet
]
# (method, template) of every route with a session id, with its body
SESSION_ROUTES = [
    ("POST", "/v1/sessions/{}/acquire", ACQUIRE),
    ("POST", "/v1/sessions/{}/events", b'{"type": "flush"}'),
    ("POST", "/v1/sessions/{}/save", b""),
    ("POST", "/v1/sessions/{}/restore", b""),
    ("POST", "/v1/sessions/{}/invalidate", b""),
    ("GET", "/v1/sessions/{}", b""),
    ("DELETE", "/v1/sessions/{}", b""),
]


async def answers(c: httpx.AsyncClient) -> list[tuple[str, int, str]]:
    out = []
    for sid in HOSTILE:
        for method, template, body in SESSION_ROUTES:
            r = await c.request(method, template.format(sid), content=body)
            out.append((f"{method} {template.format(sid)}", r.status_code, r.json()["error"]["code"]))
    return out


async def test_an_encoded_hostile_session_id_is_refused_in_its_route(h: Harness) -> None:
    async with asgi(h) as c:
        got = await answers(c)
    assert got == [(where, 400, "KV_INVALID_SESSION_ID") for where, _, _ in got]
    assert_nothing_changed(h)


async def test_the_real_listener_answers_the_same(h: Harness) -> None:
    async with listening(h) as c:
        got = await answers(c)
    assert got == [(where, 400, "KV_INVALID_SESSION_ID") for where, _, _ in got]
    assert_nothing_changed(h)


async def test_the_clients_encoding_reaches_the_route(h: Harness) -> None:
    """What the client sends for a hostile id (kvsidecar.client_wire) is refused as a session id."""
    async with asgi(h) as c:
        for sid in ["a/b", "../x", "a\x00b", "a%2Fb", "a?b", "a#b", "é/"]:
            r = await c.post(session_path(sid, "invalidate"))
            assert r.status_code == 400 and r.json()["error"]["code"] == "KV_INVALID_SESSION_ID", sid
    assert_nothing_changed(h)


async def test_encoded_dots_stay_a_session_id_inside_the_route(h: Harness) -> None:
    """`%2e%2e` is the session id `..` (the documented alphabet allows it; ids are hashed, never a path):
    answered by the session route it was sent to, never by the route a dot-segment would lead to."""
    async with asgi(h) as c:
        r = await c.get("/v1/sessions/%2e%2e")
        assert r.status_code == 404 and r.json()["error"]["code"] == "KV_NOT_FOUND"
        assert "session" in r.json()["error"]["message"]
        r = await c.post("/v1/sessions/%2E%2E/acquire", content=ACQUIRE)
        assert r.status_code == 200, r.text
        await c.post(f"/v1/leases/{r.json()['lease_id']}/release", json={"status": "aborted"})
        r = await c.get("/v1/sessions/%2e%2e")
        assert r.status_code == 200 and [v["session"] for v in r.json()["session"]] == [".."], r.text


async def test_encoded_literal_segments_and_empty_parameters(h: Harness) -> None:
    async with asgi(h) as c:
        assert (await c.get("/v1/%73tatus")).status_code == 200  # an unreserved char, encoded: same path
        for path in ["/v1%2Fstatus", "/v1/sessions//acquire", "/v1/sessions/"]:
            r = await c.post(path, content=ACQUIRE)
            assert r.status_code == 404 and r.json()["error"]["code"] == "KV_NOT_FOUND", path
        r = await c.get("/v1/sessions/A%2Facquire")  # GET /v1/sessions/{session_id}, session `A/acquire`
        assert r.status_code == 400 and r.json()["error"]["code"] == "KV_INVALID_SESSION_ID"
    assert_nothing_changed(h)


async def test_a_public_path_is_public_only_as_its_own_route(tmp_path: Path) -> None:
    """No token needed on /healthz however it is spelled; an encoded slash does not make a path public."""
    async for each in serve_api(tmp_path):
        r = await raw_request(each.url, "GET", "/heal%74hz")
        assert r.status == 200
        r = await raw_request(each.url, "GET", "/v1/sessions/a%2Fb")
        assert r.status == 401 and r.json()["error"]["code"] == "KV_UNAUTHORIZED"
        r = await raw_request(
            each.url, "GET", "/v1/sessions/a%2Fb", headers={"authorization": f"Bearer {TOKEN}"}
        )
        assert r.status == 400 and r.json()["error"]["code"] == "KV_INVALID_SESSION_ID"
