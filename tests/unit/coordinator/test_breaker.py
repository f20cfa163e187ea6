from __future__ import annotations

from kvsidecar.coordinator.breaker import BreakerState, CircuitBreaker


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def state(b: CircuitBreaker) -> BreakerState:
    """Read through a call: mypy would otherwise keep `b.state` narrowed across the calls that change it."""
    return b.state


def test_opens_after_consecutive_failures_and_recovers_through_half_open() -> None:
    clock = Clock()
    b = CircuitBreaker(max_consecutive_failures=3, cooldown_s=60, clock=clock)
    assert state(b) is BreakerState.HEALTHY and b.allow()
    assert not b.failure("x") and state(b) is BreakerState.DEGRADED
    assert not b.failure("x")
    assert b.failure("x") and state(b) is BreakerState.OPEN
    assert not b.allow()
    clock.t = 60
    assert state(b) is BreakerState.HALF_OPEN
    assert b.allow() and not b.allow()  # one trial at a time
    assert b.success() and state(b) is BreakerState.HEALTHY


def test_failed_trial_doubles_the_cooldown_up_to_the_cap() -> None:
    clock = Clock()
    b = CircuitBreaker(max_consecutive_failures=1, cooldown_s=10, max_cooldown_s=25, clock=clock)
    b.failure("x")
    for expected in (20, 25, 25):
        clock.t += b.cooldown_s
        assert b.allow()
        b.failure("x")
        assert b.cooldown_s == expected and state(b) is BreakerState.OPEN


def test_success_resets_the_count() -> None:
    b = CircuitBreaker(max_consecutive_failures=2, clock=Clock())
    b.failure("x")
    b.success()
    assert not b.failure("x") and state(b) is BreakerState.DEGRADED
