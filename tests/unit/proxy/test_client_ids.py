"""Session ids of unmodified agent clients, from their recorded requests (kvsidecar.proxy.client_ids, issue 28)."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvsidecar.proxy import client_ids as ci
from kvsidecar.proxy.client_ids import Recognition, asgi_headers, normalize_session_id, recognize
from kvsidecar.store.naming import validate_session_id
from tests.unit.client_fixtures import Recorded, load, posts
from tests.unit.proxy import hostile


def rec(r: Recorded, **kw: Any) -> Recognition:
    return recognize(r.path, r.header_map, r.body, **kw)


def test_every_recording_is_recognized_without_error_and_ids_are_safe() -> None:
    recorded = posts()
    assert len(recorded) >= 25
    for r in recorded:
        got = rec(r)
        assert got.rejected == (), r.name
        if got.session_id is not None:
            assert validate_session_id(got.session_id) == got.session_id
            assert got.signal in ci.SIGNALS
        assert got.markers <= frozenset(ci.MARKERS)


@pytest.mark.parametrize(
    ("turn1", "turn2"),
    [("p_turn1", "p_turn2_continue"), ("ui_turn1", "ui_turn2"), ("tools_turn1", "tools_turn2_continue")],
)
def test_claude_code_turns_share_the_header_id(turn1: str, turn2: str) -> None:
    a, b = rec(load("claude", turn1)), rec(load("claude", turn2))
    assert a.session_id == b.session_id is not None
    assert a.signal == b.signal == ci.SIG_CLAUDE_HEADER
    assert not a.auxiliary and not b.auxiliary
    assert (
        rec(load("claude", "tools_turn1_tool_result")).session_id
        == rec(load("claude", "tools_turn1")).session_id
    )


def test_claude_code_second_conversation_gets_another_id() -> None:
    assert rec(load("claude", "p_conv2_turn1")).session_id != rec(load("claude", "p_turn1")).session_id


def test_claude_code_metadata_user_id_names_the_session_without_the_header() -> None:
    r = load("claude", "p_turn1")
    got = recognize(r.path, r.without("X-Claude-Code-Session-Id"), r.body)
    assert got.signal == ci.SIG_CLAUDE_METADATA
    assert got.session_id == rec(r).session_id
    legacy = copy.deepcopy(r.body)
    legacy["metadata"]["user_id"] = "user_abc_account__session_1b2c3d4e-0000-4000-8000-000000000000"
    got = recognize(r.path, r.without("X-Claude-Code-Session-Id"), legacy)
    assert (got.session_id, got.signal) == ("1b2c3d4e-0000-4000-8000-000000000000", ci.SIG_CLAUDE_METADATA)


def test_claude_code_title_request_is_auxiliary_with_the_conversations_id() -> None:
    title, turn1 = rec(load("claude", "ui_title")), rec(load("claude", "ui_turn1"))
    assert title.markers == {ci.TITLE_CLAUDE}
    assert title.auxiliary
    assert title.session_id == turn1.session_id


def test_codex_turns_share_the_session_header_and_the_title_has_a_new_id() -> None:
    t1, t2 = rec(load("codex", "exec_turn1")), rec(load("codex", "exec_turn2_resume"))
    assert t1.session_id == t2.session_id is not None
    assert t1.signal == ci.SIG_CODEX_SESSION
    assert rec(load("codex", "exec_conv2_turn1")).session_id != t1.session_id
    ui1, title, ui2 = (rec(load("codex", n)) for n in ("ui_turn1", "ui_title", "ui_turn2"))
    assert ui1.session_id == ui2.session_id
    assert title.markers == {ci.TITLE_CODEX} and title.auxiliary
    assert title.session_id is not None and title.session_id != ui1.session_id
    assert not ui1.auxiliary and not ui2.auxiliary
    tools = [rec(load("codex", n)).session_id for n in ("tools_turn1", "tools_turn1_function_output")]
    assert tools[0] == tools[1] == rec(load("codex", "tools_turn2_resume")).session_id


def test_codex_body_fields_back_up_the_headers() -> None:
    r = load("codex", "exec_turn1")
    headers = r.without("session-id", "thread-id")
    got = recognize(r.path, headers, r.body)
    assert (got.session_id, got.signal) == (rec(r).session_id, ci.SIG_PROMPT_CACHE_KEY)
    body = {k: v for k, v in r.body.items() if k != "prompt_cache_key"}
    got = recognize(r.path, headers, body)
    assert (got.session_id, got.signal) == (rec(r).session_id, ci.SIG_CLIENT_METADATA)
    got = recognize(r.path, r.without("session-id"), r.body)
    assert got.signal == ci.SIG_CODEX_THREAD
    # the title marker is also read from client_metadata when the header is gone
    title = load("codex", "ui_title")
    assert recognize(title.path, title.without("x-codex-turn-metadata"), title.body).markers == {
        ci.TITLE_CODEX
    }


def test_opencode_title_comes_first_with_the_same_id_and_is_auxiliary() -> None:
    title, t1, t2 = (rec(load("opencode", n)) for n in ("run_title", "run_turn1", "run_turn2_continue"))
    assert title.session_id == t1.session_id == t2.session_id is not None
    assert t1.signal == ci.SIG_SESSION_HEADER
    assert title.markers == {ci.TITLE_OPENCODE} and not t1.auxiliary and not t2.auxiliary
    conv2 = rec(load("opencode", "run_conv2_turn1"))
    assert conv2.session_id != t1.session_id
    assert rec(load("opencode", "run_conv2_title")).markers == {ci.TITLE_OPENCODE}
    # documented: a second conversation's first request is byte-identical to the first one's
    assert load("opencode", "run_conv2_turn1").body == load("opencode", "run_turn1").body
    r = load("opencode", "run_turn1")
    assert recognize(r.path, r.without("x-session-id"), r.body).signal == ci.SIG_AFFINITY


def test_aider_sends_no_id_and_no_marker() -> None:
    for name in ("oneshot_turn1", "oneshot_restored_history", "ui_turn1", "ui_turn2"):
        got = rec(load("aider", name))
        assert (got.session_id, got.signal, got.markers) == (None, None, frozenset())


def test_configured_header_and_field_win() -> None:
    r = load("claude", "p_turn1")
    headers = {**r.header_map, "x-my-session": ("mine-1",)}
    got = recognize(r.path, headers, r.body, configured_header="X-My-Session")
    assert (got.session_id, got.signal) == ("mine-1", ci.CONFIGURED)
    got = recognize(r.path, r.header_map, {**r.body, "user": "u-7"}, configured_field="user")
    assert (got.session_id, got.signal) == ("u-7", ci.CONFIGURED)
    # the default header keeps its own name, and wins over Claude Code's
    headers = {**r.header_map, "x-session-id": ("explicit",)}
    got = recognize(r.path, headers, r.body, configured_header="X-Session-Id")
    assert (got.session_id, got.signal) == ("explicit", ci.SIG_SESSION_HEADER)
    # an unusable configured value is reported, and the built-in signal still names the session
    headers = {**r.header_map, "x-my-session": ("x" * 300,)}
    got = recognize(r.path, headers, r.body, configured_header="X-My-Session")
    assert got.configured_rejected and got.rejected[0] == (ci.CONFIGURED, ci.R_LONG)
    assert got.signal == ci.SIG_CLAUDE_HEADER


def test_ids_are_bounded_and_hashed_never_passed_raw() -> None:
    assert normalize_session_id("abc-1") == ("abc-1", False, None)
    sid, hashed, _ = normalize_session_id("has space/../etc")
    assert hashed and sid is not None and sid.startswith(ci.HASHED_PREFIX)
    assert validate_session_id(sid) == sid and "/" not in sid
    assert normalize_session_id("has space/../etc")[0] == sid  # stable
    assert normalize_session_id("x" * (ci.ID_MAX + 1)) == (None, False, ci.R_LONG)
    assert normalize_session_id("a\nb") == (None, False, ci.R_CHARS)
    assert normalize_session_id("") == (None, False, ci.R_EMPTY)
    bads: list[object] = [None, 7, 1.5, [], {}, True]
    for bad in bads:
        assert normalize_session_id(bad) == (None, False, ci.R_TYPE)


def test_hostile_claude_requests_fall_through_without_exceptions() -> None:
    r = load("claude", "p_turn1")
    good = rec(r).session_id
    no_header = r.without("X-Claude-Code-Session-Id")
    huge = {**r.header_map, "x-claude-code-session-id": ("A" * 100_000,)}
    got = recognize(r.path, huge, r.body)
    assert got.rejected[0] == (ci.SIG_CLAUDE_HEADER, ci.R_LONG)
    assert (got.session_id, got.signal) == (good, ci.SIG_CLAUDE_METADATA)
    twice = {**r.header_map, "x-claude-code-session-id": ("a", "b")}
    assert recognize(r.path, twice, r.body).rejected[0] == (ci.SIG_CLAUDE_HEADER, ci.R_AMBIGUOUS)
    for user_id in (
        '{"session_id": ',
        "{" * 5000,
        '{"session_id": 5}',
        '{"session_id": {"a": 1}}',
        "[]",
        12,
        None,
    ):
        body = copy.deepcopy(r.body)
        body["metadata"]["user_id"] = user_id
        got = recognize(r.path, no_header, body)
        assert got.session_id is None
    deep: Any = "x"
    for _ in range(2000):
        deep = {"a": [deep]}
    metadatas: list[Any] = [
        [],
        "str",
        {"user_id": deep},
        {"user_id": json.dumps({"session_id": "s" * 10_000})},
    ]
    for metadata in metadatas:
        body = {**r.body, "metadata": metadata}
        assert recognize(r.path, no_header, body).session_id is None
    big_json = json.dumps({"session_id": "ok-1", "pad": "p" * 20_000})
    assert recognize(r.path, no_header, {**r.body, "metadata": {"user_id": big_json}}).session_id is None


def test_hostile_markers_and_bodies() -> None:
    title = load("codex", "ui_title")
    for meta in (
        "{not json",
        "[1]",
        '{"thread_source": 5}',
        json.dumps({"thread_source": "thread_title", "p": "x" * 20_000}),
    ):
        headers = {**title.without("x-codex-turn-metadata"), "x-codex-turn-metadata": (meta,)}
        body = {k: v for k, v in title.body.items() if k != "client_metadata"}
        assert recognize(title.path, headers, body).markers == frozenset()
    claude_title = load("claude", "ui_title")
    configs: list[Any] = [None, [], {"format": []}, {"format": {"type": "json_schema", "schema": []}}]
    for output_config in configs:
        body = {**claude_title.body, "output_config": output_config}
        assert recognize(claude_title.path, claude_title.header_map, body).markers == frozenset()
    # a real turn never carries a title marker even on the wrong route
    turn = load("claude", "ui_turn1")
    assert recognize("/v1/chat/completions", turn.header_map, turn.body).markers == frozenset()
    bodies: list[Any] = [None, [], "str", 5, {"messages": "x"}, {"messages": [None, 1]}, {"tools": {"a": 1}}]
    for odd in bodies:
        for route in ("/v1/messages", "/v1/chat/completions", "/v1/responses", "/completion"):
            got = recognize(route, {"x-session-id": ("s-1",)}, odd)
            assert got.session_id == "s-1"


def test_random_garbage_never_raises_inside_the_recognizers() -> None:
    """The private core, without recognize()'s catch-all: fixtures with random parts replaced."""
    rng = random.Random(28)
    garbage: list[Any] = [None, 0, -1, 1e308, "", "{", "x" * 5000, [], {}, [None], {"session_id": []}, True]
    for r in posts():
        for _ in range(20):
            body = copy.deepcopy(r.body)
            _mutate(body, rng, garbage)
            headers: dict[str, Any] = {k: v for k, v in r.header_map.items()}
            if headers and rng.random() < 0.5:
                headers[rng.choice(sorted(headers))] = rng.choice([("",), ("a", "b"), ("{",), ("\x00",)])
            ci._recognize(r.path, headers, body, "X-Session-Id", "user")


def _mutate(value: Any, rng: random.Random, garbage: list[Any], depth: int = 0) -> None:
    if depth > 6:
        return
    if isinstance(value, dict) and value:
        key = rng.choice(sorted(value))
        if rng.random() < 0.4:
            value[key] = rng.choice(garbage)
        else:
            _mutate(value[key], rng, garbage, depth + 1)
    elif isinstance(value, list) and value:
        i = rng.randrange(len(value))
        if rng.random() < 0.4:
            value[i] = rng.choice(garbage)
        else:
            _mutate(value[i], rng, garbage, depth + 1)


def test_asgi_headers_lowercases_and_keeps_repeats() -> None:
    got = asgi_headers([(b"X-Session-Id", b"a"), (b"x-session-id", b"b"), (b"Session-Id", b"\x01")])
    assert got == {"x-session-id": ("a", "b"), "session-id": ("\x01",)}
    result = recognize("/v1/chat/completions", got, {})
    assert result.session_id is None
    assert result.rejected == ((ci.SIG_CODEX_SESSION, ci.R_CHARS), (ci.SIG_SESSION_HEADER, ci.R_AMBIGUOUS))
    latin = asgi_headers([(b"x-session-id", b"caf\xe9")])  # printable but not a plain token: hashed
    assert recognize("/v1/chat/completions", latin, {}).hashed


# -- hostile requests: recognition itself never fails ----------------------------------------------------------
# `recognize()` turns any exception into "unrecognized"; its inner reading is held to raising nothing at all,
# so that no hostile body silently costs a client its session id.
HEADER_TEXT = st.text(alphabet=st.characters(min_codepoint=0, max_codepoint=255), max_size=40)
HEADER_NAMES = st.sampled_from(
    [
        "x-session-id",
        "x-claude-code-session-id",
        "session-id",
        "thread-id",
        "x-session-affinity",
        "x-codex-turn-metadata",
    ]
)


def test_any_type_confusion_at_any_field_is_read_without_error() -> None:
    for route, body in hostile.corpus(distinct=True):
        for path in hostile.paths(body):
            for value in hostile.CONFUSIONS:
                ci._recognize(route, {}, hostile.replaced(body, path, value), "x-session-id", "user")


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(
    hostile.mutated(),
    st.dictionaries(HEADER_NAMES | HEADER_TEXT, HEADER_TEXT | st.lists(HEADER_TEXT, max_size=3), max_size=4),
)
def test_any_json_and_any_headers_are_read_without_error(
    case: tuple[str, Any], headers: dict[str, Any]
) -> None:
    route, body = case
    got = ci._recognize(route, headers, body, "x-session-id", "user")
    if got.session_id is not None:
        assert validate_session_id(got.session_id) == got.session_id
    raw = [(k.encode("latin-1"), v.encode("latin-1")) for k, v in headers.items() if isinstance(v, str)]
    assert recognize(route, asgi_headers(raw), body) is not None
