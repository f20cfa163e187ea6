"""What `GET /v1/status`, `GET /v1/sessions` and the CLI show: built in one place from the coordinator's
state and the store (the CLI's offline view of a stopped daemon uses the same `session_view`).

A session is shown by two names (docs/CLIENTS.md, "How to see that it works"): `session`, the short hash
the logs use (not reversible, safe anywhere), and `id`, a visible form of the id the user can match to the
one the client prints (`visible_id`), shown only by the authenticated API and the CLI, never in a log.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kvsidecar.coordinator.decisions import ModelFacts, save_useless
from kvsidecar.coordinator.pool import owner_slot
from kvsidecar.coordinator.server import ServerRuntime
from kvsidecar.coordinator.sessions import SessionTable
from kvsidecar.coordinator.state import Lease, SessionRuntime, SessionState, Slot
from kvsidecar.coordinator.verdict import persistence_now
from kvsidecar.errors import DirMoved
from kvsidecar.fingerprint.savepath import SetupWarning, llama_save_dir, save_path_warning
from kvsidecar.fingerprint.server_memory import SWA_FULL_FIX
from kvsidecar.store.manifest import Manifest
from kvsidecar.store.snapshots import SnapshotStore


class StatusSections:
    """The parts of `status()` that other packages own (fleet mode's, the proxy's): each is handed the
    coordinator at construction and adds its own section here; the coordinator only renders them, in the
    order they were added. A part built again on the same coordinator (a second proxy) replaces its own."""

    def __init__(self) -> None:
        self._views: dict[str, Callable[[], dict[str, Any]]] = {}

    def add(self, name: str, view: Callable[[], dict[str, Any]]) -> None:
        self._views[name] = view

    def get(self, name: str) -> Callable[[], dict[str, Any]] | None:
        return self._views.get(name)

    def render(self) -> dict[str, Any]:
        return {name: view() for name, view in self._views.items()}


def visible_id(session_id: str) -> str:
    """Enough of a session id to match it to the id its client prints, not the whole id: its first 8
    characters, and for an id over 16 characters also its last 4 (one client's ids often share their first
    8: Codex's are time-ordered UUIDv7, opencode's `ses_` and a time, so two sessions started within a
    minute differ only further on), joined by `…`. An id of at most 8 characters is shown whole."""
    if len(session_id) <= 8:
        return session_id
    return session_id[:8] + "…" + (session_id[-4:] if len(session_id) > 16 else "")


def _named_view(rt: SessionRuntime | None) -> dict[str, Any]:
    """Who named it and how it went: the client and signal of its latest acquire (fixed names), that
    acquire's outcome and reason, and the engine's reuse of its latest turns (oldest first)."""
    return {
        "client": rt.client_name if rt else None,
        "signal": rt.named_by if rt else None,
        "last_outcome": rt.last_outcome if rt else None,
        "last_reason": rt.last_reason if rt else None,
        "turns": [{"cached_tokens": c, "prompt_tokens": p} for c, p in rt.recent_turns] if rt else [],
    }


def session_view(
    m: Manifest | None,
    rt: SessionRuntime | None,
    slot: Slot | None,
    *,
    full_id: bool,
    now: float | None = None,
) -> dict[str, Any] | None:
    """One (session, provider, model) as the API and the CLI show it; None if nothing is known. `now`: the
    coordinator's monotonic clock, for the unsaved age."""
    ident = rt.identity if rt else m.identity if m else None
    if ident is None:
        return None
    state = rt.state if rt else SessionState.SAVED if m and m.has_valid else SessionState.INVALID
    return {
        "session": ident.session_id if full_id else ident.short,
        "id": visible_id(ident.session_id),
        **_named_view(rt),
        "provider": ident.provider,
        "model": ident.model,
        "server": ident.server,
        "state": state.value,
        "resident_slot": slot.id if slot else None,
        "dirty_revision": rt.dirty_revision if rt else 0,
        "saved_revision": rt.saved_revision if rt else 0,
        "last_error": rt.last_error if rt else None,
        "snapshot": None if m is None else _snapshot_view(m),
        **unsaved_view(rt, time.monotonic() if now is None else now),
    }


def unsaved_view(rt: SessionRuntime | None, now: float) -> dict[str, Any]:
    """What a llama-server crash would cost the session now (issue 26): seconds since its first turn that
    no saved generation holds (null when clean), the tokens past the generation its slot extends (0 when
    clean, null when unknown) and the turns since its last save."""
    age = rt.unsaved_age_s(now) if rt else None
    return {
        "unsaved_age_s": None if age is None else round(age, 3),
        "unsaved_tokens": rt.unsaved_tokens if rt else 0,
        "unsaved_turns": rt.unsaved_turns if rt else 0,
    }


def _snapshot_view(m: Manifest) -> dict[str, Any]:
    return {
        "current": m.current,
        "bytes": m.total_bytes,
        "updated_at": m.updated_at,
        "generations": {
            g: {
                "tokens": r.tokens,
                "bytes": r.bytes,
                "invalid_reason": r.invalid_reason,
                "saved_at": r.saved_at,
            }
            for g, r in m.ordered_generations()
        },
    }


def session_views(
    sessions: SessionTable,
    store: SnapshotStore,
    servers: dict[str, ServerRuntime],
    session_id: str | None,
    *,
    now: float | None = None,
) -> list[dict[str, Any]]:
    views = []
    for key in set(sessions.by_key) | {m.key for m in store.all()}:
        rt, m = sessions.get(key), store.get(key)
        ident = rt.identity if rt else m.identity if m else None
        if ident is None or (session_id is not None and ident.session_id != session_id):
            continue
        srv = servers.get(ident.server)
        slot = owner_slot(srv, key) if srv else None
        view = session_view(m, rt, slot, full_id=session_id is not None, now=now)
        if view is not None:
            views.append(view)
    return sorted(views, key=lambda v: (v["server"], v["session"]))


def status(
    *,
    enabled: bool,
    servers: dict[str, ServerRuntime],
    sessions: SessionTable,
    store: SnapshotStore,
    open_leases: int,
    stats: dict[str, int],
    costs: dict[str, dict[str, Any]],
    pending_restart: list[str],
    restarts: Callable[[ServerRuntime], int],
    now: float | None = None,
) -> dict[str, Any]:
    """`restarts`: how many restarts of a server have been seen (runtime.RuntimeGuard.epoch)."""
    manifests = store.all()
    valid = sum(1 for m in manifests if m.has_valid)
    now = time.monotonic() if now is None else now
    return {
        "enabled": enabled,
        "servers": [
            server_view(srv, sessions, enabled=enabled, now=now, store=store, restarts=restarts(srv))
            for srv in servers.values()
        ],
        "snapshots": {
            "known": len(manifests),
            "valid": valid,
            "invalid": len(manifests) - valid,
            "bad_manifests": len(store.bad_manifests()),
            "bytes": sum(m.total_bytes for m in manifests),
        },
        "sessions_in_memory": len(sessions.by_key),
        "leases": open_leases,
        "stats": stats,
        "cost_model": costs,
        "config": {"pending_restart": pending_restart},
    }


def server_view(
    srv: ServerRuntime,
    sessions: SessionTable,
    *,
    enabled: bool = True,
    now: float | None = None,
    store: SnapshotStore | None = None,
    restarts: int = 0,
) -> dict[str, Any]:
    now = time.monotonic() if now is None else now

    def slot_state(s: Slot) -> str:
        if isinstance(s.holder, Lease):
            return "inference"
        if isinstance(s.holder, str):
            return s.holder
        if s.owner is None:
            return "aux" if s.holds_aux else "idle"
        return "dirty" if sessions.is_dirty(s.owner) else "ready"

    def owner(s: Slot) -> str | None:
        rt = sessions.get(s.owner)
        return rt.identity.short if rt else None

    view: dict[str, Any] = {
        "name": srv.name,
        "kind": srv.backend.kind,
        "endpoint": srv.config.base_url,
        "mode": srv.config.mode.value,
        "available": srv.available,
        "persistence": srv.breaker.state.value,  # the circuit breaker's state
        # GET /slots answers (llama-server --slots): without it nothing is saved or restored. None: unknown
        "slots_endpoint": srv.caps.slots_endpoint if srv.caps is not None else None,
        "last_error": srv.last_error,
        "fingerprint": srv.fingerprint.digest[:16] if srv.fingerprint else None,
        "runtime": {
            "state": srv.state.value,  # what is known of it now (fingerprint/identity.py)
            "identity": srv.identity_kind,
            "canary": (srv.canary[:12] if srv.canary else "pending") if srv.config.runtime_canary else "off",
            "canary_failures": srv.canary_failures,
            "restarts_seen": restarts,
            "model_identity": srv.model_proof.to_dict() if srv.model_proof is not None else None,
        },
        "slots": [
            {
                "id": s.id,
                "owner": owner(s),
                "state": slot_state(s),
                "tokens": slot_tokens(s, sessions.get(s.owner)),
                **unsaved_view(sessions.get(s.owner), now),  # what a crash would cost its owner now
            }
            for s in sorted(srv.slots.values(), key=lambda s: s.id)
        ],
        "memory": memory_view(srv),
        # setup problems found now (srv.process is the llama-server process seen at the last refresh)
        "warnings": [w.to_dict() for w in _setup_warnings(srv, store)],
    }
    view["persistence_now"] = persistence_now(view, enabled=enabled)
    return view


def memory_view(srv: ServerRuntime) -> dict[str, Any] | None:
    """The model's memory class on the server's current instance (read from its model files and settings)
    and whether kvsidecar saves its slots: `saves` "off" with the reason, the fix and its memory figure
    where no restore could use a save (decisions.save_useless). None until the server was read."""
    m = srv.memory
    if m is None:
        return None
    reason = save_useless(ModelFacts.of(m))
    return {
        **m.to_dict(),
        "saves": "off" if reason else "on",
        "reason": reason,
        "fix": SWA_FULL_FIX if reason else None,
        "cost": m.swa_full_cost() if reason else None,
    }


def slot_tokens(slot: Slot, owner: SessionRuntime | None) -> int | None:
    """The tokens a slot holds: its owner's prompt after its latest turn (the pool records a slot's size
    only when the slot changes hands, at a restore or a cold start, so a session that started cold showed
    0 through every turn and save), else the pool's record (None: unknown)."""
    if owner is not None and owner.context_tokens is not None:
        return owner.context_tokens
    return slot.tokens


def _setup_warnings(srv: ServerRuntime, store: SnapshotStore | None) -> list[SetupWarning]:
    """The server's setup problems now: its snapshot directory (or the metadata directories) no longer
    where its path leads (KV_SNAPSHOT_DIR_MOVED: nothing is saved or restored), and llama-server saving
    elsewhere than snapshot_dir. A --slot-save-path that never led to snapshot_dir is the latter only."""
    mismatch = save_path_warning(srv.name, srv.config, srv.process)
    found: list[SetupWarning] = []
    if store is not None:
        theirs = None if mismatch is not None else llama_save_dir(srv.process)
        faults = store.dir_faults({srv.name: theirs})
        for area, why in faults.items():
            if area.startswith("snapshots:") and area != f"snapshots:{srv.name}":
                continue
            found.append(
                SetupWarning(
                    code=DirMoved.code,
                    server=srv.name,
                    message=f"{area}: {why}; nothing is saved or restored there until it leads back",
                    fix=DirMoved.default_hint,
                )
            )
    return found + ([mismatch] if mismatch is not None else [])
