"""The session table and the session state machine (spec §18).

`SessionTable` owns every `SessionRuntime` the coordinator knows: by identity key and by session id, which
of them an operation is busy with (retention keeps off those), and when one holds nothing any more (no
snapshot, no slot, no lease: forgotten, so memory does not grow with every session id seen once).

`transition()` is the only place a session's state changes, like `breaker.py` for the breaker:

    NONE/SAVED/INVALID --restore_begin--> RESTORING --restored--> ACTIVE_CLEAN --ran--> ACTIVE_DIRTY
    (any) --cold_start--> COLD (INVALID stays INVALID: its snapshot was rejected)
    ACTIVE_* --save_begin--> SAVING --saved--> ACTIVE_CLEAN (resident) | resting
    SAVING --save_failed--> ACTIVE_DIRTY (resident) | resting
    (any) --evicted | lost | restore_failed--> resting;  (any) --rejected | invalidated--> INVALID

"resting" is what the store says: SAVED with a valid snapshot, INVALID with only invalid ones, else NONE.

Owners: `SessionTable` is the only code that writes these fields of a `SessionRuntime`:
- `state` (through `transition()`: `apply()`) and `last_error` (a failure event's code);
- `dirty_revision` (`ran()`) and `saved_revision` (`saved()`, `restored()`, `give_up_unsaved()`): dirtiness,
  which drives eviction saves and retention's protection, is `dirty_revision > saved_revision` (spec §28);
- `dirty_since`, `dirty_since_rev` (`mark_unsaved()`);
- what the slot holds of it: `base_tokens`, `base_generation`, `context_tokens`, `append_only`,
  `verify_tokens` (`restored()`, `started_cold()`, `saved()`, `track_context()`, `take_verify()`);
- who last called and when: `seq`, `released_at`, `think_s`, `client_name`, `named_by` (`arrived()`,
  `released()`, `hinted()`); what its last acquire did: `last_outcome`, `last_reason` (`prepared()`);
  the engine's reuse of its latest turns: `recent_turns` (`track_context()`); its credential scope is
  part of its identity (never written).
The checkpoint policy's own timers (`idle_*`, `clean_*`, `protect_*`) are written by checkpoint.py alone,
the overlapped commit (`pending_commit`) by save.py and the refused files (`refused`) by restore.py.
Everything here runs on the event loop.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from enum import StrEnum

from kvsidecar.coordinator.state import HOOK_SIGNAL, UNKNOWN_CLIENT, SessionRuntime, SessionState
from kvsidecar.store.naming import SnapshotIdentity, validate_session_id
from kvsidecar.store.snapshots import SnapshotStore


class SessionEvent(StrEnum):
    RESTORE_BEGIN = "restore_begin"
    RESTORED = "restored"
    RESTORE_FAILED = "restore_failed"
    COLD_START = "cold_start"
    RAN = "ran"  # an inference on the session's slot succeeded: the slot moved past the snapshot
    SAVE_BEGIN = "save_begin"
    SAVED = "saved"
    SAVE_FAILED = "save_failed"
    EVICTED = "evicted"
    LOST = "lost"  # the server lost the slot's content (restart)
    REJECTED = "rejected"  # every snapshot generation was refused
    INVALIDATED = "invalidated"  # an operator invalidated the snapshot


def transition(
    state: SessionState, event: SessionEvent, *, resident: bool, resting: SessionState
) -> SessionState:
    """The next state of a session. `resting` is the state the store alone would give it."""
    match event:
        case SessionEvent.RESTORE_BEGIN:
            return SessionState.RESTORING
        case SessionEvent.RESTORED:
            return SessionState.ACTIVE_CLEAN
        case SessionEvent.COLD_START:
            return state if state is SessionState.INVALID else SessionState.COLD
        case SessionEvent.RAN:
            return SessionState.ACTIVE_DIRTY
        case SessionEvent.SAVE_BEGIN:
            return SessionState.SAVING
        case SessionEvent.SAVED:
            return SessionState.ACTIVE_CLEAN if resident else resting
        case SessionEvent.SAVE_FAILED:
            return SessionState.ACTIVE_DIRTY if resident else resting
        case SessionEvent.REJECTED | SessionEvent.INVALIDATED:
            return SessionState.INVALID
        case SessionEvent.EVICTED | SessionEvent.LOST | SessionEvent.RESTORE_FAILED:
            return resting
    raise AssertionError(f"unhandled session event {event}")  # pragma: no cover


class SessionTable:
    def __init__(self, store: SnapshotStore) -> None:
        self.store = store
        self.by_key: dict[str, SessionRuntime] = {}
        self.by_session_id: dict[str, set[str]] = {}
        self.busy: dict[str, int] = {}  # keys being restored or saved right now (retention keeps off)

    def get(self, key: str | None) -> SessionRuntime | None:
        return self.by_key.get(key) if key is not None else None

    def runtime(self, identity: SnapshotIdentity) -> SessionRuntime:
        rt = self.by_key.get(identity.key)
        if rt is None:
            rt = SessionRuntime(identity=identity)
            rt.state = self.resting(rt)
            self.by_key[identity.key] = rt
            self.by_session_id.setdefault(identity.session_id, set()).add(identity.key)
        return rt

    def resting(self, rt: SessionRuntime) -> SessionState:
        manifest = self.store.get(rt.key)
        if manifest is None:
            return SessionState.NONE
        return SessionState.SAVED if manifest.has_valid else SessionState.INVALID

    def apply(
        self, rt: SessionRuntime, event: SessionEvent, *, resident: bool = False, error: str | None = None
    ) -> None:
        """The session's state after `event`; `error`: the code of the failure it was (its view shows it)."""
        resting = self.resting(rt) if event in _NEEDS_RESTING else rt.state
        rt.state = transition(rt.state, event, resident=resident, resting=resting)
        if error is not None:
            rt.last_error = error

    # revisions (spec §28): dirty <=> dirty_revision > saved_revision -------------------------------------
    def ran(self, rt: SessionRuntime) -> int:
        """An inference on the session's own slot succeeded: the slot moved past the snapshot. Returns the
        new revision."""
        rt.dirty_revision += 1
        self.apply(rt, SessionEvent.RAN)
        return rt.dirty_revision

    def saved(
        self, rt: SessionRuntime, *, revision: int, tokens: int, generation: str, resident: bool
    ) -> None:
        """A save of `revision` (`tokens`) was committed as `generation`; the slot (when `resident`) extends
        it from now on."""
        rt.saved_revision = max(rt.saved_revision, revision)
        rt.base_tokens, rt.base_generation, rt.append_only = tokens, generation, True
        self.apply(rt, SessionEvent.SAVED, resident=resident)

    def restored(self, rt: SessionRuntime, *, tokens: int, generation: str) -> None:
        """A restore of `generation` counted: the slot equals that snapshot (its reuse still to be seen)."""
        self.apply(rt, SessionEvent.RESTORED)
        rt.verify_tokens, rt.saved_revision = tokens, rt.dirty_revision
        rt.base_tokens = rt.context_tokens = tokens
        rt.base_generation, rt.append_only = generation, True

    def started_cold(self, rt: SessionRuntime) -> None:
        """A cold start: the slot extends no snapshot of the session."""
        rt.verify_tokens = rt.base_tokens = rt.context_tokens = rt.base_generation = None
        rt.append_only = False
        self.apply(rt, SessionEvent.COLD_START)

    @staticmethod
    def give_up_unsaved(rt: SessionRuntime) -> bool:
        """The turns no saved generation holds are gone: not saved before an eviction (policy off, or the
        save failed), lost with the server, or older than what another host owns now. True if there were
        any. The only place unsaved progress is written off."""
        if not rt.dirty:
            return False
        rt.saved_revision = rt.dirty_revision
        return True

    @staticmethod
    def mark_unsaved(rt: SessionRuntime, now: float) -> None:
        """The session ran: when its first turn past the saved revision ran (a save moves saved_revision,
        so a mark from before it is recognised as stale and renewed)."""
        if rt.dirty_since is None or rt.dirty_since_rev != rt.saved_revision:
            rt.dirty_since, rt.dirty_since_rev = now, rt.saved_revision

    # what the slot holds of it, and who called ----------------------------------------------------------
    @staticmethod
    def track_context(rt: SessionRuntime, prompt_tokens: int | None, cached_tokens: int | None) -> None:
        """After a turn: how many tokens the slot's prompt has, and whether the snapshot the slot extends
        is still its prefix (the engine reused at least that much). Unknown counts end the append-only
        claim."""
        if prompt_tokens is None or cached_tokens is None:
            rt.append_only, rt.context_tokens = False, None
            return
        rt.context_tokens = prompt_tokens + cached_tokens
        rt.recent_turns.append((cached_tokens, rt.context_tokens))  # what the user sees of its reuse
        # A snapshot ends with the tokens the model generated; the next prompt carries the reply as the
        # harness renders it, which may tokenize differently: a few trailing tokens may be recomputed.
        if rt.base_tokens is None or cached_tokens + max(8, rt.base_tokens // 50) < rt.base_tokens:
            rt.append_only = False

    @staticmethod
    def take_verify(rt: SessionRuntime) -> int:
        """The tokens the last restore claimed, once: its first inference's reuse is checked against them."""
        restored, rt.verify_tokens = rt.verify_tokens or 0, None
        return restored

    @staticmethod
    def arrived(
        rt: SessionRuntime,
        *,
        seq: int | None,
        now: float,
        client: str = UNKNOWN_CLIENT,
        signal: str = HOOK_SIGNAL,
    ) -> float | None:
        """An acquire of the session: its sequence number, the client and
        the signal that named it (fixed names). Returns its think time (from its last release to now) when
        it had one."""
        rt.client_name, rt.named_by = client, signal
        if seq is not None:
            rt.seq = seq
        if rt.released_at is None:
            return None
        think_s = now - rt.released_at
        rt.think_s.append(think_s)
        rt.released_at = None
        return think_s

    @staticmethod
    def prepared(rt: SessionRuntime, outcome: str, reason: str | None) -> None:
        """Its slot was prepared for an acquire: resident, restored or cold, and why (None: none given)."""
        rt.last_outcome, rt.last_reason = outcome, reason

    @staticmethod
    def released(rt: SessionRuntime, now: float) -> None:
        rt.released_at = now

    @staticmethod
    def hinted(rt: SessionRuntime, seq: int | None) -> None:
        """A lifecycle hint named the session's sequence number."""
        if seq is not None:
            rt.seq = seq

    def is_dirty(self, key: str) -> bool:
        rt = self.by_key.get(key)
        return rt is not None and rt.dirty

    def known(self, session_id: str) -> list[SessionRuntime]:
        """Every identity of a session id: in memory, or only on disk (loaded then)."""
        validate_session_id(session_id)
        keys = set(self.by_session_id.get(session_id, set()))
        keys |= {m.key for m in self.store.all() if m.session_id == session_id}
        out = []
        for key in keys:
            rt = self.by_key.get(key)
            if rt is None and (m := self.store.get(key)) is not None:
                rt = self.runtime(m.identity)
            if rt is not None:
                out.append(rt)
        return out

    def drop(self, rt: SessionRuntime) -> None:
        rt.cancel_timers()
        self.by_key.pop(rt.key, None)
        keys = self.by_session_id.get(rt.identity.session_id)
        if keys is not None:
            keys.discard(rt.key)
            if not keys:
                del self.by_session_id[rt.identity.session_id]

    def forget_idle(self, held: set[str]) -> int:
        """Drop sessions that hold nothing: no snapshot, no slot or lease (`held`), no progress."""
        dropped = 0
        for key, rt in list(self.by_key.items()):
            if key in held or key in self.busy or rt.dirty or self.store.get(key) is not None:
                continue
            self.drop(rt)
            dropped += 1
        return dropped

    @contextlib.contextmanager
    def busy_with(self, key: str) -> Iterator[None]:
        self.busy[key] = self.busy.get(key, 0) + 1
        try:
            yield
        finally:
            self.busy[key] -= 1
            if not self.busy[key]:
                del self.busy[key]


_NEEDS_RESTING = {
    SessionEvent.SAVED,
    SessionEvent.SAVE_FAILED,
    SessionEvent.EVICTED,
    SessionEvent.LOST,
    SessionEvent.RESTORE_FAILED,
}
