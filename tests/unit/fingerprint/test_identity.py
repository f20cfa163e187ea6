"""The identity state machine of one llama-server runtime: its transition table, and its one writer's events.

Only a probe of an awake server with a complete fingerprint reaches PROVEN; every doubt, exit, failure or
sleep withdraws the fingerprint (or keeps it only for display while unreachable) and the trust rule refuses.
An event that does not apply to a state leaves the state as it is.
"""

from __future__ import annotations

import itertools

import pytest

from kvsidecar.backend.base import BackendCapabilities
from kvsidecar.fingerprint.identity import (
    IdentityEvent,
    IdentityState,
    RuntimeIdentity,
    RuntimeKey,
    transition,
)
from kvsidecar.fingerprint.llama_process import ProcessInfo
from kvsidecar.fingerprint.runtime import RuntimeFingerprint
from kvsidecar.store.trust import Decision, Saved, trust

S, E = IdentityState, IdentityEvent
ALL = list(S)
AWAKE = {S.PROBING, S.PROVEN}


def expected(state: IdentityState, event: IdentityEvent, complete: bool) -> IdentityState:
    """The table as the module documents it, written out independently of its `match`."""
    awake = S.PROVEN if complete else S.PROBING
    table: dict[IdentityEvent, IdentityState] = {
        E.SAME: awake,
        E.NEW: S.PROBING,
        E.ASLEEP: S.SLEEPING,
        E.UNREACHED: S.GONE if state is S.GONE else S.UNREACHABLE,
        E.FINGERPRINTED: awake if state in AWAKE else state,
        E.CANARY: awake if state in AWAKE else state,
        E.CANARY_FAILED: state,
        E.DOUBTED: S.CHANGED if state in AWAKE else state,
        E.EXITED: state if state is S.UNKNOWN else S.GONE,
    }
    return table[event]


@pytest.mark.parametrize(("state", "event", "complete"), list(itertools.product(ALL, list(E), [False, True])))
def test_transition_table(state: IdentityState, event: IdentityEvent, complete: bool) -> None:
    assert transition(state, event, complete=complete) is expected(state, event, complete)


@pytest.mark.parametrize(("state", "event"), list(itertools.product(ALL, list(E))))
def test_proven_is_reached_only_by_a_probe_or_a_proof_made_now_with_every_part(
    state: IdentityState, event: IdentityEvent
) -> None:
    if state is S.PROVEN:
        return  # staying proven: the events that keep a state (the table above)
    assert transition(state, event, complete=False) is not S.PROVEN
    if transition(state, event, complete=True) is S.PROVEN:
        assert event is E.SAME or (event in (E.FINGERPRINTED, E.CANARY) and state in AWAKE)


@pytest.mark.parametrize(
    ("state", "event"),
    [
        (S.CHANGED, E.FINGERPRINTED),  # a proof made for an instance now doubted
        (S.CHANGED, E.CANARY),
        (S.GONE, E.FINGERPRINTED),  # nor for one whose process ended
        (S.GONE, E.CANARY),
        (S.SLEEPING, E.CANARY),  # no model is loaded
        (S.UNKNOWN, E.FINGERPRINTED),  # never probed
        (S.UNKNOWN, E.DOUBTED),
        (S.UNKNOWN, E.EXITED),  # no process known to have ended
        (S.GONE, E.UNREACHED),  # gone stays gone: it is known to have ended
        (S.SLEEPING, E.DOUBTED),
        (S.UNREACHABLE, E.DOUBTED),
    ],
)
def test_an_event_that_does_not_apply_is_refused(state: IdentityState, event: IdentityEvent) -> None:
    for complete in (False, True):
        assert transition(state, event, complete=complete) is state


# The runtime's one writer ------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def caps(
    *, nonce: str | None = "n1", sleeping: bool = False, model: str = "/m/a.gguf"
) -> BackendCapabilities:
    return BackendCapabilities(
        kind="llama-server",
        alive=True,
        slots_endpoint=True,
        total_slots=2,
        n_ctx=4096,
        model_path=model,
        build_info="b1",
        instance_id=nonce,
        sleeping=sleeping,
    )


def proc(pid: int = 10, created: float = 1.0) -> ProcessInfo:
    return ProcessInfo(
        pid=pid, create_time=created, exe="/bin/llama-server", cmdline=("llama-server",), flags={}
    )


BASE = RuntimeFingerprint(components={"model_file": "m1", "build_info": "b1"})


def identity(*, canary: bool = False, clock: Clock | None = None) -> RuntimeIdentity:
    return RuntimeIdentity(key=RuntimeKey("main"), canary=lambda: canary, clock=clock or Clock())


def proven_identity(*, canary: bool = False, clock: Clock | None = None) -> RuntimeIdentity:
    ident = identity(canary=canary, clock=clock)
    result = ident.probed(caps(), proc())
    assert result.rebuild and not result.restarted
    ident.fingerprinted(BASE, None)
    if canary:
        ident.canary_measured("k1")
    assert state(ident) is S.PROVEN
    return ident


def state(ident: RuntimeIdentity) -> IdentityState:
    """Read afresh each time (mypy would otherwise narrow it across the events between two reads)."""
    return ident.now.state


def restores(ident: RuntimeIdentity, fp: RuntimeFingerprint) -> bool:
    return (
        trust(Saved(fingerprint=fp.digest, components=fp.components), ident.now).decision is Decision.RESTORE
    )


def test_a_runtime_starts_unknown_and_is_proven_by_a_probe_and_its_fingerprint() -> None:
    clock = Clock()
    ident = identity(clock=clock)
    assert state(ident) is S.UNKNOWN and ident.now.shown is None and not ident.now.available
    clock.t = 101.0
    ident.probed(caps(), proc())
    assert (ident.now.state, ident.now.since, ident.now.shown) == (S.PROBING, 101.0, None)
    assert ident.now.available and ident.now.process == proc()
    clock.t = 102.0
    ident.fingerprinted(BASE, None)
    assert (ident.now.state, ident.now.since, ident.now.shown) == (S.PROVEN, 102.0, BASE)
    assert restores(ident, BASE)
    assert str(ident.key) == "main" and str(RuntimeKey("main", "coder")) == "main[coder]"


def test_with_the_canary_on_it_is_proven_only_once_the_canary_is_measured() -> None:
    ident = identity(canary=True)
    ident.probed(caps(), proc())
    ident.fingerprinted(BASE, None)
    assert state(ident) is S.PROBING and ident.now.shown is None
    ident.canary_failed()
    assert (ident.now.state, ident.now.canary_failures) == (S.PROBING, 1)
    ident.canary_measured("k1")
    whole = ident.now.shown
    assert state(ident) is S.PROVEN and whole is not None
    assert whole.components == {**BASE.components, "canary_kv": "k1"}
    assert ident.now.canary_failures == 0


def test_a_probe_of_the_same_instance_keeps_it_proven_without_a_rebuild() -> None:
    clock = Clock()
    ident = proven_identity(clock=clock)
    since, fp = ident.now.since, ident.now.shown
    clock.t = 500.0
    result = ident.probed(caps(), proc())
    assert not result.restarted and not result.rebuild
    assert (ident.now.state, ident.now.since, ident.now.shown, ident.now.epoch) == (S.PROVEN, since, fp, 0)
    assert ident.probed(caps(), proc(), force=True).rebuild  # a forced proof withdraws it
    assert state(ident) is S.PROBING and ident.now.shown is None


@pytest.mark.parametrize(
    ("new_caps", "new_proc", "reason"),
    [
        (caps(), proc(pid=11), "process changed"),
        (caps(), proc(created=2.0), "process changed"),
        (caps(nonce="n2"), proc(), "instance nonce changed"),
        (caps(model="/m/b.gguf"), proc(), "model changed"),
        (caps(), None, "local process gone"),
    ],
)
def test_a_restart_withdraws_the_fingerprint_and_moves_the_epoch(
    new_caps: BackendCapabilities, new_proc: ProcessInfo | None, reason: str
) -> None:
    ident = proven_identity()
    result = ident.probed(new_caps, new_proc)
    assert (result.restarted, result.reason, result.rebuild) == (True, reason, True)
    assert (ident.now.state, ident.now.shown, ident.now.epoch, ident.now.restart) == (
        S.PROBING,
        None,
        1,
        reason,
    )
    assert not restores(ident, BASE)
    ident.fingerprinted(BASE, None)
    assert state(ident) is S.PROVEN
    # an operation bracketed before the restart is void after it, even under the same fingerprint
    stale = Saved(fingerprint=BASE.digest, components=BASE.components, epoch=0)
    assert trust(stale, ident.now).decision is Decision.REFUSE


def test_a_failed_check_between_probes_doubts_it_until_the_next_probe_decides() -> None:
    ident = proven_identity(canary=True)
    ident.doubted()
    assert state(ident) is S.CHANGED and ident.now.shown is None
    whole = ident.now.fingerprint
    assert whole is not None and not restores(ident, whole)
    ident.canary_measured("k2")  # a canary measured meanwhile is not this instance's proof
    assert ident.now.canary == "k1" and state(ident) is S.CHANGED
    ident.probed(caps(), proc())  # the same instance after all
    assert state(ident) is S.PROVEN and restores(ident, whole)


def test_a_doubt_then_a_new_instance_is_a_restart() -> None:
    ident = proven_identity()
    ident.doubted()
    result = ident.probed(caps(nonce="n2"), proc(pid=11))
    assert result.restarted and result.new_process
    assert state(ident) is S.PROBING and ident.now.epoch == 1


def test_its_process_seen_ended_makes_it_gone_and_another_process_does_not() -> None:
    ident = proven_identity()
    assert not ident.exited(proc(pid=99))
    assert state(ident) is S.PROVEN
    assert ident.exited(proc())
    assert state(ident) is S.GONE and ident.now.shown is None and not restores(ident, BASE)
    ident.call_failed()
    assert state(ident) is S.GONE  # gone stays gone: it is known to have ended
    ident.fingerprinted(BASE, None)  # a build that finishes late does not prove it
    assert state(ident) is S.GONE and not restores(ident, BASE)
    result = ident.probed(caps(nonce="n2"), proc(pid=11))
    assert result.new_process and state(ident) is S.PROBING


def test_an_unknown_runtime_never_seen_to_exit() -> None:
    ident = identity()
    assert not ident.exited(proc())
    assert state(ident) is S.UNKNOWN


def test_an_unreached_server_shows_its_last_fingerprint_but_is_not_trusted() -> None:
    ident = proven_identity()
    result = ident.probe_failed("connection refused")
    assert (result.available, result.restarted, result.reason) == (False, True, "unreachable")
    now = ident.now
    assert (now.state, now.available, now.last_error, now.epoch) == (
        S.UNREACHABLE,
        False,
        "connection refused",
        1,
    )
    assert now.shown == BASE and not restores(ident, BASE)
    again = ident.probe_failed("connection refused")  # still out of reach: not another restart
    assert not again.restarted and ident.now.epoch == 1
    ident.probed(caps(), proc())  # the same process and nonce: it only looked gone
    assert state(ident) is S.PROVEN and restores(ident, BASE)


def test_a_persistence_call_out_of_reach_marks_it_unreachable_without_a_restart() -> None:
    ident = proven_identity()
    ident.call_failed()
    assert (ident.now.state, ident.now.available, ident.now.epoch) == (S.UNREACHABLE, False, 0)
    assert not restores(ident, BASE)


def test_sleep_withdraws_the_fingerprint_and_a_wake_is_a_restart() -> None:
    ident = proven_identity()
    result = ident.probed(caps(sleeping=True), proc())
    assert (result.restarted, result.reason, result.rebuild) == (True, "entered sleep mode", False)
    assert state(ident) is S.SLEEPING and ident.now.fingerprint is None and ident.now.sleeping
    ident.canary_measured("k1")
    assert state(ident) is S.SLEEPING and ident.now.canary is None
    result = ident.probed(caps(), proc(), slept=caps(sleeping=True))
    assert (result.restarted, result.reason, result.rebuild) == (True, "woke from sleep mode", True)
    assert state(ident) is S.PROBING and ident.now.epoch == 2


def test_the_wake_failing_after_a_sleep_keeps_the_sleep_seen() -> None:
    ident = proven_identity()
    ident.probe_failed("timeout", slept=caps(sleeping=True))
    assert state(ident) is S.UNREACHABLE and ident.now.sleeping


def test_the_state_and_since_move_only_on_a_change_of_state() -> None:
    clock = Clock()
    ident = proven_identity(clock=clock)
    since = ident.now.since
    clock.t = 900.0
    ident.canary_failed()
    assert (ident.now.state, ident.now.since) == (S.PROVEN, since)
    ident.doubted()
    assert (ident.now.state, ident.now.since) == (S.CHANGED, 900.0)
