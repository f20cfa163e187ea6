"""`Caller`: whether the one who asked for a lease still waits for the answer (issue 26 C).

A lease exists only while someone holds it. An acquire whose caller has gone (its connection closed: the
hook API watches for ASGI's `http.disconnect`; or its deadline passed: `X-KV-Deadline-Ms`, a budget a
forwarding fleet host sets) stops waiting for a slot at once, and one that got its slot meanwhile gives it
back instead of granting a lease nobody would ever release.

What is never cut short: a restore (or the save of the slot's previous owner) already under way runs to
its end, so the slot holds what its records say; only the grant is refused. Everything here runs on the
event loop (its clock: `loop.time()`).
"""

from __future__ import annotations

import asyncio
import contextlib

from kvsidecar.errors import SlotBusy

__all__ = ["DEADLINE_MARGIN_S", "Caller", "deadline_from_budget"]

# What a receiver takes off a forwarded call's budget (a share of it, at least this and at most 2 s): it
# gives up before its sender does, so it never grants a lease after the sender stopped waiting for it.
DEADLINE_MARGIN_S = 0.25


def deadline_from_budget(budget_s: float, now: float) -> float:
    """The local deadline (loop time) of a call that came with `budget_s` seconds: the budget counts from
    its receipt here (the hosts' clocks may differ), less a margin for the time it spent on the way."""
    margin = min(2.0, max(DEADLINE_MARGIN_S, budget_s * 0.05))
    return now + budget_s - margin


class Caller:
    """One acquire's caller: gone once `leave()` was called (its connection closed) or its deadline
    (`loop.time()` seconds; None: none) has passed."""

    def __init__(self, *, deadline: float | None = None) -> None:
        self.deadline = deadline
        self.why: str | None = None
        self._left = asyncio.Event()

    def leave(self, why: str = "the client closed its connection") -> None:
        if self.why is None:
            self.why = why
        self._left.set()

    def gone(self) -> bool:
        if self._left.is_set():
            return True
        return self.deadline is not None and asyncio.get_running_loop().time() >= self.deadline

    def remaining(self) -> float | None:
        """Seconds until the deadline (0 once past), or None without one."""
        if self.deadline is None:
            return None
        return max(0.0, self.deadline - asyncio.get_running_loop().time())

    async def wait(self) -> None:
        """Return once the caller is gone (left, or its deadline passed)."""
        remaining = self.remaining()
        if remaining is None:
            await self._left.wait()
            return
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(remaining):
                await self._left.wait()

    def error(self, server: str) -> SlotBusy:
        """The answer to a caller that is gone (nobody may read it: the connection may be closed)."""
        why = self.why or "its deadline passed"
        return SlotBusy(
            f"acquire on server {server} abandoned: {why}; no lease was granted",
            hint="the slot stayed free for the next request",
        )
