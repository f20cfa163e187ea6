"""The one guarded persistence call (kvsidecar/coordinator/guard.py): the breaker's gate and its half-open
trial, the bound of a call, and the verdict, on a server of the fake backend and a clock of our own."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from kvsidecar.backend.base import BackendCapabilities
from kvsidecar.backend.fake import FakeKvBackend
from kvsidecar.coordinator.breaker import BreakerState
from kvsidecar.coordinator.costs import CostModel
from kvsidecar.coordinator.guard import PersistGuard
from kvsidecar.coordinator.server import ServerRuntime, build_servers, server_maker
from kvsidecar.coordinator.telemetry import Telemetry
from kvsidecar.errors import (
    ConnectionLost,
    EraseFailed,
    InvariantViolation,
    OperationTimeout,
    RestoreFailed,
    SaveFailed,
    SnapshotCorrupt,
)
from kvsidecar.metrics import Metrics
from tests.unit.coordinator_helpers import make_config


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def srv(tmp_path: Path, clock: Clock) -> ServerRuntime:
    config = make_config(tmp_path)
    backend = FakeKvBackend(tmp_path / "snaps")
    server = build_servers(config, {"local": backend}, server_maker(config, None, None, None, clock))["local"]
    reached(server)
    server.slots[0].holder = "test"  # the caller holds the slot (Invariant 8)
    return server


def reached(server: ServerRuntime) -> None:
    """The server answered a probe: its identity (the one writer of what is known of it) is told so."""
    caps = BackendCapabilities(
        kind="fake",
        alive=True,
        slots_endpoint=True,
        total_slots=1,
        n_ctx=4096,
        model_path="/m",
        build_info="b",
    )
    server.identity.probed(caps, None)
    assert server.available


@pytest.fixture
def guard() -> PersistGuard:
    return PersistGuard(telemetry=Telemetry(Metrics(), CostModel()))


def state(srv: ServerRuntime) -> BreakerState:
    return srv.breaker.state  # read afresh (the property changes with every verdict and with the clock)


def half_open(srv: ServerRuntime, clock: Clock) -> None:
    for _ in range(srv.breaker.max_consecutive_failures):
        srv.breaker.failure("KV_SAVE_FAILED")
    clock.now += srv.breaker.cooldown_s + 1
    assert state(srv) is BreakerState.HALF_OPEN


async def test_a_half_open_breaker_lets_one_operation_through(
    guard: PersistGuard, srv: ServerRuntime, clock: Clock
) -> None:
    half_open(srv, clock)
    slot = srv.slots[0]
    async with guard.persisting(srv, "save", slot=slot) as trial:
        assert trial.allowed and trial.trial
        async with guard.persisting(srv, "load", slot=slot) as second:
            assert not second.allowed  # one trial at a time
        trial.void()
    assert not srv.breaker.trial_in_flight and state(srv) is BreakerState.HALF_OPEN


async def test_the_trial_ends_whatever_ends_the_operation(
    guard: PersistGuard, srv: ServerRuntime, clock: Clock
) -> None:
    """Issue 14: a trial that ended with no verdict kept the breaker half-open until a restart."""
    half_open(srv, clock)
    for escaping in (RuntimeError("a bug"), asyncio.CancelledError(), SnapshotCorrupt("a file's fault")):
        with pytest.raises(type(escaping)):
            async with guard.persisting(srv, "load", slot=srv.slots[0]) as op:
                assert op.trial
                raise escaping
        assert not srv.breaker.trial_in_flight and state(srv) is BreakerState.HALF_OPEN


async def test_a_server_not_ready_does_not_spend_the_trial(
    guard: PersistGuard, srv: ServerRuntime, clock: Clock
) -> None:
    half_open(srv, clock)
    async with guard.persisting(srv, "save", slot=srv.slots[0], ready=False) as op:
        assert not op.allowed and not op.trial and not srv.breaker.trial_in_flight
    async with guard.persisting(srv, "save", slot=srv.slots[0]) as op:
        assert op.allowed and op.trial  # still there for the next operation


async def test_an_open_breaker_allows_nothing_gated(guard: PersistGuard, srv: ServerRuntime) -> None:
    for _ in range(srv.breaker.max_consecutive_failures):
        srv.breaker.failure("KV_SAVE_FAILED")
    assert guard.circuit_open(srv)
    for kind in ("save", "load"):
        async with guard.persisting(srv, kind, slot=srv.slots[0]) as op:
            assert not op.allowed
    assert srv.breaker.failures == 3 and state(srv) is BreakerState.OPEN
    async with guard.persisting(srv, "erase", slot=srv.slots[0]) as op:
        assert op.allowed  # an erase is not gated (leftover KV is cleared where the server answers) ...
    assert state(srv) is BreakerState.HEALTHY  # ... and one that worked shows the server does


@pytest.mark.parametrize(
    ("kind", "error", "counted"),
    [
        ("erase", EraseFailed("x"), True),
        ("save", SaveFailed("x"), True),
        ("restore", ConnectionLost("x"), True),
        ("restore", RestoreFailed("the server refused this file"), False),
        ("restore", SnapshotCorrupt("the file's own fault"), False),
        ("canary", SaveFailed("the canary's own failure"), False),
    ],
)
async def test_only_server_errors_are_failures(
    guard: PersistGuard, srv: ServerRuntime, kind: str, error: Exception, counted: bool
) -> None:
    with pytest.raises(type(error)):
        async with guard.persisting(srv, kind, slot=srv.slots[0]):  # type: ignore[arg-type]
            raise error
    assert srv.breaker.failures == (1 if counted else 0)
    assert srv.available is not (counted and isinstance(error, ConnectionLost))  # out of reach: re-probed


async def test_a_normal_end_is_a_success_unless_voided(guard: PersistGuard, srv: ServerRuntime) -> None:
    srv.breaker.failure("KV_ERASE_FAILED")
    async with guard.persisting(srv, "erase", slot=srv.slots[0]) as op:
        op.void()  # nothing could be confirmed
    assert state(srv) is BreakerState.DEGRADED
    async with guard.persisting(srv, "erase", slot=srv.slots[0]):
        pass
    assert state(srv) is BreakerState.HEALTHY and srv.breaker.failures == 0


async def test_the_verdict_is_given_once(guard: PersistGuard, srv: ServerRuntime) -> None:
    error = SaveFailed("x")
    with pytest.raises(SaveFailed):
        async with guard.persisting(srv, "save", slot=srv.slots[0]) as op:
            op.failed(error)  # handled in the body (strict mode then raises it on)
            raise error
    assert srv.breaker.failures == 1
    async with guard.persisting(srv, "save", slot=srv.slots[0]) as op:
        op.failed(error)  # a failure the body handled: not a success for ending normally
    assert srv.breaker.failures == 2


async def test_a_call_past_its_bound_is_a_timeout_that_counts(
    guard: PersistGuard, srv: ServerRuntime, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr("kvsidecar.coordinator.guard.MARGIN_S", 0.0)
    srv.config = srv.config.model_copy(update={"persist_timeout_s": 0.01})
    with pytest.raises(OperationTimeout):
        async with guard.persisting(srv, "erase", slot=srv.slots[0]) as op:
            await op.call(asyncio.sleep(5))
    assert srv.breaker.failures == 1 and not srv.available


async def test_an_operation_on_a_slot_nobody_holds_is_refused(
    guard: PersistGuard, srv: ServerRuntime
) -> None:
    srv.slots[0].holder = None
    with pytest.raises(InvariantViolation, match="Invariant 8"):
        async with guard.persisting(srv, "restore", slot=srv.slots[0]):
            raise AssertionError("not reached")
    assert srv.breaker.failures == 0


class SteppingClock(Clock):
    """Moves on by `step` at every read: a cooldown can end between two reads of one decision."""

    def __init__(self) -> None:
        super().__init__()
        self.step = 0.0

    def __call__(self) -> float:
        self.now += self.step
        return self.now


@pytest.mark.parametrize("before_end_s", [1.0, 0.7, 0.5, 0.3, 0.1, 0.0])
async def test_a_trial_granted_as_the_cooldown_ends_is_ended_by_the_block(
    tmp_path: Path, guard: PersistGuard, before_end_s: float
) -> None:
    """The breaker's state is read once per admission (`admit()`): whatever the clock does between reads,
    an operation that ends with no verdict never leaves the half-open trial in flight (which would refuse
    every save and restore from then on)."""
    clock = SteppingClock()
    config = make_config(tmp_path)
    make = server_maker(config, None, None, None, clock)
    server = build_servers(config, {"local": FakeKvBackend(tmp_path / "s")}, make)["local"]
    reached(server)
    server.slots[0].holder = "test"
    breaker = server.breaker
    for _ in range(breaker.max_consecutive_failures):
        breaker.failure("KV_SAVE_FAILED")
    assert breaker.opened_at is not None
    clock.now = breaker.opened_at + breaker.cooldown_s - before_end_s
    clock.step = 0.6
    async with guard.persisting(server, "save", slot=server.slots[0]) as op:
        took_trial = breaker.trial_in_flight
        assert op.trial is took_trial and op.allowed is took_trial  # refused, or granted as the trial
        op.void()  # e.g. the server restarted under it: no verdict
    assert not breaker.trial_in_flight
