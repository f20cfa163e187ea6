"""Content-derived conversation identity over recorded client requests (kvsidecar.client_content, issue 28)."""

from __future__ import annotations

import copy
import random
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings

from kvsidecar.proxy import client_content as cc
from kvsidecar.proxy.client_content import (
    KnownConversation,
    Normalized,
    conversation_id,
    divergence_index,
    extends,
    find_conversation,
    first_divergence,
    normalize,
)
from kvsidecar.store.naming import validate_session_id
from tests.unit.client_fixtures import load, posts
from tests.unit.proxy import hostile


def norm(client: str, name: str) -> Normalized:
    r = load(client, name)
    got = normalize(r.path, r.body)
    assert got is not None, name
    return got


def known(client: str, name: str, cid: str = "conv", credential: str = "cred") -> KnownConversation:
    return KnownConversation.of(cid, credential, norm(client, name))


def test_every_recording_normalizes() -> None:
    for r in posts():
        got = normalize(r.path, r.body)
        assert got is not None, (r.client, r.name)
        assert len(got.elements) == len(got.digests) == len(got.roles) > 0


# (client, earlier, later, exact): turn N+1 carries turn N
EXTENSIONS = [
    ("claude", "p_turn1", "p_turn2_continue", True),
    ("claude", "ui_turn1", "ui_turn2", True),
    ("claude", "tools_turn1", "tools_turn1_tool_result", True),
    ("claude", "tools_turn1_tool_result", "tools_turn2_continue", True),
    ("codex", "exec_turn1", "exec_turn2_resume", True),
    ("codex", "ui_turn1", "ui_turn2", True),
    ("codex", "tools_turn1", "tools_turn1_function_output", True),
    ("codex", "tools_turn1_function_output", "tools_turn2_resume", True),
    ("opencode", "run_turn1", "run_turn2_continue", True),
    ("opencode", "tools_turn1", "tools_turn1_tool_result", True),
    ("opencode", "tools_turn1_tool_result", "tools_turn2_continue", True),
    ("aider", "ui_turn1", "ui_turn2", False),  # aider drops the reminder from the previous user message
]


@pytest.mark.parametrize(("client", "earlier", "later", "exact"), EXTENSIONS)
def test_next_turn_extends_the_previous_one(client: str, earlier: str, later: str, exact: bool) -> None:
    a, b = norm(client, earlier), norm(client, later)
    match = extends(b, KnownConversation.of("conv", "cred", a))
    assert match is not None
    assert (match.conversation_id, match.matched, match.exact) == ("conv", len(a.elements), exact)
    assert (first_divergence(a, b) is None) is exact
    assert divergence_index(b, KnownConversation.of("conv", "cred", a)) == (
        None if exact else len(a.elements) - 1
    )


# (client, first, other): requests that must not continue `first`
NOT_EXTENSIONS = [
    ("claude", "p_turn1", "p_conv2_turn1"),
    ("claude", "ui_turn1", "ui_title"),
    ("claude", "ui_title", "ui_turn2"),
    ("codex", "exec_turn1", "exec_conv2_turn1"),
    ("codex", "ui_turn1", "ui_title"),
    ("codex", "ui_title", "ui_turn2"),
    ("opencode", "run_title", "run_turn1"),
    ("opencode", "run_turn1", "run_title"),
    ("aider", "oneshot_turn1", "ui_turn1"),
    ("aider", "oneshot_turn1", "oneshot_restored_history"),  # a restored history is reshaped, not extended
]


@pytest.mark.parametrize(("client", "first", "other"), NOT_EXTENSIONS)
def test_other_conversations_and_title_requests_do_not_extend(client: str, first: str, other: str) -> None:
    assert extends(norm(client, other), known(client, first)) is None


def test_divergence_points_of_second_conversations() -> None:
    claude = first_divergence(norm("claude", "p_turn1"), norm("claude", "p_conv2_turn1"))
    assert claude is not None and (claude.index, claude.role) == (1, "system")  # element 0 is the tools
    assert b"cc_version=2.1.197." in norm("claude", "p_turn1").elements[1][: claude.offset]
    codex = first_divergence(norm("codex", "exec_turn1"), norm("codex", "exec_conv2_turn1"))
    assert (
        codex is not None
        and codex.role == "user"
        and codex.index == len(norm("codex", "exec_turn1").elements) - 1
    )
    aider = first_divergence(norm("aider", "ui_turn1"), norm("aider", "ui_turn2"))
    assert aider is not None and aider.role == "user"
    assert (
        norm("aider", "ui_turn2").elements[aider.index]
        == norm("aider", "ui_turn1").elements[aider.index][: aider.offset]
    )


def test_opencode_second_conversation_is_the_same_first_request() -> None:
    """Documented: opencode's second conversation starts byte-identical, so by content it repeats the first
    (a retry-shaped match: same KV, nothing lost); its own x-session-id tells them apart."""
    match = extends(norm("opencode", "run_conv2_turn1"), known("opencode", "run_turn1"))
    assert match is not None and match.exact


def test_aider_turns_are_matched_by_content_scoped_by_credential() -> None:
    table = [
        known("aider", "oneshot_turn1", "c:one"),
        known("aider", "ui_turn1", "c:ui"),
        known("aider", "ui_turn1", "c:other-cred", credential="someone-else"),
    ]
    turn2 = norm("aider", "ui_turn2")
    match = find_conversation(turn2, "cred", table)
    assert match is not None and match.conversation_id == "c:ui"
    assert find_conversation(turn2, "nobody", table) is None
    other = find_conversation(turn2, "someone-else", table)
    assert other is not None and other.conversation_id == "c:other-cred"
    # a new conversation (its first request extends nothing) gets its own id
    first = norm("aider", "ui_turn1")
    assert find_conversation(first, "cred", [known("aider", "oneshot_turn1", "c:one")]) is None


def test_longest_and_exact_matches_win() -> None:
    t1, t2 = norm("codex", "tools_turn1"), norm("codex", "tools_turn1_function_output")
    t3 = norm("codex", "tools_turn2_resume")
    table = [KnownConversation.of("short", "cred", t1), KnownConversation.of("long", "cred", t2)]
    match = find_conversation(t3, "cred", table)
    assert match is not None and match.conversation_id == "long"
    a1, a2 = norm("aider", "ui_turn1"), norm("aider", "ui_turn2")
    prefix = Normalized(api=a1.api, elements=a1.elements[:-1], digests=a1.digests[:-1], roles=a1.roles[:-1])
    table = [KnownConversation.of("cut", "cred", a1), KnownConversation.of("exact", "cred", prefix)]
    match = find_conversation(a2, "cred", table)
    assert match is not None and match.conversation_id == "cut"  # more elements beats exact
    same = [KnownConversation.of("x", "cred", a1), KnownConversation.of("y", "cred", a1)]
    match = find_conversation(a2, "cred", same)
    assert match is not None and match.conversation_id == "x"  # ties: first in iteration order


def test_conversation_ids_are_deterministic_safe_and_unique() -> None:
    a = norm("aider", "ui_turn1")
    cid = conversation_id("cred", a)
    assert cid == conversation_id("cred", a) and cid.startswith(cc.CONTENT_PREFIX)
    assert validate_session_id(cid) == cid
    assert conversation_id("other", a) != cid
    assert conversation_id("cred", a, taken={cid}) == cid + ".2"
    assert conversation_id("cred", a, taken={cid, cid + ".2"}) == cid + ".3"
    assert validate_session_id(cid + ".3")


def test_cache_control_and_string_or_block_content_are_the_same() -> None:
    base = {
        "system": "be brief",
        "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
        "tools": [{"name": "Read", "input_schema": {"type": "object"}}],
    }
    moved = {
        "system": [{"type": "text", "text": "be brief", "cache_control": {"type": "ephemeral"}}],
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}],
            },
            {"role": "assistant", "content": [{"type": "text", "text": "yo"}]},
        ],
        "tools": [
            {"name": "Read", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}
        ],
    }
    a, b = normalize("/v1/messages", base), normalize("/v1/messages", moved)
    assert a is not None and b is not None and a.digests == b.digests
    changed: Any = copy.deepcopy(moved)
    changed["messages"][0]["content"][0]["text"] = "hi!"
    c = normalize("/v1/messages", changed)
    assert c is not None and c.digests[2] != a.digests[2]


def test_responses_item_ids_are_ignored() -> None:
    r = load("codex", "exec_turn1")
    renamed = copy.deepcopy(r.body)
    for item in renamed["input"]:
        item["id"] = "msg_other"
    assert normalize(r.path, renamed) == normalize(r.path, r.body)


def test_hostile_bodies_give_no_identity_and_no_exception() -> None:
    deep: Any = "x"
    for _ in range(200):
        deep = [deep]
    bad_bodies: list[Any] = [
        None,
        [],
        "s",
        {"messages": "x"},
        {"messages": [None]},
        {"messages": [{"role": 5, "content": "x"}]},
        {"messages": [{"role": "user", "content": deep}]},
        {"messages": [{"role": "user", "content": "x"}] * (cc.MAX_ELEMENTS + 1)},
    ]
    for route in ("/v1/chat/completions", "/v1/messages"):
        for body in bad_bodies:
            assert normalize(route, body) is None
    assert normalize("/v1/responses", {"input": [1]}) is None
    assert normalize("/completion", {"prompt": "x"}) is None  # no messages: no content identity
    odd = normalize("/v1/chat/completions", {"messages": [{"role": "user", "content": "\ud800 lone"}]})
    assert odd is not None
    empty = KnownConversation(
        conversation_id="e", credential="c", digests=(), last_role="", last_cuts=frozenset()
    )
    assert extends(odd, empty) is None


def test_random_garbage_never_raises() -> None:
    rng = random.Random(2828)
    garbage: list[Any] = [None, 0, "", "\n\n", [], {}, [None], {"type": "text", "text": 5}, 1e308, True]
    for r in posts():
        base = normalize(r.path, r.body)
        assert base is not None
        table = [KnownConversation.of("k", "c", base)]
        for _ in range(15):
            body = copy.deepcopy(r.body)
            _mutate(body, rng, garbage)
            got = normalize(r.path, body)
            if got is not None:
                find_conversation(got, "c", table)
                first_divergence(base, got)
                divergence_index(got, table[0])


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


# -- hostile bodies: normalize() never raises ------------------------------------------------------------------
def test_any_type_confusion_at_any_field_normalizes_or_gives_none() -> None:
    """Every path of every recorded and hand-written chat, Messages and Responses body, replaced by each of the
    type confusions (`{"type": ["text"]}` raised TypeError here and made the proxy answer 500)."""
    for route, body in hostile.corpus(distinct=True):
        for path in hostile.paths(body):
            for value in hostile.CONFUSIONS:
                got = normalize(route, hostile.replaced(body, path, value))
                assert got is None or isinstance(got, Normalized), (route, path, value)


@settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
@given(hostile.mutated())
def test_any_json_at_any_field_normalizes_or_gives_none(case: tuple[str, Any]) -> None:
    route, body = case
    for where in (route, "/v1/chat/completions", "/v1/messages", "/v1/responses"):  # under any route too
        got = normalize(where, body)
        assert got is None or isinstance(got, Normalized)
