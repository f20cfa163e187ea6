"""Whose KV a request may run on: one credential scope's KV is never lent to another scope's request
(docs/CLIENTS.md, "Credential scopes").

llama-server (tools/server/server-context.cpp of 11434: `get_available_slot`, the reuse decision, the idle
slot cache; each held on the real binary by tests/integration/test_scope_real.py) reuses KV two ways:

- from the slot a request is pinned to: with `cache_prompt` (its default) the exact common token prefix of
  what the slot holds and the prompt;
- from its host-memory prompt cache (`--cache-ram`, on by default), one per server, across slots and
  clients: each idle slot is copied into it when a task starts (`--cache-idle-slots`, on by default), and a
  request pinned to a *non-empty* slot whose prompt keeps less than half of the slot's tokens has the slot
  copied there and the cache's best match for its prompt (any slot's, anyone's) loaded into the slot first.
  A request pinned to an *empty* slot never looks there (its keep ratio is 0/0 and the comparison is false),
  nor does any pinned request with `--slot-prompt-similarity 0`.

`verdict()` is the rule, pure, and the only one. `ScopeGate.admit()` applies it to the slot a request is about
to run on, on every path that runs a request (`Switch`: a session's turn, resident, restored or cold, from a
donor or not; an auxiliary request: no id, a title, a pass-through route; the operator's probes): the slot is
erased when the verdict says so, and the request is refused (KV_BACKEND_UNAVAILABLE) when that erase fails.

1. An empty slot: run (nothing to reuse, and no look in the RAM cache).
2. KV of unknown scope, or of another scope: erase.
3. When llama-server's RAM cache may hold KV of a scope other than the request's (`ScopeLedger`), a request
   that is not the operator's runs only on its own session's KV that its prompt is known to keep at least
   half of (`keeps_half`: then llama-server does not look in the cache); anything else is erased first.
4. Run.

The operator's scope (`HOOK_SCOPE`) is trusted: KV flowing into it is no leak (it can read every slot), KV
flowing out of it is (rule 2; rule 3 counts it as another scope).

Within one scope no request costs more than it would with llama-server alone (`ScopeGate.park`, one token
of kvsidecar's own): right before kvsidecar replaces KV that no session owns (a title's, say; a session's
too on a hybrid or SWA model, or one no save holds) with a restore, a carry-over or an erase, it hands it to
the RAM cache as llama-server would (`arm`, `hand_off`; a switch that keeps the slot's KV leaves that to
llama-server); and a request about to run on an empty slot gets a slot that is not empty, where that cache
may hold anything, so that llama-server looks there as it would for a request it placed itself. Neither on
SWA with `--swa-full` (that cache's copy lacks the SWA positions before the window: switch.py
`_ram_copy_right`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from enum import StrEnum
from functools import partial
from typing import NamedTuple

from kvsidecar.coordinator.guard import PersistGuard
from kvsidecar.coordinator.pool import SlotPool
from kvsidecar.coordinator.server import ServerRuntime
from kvsidecar.coordinator.state import AcquireResult, Slot
from kvsidecar.coordinator.telemetry import Telemetry
from kvsidecar.errors import BackendUnavailable, KvError
from kvsidecar.fingerprint.identity import RuntimeKey
from kvsidecar.fingerprint.llama_process import ProcessInfo
from kvsidecar.store.naming import HOOK_SCOPE

# kvsidecar's own prompt that leaves a slot non-empty: its first token only (no BOS), so that a park computes
# one token and the request after it keeps none of it (`ScopeGate.park`)
PARK_PROMPT = "kvsidecar"
ISOLATED = "isolated"  # AcquireResult.reason of a session whose own KV rule 3 erased (X-KV-Reason ISOLATED)
SEVERAL = 2  # distinct scopes a ledger keeps: with two, every scope has another beside it


class Verdict(StrEnum):
    RUN = "run"
    UNKNOWN_SCOPE = "unknown_scope"  # rule 2
    OTHER_SCOPE = "other_scope"  # rule 2
    RAM_CACHE = "ram_cache"  # rule 3


class SlotKv(NamedTuple):
    """What a slot holds when a request is about to run on it (a tuple: built on the resident path)."""

    scope: str | None  # whose KV (None: unknown)
    empty: bool  # known to hold no token
    session: str | None = None  # the session key whose own KV it is (None: nobody's, or not the request's)


class Incoming(NamedTuple):
    """The request about to run: its scope, its session (None: auxiliary), and whether its prompt is known to
    extend its session's KV (the proxy's conversation table: every element of its session's last request,
    exactly, then more; never known for the hook API, whose prompts kvsidecar never sees)."""

    scope: str
    session: str | None = None
    extends: bool = False


def keeps_half(slot: SlotKv, incoming: Incoming) -> bool:
    """Does the request's prompt keep at least half of the slot's tokens (so that llama-server does not look
    in its RAM cache)? THE place a token-level check plugs in: today it is known only from messages (the
    session's own KV, and a prompt that extends its last request); a check on the prompt's tokens against the
    slot's would also admit donors and kept KV, and close the cases messages cannot see (docs/CLIENTS.md)."""
    return slot.session is not None and slot.session == incoming.session and incoming.extends


def verdict(slot: SlotKv, incoming: Incoming, *, ram_shared: bool | Callable[[], bool]) -> Verdict:
    """The rule (the module docstring). `ram_shared`: the RAM cache may hold another scope's KV that this
    request could be given (`ScopeGate.ram_shared`; a callable is asked only when rule 3 needs it)."""
    if slot.empty:
        return Verdict.RUN
    if slot.scope is None:
        return Verdict.UNKNOWN_SCOPE
    if slot.scope != incoming.scope:
        return Verdict.OTHER_SCOPE
    if incoming.scope == HOOK_SCOPE or keeps_half(slot, incoming):
        return Verdict.RUN
    return Verdict.RAM_CACHE if (ram_shared() if callable(ram_shared) else ram_shared) else Verdict.RUN


def ram_lookups(process: ProcessInfo | None, *, remote: bool = True) -> bool:
    """May llama-server load an entry of its RAM cache into a pinned slot? Off only when its settings say so
    (`--cache-ram 0`, or `--slot-prompt-similarity 0`, on the command line or as `LLAMA_ARG_*`); a value that
    cannot be read: on. A server whose process is not seen (remote): `remote` (the scope rule assumes on;
    what only saves work, `park`, runs only where the settings are seen)."""
    if process is None:
        return remote
    settings = process.settings
    for key in ("cache-ram", "slot-prompt-similarity"):
        value = settings.effective(key)
        with contextlib.suppress(ValueError):
            if value is not None and float(value) == 0.0:
                return False
    return True


class ScopeLedger:
    """The scopes whose KV has been in a slot of each llama-server instance, and so may be in its RAM cache.
    Unknown (None: assume several) until an instance is seen from its start: a new process whose slots never
    ran a task (`fresh`); forgotten when that cannot be shown. At most `SEVERAL` are kept. Its one writer.
    Kept per runtime (`ServerRuntime.key`: a router's children each have a RAM cache of their own)."""

    def __init__(self) -> None:
        self._seen: dict[RuntimeKey, frozenset[str] | None] = {}

    def seen(self, srv: ServerRuntime) -> frozenset[str] | None:
        return self._seen.get(srv.key)

    def known(self, srv: ServerRuntime) -> bool:
        return srv.key in self._seen

    def fresh(self, srv: ServerRuntime) -> None:
        """A new instance whose slots never ran a task: its RAM cache is empty."""
        self._seen[srv.key] = frozenset()

    def unknown(self, srv: ServerRuntime) -> None:
        self._seen[srv.key] = None

    def ran(self, srv: ServerRuntime, scope: str) -> None:
        seen = self._seen.get(srv.key)
        if seen is not None and scope not in seen and len(seen) < SEVERAL:
            self._seen[srv.key] = seen | {scope}


class ScopeGate:
    """Applies `verdict()` to a held slot: the one caller of the rule (see the module docstring)."""

    def __init__(
        self, *, pool: SlotPool, persist: PersistGuard, telemetry: Telemetry, ledger: ScopeLedger
    ) -> None:
        self.pool = pool
        self.persist = persist
        self.telemetry = telemetry
        self.ledger = ledger
        self._due: dict[tuple[str, int], tuple[str | None, bool]] = {}  # armed hand-offs (`arm`)

    async def first_sight(self, srv: ServerRuntime) -> None:
        """An instance seen for the first time (kvsidecar started, or the server restarted). Its RAM cache is
        known empty only when no slot ever ran a task (/slots shows a slot's last task once one did; the
        runtime canary, kvsidecar's own, has not run yet); the slots are then erased, as one may hold KV a
        restore put there, which llama-server would copy into that cache at the next task. Else: unknown."""
        self.ledger.unknown(srv)
        if srv.sleeping:
            return  # asking would wake it
        try:
            if any(s.used for s in await srv.backend.inspect_slots()):
                return
        except KvError:
            return
        for slot in list(srv.slots.values()):
            if not self.pool.try_take(srv, slot, "scope"):
                return
            try:
                async with self.persist.persisting(srv, "erase", slot=slot) as op:
                    await op.call(srv.backend.erase_slot(slot.id))
                self.pool.erased(slot)
            except KvError:
                return
            finally:
                self.pool.give_back(srv, slot, quiet=True)
        self.ledger.fresh(srv)

    def ram_shared(self, srv: ServerRuntime, scope: str) -> bool:
        """The RAM cache may hold KV of a scope other than `scope`, which a request could be given."""
        if not ram_lookups(srv.process):
            return False
        seen = self.ledger.seen(srv)
        return seen is None or any(s != scope for s in seen)

    def judge(self, srv: ServerRuntime, slot: SlotKv, incoming: Incoming) -> Verdict:
        return verdict(slot, incoming, ram_shared=partial(self.ram_shared, srv, incoming.scope))

    def may_use_own(self, srv: ServerRuntime, incoming: Incoming) -> bool:
        """May the session's own KV (its snapshot restored) be what its request runs on?"""
        own = SlotKv(scope=incoming.scope, empty=False, session=incoming.session)
        return self.judge(srv, own, incoming) is Verdict.RUN

    def may_share(self, srv: ServerRuntime, incoming: Incoming) -> bool:
        """May KV of another session of its scope (kept in the slot, or a donor's) be what it runs on?"""
        other = SlotKv(scope=incoming.scope, empty=False)
        return self.judge(srv, other, incoming) is Verdict.RUN

    def held(self, slot: Slot, incoming: Incoming, *, own: bool) -> SlotKv:
        """What `slot` holds for `incoming` (`own`: the session's own KV, resident or restored)."""
        return SlotKv(scope=slot.scope, empty=slot.tokens == 0, session=incoming.session if own else None)

    async def admit(
        self,
        srv: ServerRuntime,
        slot: Slot,
        incoming: Incoming,
        result: AcquireResult,
        *,
        own: bool,
        prime: bool,
    ) -> None:
        """The slot is about to run `incoming`: erase it first when the rule says so (refused when that
        fails). Else, with `prime` (KV of other requests of its scope may be reused: always for an auxiliary
        request, `restore.share_prefix` for a session), an empty slot is left non-empty where llama-server's
        RAM cache may give this scope what it holds, so that llama-server looks there as it would for a
        request it placed itself (and copies every idle slot's KV there first, as a task starts). A slot
        that is not empty is left as it is: the request keeps its common prefix with it, and llama-server
        itself looks in its cache when that is less than half of it."""
        found = self.judge(srv, self.held(slot, incoming, own=own), incoming)
        if found is not Verdict.RUN:
            await self.erase(srv, slot, found, result)
        elif prime and slot.tokens == 0 and self._ram_usable(srv, incoming.scope) and self._ram_filled(srv):
            await self.park(srv, slot, "prime")
        self.ledger.ran(srv, incoming.scope)

    def ran(self, srv: ServerRuntime, incoming: Incoming) -> None:
        """A resident request runs on what its slot holds (the verdict was RUN)."""
        self.ledger.ran(srv, incoming.scope)

    async def erase(self, srv: ServerRuntime, slot: Slot, why: Verdict | str, result: AcquireResult) -> None:
        """Erase a held slot before a request of another scope runs on it (or one its KV would answer wrong:
        `why` a plan reason); KV_BACKEND_UNAVAILABLE when it cannot be done (the request is not run on KV it
        must not see)."""
        why = why.value if isinstance(why, Verdict) else why
        try:
            async with self.persist.persisting(srv, "erase", slot=slot) as op:
                await op.call(srv.backend.erase_slot(slot.id))
        except KvError as exc:
            self.telemetry.isolation(srv.name, slot.id, "erase_failed", why)
            raise BackendUnavailable(
                f"slot {slot.id} of server {srv.name} holds KV this request may not run on, and erasing it "
                f"failed ({exc.code})"
            ) from None
        self.pool.erased(slot)
        result.actions.append("erase")
        self.telemetry.isolation(srv.name, slot.id, "erase", why)

    def arm(self, srv: ServerRuntime, slot: Slot, held_by: str | None, *, owned_too: bool = False) -> None:
        """A switch may replace what the slot holds: `hand_off` runs `before_replace` right before a
        restore, a carry-over or an erase does (restore.py, coldstart.py, runtime.py's canary). A switch that
        keeps the slot's KV instead `disarm`s it: llama-server itself then hands that KV to its RAM cache when
        the next request keeps less than half of it, as it does alone, and no park is computed."""
        self._due[(srv.name, slot.id)] = (held_by, owned_too)

    def disarm(self, srv: ServerRuntime, slot: Slot) -> None:
        self._due.pop((srv.name, slot.id), None)

    async def hand_off(self, srv: ServerRuntime, slot: Slot) -> None:
        """kvsidecar replaces what the slot holds now: the armed hand-off, once."""
        due = self._due.pop((srv.name, slot.id), None)
        if due is not None:
            await self.before_replace(srv, slot, due[0], owned_too=due[1])

    async def before_replace(
        self, srv: ServerRuntime, slot: Slot, held_by: str | None, *, owned_too: bool = False
    ) -> None:
        """kvsidecar is about to replace what the slot holds (a restore, an erase): KV no session owns (a
        title's, an auxiliary request's) is handed to llama-server's RAM cache first, as llama-server itself
        does before it reuses a slot, so that a request of the same scope still finds it there (H.6). Only
        within one scope: with several, no request of a proxy client is given anything from that cache.
        `owned_too`: a session's KV as well (a model whose snapshot a next prompt may not be able to use:
        hybrid, recurrent, SWA; the RAM cache keeps its checkpoints, coordinator/plan.py)."""
        if (held_by is not None and not owned_too) or slot.tokens == 0 or slot.scope is None:
            return
        seen = self.ledger.seen(srv)
        if seen is None or not seen <= {slot.scope} or not ram_lookups(srv.process, remote=False):
            return
        await self.park(srv, slot, "park")

    def _ram_filled(self, srv: ServerRuntime) -> bool:
        """May the RAM cache hold anything? Not when no request ran on this instance since it was seen
        fresh (`ScopeLedger.fresh`: nothing was ever handed to it): a prime there computes for nothing."""
        return self.ledger.seen(srv) != frozenset()

    def _ram_usable(self, srv: ServerRuntime, scope: str) -> bool:
        """llama-server's RAM cache is on, and may give this scope what it holds."""
        if not ram_lookups(srv.process, remote=False):
            return False
        return scope == HOOK_SCOPE or not self.ram_shared(srv, scope)

    async def park(self, srv: ServerRuntime, slot: Slot, why: str) -> None:
        """One token of kvsidecar's own on the held slot (`park_prompt`): llama-server copies what the slot
        held into its RAM cache as the task starts (`get_available_slot` of 11434: the prompt keeps none of
        it, less than half), and computes that one token; the slot is left non-empty and sharing no prefix
        with any request, so that the next request pinned to it looks in that cache and finds there what
        it would have found alone. Best effort: a failure costs warmth only."""
        left: int | None = None
        try:
            async with self.persist.persisting(srv, "park", slot=slot) as op:
                done = await op.call(srv.backend.run_prompt(slot.id, await park_prompt(srv)))
            left = done.computed + done.reused
        except KvError as exc:
            self.telemetry.isolation(srv.name, slot.id, "park_failed", exc.code)
            return
        finally:  # whatever it holds now, it is not known to be empty (its size: a lease's baseline)
            self.pool.touched(slot, left)
        self.telemetry.isolation(srv.name, slot.id, why, "same_scope")


async def park_prompt(srv: ServerRuntime) -> str | list[int]:
    """`PARK_PROMPT`'s first token, without the BOS: a prompt of one token that no request starts with (a
    text prompt gets the BOS, which every request shares: the slot would then keep 1 of its 2 tokens for
    the next request, so llama-server would find nothing better in its cache). The text when the server
    cannot tokenize."""
    try:
        ids = await srv.backend.tokenize(PARK_PROMPT, add_special=False, parse_special=False)
    except KvError:
        return PARK_PROMPT
    return ids[:1] or PARK_PROMPT
