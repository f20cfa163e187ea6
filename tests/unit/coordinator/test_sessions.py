"""The session state machine (`transition()`, spec §18) as a table, and the SessionTable's writes of a
session's revisions: the only place a state, a revision or dirtiness changes (kvsidecar/coordinator/sessions.py).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from kvsidecar.coordinator.sessions import SessionEvent, SessionTable, transition
from kvsidecar.coordinator.state import SessionRuntime, SessionState
from kvsidecar.store.naming import SnapshotIdentity
from kvsidecar.store.snapshots import SnapshotStore

S = SessionState
E = SessionEvent
RESTING = "resting"  # the state the store alone gives the session (its `resting` argument)

# event -> (next state when the session is resident, when it is not); RESTING: the store's word.
TABLE: dict[SessionEvent, tuple[SessionState | str, SessionState | str]] = {
    E.RESTORE_BEGIN: (S.RESTORING, S.RESTORING),
    E.RESTORED: (S.ACTIVE_CLEAN, S.ACTIVE_CLEAN),
    E.RESTORE_FAILED: (RESTING, RESTING),
    E.COLD_START: (S.COLD, S.COLD),
    E.RAN: (S.ACTIVE_DIRTY, S.ACTIVE_DIRTY),
    E.SAVE_BEGIN: (S.SAVING, S.SAVING),
    E.SAVED: (S.ACTIVE_CLEAN, RESTING),
    E.SAVE_FAILED: (S.ACTIVE_DIRTY, RESTING),
    E.EVICTED: (RESTING, RESTING),
    E.LOST: (RESTING, RESTING),
    E.REJECTED: (S.INVALID, S.INVALID),
    E.INVALIDATED: (S.INVALID, S.INVALID),
}
# (state, event) -> next state, whatever the residency: where the row above does not hold.
EXCEPTIONS: dict[tuple[SessionState, SessionEvent], SessionState] = {
    (S.INVALID, E.COLD_START): S.INVALID,  # its snapshot was rejected: a cold start does not clear that
}
RESTING_STATES = (S.NONE, S.SAVED, S.INVALID)  # what the store can say


def expected(state: SessionState, event: SessionEvent, resident: bool, resting: SessionState) -> SessionState:
    if (state, event) in EXCEPTIONS:
        return EXCEPTIONS[state, event]
    when_resident, when_not = TABLE[event]
    want = when_resident if resident else when_not
    return resting if want == RESTING else SessionState(want)


def test_the_table_names_every_event() -> None:
    assert set(TABLE) == set(SessionEvent)


@pytest.mark.parametrize(
    ("state", "event", "resident", "resting"),
    list(itertools.product(SessionState, SessionEvent, (True, False), RESTING_STATES)),
)
def test_transition(state: SessionState, event: SessionEvent, resident: bool, resting: SessionState) -> None:
    assert transition(state, event, resident=resident, resting=resting) is expected(
        state, event, resident, resting
    )


# the table's writes of a session ------------------------------------------------------------------
@pytest.fixture
def table(tmp_path: Path) -> SessionTable:
    store = SnapshotStore(state_dir=tmp_path / "state", snapshot_dirs={"local": tmp_path / "snaps"})
    store.open()
    return SessionTable(store)


def state_of(rt: SessionRuntime) -> SessionState:
    return rt.state  # read afresh after each event


def session(table: SessionTable) -> SessionRuntime:
    return table.runtime(SnapshotIdentity(server="local", provider="p", model="m", session_id="s"))


def test_a_turn_makes_the_session_dirty_and_a_save_of_it_clean(table: SessionTable) -> None:
    rt = session(table)
    assert rt.state is S.NONE and not rt.dirty
    assert table.ran(rt) == 1 and rt.dirty and rt.state is S.ACTIVE_DIRTY
    table.apply(rt, E.SAVE_BEGIN)
    table.saved(rt, revision=1, tokens=40, generation="g1", resident=True)
    assert not rt.dirty and rt.state is S.ACTIVE_CLEAN
    assert (rt.base_tokens, rt.base_generation, rt.append_only) == (40, "g1", True)


def test_a_save_of_an_older_revision_never_moves_the_saved_revision_back(table: SessionTable) -> None:
    rt = session(table)
    for _ in range(3):
        table.ran(rt)
    table.saved(rt, revision=3, tokens=90, generation="g2", resident=True)
    table.saved(rt, revision=2, tokens=60, generation="g1", resident=True)  # an overlapped commit, late
    assert rt.saved_revision == 3 and not rt.dirty


def test_unsaved_turns_are_given_up_in_one_place(table: SessionTable) -> None:
    rt = session(table)
    assert table.give_up_unsaved(rt) is False  # nothing to give up
    table.ran(rt)
    table.ran(rt)
    assert rt.unsaved_turns == 2
    assert table.give_up_unsaved(rt) is True
    assert not rt.dirty and rt.unsaved_turns == 0 and rt.dirty_revision == 2  # revisions never go back


def test_a_restore_makes_the_slot_equal_its_snapshot_and_a_cold_start_forgets_it(table: SessionTable) -> None:
    rt = session(table)
    table.ran(rt)
    table.apply(rt, E.RESTORE_BEGIN)
    table.restored(rt, tokens=70, generation="g1")
    assert rt.state is S.ACTIVE_CLEAN and not rt.dirty
    assert (rt.verify_tokens, rt.base_tokens, rt.context_tokens, rt.append_only) == (70, 70, 70, True)
    assert table.take_verify(rt) == 70 and rt.verify_tokens is None  # its reuse is checked once
    table.started_cold(rt)
    assert state_of(rt) is S.COLD
    assert (rt.base_tokens, rt.context_tokens, rt.base_generation, rt.append_only) == (
        None,
        None,
        None,
        False,
    )


def test_a_failure_event_records_its_code(table: SessionTable) -> None:
    rt = session(table)
    table.apply(rt, E.RESTORE_BEGIN)
    table.apply(rt, E.RESTORE_FAILED, error="KV_RESTORE_FAILED")
    assert rt.state is S.NONE and rt.last_error == "KV_RESTORE_FAILED"


def test_the_unsaved_mark_is_renewed_after_a_save(table: SessionTable) -> None:
    rt = session(table)
    table.ran(rt)
    table.mark_unsaved(rt, 10.0)
    table.mark_unsaved(rt, 20.0)  # a later turn: the first unsaved one is still at 10
    assert rt.unsaved_age_s(25.0) == 15.0
    table.saved(rt, revision=1, tokens=10, generation="g1", resident=True)
    assert rt.unsaved_age_s(25.0) is None  # clean
    table.ran(rt)
    table.mark_unsaved(rt, 30.0)  # the old mark belongs to a saved revision: renewed
    assert rt.unsaved_age_s(31.0) == 1.0


def test_an_arrival_measures_the_think_time_since_the_last_release(table: SessionTable) -> None:
    rt = session(table)
    assert table.arrived(rt, seq=4, now=5.0) is None  # never released
    table.released(rt, 10.0)
    assert table.arrived(rt, seq=None, now=12.5) == 2.5
    assert (rt.scope, rt.seq, rt.released_at, list(rt.think_s)) == ("hook", 4, None, [2.5])
