"""Per-server circuit breaker for persistence calls (spec §33). Inference is never blocked by it.

HEALTHY --failure--> DEGRADED --(max_consecutive_failures)--> OPEN --(cooldown)--> HALF_OPEN
HALF_OPEN: one trial call; success -> HEALTHY, failure -> OPEN again with the cooldown doubled (capped).
The clock is injected; nothing here sleeps.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import StrEnum


class BreakerState(StrEnum):
    HEALTHY = "healthy"
    DEGRADED = "degraded"
    OPEN = "open"
    HALF_OPEN = "half_open"


class CircuitBreaker:
    def __init__(
        self,
        *,
        max_consecutive_failures: int = 3,
        cooldown_s: float = 60.0,
        max_cooldown_s: float = 600.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_consecutive_failures = max_consecutive_failures
        self.base_cooldown_s = cooldown_s
        self.max_cooldown_s = max_cooldown_s
        self.clock = clock
        self.failures = 0
        self.cooldown_s = cooldown_s
        self.opened_at: float | None = None
        self.trial_in_flight = False
        self.last_error: str | None = None

    def configure(self, *, max_consecutive_failures: int, cooldown_s: float) -> None:
        """SIGHUP: new limits. The current state is kept: an open breaker stays open for the cooldown it
        opened with, and the new base cooldown applies from its next recovery on."""
        self.max_consecutive_failures = max_consecutive_failures
        self.base_cooldown_s = cooldown_s

    @property
    def state(self) -> BreakerState:
        if self.opened_at is not None:
            if self.clock() - self.opened_at >= self.cooldown_s:
                return BreakerState.HALF_OPEN
            return BreakerState.OPEN
        return BreakerState.DEGRADED if self.failures else BreakerState.HEALTHY

    def allow(self) -> bool:
        """May a persistence call go ahead now? In HALF_OPEN only one trial at a time."""
        return self.admit() is not None

    def admit(self) -> bool | None:
        """`allow()`, saying what it granted: None (refused), False (a plain call) or True (the half-open
        trial, which the caller must end). The state is read once: a cooldown that ends between a read of
        `state` and the grant cannot hand out a trial its caller does not know it holds."""
        state = self.state
        if state is BreakerState.OPEN:
            return None
        if state is BreakerState.HALF_OPEN:
            if self.trial_in_flight:
                return None
            self.trial_in_flight = True
            return True
        return False

    def end_trial(self) -> None:
        """Whatever happened, the call that `allow()` let through is over: a trial that ended with no
        verdict (a snapshot error, a restart seen by the bracket, a cancellation) must not keep the
        breaker half-open forever. Harmless after success() or failure()."""
        self.trial_in_flight = False

    def success(self) -> bool:
        """Record a success; True when this closed an open breaker (a recovery worth logging)."""
        recovered = self.opened_at is not None
        self.failures = 0
        self.opened_at = None
        self.trial_in_flight = False
        self.cooldown_s = self.base_cooldown_s
        self.last_error = None
        return recovered

    def failure(self, error: str) -> bool:
        """Record a failure; True when this opened the breaker."""
        self.last_error = error
        self.failures += 1
        if self.opened_at is not None:  # a failed trial: back off
            self.cooldown_s = min(self.cooldown_s * 2, self.max_cooldown_s)
            self.opened_at = self.clock()
            self.trial_in_flight = False
            return False
        if self.failures >= self.max_consecutive_failures:
            self.opened_at = self.clock()
            return True
        return False
