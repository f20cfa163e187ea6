"""The checkpoint decisions' inputs, read from the coordinator's live records at one moment: the slots, the
sessions and the store's manifests become the named tuples that the pure decisions (decisions.py) take.
Read only: nothing here writes a record. checkpoint.py calls these right before a decision."""

from __future__ import annotations

from collections.abc import Collection
from typing import NamedTuple

from kvsidecar.coordinator.decisions import SavedGeneration, ServerFacts, SessionFacts, SlotFacts
from kvsidecar.coordinator.pool import CLEANING, aux_slot_id
from kvsidecar.coordinator.server import ServerRuntime
from kvsidecar.coordinator.sessions import SessionTable
from kvsidecar.coordinator.state import SessionRuntime
from kvsidecar.store.manifest import Manifest


class Moment(NamedTuple):
    """A server's facts at one moment: what a decision about its slots reads."""

    server: ServerFacts
    sessions: dict[str, SessionFacts]  # its resident dirty sessions, by key
    now: float


def moment(
    srv: ServerRuntime,
    sessions: SessionTable,
    now: float,
    *,
    cleaning: Collection[str],
    waiting: bool,
    wait_s: float,
    coming: int = 0,
) -> Moment:
    """The server's slots and its resident dirty sessions (the only ones a background save is for), in one
    pass: a give-back reads this on the resident hot path. `cleaning`: the keys with a clean ahead under way;
    `waiting`: a request waits for a slot; `coming`: the switches coming (`decisions.switches_coming`)."""
    aux = aux_slot_id(srv)
    slots: list[SlotFacts] = []
    resident: dict[str, SessionFacts] = {}
    for s in srv.slots.values():
        owner = s.owner
        rt = sessions.get(owner)
        dirty = rt is not None and rt.dirty
        # positional, in the field order of SlotFacts (the resident hot path reads this at every give-back;
        # tests/unit/coordinator/test_facts.py checks it against the keyword form)
        slot = SlotFacts(
            s.id,
            owner,
            dirty,
            s.free,
            s.claimed_by is not None,
            s.holder == CLEANING,
            s.id == aux,
            s.last_used_at,
        )
        slots.append(slot)
        if rt is not None and owner is not None and dirty:
            resident[owner] = session_facts(owner, rt, now, cleaning=owner in cleaning)
    server = ServerFacts(slots=tuple(slots), coming=coming, waiting=waiting, wait_s=wait_s)
    return Moment(server, resident, now)


def session_facts(
    key: str, rt: SessionRuntime, now: float, *, cleaning: bool, newest: SavedGeneration | None = None
) -> SessionFacts:
    """`key`: rt.key, which callers mostly know already (it is a hash to compute)."""
    commit = rt.pending_commit
    return SessionFacts(  # positional, in the field order of SessionFacts (see `moment`)
        key,
        rt.context_tokens,
        tuple(rt.think_s),
        rt.append_only,
        rt.base_tokens,
        rt.base_generation,
        rt.unsaved_age_s(now),
        rt.unsaved_turns,
        rt.unsaved_tokens,
        rt.released_at,
        rt.protect_tried == rt.dirty_revision,
        commit is not None and not commit.done(),
        rt.clean_timer is not None,
        rt.clean_due_at,
        cleaning,
        newest,
    )


def newest_generation(rt: SessionRuntime, manifest: Manifest | None) -> SavedGeneration | None:
    """The session's newest valid saved generation, and the runtimes that refused it."""
    valid = [(g, r) for g, r in manifest.ordered_generations() if r.valid] if manifest else []
    if not valid:
        return None
    generation, record = valid[0]
    refused = frozenset(digest for g, digest in rt.refused if g == generation)
    return SavedGeneration(generation, record.tokens, record.fingerprint, refused)
