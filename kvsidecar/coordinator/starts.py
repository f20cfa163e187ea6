"""The facts a session's start is planned from, read at one moment (`StartFacts` for plan.py), and what the
planner remembers between acquires: each server's memory class, the llama-server instance (restart epoch)
each session last ran on, and the reuse each restore was planned to give (checked at release).

`Planner.plan()` reads: the model's memory class (fingerprint/memory_class.py, from the model files of the
process and its settings, read once per instance with its fingerprint by `ServerRuntime.refresh`), the
prompt's tokens (the proxy's, or the hook API's `prompt`), the slot (its scope, tokens, whether it is empty),
the session's restorable points (every generation that passes the candidate checks, newest first, each with
its tokens from the file's header), a donor's point and tokens, the RAM cache's setting, the cost figures and
the flags; then asks `plan_start` and returns its answer. It writes nothing but its own three maps; the
executors (restore.py, coldstart.py, carry.py) act on the plan.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import OrderedDict
from dataclasses import dataclass
from typing import TypeVar

from kvsidecar.backend.base import PromptTokenizer
from kvsidecar.backend.prompts import KnownTokens, PromptTokens
from kvsidecar.coordinator.costs import CostModel
from kvsidecar.coordinator.plan import (
    PLAIN_CLASS,
    DonorFacts,
    Flags,
    ModelFacts,
    Point,
    PromptFacts,
    SlotFacts,
    StartFacts,
    StartPlan,
    plan_start,
    wants_prompt_point,
)
from kvsidecar.coordinator.runtime import RuntimeGuard
from kvsidecar.coordinator.scope import ram_lookups
from kvsidecar.coordinator.server import ServerRuntime
from kvsidecar.coordinator.state import SessionRuntime, Slot
from kvsidecar.errors import KvError
from kvsidecar.fingerprint.memory_class import PLAIN, UNKNOWN, MemoryClass
from kvsidecar.store.naming import SnapshotIdentity
from kvsidecar.store.snapshots import Candidate, Rejection, SnapshotStore

V = TypeVar("V")
FAKE_KIND = "fake"  # backend/fake.py: a plain-attention engine (it reuses any common prefix)
_REMEMBERED = 1 << 16  # sessions whose instance and expected reuse are kept (oldest forgotten first)


@dataclass(frozen=True, kw_only=True)
class Own:
    """The session's own snapshot as found for this runtime."""

    candidates: tuple[Candidate, ...] = ()  # newest first
    rejections: tuple[Rejection, ...] = ()


def memory_of(srv: ServerRuntime) -> MemoryClass:
    """The memory class of the model `srv` runs, as its identity read it with the fingerprint of this very
    instance (`ServerRuntime.refresh`: one read feeds the identity, status, doctor and the plan); unknown
    (the strict rule) while it is not read, or for a server whose process is not seen here (a remote one)."""
    caps = srv.caps
    if caps is not None and caps.kind == FAKE_KIND:  # the fake engine reuses any common prefix: plain
        return MemoryClass(kind=PLAIN, arch="fake", n_layer=0, attention_layers=0, why="the fake engine")
    known = srv.memory_class
    if known is None:
        return MemoryClass(
            kind=UNKNOWN, arch="", n_layer=0, attention_layers=0, why="not read (process not seen)"
        )
    return known


def ram_cache_of(srv: ServerRuntime) -> str:
    """llama-server's RAM cache as its settings say: on / off / unknown (the process is not seen)."""
    if srv.process is None:
        return "unknown"
    return "on" if ram_lookups(srv.process) else "off"


class Planner:
    def __init__(
        self, *, store: SnapshotStore, guard: RuntimeGuard, costs: CostModel, share_prefix: bool = True
    ) -> None:
        self.store = store
        self.guard = guard
        self.costs = costs
        self._ran: OrderedDict[str, tuple[str, int]] = OrderedDict()  # key -> (server, epoch)
        self._expected: OrderedDict[str, int] = OrderedDict()  # key -> tokens its restore should give

    async def memory(self, srv: ServerRuntime) -> MemoryClass:
        return memory_of(srv)

    def memory_kind(self, srv: ServerRuntime) -> str:
        """The class of the instance `srv` runs now (`memory_of`: no I/O; unknown while it is not read), not
        the one its last plan used: after a restart that one may be another model's or other settings'."""
        return memory_of(srv).kind

    def resident_point(
        self, srv: ServerRuntime, prompt: PromptTokens | None, *, restore_enabled: bool, oversubscribed: bool
    ) -> bool:
        """Does a resident session's turn take a save point at its prompt's end? plan.py's rule, with the
        class read for the instance `srv` runs now (no I/O: a resident acquire makes none)."""
        memory = memory_of(srv)  # this instance's read (no I/O), not the last plan's
        facts = StartFacts(
            scope="",
            model=ModelFacts(kind=memory.kind, swa_full=memory.swa_full),
            prompt=_prompt(prompt),
            costs=self.costs.server(srv.name).figures(),
            flags=Flags(restore_enabled=restore_enabled, oversubscribed=oversubscribed),
        )
        return wants_prompt_point(facts)

    def tokenizer_for(self, srv: ServerRuntime, *, always: bool = False) -> PromptTokenizer | None:
        """llama-server's tokenizer, when a request's tokens can change what its session starts from: every
        class but plain (whose newest point needs no proof), and `always` (a donor is proposed: chosen by the
        tokens it shares)."""
        return None if not always and self.memory_kind(srv) == PLAIN_CLASS else srv.backend

    def ran(self, srv: ServerRuntime, rt: SessionRuntime) -> None:
        """`rt` runs on the current instance of `srv` (so its RAM cache may hold it)."""
        _remember(self._ran, rt.key, (srv.name, self.guard.epoch(srv)))

    def expect(self, rt: SessionRuntime, tokens: int | None) -> None:
        if tokens is None:
            self._expected.pop(rt.key, None)
        else:
            _remember(self._expected, rt.key, tokens)

    def expected(self, rt: SessionRuntime) -> int | None:
        return self._expected.pop(rt.key, None)

    async def plan(
        self,
        srv: ServerRuntime,
        slot: Slot,
        rt: SessionRuntime,
        own: Own | None,
        *,
        prompt: PromptTokens | None,
        donor: SnapshotIdentity | None,
        flags: Flags,
    ) -> tuple[StartPlan, StartFacts]:
        memory = await self.memory(srv)
        points: tuple[Point, ...] = ()
        if own is not None and own.candidates:
            points = tuple([await self._point(c) for c in own.candidates])
        elif own is not None and own.rejections:
            rej = own.rejections[0]  # saved under another build: a carry-over may bring it back
            points = (Point(generation=str(rej.generation), n_tokens=0, carry=True),)
        facts = StartFacts(
            scope=rt.scope,
            model=ModelFacts(kind=memory.kind, n_swa=memory.n_swa, swa_full=memory.swa_full),
            prompt=_prompt(prompt),
            slot=SlotFacts(scope=slot.scope, empty=slot.tokens == 0, n_tokens=slot.tokens, tokens=None),
            points=points,
            donor=await self._donor(srv, donor) if donor is not None else None,
            costs=self.costs.server(srv.name).figures(),
            flags=Flags(
                **{
                    **flags.__dict__,
                    "ram_cache": ram_cache_of(srv),
                    "ran_on_instance": self._ran.get(rt.key) == (srv.name, self.guard.epoch(srv)),
                }
            ),
        )
        return plan_start(facts), facts

    async def _point(self, candidate: Candidate) -> Point:
        tokens = await asyncio.to_thread(self.store.point_tokens, candidate)
        return Point(generation=str(candidate.generation), n_tokens=candidate.record.tokens, tokens=tokens)

    async def _donor(self, srv: ServerRuntime, donor: SnapshotIdentity) -> DonorFacts | None:
        fingerprint = srv.fingerprint
        manifest = self.store.get(donor.key)
        if fingerprint is None or manifest is None or manifest.scope is None:
            return None
        candidate = None
        with contextlib.suppress(KvError):
            candidate, _ = await asyncio.to_thread(
                self.store.find_restorable, donor, fingerprint, max_tokens=srv.slot_n_ctx
            )
        if candidate is None:
            return None
        return DonorFacts(key=donor.key, scope=manifest.scope, point=await self._point(candidate))


def _remember(table: OrderedDict[str, V], key: str, value: V) -> None:
    table.pop(key, None)
    table[key] = value
    while len(table) > _REMEMBERED:
        table.popitem(last=False)


def _prompt(prompt: PromptTokens | None) -> PromptFacts:
    if prompt is None:
        return PromptFacts(unknown="not_given")
    if isinstance(prompt, KnownTokens):
        return PromptFacts(tokens=prompt.tokens)
    return PromptFacts(unknown=prompt.reason)
