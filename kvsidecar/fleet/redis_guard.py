"""`RedisGuard.guarded()`: the one guarded Redis call of fleet mode.

Every call fleet mode makes to Redis (a heartbeat, a residency event, a claim, a lease given back, the
leader's view for retention, a route's owner, a queued release, a fan-out's hosts, `fleet status`, leaving
the fleet) runs inside it. It bounds the call's time (`timeout_s` per round trip the call may take) and
turns whatever redis-py, the socket or the bound raises (`DOWN`) into one `RedisDown`, after telling the
agent once (`on_down`: its `went_down`, which logs KV_FLEET_REDIS_DOWN and serves as a single host until a
heartbeat finds Redis again). It is to Redis what `backend/llamacpp.py` is to httpx: the one place its
errors are seen. So a Redis that stalls (SIGSTOP, `DEBUG SLEEP`, a partition that drops packets) costs each
call at most its bound, in one place; the client's socket timeouts (`plane.connect`) are a second fence
under it.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from redis.exceptions import RedisError

# What a Redis outage looks like from redis-py (a dead socket can also surface as an OSError, a stall as
# the bound's TimeoutError): exactly what `guarded` converts.
DOWN: tuple[type[BaseException], ...] = (RedisError, OSError, asyncio.TimeoutError)


class RedisDown(Exception):
    """Redis did not answer within the bound, or failed: the caller goes on without it."""

    def __init__(self, cause: BaseException) -> None:
        super().__init__(type(cause).__name__)
        self.cause = cause


class RedisGuard:
    def __init__(self, *, timeout_s: float, on_down: Callable[[BaseException], None] | None = None) -> None:
        self.timeout_s = timeout_s
        self.on_down = on_down
        self.calls = 0  # guarded calls begun
        self.failed = 0  # of which ended in RedisDown (timed out or failed)

    @contextlib.asynccontextmanager
    async def guarded(self, round_trips: int = 1, *, report: bool = True) -> AsyncIterator[None]:
        """Run the body (Redis calls only) within `round_trips` x `timeout_s`; any failure leaves as
        `RedisDown`, reported to `on_down` first unless `report` is false (leaving the fleet at a stop)."""
        self.calls += 1
        try:
            async with asyncio.timeout(self.timeout_s * round_trips):
                yield
        except DOWN as exc:
            self.failed += 1
            if report and self.on_down is not None:
                self.on_down(exc)
            raise RedisDown(exc) from exc
