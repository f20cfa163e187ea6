"""The coordinator's in-memory records: sessions (spec §18), physical slots (§19) and leases.

Plain data; the rules that change them live in sessions.py (state machine), pool.py (slots) and
leases.py (leases).

All of it is owned by the event loop thread; nothing here is touched from another thread.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from kvsidecar.store.naming import SnapshotIdentity


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
    # The commit (checksum + manifest) of a switch's save, still running while the slot's next session
    # restores (save.py `overlap`): the session's own next acquire waits for it.
    pending_commit: asyncio.Task[bool] | None = None

    @property
    def key(self) -> str:
        return self.identity.key

    def cancel_clean_ahead(self) -> None:
        if self.clean_timer is not None:
            self.clean_timer.cancel()
            self.clean_timer = None

    def cancel_timers(self) -> None:
        """Its idle and clean-ahead timers: the session is dropped, or the coordinator closes."""
        self.cancel_clean_ahead()
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


@dataclass(kw_only=True)
class Slot:
    id: int
    # Invariant 2: at most one owner. `owner` is the identity key whose KV the slot holds.
    owner: str | None = None
    # Who holds the slot right now: a Lease (inference) or an internal operation ("save", "purge").
    # Invariant 8: restore, erase, inference and save on this slot happen only while holding it.
    holder: Lease | str | None = None
    # The session this slot is being prepared for: claimed at hand-over, before `owner` is set, so a
    # second request of the same session waits for this slot instead of taking another (Invariant 2).
    claimed_by: str | None = None
    holds_aux: bool = False
    last_used_at: float = 0.0
    tokens: int | None = None
    # While it is saved ahead of its switch: until when (monotonic) a new session waits for it rather than
    # evict another dirty slot (past that, the save overran its prediction and nobody waits any longer).
    cleaning_until: float | None = None

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

    def to_dict(self) -> dict[str, Any]:
        return {k: (v.value if isinstance(v, Outcome) else v) for k, v in self.__dict__.items()}
