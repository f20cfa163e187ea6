"""What kvsidecar knows of one llama-server runtime, and its one writer: `RuntimeIdentity`.

A runtime is what serves one model: a plain llama-server, or (router mode) one child of a router, keyed by
its model (`RuntimeKey`). Every fact about it lives in one immutable record, `IdentityFacts`, that only
`RuntimeIdentity` replaces, each time through `transition()`; everything else reads it:

- `caps`: the last answer of `/props` (slots, context size, model path, build, the per-start nonce, sleep
  mode), kept while the server does not answer, so that the next answer is compared with it;
- `process`: the local llama-server process (pid and create time, command line, environment, mapped model
  files), None for a server whose process is not seen here;
- `available`, `last_error`: whether its last probe (or a persistence call) reached it;
- `base`, `canary`, `fingerprint`: the fingerprint's components without the KV canary, the canary's KV
  digest made on this instance, and the whole (None until every part is known); `canary_failures`;
- `memory`: the loaded model's memory class (`memory_class.py`), read with the fingerprint;
- `epoch`: the restarts seen (an operation that spans a change of it is void), and why the last one was.

States, and what moves them (`transition`, tested as a table in tests/unit/fingerprint/test_identity.py):

    UNKNOWN --NEW--> PROBING --FINGERPRINTED / CANARY (complete)--> PROVEN
    any --NEW (a restart, a wake, a reload, first sight, a forced proof)--> PROBING (fingerprint withdrawn)
    any --SAME--> PROVEN (complete) or PROBING;   any --ASLEEP--> SLEEPING (no model, no fingerprint)
    PROBING/PROVEN --DOUBTED (a bracket's instance check failed)--> CHANGED: the next probe decides
    any but UNKNOWN --EXITED (the /proc check, the exit watch)--> GONE;   any --UNREACHED--> UNREACHABLE
    (GONE stays GONE: it is known to have ended)

The fingerprint is shown (`IdentityFacts.shown`) while PROVEN, and while UNREACHABLE (the last one proven,
for status and for the comparison at the next answer); never while CHANGED or GONE. Only PROVEN is trusted
(`store/trust.py`). Pure: no I/O, no event loop, an injected clock. The I/O that produces the events (the
probe, the process lookup, the fingerprint build, the instance checks) is `coordinator/server.py`'s.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, NamedTuple

from kvsidecar.backend.base import BackendCapabilities
from kvsidecar.fingerprint.llama_process import ProcessInfo
from kvsidecar.fingerprint.memory_class import MemoryClass
from kvsidecar.fingerprint.runtime import RuntimeFingerprint


class RuntimeKey(NamedTuple):
    """Which runtime: the configured server, and the model of a router's child (None: a plain server)."""

    server: str
    model: str | None = None

    def __str__(self) -> str:
        return self.server if self.model is None else f"{self.server}[{self.model}]"


class IdentityState(StrEnum):
    UNKNOWN = "unknown"  # never reached
    PROBING = "probing"  # reached and awake; its fingerprint being built, or incomplete (canary pending)
    PROVEN = "proven"  # reached and awake: the complete fingerprint of this instance
    CHANGED = "changed"  # a bracket's check says it may not be the instance proven; the next probe decides
    GONE = "gone"  # its local process ended (the /proc check, the exit watch); not yet probed again
    UNREACHABLE = "unreachable"  # the last probe or persistence call did not reach it
    SLEEPING = "sleeping"  # in sleep mode: no model loaded, no slot's KV, no fingerprint


class IdentityEvent(StrEnum):
    SAME = "same"  # a probe: awake, the runtime already fingerprinted
    NEW = "new"  # a probe: awake, a runtime to fingerprint (first sight, a restart, a reload, a forced proof)
    ASLEEP = "asleep"  # a probe: in sleep mode
    UNREACHED = "unreached"  # a probe or a persistence call did not reach it
    FINGERPRINTED = "fingerprinted"  # the fingerprint of what the probe found was built
    CANARY = "canary"  # the KV canary was measured on this instance
    CANARY_FAILED = "canary_failed"
    DOUBTED = "doubted"  # a bracket's instance check failed (nonce, model mappings, asleep, no answer)
    EXITED = "exited"  # its local process is seen ended


S, E = IdentityState, IdentityEvent
_BUILDING = frozenset({S.PROBING, S.PROVEN})  # a fingerprint or canary made now belongs to this instance
SHOWN = frozenset({S.PROVEN, S.UNREACHABLE})
# The restart reasons that prove a new llama-server process (not a server that only looked gone for a while).
NEW_PROCESS = frozenset({"process changed", "instance nonce changed"})


def transition(state: IdentityState, event: IdentityEvent, *, complete: bool) -> IdentityState:
    """The next state. `complete`: the fingerprint, once the event's facts are in, has every part."""
    awake = S.PROVEN if complete else S.PROBING
    match event:
        case E.SAME:
            return awake
        case E.NEW:
            return S.PROBING
        case E.ASLEEP:
            return S.SLEEPING
        case E.UNREACHED:
            return S.GONE if state is S.GONE else S.UNREACHABLE
        case E.FINGERPRINTED | E.CANARY:
            return awake if state in _BUILDING else state
        case E.CANARY_FAILED:
            return state
        case E.DOUBTED:
            return S.CHANGED if state in _BUILDING else state
        case E.EXITED:
            return state if state is S.UNKNOWN else S.GONE
    raise AssertionError(f"unhandled identity event {event}")  # pragma: no cover


@dataclass(frozen=True, slots=True, kw_only=True)
class IdentityFacts:
    """Everything known of one runtime at one moment (see the module docstring); replaced, never edited."""

    state: IdentityState = S.UNKNOWN
    since: float = 0.0  # when it entered `state` (the injected clock)
    caps: BackendCapabilities | None = None
    process: ProcessInfo | None = None
    available: bool = False
    last_error: str | None = None
    base: RuntimeFingerprint | None = None  # the fingerprint without the canary
    canary: str | None = None  # digest of the runtime canary's KV, made on this instance
    canary_failures: int = 0
    fingerprint: RuntimeFingerprint | None = None  # the whole, None until every part is known
    memory: MemoryClass | None = None
    epoch: int = 0  # restarts seen
    restart: str | None = None  # why the last restart was seen

    @property
    def shown(self) -> RuntimeFingerprint | None:
        """The fingerprint as the server's (status, saves, the bracket): None while it is not bound."""
        return self.fingerprint if self.state in SHOWN else None

    @property
    def sleeping(self) -> bool:
        return self.caps is not None and self.caps.sleeping


@dataclass(frozen=True, kw_only=True)
class RefreshResult:
    available: bool
    restarted: bool
    reason: str | None = None
    rebuild: bool = False  # the fingerprint is to be built for what the probe found (then `fingerprinted`)

    @property
    def new_process(self) -> bool:
        return self.restarted and self.reason in NEW_PROCESS


class RuntimeIdentity:
    """The state machine of one runtime: its one writer. Each method is an event (module docstring)."""

    def __init__(self, *, key: RuntimeKey, canary: Callable[[], bool], clock: Callable[[], float]) -> None:
        self.key = key
        self._canary_on = canary  # is the KV canary a part of the fingerprint (servers.<name>.runtime_canary)
        self._clock = clock
        self.now = IdentityFacts(since=clock())

    # the probe ------------------------------------------------------------------------------------------
    def probed(
        self,
        caps: BackendCapabilities,
        process: ProcessInfo | None,
        *,
        force: bool = False,
        slept: BackendCapabilities | None = None,
    ) -> RefreshResult:
        """A probe answered `caps`, and the process lookup found `process`. `force`: fingerprint it again
        even when nothing looks changed. `slept`: the probe found it asleep and woke it (then this answer
        is compared with the sleeping one: a wake is a restart)."""
        old = self.now
        restarted, reason = restart_reason(
            old.available, slept if slept is not None else old.caps, caps, old.process, process
        )
        seen: dict[str, Any] = {"caps": caps, "process": process, "available": True, "last_error": None}
        if restarted:
            seen.update(epoch=old.epoch + 1, restart=reason)
        rebuild = not caps.sleeping and (
            force or restarted or old.base is None or (process is not None and old.process is None)
        )
        if caps.sleeping or rebuild:  # no model loaded, or another one: the fingerprint is withdrawn now
            self._apply(E.ASLEEP if caps.sleeping else E.NEW, base=None, canary=None, memory=None, **seen)
        else:
            self._apply(E.SAME, **seen)
        return RefreshResult(available=True, restarted=restarted, reason=reason, rebuild=rebuild)

    def probe_failed(self, error: str, *, slept: BackendCapabilities | None = None) -> RefreshResult:
        """A probe did not reach it (`slept`: it answered asleep, then the wake or the next probe failed).
        A server that was reachable may have restarted meanwhile: a restart (the epoch moves)."""
        old = self.now
        seen: dict[str, Any] = {"available": False, "last_error": error}
        if slept is not None:
            seen["caps"] = slept
        if old.available:
            seen.update(epoch=old.epoch + 1, restart="unreachable")
        self._apply(E.UNREACHED, **seen)
        return RefreshResult(available=False, restarted=old.available, reason="unreachable")

    def call_failed(self) -> None:
        """A persistence call found it out of reach (unavailable, timeout): the next probe or bracket
        re-checks it, and says whether it restarted."""
        self._apply(E.UNREACHED, available=False)

    def fingerprinted(self, base: RuntimeFingerprint, memory: MemoryClass | None) -> None:
        """The fingerprint (without the canary) of what the last probe found, and the model's memory
        class. Builds are serialized with the probes (the server's refresh lock)."""
        self._apply(E.FINGERPRINTED, base=base, canary=None, memory=memory)

    # the canary -----------------------------------------------------------------------------------------
    def canary_measured(self, digest: str) -> None:
        """The canary's KV digest, measured on this instance (kept only while it is being proven)."""
        if self.now.state in _BUILDING:
            self._apply(E.CANARY, canary=digest, canary_failures=0)
        else:
            self._apply(E.CANARY)

    def canary_failed(self) -> None:
        self._apply(E.CANARY_FAILED, canary_failures=self.now.canary_failures + 1)

    # the brackets and the process checks ----------------------------------------------------------------
    def doubted(self) -> None:
        """A bracket could not show that the server is still the instance proven."""
        self._apply(E.DOUBTED)

    def exited(self, process: ProcessInfo) -> bool:
        """`process` is seen ended; it counts only when it is this runtime's process (True then)."""
        current = self.now.process
        if current is None or current.identity != process.identity:
            return False
        self._apply(E.EXITED)
        return True

    # the one place the record is replaced ----------------------------------------------------------------
    def _apply(self, event: IdentityEvent, **changes: Any) -> None:
        old = self.now
        facts = dataclasses.replace(old, **changes) if changes else old
        if "base" in changes or "canary" in changes:
            facts = dataclasses.replace(facts, fingerprint=self._whole(facts.base, facts.canary))
        state = transition(old.state, event, complete=facts.fingerprint is not None)
        if state is not old.state:
            facts = dataclasses.replace(facts, state=state, since=self._clock())
        self.now = facts

    def _whole(self, base: RuntimeFingerprint | None, canary: str | None) -> RuntimeFingerprint | None:
        """The full fingerprint: what the server and its process say, plus the canary's KV digest."""
        if base is None:
            return None
        if not self._canary_on():
            return base
        if canary is None:
            return None
        return RuntimeFingerprint(components={**base.components, "canary_kv": canary}, info=dict(base.info))


def restart_reason(
    was_available: bool,
    old_caps: BackendCapabilities | None,
    caps: BackendCapabilities,
    old_process: ProcessInfo | None,
    process: ProcessInfo | None,
) -> tuple[bool, str | None]:
    """Did the server restart since the last probe, and what shows it. Identity evidence (process, nonce)
    decides when there is some: a slow answer that made the server look unreachable is not a restart."""
    if old_caps is None:
        return False, None
    same_evidence = False
    if old_process is not None and process is not None:
        if old_process.identity != process.identity:
            return True, "process changed"
        same_evidence = True
    if caps.sleeping and not old_caps.sleeping:
        return True, "entered sleep mode"  # the model and every slot's KV are freed
    if old_caps.sleeping and not caps.sleeping:
        return True, "woke from sleep mode"  # the model was loaded again from its path
    if (
        old_process is not None
        and process is not None
        and old_process.mapped_models is not None
        and old_process.load_identity != process.load_identity
    ):
        return True, "model mapped again"
    if old_caps.instance_id is not None or caps.instance_id is not None:
        if old_caps.instance_id != caps.instance_id:
            return True, "instance nonce changed"
        same_evidence = True
    if caps.model_path != old_caps.model_path:
        return True, "model changed"
    if old_process is not None and process is None:
        return True, "local process gone"
    if not was_available and not same_evidence:
        return True, "was unreachable"
    return False, None
