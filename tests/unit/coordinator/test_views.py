"""The status and session views: what a user of a real client watches (`kvsidecar sessions`,
`GET /v1/sessions`, `/v1/status`): the client and signal that named a session, its id's visible form, the
reuse of its latest turns and its last outcome; what a slot holds; and the same names in the log events.
Through the proxy with the recorded agent clients (tests/fixtures/clients) on the fake engine."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvsidecar.backend.fake import FakeKvBackend
from kvsidecar.coordinator.views import visible_id
from tests.unit.client_fixtures import load
from tests.unit.coordinator_helpers import Harness
from tests.unit.proxy.test_app import Rig
from tests.unit.proxy.test_sessions import replay, with_engine


def client_id(client: str, name: str) -> str:
    """The id the client itself printed for a recorded request (its session header)."""
    header = {"claude": "x-claude-code-session-id", "codex": "session-id", "opencode": "x-session-id"}[client]
    return next(v for k, v in load(client, name).headers if k.lower() == header)


# the id's visible form ------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("client", "first", "second"),
    [
        ("claude", "p_turn1", "p_conv2_turn1"),
        ("codex", "exec_turn1", "exec_conv2_turn1"),  # time-ordered UUIDv7: the same first 8 characters
        ("opencode", "run_turn1", "run_conv2_turn1"),  # `ses_` and a time: the same first 8 too
    ],
)
def test_the_visible_id_matches_what_the_client_prints_and_tells_two_apart(
    client: str, first: str, second: str
) -> None:
    one, two = client_id(client, first), client_id(client, second)
    shown = visible_id(one)
    assert shown == f"{one[:8]}…{one[-4:]}" and one.startswith(shown[:8]) and one.endswith(shown[-4:])
    assert visible_id(two) != shown  # two conversations started within a minute stay apart
    assert one not in shown and len(shown) == 13  # never the whole id


def test_the_visible_id_of_short_ids() -> None:
    assert visible_id("A") == "A" and visible_id("task-007") == "task-007"  # 8 or fewer: whole
    assert visible_id("abcdefghijkl") == "abcdefgh…"  # 9 to 16: the first 8 only
    assert visible_id("h:" + "0" * 30) == "h:000000…0000"


# what a slot holds ----------------------------------------------------------------------------------
async def test_a_slot_shows_the_tokens_it_holds_after_turns_and_saves(h: Harness) -> None:
    """A session that started cold showed `tokens: 0` through every turn and save: the pool records a
    slot's size only when it changes hands."""
    for _ in range(3):
        _, _, prompt_n, cache_n = await h.turn("A")
    assert (await h.coordinator.save("A"))["saved"] == 1
    slot = h.coordinator.status()["servers"][0]["slots"][0]
    assert slot["state"] == "ready" and slot["tokens"] == prompt_n + cache_n == 150
    view = h.coordinator.session_views()[0]
    assert view["snapshot"]["generations"][view["snapshot"]["current"]]["tokens"] == 150


# one place to watch: the session view through the proxy ---------------------------------------------
@pytest.fixture
async def r(tmp_path: Path) -> AsyncIterator[tuple[Rig, FakeKvBackend]]:
    async for each in with_engine(tmp_path, proxy={"identity": "session"}):
        yield each


def view_of(rig: Rig, session_id: str) -> dict[str, object]:
    (found,) = [v for v in rig.h.coordinator.session_views() if v["id"] == visible_id(session_id)]
    return found


async def test_each_clients_session_says_who_named_it_how_and_how_warm(r: tuple[Rig, FakeKvBackend]) -> None:
    rig, _ = r
    await replay(rig, "claude", "p_turn1")
    await replay(rig, "claude", "p_turn2_continue")
    claude = view_of(rig, client_id("claude", "p_turn1"))
    assert claude["client"] == "claude-code" and claude["signal"] == "header:x-claude-code-session-id"
    assert claude["last_outcome"] == "resident" and claude["last_reason"] is None
    turns = claude["turns"]
    assert isinstance(turns, list) and len(turns) == 2
    assert turns[0]["cached_tokens"] == 0 and turns[1]["cached_tokens"] >= 0.9 * turns[0]["prompt_tokens"]
    await replay(rig, "codex", "exec_turn1")  # evicts Claude Code's session (one slot)
    codex = view_of(rig, client_id("codex", "exec_turn1"))
    assert (codex["client"], codex["signal"], codex["last_outcome"]) == ("codex", "header:session-id", "cold")
    await replay(rig, "opencode", "run_turn1")
    opencode = view_of(rig, client_id("opencode", "run_turn1"))
    assert (opencode["client"], opencode["signal"]) == ("opencode", "header:x-session-id")
    await replay(rig, "aider", "ui_turn1")
    (aider,) = [v for v in rig.h.coordinator.session_views() if v["signal"] == "content"]
    assert aider["client"] == "aider" and str(aider["id"]).startswith("c:")
    await replay(rig, "claude", "p_turn2_continue")  # back from disk
    claude = view_of(rig, client_id("claude", "p_turn1"))
    assert claude["last_outcome"] == "restored" and len(claude["turns"]) == 3  # type: ignore[arg-type]


async def test_session_log_events_name_the_client_and_signal_never_the_id(
    r: tuple[Rig, FakeKvBackend], caplog: pytest.LogCaptureFixture
) -> None:
    rig, _ = r
    caplog.set_level(logging.INFO, logger="kvsidecar.coordinator")
    await replay(rig, "codex", "exec_turn1")
    await replay(rig, "claude", "p_turn1")  # a switch: codex's session saved, claude's cold
    lines = [rec.getMessage() for rec in caplog.records if rec.getMessage().startswith("kv.session.")]
    cold = [line for line in lines if line.startswith("kv.session.cold ")]
    assert any("client=claude-code signal=header:x-claude-code-session-id" in line for line in cold), lines
    saved = [line for line in lines if line.startswith("kv.session.save.success ")]
    assert saved and all("client=codex signal=header:session-id" in line for line in saved), lines
    for secret in (client_id("codex", "exec_turn1"), client_id("claude", "p_turn1")):
        assert all(secret not in line and visible_id(secret) not in line for line in lines)
