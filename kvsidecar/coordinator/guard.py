"""The one guarded persistence call (spec §33, §59): `PersistGuard.persisting(srv, kind, slot=...)`.

Every save, restore, erase and runtime canary runs inside it, and nothing else asks a server's circuit
breaker, holds its half-open trial, bounds a call to the server or records a verdict:

    async with guard.persisting(srv, "erase", slot=slot) as op:
        await op.call(srv.backend.erase_slot(slot.id))

- *allow*: a gated kind asks the breaker once (`op.allowed`; the body does nothing when it is False). A
  half-open breaker lets one operation through, the trial, and the trial ends when the block does, whatever
  happened: a trial that ended with no verdict (a snapshot error, a restart seen by the bracket, a
  cancellation) must not keep the breaker half-open (issue 14).
- *bound*: `op.call()` gives a call `persist_timeout_s` (plus a margin) of its own, independent of any
  inference timeout, and raises OperationTimeout past it.
- *verdict*, once per operation: what the body said (`op.failed(exc)` for an error it handled itself,
  `op.succeeded()`, `op.void()` when there is nothing to judge: the result could not be confirmed), else
  how the block ended: a KvError escaping is a failure, a normal end a success. Only errors of the server
  count (BackendError), and for a restore not a file the server refused (RestoreFailed: the file's
  problem). A failure may open the breaker; a server out of reach (unavailable, timeout) is marked
  unavailable until the next bracket or probe; a success closes an open breaker.
- *Invariant 8*: an operation on a slot runs only while the slot is held (pool.py): a free `slot` raises
  InvariantViolation.

The kinds (`_RULES`): `save` (gated, judged: the write and its commit; an overlapped commit carries the
operation with it, save.py), `load` (gated, not judged: a session's restore or cold start, the gate of its
steps, which are judged on their own), `restore` and `erase` (judged), `canary` (bound only: its failures
are the canary's own, counted in `canary_failures`), `park` (bound only: scope.py's one token that hands
a slot's KV to llama-server's RAM cache, best effort).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass
from typing import Literal, TypeVar

from kvsidecar.coordinator.breaker import BreakerState
from kvsidecar.coordinator.server import ServerRuntime
from kvsidecar.coordinator.state import Slot
from kvsidecar.coordinator.telemetry import Telemetry
from kvsidecar.errors import (
    BackendError,
    BackendUnavailable,
    InvariantViolation,
    KvError,
    OperationTimeout,
    RestoreFailed,
)

T = TypeVar("T")
MARGIN_S = 5.0
Kind = Literal["save", "load", "restore", "erase", "canary", "park"]


@dataclass(frozen=True)
class _Rule:
    gated: bool  # the breaker decides whether it runs (one at a time while half-open: the trial)
    judged: bool  # its outcome is a verdict on the server
    not_counted: tuple[type[BackendError], ...] = ()  # errors that say nothing of the server


_RULES: dict[str, _Rule] = {
    "save": _Rule(gated=True, judged=True),
    "load": _Rule(gated=True, judged=False),
    "restore": _Rule(gated=False, judged=True, not_counted=(RestoreFailed,)),
    "erase": _Rule(gated=False, judged=True),
    "canary": _Rule(gated=False, judged=False),
    "park": _Rule(gated=False, judged=False),  # kvsidecar's one token on a slot (scope.py): best effort
}


class Persisting:
    """One guarded persistence operation: the value of `PersistGuard.persisting`."""

    def __init__(
        self, srv: ServerRuntime, rule: _Rule, telemetry: Telemetry, *, allowed: bool, trial: bool
    ) -> None:
        self.srv = srv
        self.allowed = allowed  # the breaker let it run
        self.trial = trial  # it is the half-open breaker's one trial
        self._rule = rule
        self._telemetry = telemetry
        self._judged = not (allowed and rule.judged)  # nothing to record for it (any more)

    async def call(self, op: Awaitable[T]) -> T:
        """One call to the server, with its own bound (spec §59)."""
        srv = self.srv
        try:
            return await asyncio.wait_for(op, srv.config.persist_timeout_s + MARGIN_S)
        except TimeoutError:
            raise OperationTimeout(
                f"persistence call to {srv.name} ran past {srv.config.persist_timeout_s}s"
            ) from None

    def failed(self, exc: BaseException) -> None:
        """The operation failed with `exc` (an error the body handles itself)."""
        if self._judged:
            return
        self._judged = True
        if not isinstance(exc, BackendError) or isinstance(exc, self._rule.not_counted):
            return
        srv = self.srv
        if srv.breaker.failure(exc.code):
            self._telemetry.circuit_open(srv.name, exc.code, srv.breaker.cooldown_s)
        if isinstance(exc, BackendUnavailable | OperationTimeout):
            srv.identity.call_failed()  # the next bracket or probe re-checks, and says whether it restarted

    def succeeded(self) -> None:
        if self._judged:
            return
        self._judged = True
        if self.srv.breaker.success():
            self._telemetry.circuit_recovered(self.srv.name)

    def void(self) -> None:
        """Nothing to judge: the result could not be confirmed (the server restarted under it, the file was
        swapped), or nothing was written."""
        self._judged = True


class PersistGuard:
    def __init__(self, *, telemetry: Telemetry) -> None:
        self.telemetry = telemetry

    @contextlib.asynccontextmanager
    async def persisting(
        self, srv: ServerRuntime, kind: Kind, *, slot: Slot | None = None, ready: bool = True
    ) -> AsyncIterator[Persisting]:
        """One persistence operation of `kind` on `srv` (on `slot`, which the caller must hold). `ready`
        False: the server cannot take it now (no proven runtime): not allowed, and the breaker is not asked
        (a half-open trial is not spent on it)."""
        if slot is not None and slot.free:
            raise InvariantViolation(
                f"a {kind} on slot {slot.id} of server {srv.name}, which nobody holds (Invariant 8)"
            )
        rule = _RULES[kind]
        trial, allowed = False, True
        if rule.gated:
            granted = srv.breaker.admit() if ready else None
            allowed, trial = granted is not None, granted is True
        op = Persisting(srv, rule, self.telemetry, allowed=allowed, trial=trial)
        try:
            yield op
        except KvError as exc:
            op.failed(exc)
            raise
        else:
            op.succeeded()
        finally:
            if trial:  # this operation held the half-open trial: it ends here
                srv.breaker.end_trial()

    @staticmethod
    def circuit_open(srv: ServerRuntime) -> bool:
        """The breaker stops every persistence call to the server now (no trial either)."""
        return srv.breaker.state is BreakerState.OPEN
