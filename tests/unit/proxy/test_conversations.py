"""The conversation table's turns (`begin` at dispatch, `end` with how the turn ended), what it takes for a
request to continue a conversation (extension, growth in place), message 0, and side requests."""

from __future__ import annotations

from typing import Any

from kvsidecar.proxy.client_content import Normalized, normalize
from kvsidecar.proxy.conversations import (
    ConversationTable,
    Shape,
    element_digest,
    from_elsewhere,
)


def chat(*texts: str, system: str | None = None, tools: bool = False) -> Normalized:
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    for n, text in enumerate(texts):
        messages.append({"role": "user" if n % 2 == 0 else "assistant", "content": text})
    body: dict[str, Any] = {"messages": messages}
    if tools:
        body["tools"] = [{"type": "function", "function": {"name": "f", "parameters": {}}}]
    norm = normalize("/v1/chat/completions", body)
    assert norm is not None
    return norm


def test_the_element_digest_is_the_normalizers() -> None:
    norm = chat("a", "b", system="s", tools=True)
    assert tuple(element_digest(e) for e in norm.elements) == norm.digests


def test_a_turn_in_flight_is_known_and_so_is_the_request_before_it() -> None:
    table = ConversationTable()
    sid, _ = table.identify("k", chat("q1"))
    table.record("k", sid, "m", chat("q1"))
    turn = table.begin("k", sid, "m", chat("q1", "a1", "q2"))
    # the next turn, sent the instant the answer ends, and an edit of the turn still in flight
    assert table.identify("k", chat("q1", "a1", "q2", "a2", "q3")) == (sid, True)
    assert table.identify("k", chat("q1", "a1", "q2 edited")) == (sid, True)
    table.end("k", sid, turn, "ok")
    assert table.identify("k", chat("q1", "a1", "q2", "a2", "q3")) == (sid, True)
    assert table.identify("k", chat("q1", "a1", "q2 edited"))[1] is False  # settled: only its latest


def test_an_error_leaves_the_conversation_as_it_was() -> None:
    table = ConversationTable()
    table.record("k", "s", "m", chat("q1"))
    turn = table.begin("k", "s", "m", chat("q1", "a1", "q2"))
    table.end("k", "s", turn, "error")
    entry = table.get("k", "s")
    assert entry is not None and entry.known.digests == chat("q1").digests and entry.settled is None
    first = table.begin("k", "new", "m", chat("x"))
    table.end("k", "new", first, "error")  # its first turn failed: not a conversation at all
    assert table.get("k", "new") is None


def test_an_aborted_turn_stays_the_latest_and_the_one_before_stays_known() -> None:
    table = ConversationTable()
    sid, _ = table.identify("k", chat("q1"))
    table.record("k", sid, "m", chat("q1"))
    turn = table.begin("k", sid, "m", chat("q1", "a1", "q2"))
    table.end("k", sid, turn, "aborted")
    assert table.identify("k", chat("q1", "a1", "q2", "partial", "redirect")) == (sid, True)
    assert table.identify("k", chat("q1", "a1", "q2 rephrased")) == (sid, True)


def test_a_turn_that_ends_after_a_later_one_began_changes_nothing() -> None:
    table = ConversationTable()
    first = table.begin("k", "s", "m", chat("q1"))
    second = table.begin("k", "s", "m", chat("q1", "a1", "q2"))
    table.end("k", "s", first, "error")
    entry = table.get("k", "s")
    assert (
        entry is not None and entry.turn == second and entry.known.digests == chat("q1", "a1", "q2").digests
    )
    table.end("k", "s", second, "ok")
    entry = table.get("k", "s")
    assert entry is not None and entry.settled is None


def test_continuing_a_conversation_growing_in_place_and_message_zero() -> None:
    table = ConversationTable()
    table.record("k", "s", "m", chat("Tell me a story."))
    entry = table.get("k", "s")
    assert entry is not None
    assert entry.continued_by(chat("Tell me a story. About a king."))  # grown in its only message
    assert not entry.continued_by(chat("Tell me a story"))  # shorter: not a continuation
    assert from_elsewhere(chat("Give this a title."), entry.known, entry.shape)
    assert not from_elsewhere(chat("Tell me a story. And more."), entry.known, entry.shape)
    with_tools = chat("q1", system="You code.", tools=True)
    shape = Shape.of(with_tools)
    assert shape.head == 1  # message 0 is the system prompt, after the tools
    table.record("k", "t", "m", with_tools)
    known = table.get("k", "t")
    assert known is not None
    assert not from_elsewhere(chat("q1", "a", "q2", system="You code."), known.known, known.shape)
    assert from_elsewhere(chat("q1", system="you title.", tools=True), known.known, known.shape)


def test_a_side_request_is_promoted_only_by_a_continuation_with_more() -> None:
    table = ConversationTable()
    table.record("k", "s", "m", chat("q1", system="You code."))
    side = chat("q1", system="you title.")
    table.aside("k", "s", side)
    assert not table.promoted("k", "s", side)  # a retry of it
    assert not table.promoted("k", "s", chat("q1", "a1", "q2", system="You code."))
    assert table.promoted("k", "s", chat("q1", "a1", "q2", system="you title."))
    assert not table.promoted("other", "s", chat("q1", "a1", "q2", system="you title."))  # per credential
    table.begin("k", "s", "m", chat("q1", "a1", "q2", system="You code."))  # a turn of the conversation
    assert not table.promoted("k", "s", chat("q1", "a1", "q2", system="you title."))


def test_a_changed_system_prompt_with_the_whole_conversation_after_it_is_a_turn() -> None:
    """Message 0 changed: a title carries at most a piece of the conversation (here its first message,
    verbatim); a turn whose system prompt changed (a date in it) carries all of it and the new turn."""
    conversation = chat("fix the bug", system="You code. Today is Monday.")
    shape = Shape.of(conversation)
    known = ConversationTable()
    known.record("k", "s", "m", conversation)
    entry = known.get("k", "s")
    assert entry is not None
    title = chat("fix the bug", system="you write titles.")
    assert from_elsewhere(title, entry.known, shape)
    turn = chat("fix the bug", "done", "now test it", system="You code. Today is Tuesday.")
    assert not from_elsewhere(turn, entry.known, shape)
    retry = chat("fix the bug", system="You code. Today is Tuesday.")  # nothing after: not a turn yet
    assert from_elsewhere(retry, entry.known, shape)
