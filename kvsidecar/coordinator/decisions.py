"""The checkpoint policy's decisions, as pure functions of the slots, the sessions, the demand, the cost
figures and `now` (issue 27): no I/O, no clock, no event loop, no writes. The inputs are named tuples
(immutable, and cheap enough to build at every give-back), read from live state by facts.py; the costs are
anything with `costs.Costs`'s predictions (the live model, or a snapshot). checkpoint.py calls one function
and acts on its answer (a timer, a save, a counter); the golden files under tests/golden/checkpoint pin
each answer.

With `checkpoint.policy: cost-aware` (the default; issue 15) two decisions take the save off the switch,
using the cost model learned online (costs.py); each falls back to save-before-evict whenever a figure it
needs is unknown, so its worst case is the behaviour before that policy:
- *skip a save* (`skip_save`): at a switch, when the slot still extends the session's newest saved
  generation (every turn since reused all of it: append-only history) and recomputing the tokens since is
  predicted cheaper than writing the whole slot, nothing is saved; the next restore brings the older
  generation back and llama-server recomputes only the difference.
- *clean ahead*: after a release, once the session has been idle for as long as its save is predicted to
  take (`clean_ahead_delay`; ski rental: a request of its own that lands during the save waits at most that
  long again; at once when its recent think times are more than twice its save), and while its server is
  idle (no slot working, nobody waiting) and its slot is one the coming switches will take
  (`clean_ahead`), the slot is saved in the background; the switch then finds it clean. As many
  slots are kept clean as switches are coming (`switches_coming`: the sessions that asked lately beyond the
  server's slots; `next_victims`: least recently used first), none when every active session keeps its own.

*Protect* (issue 26, `protect_reason` and `protect_choice`): a session that keeps its slot and calls more
often than `idle_s` would otherwise never be saved, and a llama-server crash would cost it everything since
its last save. Its unsaved work is bounded by `checkpoint.max_unsaved_s` (seconds since its first unsaved
turn) and `checkpoint.max_unsaved_turns` (0 disables either; both 0 turn all of this off), with background
saves only ever at an idle moment of its server (llama-server's save holds its one main loop) and with the
session's own slot free:
- past a bound (trigger `max_unsaved`): at the next idle moment, whatever the cost model predicts (its own
  next request may then wait for the save, bounded by the save's time);
- before that (trigger `background`, cost-aware policy): when the save is predicted to end before the
  session's next request (released + median think time, with a margin of twice the save), and it is worth
  it: half a bound has passed, or recomputing the tokens it protects would take longer than the save.
Never a background save predicted to outlast half an acquire's wait: the session's own request, arriving
during it, must not time out waiting for it.

*Saves nothing can use* (`save_useless`): a sliding-window model that llama-server runs without
`--swa-full` writes only the window's positions of its SWA layers, and llama-server then resets even for
a prompt that extends every saved token (docs/MODELS.md): no restore of such a file is ever reused. Every
save of such a server is skipped (`SWA_WINDOW_NOT_SAVED`), whatever its trigger. Only where the class was
read from the running server and its settings were read whole (an `--swa-full` may come from its
environment); an unknown class saves as before.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping, Sequence
from itertools import takewhile
from typing import NamedTuple

from kvsidecar.config import CheckpointConfig
from kvsidecar.coordinator.costs import Costs, median
from kvsidecar.fingerprint.memory_class import SWA, UNKNOWN
from kvsidecar.fingerprint.server_memory import ServerMemory

MIN_CLEAN_AHEAD_S = 0.2  # the ski-rental wait's floor
PROMPT_CLEAN_AHEAD_S = 0.01  # right after the release has been answered
THINK_SAMPLES_NEEDED = 2  # a session's own think times count from this many on
SERVER_THINK_SAMPLES_NEEDED = 4  # else its server's, from this many on
DEMAND_WINDOW_S = 60.0  # "lately": the last minute, or DEMAND_THINKS of the server's median think times
DEMAND_THINKS = 4
CLEANING_WAIT_FACTOR = 1.5  # a new session waits for a slot being cleaned up to 1.5x its predicted save
PROTECT_FORCED = "max_unsaved"  # the triggers (and slot holders) of protect's background saves
PROTECT_PREDICTED = "background"
PROTECT_MARGIN = 2.0  # a predicted background save must fit twice in what is left of the think time
# clean_ahead's refusals (the clean_ahead counter's labels)
TOO_LONG, NO_SWITCH, BUSY, NOT_VICTIM = "too_long", "no_switch", "busy", "not_victim"
# save_useless's reason (the save_skipped counter's label, status, the log)
SWA_WINDOW_NOT_SAVED = "swa_window_not_saved"


class Rules(NamedTuple):
    """What the decisions read of `checkpoint:` (SIGHUP may change it)."""

    cost_aware: bool = True
    max_unsaved_s: float = 0.0  # 0: no time bound
    max_unsaved_turns: int = 0  # 0: no turn bound
    clean_while_busy: bool = False  # checkpoint.clean_ahead_while_busy

    @classmethod
    def of(cls, cp: CheckpointConfig) -> Rules:
        return cls(
            cost_aware=cp.policy == "cost-aware",
            max_unsaved_s=cp.max_unsaved_s,
            max_unsaved_turns=cp.max_unsaved_turns,
            clean_while_busy=cp.clean_ahead_while_busy,
        )


class SlotFacts(NamedTuple):
    """One physical slot as the decisions see it."""

    id: int
    owner: str | None = None  # the session key whose KV it holds
    dirty: bool = False  # that session has turns no saved generation holds
    free: bool = True  # nobody holds it (no inference, no save)
    claimed: bool = False  # being prepared for a session (hand-over)
    cleaning: bool = False  # held by its own clean-ahead save
    aux: bool = False  # the slot reserved for auxiliary requests
    last_used_at: float = 0.0


class ServerFacts(NamedTuple):
    slots: tuple[SlotFacts, ...]
    coming: int = 0  # switches coming (`switches_coming`)
    waiting: bool = False  # a request waits for one of its slots
    wait_s: float = 30.0  # the longest an acquire waits for a slot


class SavedGeneration(NamedTuple):
    """A session's newest valid saved generation."""

    generation: str
    tokens: int
    fingerprint: str  # the runtime digest it was saved on
    refused: frozenset[str] = frozenset()  # runtime digests that refused or crashed on it


class SessionFacts(NamedTuple):
    """A session as the decisions see it (times on the coordinator's monotonic clock)."""

    key: str = ""
    context_tokens: int | None = None  # the slot's size last reported
    think_s: tuple[float, ...] = ()  # its recent think times, oldest first
    append_only: bool = False  # every turn since `base_tokens` kept that snapshot as a prefix
    base_tokens: int | None = None  # tokens of the saved generation the slot content extends
    base_generation: str | None = None  # which generation that is
    unsaved_age_s: float | None = None  # seconds since its first unsaved turn; None: clean
    unsaved_turns: int = 0
    unsaved_tokens: int | None = None  # what a crash would cost; None: the slot's size is unknown
    released_at: float | None = None
    protect_tried: bool = False  # a background save was tried at its current revision already
    committing: bool = False  # a save's commit of it is still running
    clean_timer_pending: bool = False  # its own clean-ahead check is still to come
    clean_due_at: float | None = None  # from when its clean ahead may start (None: voided or unarmed)
    cleaning: bool = False  # a clean ahead of it is under way
    newest: SavedGeneration | None = None  # its newest valid saved generation (for skip_save)


class ModelFacts(NamedTuple):
    """A server's model memory as the decisions see it (read from the running server's model files and
    settings, `fingerprint.server_memory`)."""

    kind: str = UNKNOWN  # plain / swa / hybrid / recurrent / unknown
    n_swa: int = 0  # the sliding window (0: none)
    swa_full: bool = False  # llama-server runs with --swa-full
    settings_read: bool = False  # its command line and environment were both read

    @classmethod
    def of(cls, memory: ServerMemory | None) -> ModelFacts:
        """From what was read of the server's current instance (None: not read yet)."""
        if memory is None:
            return cls()
        m = memory.memory
        return cls(kind=m.kind, n_swa=m.n_swa, swa_full=m.swa_full, settings_read=memory.settings_read)


class SkipSave(NamedTuple):
    """Why a switch's save was skipped: the predicted times it weighed."""

    recompute_s: float
    save_s: float


class Demand(NamedTuple):
    coming: int  # switches coming: the sessions that asked lately beyond the session slots
    expired: int  # the oldest entries of the demand record that are past the window (to forget)


def think_median(own: Sequence[float], server: Sequence[float]) -> float | None:
    """The session's own median think time once it has a few, else its server's (every session's)."""
    if len(own) >= THINK_SAMPLES_NEEDED:
        return median(own)
    return median(server) if len(server) >= SERVER_THINK_SAMPLES_NEEDED else None


def skip_save(session: SessionFacts, costs: Costs, rules: Rules, fingerprint: str | None) -> SkipSave | None:
    """At a switch: is recomputing since the newest saved generation cheaper than saving the slot?"""
    if not rules.cost_aware or not session.append_only:
        return None
    base, now_tokens, newest = session.base_tokens, session.context_tokens, session.newest
    if base is None or now_tokens is None or now_tokens <= base or fingerprint is None:
        return None
    # The generation the slot extends must be the newest valid one and restorable on this runtime.
    if newest is None or newest.generation != session.base_generation or newest.tokens != base:
        return None
    if newest.fingerprint != fingerprint or fingerprint in newest.refused:
        return None
    recompute_s, save_s = costs.prefill_s(now_tokens - base), costs.save_s(now_tokens)
    if recompute_s is None or save_s is None or recompute_s >= save_s:
        return None
    return SkipSave(recompute_s=recompute_s, save_s=save_s)


def save_useless(model: ModelFacts) -> str | None:
    """Is every save of this server's slots useless, and why: a sliding-window model without `--swa-full`
    (no restore of its files is ever reused). None: saves may pay (any other class, or one not proven)."""
    if model.kind == SWA and model.n_swa > 0 and not model.swa_full and model.settings_read:
        return SWA_WINDOW_NOT_SAVED
    return None


def clean_ahead_delay(context_tokens: int | None, think_s: Sequence[float], costs: Costs) -> float | None:
    """How long after its release a session's clean-ahead check comes due (`context_tokens`: the slot's size,
    `think_s`: its own recent think times). None: no check (nothing learned yet: save-before-evict until the
    first save has been measured)."""
    if context_tokens is None:
        return None
    save_s = costs.save_s(context_tokens)
    if save_s is None:
        return None
    # Ski rental: wait as long as the save takes, so a request of its own that lands during the save waits
    # at most that long again. When this session's think times are known to be much longer than its save,
    # its own request is unlikely to land during it: start as soon as it is released.
    think = think_median(think_s, costs.think_s)
    if think is not None and think > 2 * save_s:
        return PROMPT_CLEAN_AHEAD_S
    return max(MIN_CLEAN_AHEAD_S, save_s)


def demand_window_s(server_think_s: Sequence[float]) -> float:
    think = median(server_think_s)
    return max(DEMAND_WINDOW_S, DEMAND_THINKS * think) if think is not None else DEMAND_WINDOW_S


def switches_coming(
    asked_at: Collection[float], session_slots: int, server_think_s: Sequence[float], now: float
) -> Demand:
    """How many more sessions asked a server for a slot lately than it has slots for them: the slots that
    will change hands, so the number worth keeping clean. At 0 (every active session keeps its own slot) a
    background save is a stall of the other slots for nothing; the idle timer still saves a session that
    went quiet. `asked_at`: when each one last asked, oldest first (auxiliary requests count as one more
    session when no slot is reserved for them)."""
    if len(asked_at) <= session_slots:  # only a count above the slots can change by expiring
        return Demand(coming=len(asked_at) - session_slots, expired=0)
    expired = expired_demand(asked_at, server_think_s, now)
    return Demand(coming=len(asked_at) - expired - session_slots, expired=expired)


def expired_demand(asked_at: Iterable[float], server_think_s: Sequence[float], now: float) -> int:
    """How many of the oldest requests (`asked_at`, oldest first) have left the demand window: forgotten."""
    cutoff = now - demand_window_s(server_think_s)
    return sum(1 for _ in takewhile(lambda t: t < cutoff, asked_at))


def next_victims(server: ServerFacts) -> list[int]:
    """The dirty slots the coming switches will take, in the order they will take them (least recently used
    first): as many as the switches coming, less the slots already empty, clean or being cleaned. Never the
    auxiliary slot, nor one held or being handed over."""
    if server.coming <= 0:
        return []
    ready, dirty = 0, []
    for s in server.slots:
        if s.aux:
            continue
        if s.cleaning:
            ready += 1
        elif s.free and not s.claimed:
            if s.owner is not None and s.dirty:
                dirty.append(s)
            else:
                ready += 1
    dirty.sort(key=lambda s: s.last_used_at)
    return [s.id for s in dirty[: max(0, server.coming - ready)]]


def working(server: ServerFacts, but: int | None = None) -> bool:
    """A slot of the server (other than `but`) is held: an inference, or a save of its own."""
    return any(not s.free for s in server.slots if s.id != but)


def _came_due(s: SessionFacts, now: float) -> bool:
    """Its clean ahead came due and is not under way. Not while its own timer is still to come (it checks
    then), nor once a request voided it (`clean_due_at` None)."""
    return (
        s.clean_due_at is not None and not s.clean_timer_pending and not s.cleaning and now >= s.clean_due_at
    )


def clean_due(sessions: Mapping[str, SessionFacts], now: float) -> bool:
    """Whether `clean_next` could pick any of these sessions at all: when none could, the demand it weighs
    need not be counted."""
    return any(_came_due(s, now) for s in sessions.values())


def clean_next(
    server: ServerFacts, sessions: Mapping[str, SessionFacts], rules: Rules, now: float
) -> str | None:
    """A slot was given back with nobody waiting: the session whose clean ahead should start now, if any (a
    check that came due while the server was busy is retried here rather than lost)."""
    if not rules.clean_while_busy and working(server):
        return None
    slots = {s.id: s for s in server.slots}
    for slot_id in next_victims(server):
        rt = sessions.get(slots[slot_id].owner or "")
        if rt is not None and _came_due(rt, now):
            return rt.key
    return None


class CleanAhead(NamedTuple):
    """`clean_ahead`'s verdict on one background save."""

    refused: str | None  # why not (the clean_ahead counter's label); None: start it
    budget_s: float = 0.0  # started: how long a new session waits for the slot before it takes another


def clean_ahead(
    server: ServerFacts, slot_id: int, session: SessionFacts, costs: Costs, rules: Rules
) -> CleanAhead:
    """Whether a dirty, idle session's background save starts now: its server idle, its slot one the
    coming switches will take, and the save short enough for its own request to wait for it."""
    slot = next(s for s in server.slots if s.id == slot_id)
    save_s = costs.save_s(session.context_tokens or 0)
    if save_s is None or save_s > server.wait_s / 2:
        # the session's own request, arriving during the save, must never time out waiting for it
        return CleanAhead(refused=TOO_LONG)
    if server.coming <= 0:
        return CleanAhead(refused=NO_SWITCH)
    if not slot.free or server.waiting or (working(server, but=slot_id) and not rules.clean_while_busy):
        return CleanAhead(refused=BUSY)
    if slot_id not in next_victims(server):
        return CleanAhead(refused=NOT_VICTIM)
    return CleanAhead(refused=None, budget_s=CLEANING_WAIT_FACTOR * save_s + MIN_CLEAN_AHEAD_S)


def protect_check_in(dirty_since: float, bound_s: float, now: float) -> float | None:
    """When to look again at a session's unsaved age: at half the time bound, then at the bound, so an idle
    moment that comes while nothing is given back (the session thinking, the server idle) is not missed.
    None: past the bound already (the next idle moment saves it)."""
    due = [t for t in (dirty_since + bound_s / 2, dirty_since + bound_s) if t > now]
    return min(due) - now if due else None


def protect_reason(
    session: SessionFacts, costs: Costs, rules: Rules, wait_s: float, now: float
) -> str | None:
    """Whether a background save of this dirty, idle session is due now, and which (its trigger)."""
    if not rules.max_unsaved_s and not rules.max_unsaved_turns:
        return None  # both bounds off: saved only at switches, hints and idle_s (before issue 26)
    save_s = costs.save_s(session.context_tokens) if session.context_tokens else None
    if save_s is not None and save_s > wait_s / 2:
        return None  # its own request, arriving during the save, must never time out waiting for it
    age, turns = session.unsaved_age_s, session.unsaved_turns
    over_s = bool(rules.max_unsaved_s) and age is not None and age >= rules.max_unsaved_s
    if over_s or (rules.max_unsaved_turns and turns >= rules.max_unsaved_turns):
        return PROTECT_FORCED
    if not rules.cost_aware or save_s is None or session.released_at is None:
        return None
    think = think_median(session.think_s, costs.think_s)
    if think is None or PROTECT_MARGIN * save_s > session.released_at + think - now:
        return None  # its next request is expected before the save would end
    half = (bool(rules.max_unsaved_s) and age is not None and 2 * age >= rules.max_unsaved_s) or (
        bool(rules.max_unsaved_turns) and 2 * turns >= rules.max_unsaved_turns
    )
    at_risk = session.unsaved_tokens
    recompute_s = costs.prefill_s(at_risk) if at_risk else None
    if half or (recompute_s is not None and recompute_s >= save_s):
        return PROTECT_PREDICTED
    return None


def protect_choice(
    server: ServerFacts, sessions: Mapping[str, SessionFacts], costs: Costs, rules: Rules, now: float
) -> tuple[int, str] | None:
    """At an idle moment of the server (no slot held, nobody waiting): the slot of the resident session whose
    unsaved work is due (the oldest first), and the trigger. One attempt per revision (a failure is not
    retried in a loop), none while a commit of it runs."""
    if server.waiting or working(server):
        return None
    due: list[tuple[float, int, str]] = []
    for slot in server.slots:
        rt = sessions.get(slot.owner or "")
        if rt is None or not slot.dirty or slot.claimed or rt.protect_tried or rt.committing:
            continue
        trigger = protect_reason(rt, costs, rules, server.wait_s, now)
        if trigger is not None:
            due.append((rt.unsaved_age_s or 0.0, slot.id, trigger))
    if not due:
        return None
    _, slot_id, trigger = max(due, key=lambda d: d[0])
    return slot_id, trigger
