"""The coordinator's in-memory records: sessions (spec §18), physical slots (§19) and leases.

Plain data; the rules that change them live in sessions.py (state machine, revisions), pool.py (slots)
and leases.py (leases), which are their only writers (each module's docstring lists what it writes).

All of it is owned by the event loop thread; nothing here is touched from another thread.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from kvsidecar.store.naming import HOOK_SCOPE, SnapshotIdentity

HOOK_SIGNAL = "hook"  # what named a session acquired through the hook API (the proxy names its own signals)
UNKNOWN_CLIENT = "unknown"  # a client the proxy did not recognize, or a hook API caller
TURNS_SHOWN = 4  # the latest turns whose reuse a session's view shows

__all__ = [
    "HOOK_SCOPE",
    "HOOK_SIGNAL",
    "TURNS_SHOWN",
    "UNKNOWN_CLIENT",
    "AcquireResult",
    "Lease",
    "Outcome",
    "SessionRuntime",
    "SessionState",
    "Slot",
]


class SessionState(StrEnum):
    NONE = "none"  # no known snapshot, never seen running
    COLD = "cold"  # running from a cold prefill, nothing saved yet
    RESTORING = "restoring"
    ACTIVE_CLEAN = "active_clean"  # resident, and the slot equals the saved snapshot
    ACTIVE_DIRTY = "active_dirty"  # resident, the model has advanced past the snapshot
    SAVING = "saving"
    SAVED = "saved"  # not resident; the latest state is in a durable snapshot
    INVALID = "invalid"  # the snapshot exists but may not be restored


class Outcome(StrEnum):
    RESIDENT = "resident"
    RESTORED = "restored"
    COLD = "cold"
    COLD_FALLBACK = "cold_fallback"
    BYPASS = "bypass"


@dataclass(kw_only=True)
class SessionRuntime:
    identity: SnapshotIdentity
    state: SessionState = SessionState.NONE
    # Spec §28: monotonic revisions, not a dirty flag. dirty <=> dirty_revision > saved_revision.
    dirty_revision: int = 0
    saved_revision: int = 0
    seq: int | None = None
    verify_tokens: int | None = None  # tokens a restore claimed, awaiting the engine's reuse figure
    idle_due: float | None = None  # monotonic deadline of the idle checkpoint
    idle_timer: asyncio.TimerHandle | None = None  # fires at (or before) idle_due; see checkpoint.py
    last_error: str | None = None  # the code of the last failed save or restore, shown in its view
    # (generation, fingerprint digest) pairs a server refused or crashed on: never offered to it again
    refused: set[tuple[str, str]] = field(default_factory=set)
    # What the slot holds, for the cost-aware policy (checkpoint.py): the tokens of the snapshot the slot
    # content extends (set by a restore or a save), the prompt size last reported, and whether every turn
    # since kept that snapshot as a prefix (the engine reused at least its tokens: append-only history).
    base_tokens: int | None = None
    base_generation: str | None = None  # which generation that snapshot is
    context_tokens: int | None = None
    append_only: bool = False
    released_at: float | None = None  # monotonic, for the think time between release and next acquire
    think_s: deque[float] = field(default_factory=lambda: deque(maxlen=16))  # its recent think times
    clean_timer: asyncio.TimerHandle | None = None  # a pending clean-ahead check
    # From when (monotonic) a background save of its current revision may start: the clean-ahead check
    # runs then, and again whenever its server goes idle after (a check that found it busy is not lost).
    clean_due_at: float | None = None
    # A save of it in flight: while llama-server writes the file, then the commit (checksum + manifest) of
    # a switch's save, still running while the slot's next session restores (save.py `overlap`): the
    # session's own next acquire waits for it (`Saver.wait_commit`).
    pending_commit: asyncio.Future[bool] | None = None
    # Unsaved work (issue 26, checkpoint.py `protect`): when (monotonic) its first turn past the saved
    # revision `dirty_since_rev` ran; a save moves saved_revision, so a stale mark is recognised.
    dirty_since: float | None = None
    dirty_since_rev: int = 0
    protect_timer: asyncio.TimerHandle | None = None  # when its unsaved age reaches half or all of the bound
    protect_tried: int = 0  # the revision a background save last tried (one attempt per revision)
    # What the user watches (`kvsidecar sessions`): the client and the signal that named it at its latest
    # acquire (fixed names, never client text), that acquire's outcome and reason, and the engine's reuse
    # of its latest turns: (cached, prompt) tokens, llama-server's cache_n and prompt_n + cache_n.
    client_name: str | None = None
    named_by: str | None = None
    last_outcome: str | None = None
    last_reason: str | None = None
    recent_turns: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=TURNS_SHOWN))

    @property
    def key(self) -> str:
        return self.identity.key

    @property
    def named(self) -> dict[str, str | None]:
        """The client and the signal that named it, as log fields: every `kv.session.*` event carries them
        (fixed names, never client text; None for a session not seen since the daemon started)."""
        return {"client": self.client_name, "signal": self.named_by}

    @property
    def scope(self) -> str:
        """The credential scope it belongs to (part of its identity: the proxy's digest of the client's key,
        `hook` for the operator's): another session's KV is shared with it only within one scope."""
        return self.identity.scope

    @property
    def unsaved_turns(self) -> int:
        return max(0, self.dirty_revision - self.saved_revision)

    def unsaved_age_s(self, now: float) -> float | None:
        """Seconds since its first turn that no saved generation holds; None when it is clean."""
        if not self.dirty or self.dirty_since is None or self.dirty_since_rev != self.saved_revision:
            return None
        return max(0.0, now - self.dirty_since)

    @property
    def unsaved_tokens(self) -> int | None:
        """Tokens of the slot a crash would cost: those past the saved generation its content extends (all
        of them when it extends none). 0 when clean; None when the slot's size is unknown."""
        if not self.dirty:
            return 0
        if self.context_tokens is None:
            return None
        base = self.base_tokens if self.append_only and self.base_tokens is not None else 0
        return max(0, self.context_tokens - base)

    def cancel_clean_ahead(self) -> None:
        if self.clean_timer is not None:
            self.clean_timer.cancel()
            self.clean_timer = None

    def cancel_timers(self) -> None:
        """Its idle and clean-ahead timers: the session is dropped, or the coordinator closes."""
        self.cancel_clean_ahead()
        if self.protect_timer is not None:
            self.protect_timer.cancel()
            self.protect_timer = None
        if self.idle_timer is not None:
            self.idle_timer.cancel()
            self.idle_timer = None

    @property
    def dirty(self) -> bool:
        return self.dirty_revision > self.saved_revision


@dataclass(kw_only=True)
class Lease:
    id: str
    server: str
    slot_id: int
    key: str | None  # None: an auxiliary request (never a session's state, Invariant 7)
    session_id: str | None
    outcome: Outcome
    expiry: asyncio.TimerHandle | None = None
    # Issue 26 C: a lease is "claimed" (granted, not yet seen in use) until a renewal or the engine working
    # on its slot proves someone holds it; a claimed lease ends at its claim TTL (leases.py).
    active: bool = False
    granted_at: float = 0.0  # loop time of the grant
    tokens_at_grant: int | None = None  # the slot's tokens as the grant left them (None: not known)
    prompt_point: tuple[int, ...] | None = None  # the prompt whose save point the plan takes (savepoints.py)


@dataclass(kw_only=True)
class Slot:
    id: int
    # Invariant 2: at most one owner. `owner` is the identity key whose KV the slot holds (pool.py owns it).
    owner: str | None = None
    # Who holds the slot right now: a Lease (inference) or an internal operation ("save", "purge").
    # Invariant 8: restore, erase, inference and save on this slot happen only while holding it.
    holder: Lease | str | None = None
    # The session this slot is being prepared for: claimed at hand-over, before `owner` is set, so a
    # second request of the same session waits for this slot instead of taking another (Invariant 2).
    claimed_by: str | None = None
    holds_aux: bool = False
    last_used_at: float = 0.0
    # What it holds, as far as kvsidecar knows: 0 only while it is known empty (erased, and nothing ran on it
    # since); None: unknown.
    tokens: int | None = None
    # While it is saved ahead of its switch: until when (monotonic) a new session waits for it rather than
    # evict another dirty slot (past that, the save overran its prediction and nobody waits any longer).
    cleaning_until: float | None = None
    # The credential scope of the KV it holds (None: unknown, e.g. what the slot held before the daemon
    # started): KV of one scope is never left in the slot for a request of another (coordinator/scope.py).
    scope: str | None = None
    # A cold start kept KV that is not its owner's (left by another session, or a donor's snapshot): until a
    # turn of the owner succeeds on it, the slot is not the owner's to come back to (released otherwise).
    foreign_kv: bool = False
    # SWA with --swa-full, after a restore: the first tokens of what it holds whose SWA cells the file did not
    # all hold (a later prompt must extend them, or llama-server reuses a prefix over an incomplete window)
    window_floor: tuple[int, ...] | None = None

    @property
    def free(self) -> bool:
        return self.holder is None


@dataclass(kw_only=True)
class AcquireResult:
    """What an acquire did (the hook API's answer, spec §20)."""

    outcome: Outcome
    lease_id: str | None = None
    server: str | None = None
    base_url: str | None = None
    slot_id: int | None = None
    restored_tokens: int | None = None
    restore_ms: float | None = None
    restore_server_ms: float | None = None  # llama-server's own timings.restore_ms
    evicted: str | None = None
    reason: str | None = None
    actions: list[str] = field(default_factory=list)
    # Issue 28: tokens of another session's snapshot restored as this cold session's starting prefix (the
    # `prefix_from` hint; the engine reuses only their exact common prefix with the prompt)
    shared_tokens: int | None = None
    # The start plan (coordinator/plan.py): its kind and stable reason, the model's memory class, the tokens
    # it expects the engine to reuse, and whether the prompt's tokens proved that (None: no plan was made)
    plan: str | None = None
    plan_reason: str | None = None
    memory_class: str | None = None
    expected_reuse: int | None = None
    proved: bool | None = None
    prompt_point: bool = False  # the plan takes a save point at the prompt's end (coordinator/savepoints.py)

    def to_dict(self) -> dict[str, Any]:
        return {k: (v.value if isinstance(v, Outcome) else v) for k, v in self.__dict__.items()}
