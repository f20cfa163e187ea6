"""What a session starts from, decided once: `plan_start(facts) -> StartPlan`, a pure function (no I/O, no
clock, no event loop) of facts read at one moment (the model's memory class, the prompt's tokens, the slot,
the session's restorable points, a donor, the cost figures, the flags). The executors (restore.py,
carry.py, coldstart.py) carry the plan out; the golden files under tests/golden/plan pin every answer.

What llama-server 11434 reuses after a restore of snapshot tokens T, for a prompt P (tools/server,
server-context.cpp; docs/MODELS.md has the measurements): n_past = lcp(T, P), one less when P == T (one token
is always evaluated); then, when the memory's smallest position is at or past n_past - n_swa and no context
checkpoint fits (a restore leaves none), a full reset. So, per memory class (`rule_of`):

- plain attention (`PLAIN`): any common prefix is reused;
- hybrid or recurrent (`STRICT`): the recurrent state sits at |T| - 1, so only a strict extension
  (lcp == |T| and |P| > |T|) is reused; anything else is recomputed in full;
- sliding window with `--swa-full` (`SWA_FULL`): the server reuses any common prefix, but the file holds only
  the last n_swa positions of the SWA layers, so a divergence k = |T| - lcp of 2 or more tokens before the
  saved end recomputes tokens over an incomplete window: wrong KV. Only k <= 1 is restored;
- sliding window without `--swa-full` (`NEVER`): the restored window is always one position short; a restore
  never helps;
- a class the detector could not read is treated as hybrid (fail closed).

A restore is planned only when the rule proves the engine will use it, and its expected saving (the
prefill of the tokens it spares) is worth more than its cost (reading the file back), and no kept KV of the
slot shares more. A prompt whose tokens are unknown proves nothing: plain restores the newest point, as ever;
hybrid restores the newest point only when llama-server's RAM cache cannot hold the session (off, or the
server restarted since the session ran), else keeps the slot so that the RAM cache can act; SWA never
restores. A plan that restores nothing keeps the slot's KV (same credential scope only, coordinator/scope.py)
or erases it. Each answer carries a stable reason code (`REASONS`) and the tokens it expects reused, and
whether a save point is taken at the prompt's end before generation (`wants_prompt_point`; the proxy takes
it, coordinator/savepoints.py): the point a hybrid session's next turn extends when its chat template
re-renders the last assistant message.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from kvsidecar.backend.prompts import shared_prefix
from kvsidecar.coordinator.costs import CostFigures

# memory classes as the detector names them (kvsidecar.fingerprint.memory_class)
PLAIN_CLASS, SWA_CLASS, HYBRID_CLASS, RECURRENT_CLASS, UNKNOWN_CLASS = (
    "plain",
    "swa",
    "hybrid",
    "recurrent",
    "unknown",
)
# the reuse rules a class gets after a restore
PLAIN, STRICT, SWA_FULL, NEVER = "plain", "strict", "swa_full", "never"

# plan kinds
RESIDENT, RESTORE, CARRY_OVER, DONOR, KEEP, ERASE = (
    "resident",
    "restore",
    "carry_over",
    "donor",
    "keep",
    "erase",
)

# reasons (stable codes: headers, logs, status and metrics carry them)
R_RESIDENT = "resident"
R_PROVEN = "restore_proven"  # the prompt's tokens prove the engine reuses the restore
R_UNPROVEN_PLAIN = "prompt_unknown_plain"  # plain, tokens unknown: the newest point, as ever
R_UNPROVEN_NO_RAM = "prompt_unknown_ram_cache_cannot_hold"  # hybrid: the RAM cache cannot bring it back
R_UNKNOWN_RAM = "prompt_unknown_ram_cache"  # hybrid: the RAM cache may bring it back; the slot is kept
R_SWA_UNKNOWN = "swa_prompt_unknown"  # SWA with --swa-full: no restore without a proof
R_HYBRID_DIVERGENCE = "restore_useless_hybrid_divergence"
R_SWA_WINDOW = "swa_window_incomplete"
R_SWA_NO_FULL = "swa_no_full"
R_NO_COMMON = "restore_useless_no_common_prefix"
R_NOT_WORTH = "restore_not_worth_cost"
R_KEPT_MORE = "kept_kv_shares_more"
R_NO_POINT = "no_snapshot"
R_RESTORE_OFF = "restore_disabled"
R_ISOLATED = "isolated"  # the scope rule: its own snapshot may not be used (coordinator/scope.py)
R_DONOR_PROVEN = "donor_proven"
R_DONOR_UNPROVEN = "donor_prompt_unknown_plain"
R_DONOR_USELESS = "donor_useless"
R_DONOR_NOT_WORTH = "donor_not_worth_cost"
R_DONOR_OTHER_SCOPE = "donor_other_scope"
REASONS = frozenset(
    {
        R_RESIDENT,
        R_PROVEN,
        R_UNPROVEN_PLAIN,
        R_UNPROVEN_NO_RAM,
        R_UNKNOWN_RAM,
        R_SWA_UNKNOWN,
        R_HYBRID_DIVERGENCE,
        R_SWA_WINDOW,
        R_SWA_NO_FULL,
        R_NO_COMMON,
        R_NOT_WORTH,
        R_KEPT_MORE,
        R_NO_POINT,
        R_RESTORE_OFF,
        R_ISOLATED,
        R_DONOR_PROVEN,
        R_DONOR_UNPROVEN,
        R_DONOR_USELESS,
        R_DONOR_NOT_WORTH,
        R_DONOR_OTHER_SCOPE,
    }
)
# Costs unknown: a restore is worth it when it spares at least this share of the tokens it reads back
# (reading KV back is an order of magnitude cheaper per token than computing it, on every device measured in
# docs/BENCHMARKS.md); it keeps a 19,071-token donor from being restored to spare 32.
MIN_SHARE_UNKNOWN_COSTS = 0.1


@dataclass(frozen=True, kw_only=True)
class ModelFacts:
    kind: str = UNKNOWN_CLASS  # the detector's class
    n_swa: int = 0
    swa_full: bool = False


@dataclass(frozen=True, kw_only=True)
class PromptFacts:
    tokens: tuple[int, ...] | None = None  # None: unknown
    unknown: str | None = None  # why unknown (kvsidecar.backend.prompts.REASONS)


@dataclass(frozen=True, kw_only=True)
class SlotFacts:
    resident: bool = False  # its KV is the session's own, live (llama-server's checkpoints with it)
    scope: str | None = None  # the credential scope of its KV (None: unknown)
    empty: bool = False
    n_tokens: int | None = None
    tokens: tuple[int, ...] | None = None  # what it holds, when known


@dataclass(frozen=True, kw_only=True)
class Point:
    """A restorable generation: it passed the candidate checks (or needs a carry-over first)."""

    generation: str
    n_tokens: int
    tokens: tuple[int, ...] | None = None  # from its state file's header (None: not read)
    kind: str = "turn"  # turn (end of a turn) / prompt (before generation)
    carry: bool = False  # saved under another build: carried over first


@dataclass(frozen=True, kw_only=True)
class DonorFacts:
    key: str
    scope: str  # as its manifest recorded it
    point: Point


@dataclass(frozen=True, kw_only=True)
class Flags:
    restore_enabled: bool = True
    share_prefix: bool = True  # restore.share_prefix
    own: bool = True  # the scope gate lets the request run on its own snapshot
    share: bool = True  # ... and on KV of another session of its scope
    ram_cache: str = "unknown"  # on / off / unknown (llama-server's --cache-ram)
    ran_on_instance: bool = False  # the session ran on this llama-server instance (its RAM cache may hold it)
    oversubscribed: bool = False  # the server knows more sessions than it has slots (evictions to come)


@dataclass(frozen=True, kw_only=True)
class StartFacts:
    scope: str
    model: ModelFacts = field(default_factory=ModelFacts)
    prompt: PromptFacts = field(default_factory=PromptFacts)
    slot: SlotFacts = field(default_factory=SlotFacts)
    points: tuple[Point, ...] = ()  # newest first
    donor: DonorFacts | None = None
    costs: CostFigures = field(default_factory=CostFigures)
    flags: Flags = field(default_factory=Flags)


@dataclass(frozen=True, kw_only=True)
class StartPlan:
    kind: str
    reason: str
    rule: str  # the class rule applied
    expected_reuse: int | None = None  # tokens the engine is expected to reuse (None: not known)
    proved: bool = False  # the prompt's tokens prove that reuse
    point: str | None = None  # the generation restored (own or the donor's)
    donor: str | None = None
    divergence: int | None = None  # k = |T| - lcp of the point judged (None: not known)
    take_prompt_point: bool = False  # save a point at the prompt's end before generating (wants_prompt_point)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


def rule_of(model: ModelFacts) -> str:
    if model.kind == PLAIN_CLASS:
        return PLAIN
    if model.kind == SWA_CLASS:
        return SWA_FULL if model.swa_full else NEVER
    return STRICT  # hybrid, recurrent, and a class that could not be read (fail closed)


@dataclass(frozen=True, kw_only=True)
class Use:
    """What the engine does with tokens T restored under a prompt P: reuse, or why not."""

    reuse: int
    reason: str | None  # None: used
    divergence: int


def use_of(rule: str, saved: Sequence[int], prompt: Sequence[int]) -> Use:
    """The tokens llama-server reuses after restoring `saved`, for `prompt`, under `rule`."""
    lcp = shared_prefix(saved, prompt)
    k = len(saved) - lcp
    n_past = lcp - 1 if lcp == len(prompt) else lcp  # one token is always evaluated
    if rule == NEVER:
        return Use(reuse=0, reason=R_SWA_NO_FULL, divergence=k)
    if rule == STRICT and (k != 0 or len(prompt) <= len(saved)):
        return Use(reuse=0, reason=R_HYBRID_DIVERGENCE, divergence=k)
    if rule == SWA_FULL and k > 1:
        return Use(reuse=0, reason=R_SWA_WINDOW, divergence=k)
    if n_past <= 0:
        return Use(reuse=0, reason=R_NO_COMMON, divergence=k)
    return Use(reuse=n_past, reason=None, divergence=k)


def worth(costs: CostFigures, reuse: int, n_tokens: int) -> bool:
    """Is sparing the prefill of `reuse` tokens worth reading back `n_tokens` of KV?"""
    prefill, restore = costs.prefill_s(reuse), costs.restore_s(n_tokens)
    if prefill is None or restore is None:
        return reuse >= MIN_SHARE_UNKNOWN_COSTS * n_tokens
    return prefill > restore


def kept_reuse(f: StartFacts, rule: str) -> int | None:
    """What the slot's kept KV would give the prompt (None: unknown, or it may not be kept)."""
    if not may_keep(f) or f.prompt.tokens is None:
        return None
    if f.slot.empty:
        return 0
    if f.slot.tokens is None:
        return None
    # live KV of another session: plain reuses the common prefix; other classes are judged as a restore
    # would be (a conservative bound: llama-server may do better with that KV's checkpoints)
    return use_of(PLAIN if rule == PLAIN else rule, f.slot.tokens, f.prompt.tokens).reuse


def may_keep(f: StartFacts) -> bool:
    return (
        f.flags.share
        and f.flags.share_prefix
        and not f.slot.empty
        and f.slot.scope is not None
        and f.slot.scope == f.scope
    )


def plan_start(f: StartFacts) -> StartPlan:
    """The one decision: what the session starts from (see the module docstring), and whether a save point is
    taken at the prompt's end before generating (`wants_prompt_point`)."""
    got = _start(f)
    return replace(got, take_prompt_point=True) if wants_prompt_point(f) else got


def wants_prompt_point(f: StartFacts) -> bool:
    """A save at the prompt's end (its tokens but the last, before generation) is the point that the next
    turn's prompt extends strictly even when the template re-renders the last assistant message or drops
    its reasoning. It is taken only where a restore needs a strict extension (hybrid, recurrent, SWA with
    --swa-full; not a class that could not be read), the prompt's tokens are known and the session may run on
    its own snapshot; and then when the session is likely to be evicted (the server knows more sessions than
    it has slots), or, since any session may outlive llama-server's process (a restart, a swap, a crash), when
    the point is cheap: its save (a prefill-only call is work the request does anyway) costs at most
    `POINT_SHARE` of the prefill it would spare (`point_cheap`)."""
    classes = f.model.kind in (HYBRID_CLASS, RECURRENT_CLASS) or (
        f.model.kind == SWA_CLASS and f.model.swa_full
    )
    tokens = f.prompt.tokens
    if not classes or tokens is None or len(tokens) < 2 or not f.flags.restore_enabled or not f.flags.own:
        return False
    return f.flags.oversubscribed or point_cheap(f.costs, len(tokens) - 1)


POINT_SHARE = (
    0.05  # a point no eviction calls for is taken when its save costs at most this share of its prefill
)


def point_cheap(costs: CostFigures, tokens: int) -> bool:
    """Does saving `tokens` of KV cost at most `POINT_SHARE` of their prefill? Unknown figures (a server not
    measured yet): yes, so a session's first turns are not lost to a restart while the figures are learned."""
    save, prefill = costs.save_s(tokens), costs.prefill_s(tokens)
    if save is None or prefill is None:
        return True
    return save <= POINT_SHARE * prefill


def _start(f: StartFacts) -> StartPlan:
    rule = rule_of(f.model)
    if f.slot.resident:
        reuse = None
        if f.prompt.tokens is not None and f.slot.tokens is not None:
            reuse = use_of(PLAIN, f.slot.tokens, f.prompt.tokens).reuse  # live KV, checkpoints with it
        return StartPlan(kind=RESIDENT, reason=R_RESIDENT, rule=rule, expected_reuse=reuse)
    own = _own(f, rule)
    if own is not None and own.kind in (RESTORE, CARRY_OVER):
        return own
    donor = _donor(f, rule)
    if donor is not None and donor.kind == DONOR:
        return donor
    why = own.reason if own is not None else R_NO_POINT
    if own is None and donor is not None:
        why = donor.reason
    return _cold(f, rule, why, own.divergence if own is not None else None)


def _cold(f: StartFacts, rule: str, why: str, divergence: int | None) -> StartPlan:
    """Keep the slot's KV (same scope) or erase it."""
    if may_keep(f):
        return StartPlan(
            kind=KEEP, reason=why, rule=rule, expected_reuse=kept_reuse(f, rule), divergence=divergence
        )
    return StartPlan(kind=ERASE, reason=why, rule=rule, expected_reuse=0, divergence=divergence)


def _own(f: StartFacts, rule: str) -> StartPlan | None:
    """A restore of one of the session's own points, or why none (None: it has none)."""
    if not f.points:
        return None
    if not f.flags.own:
        return StartPlan(kind=ERASE, reason=R_ISOLATED, rule=rule)
    if not f.flags.restore_enabled:
        return StartPlan(kind=ERASE, reason=R_RESTORE_OFF, rule=rule)
    if f.prompt.tokens is None or all(p.tokens is None for p in f.points):
        return _own_unproven(f, rule)  # nothing to compare: as if the prompt were unknown
    best: tuple[Point, Use] | None = None
    first: Use | None = None
    for p in f.points:
        if p.tokens is None:
            continue
        use = use_of(rule, p.tokens, f.prompt.tokens)
        first = first or use
        if use.reason is None and (best is None or use.reuse > best[1].reuse):
            best = (p, use)
    if best is None:
        reason = first.reason if first is not None and first.reason else R_NO_COMMON
        return StartPlan(kind=ERASE, reason=reason, rule=rule, divergence=first.divergence if first else None)
    point, use = best
    kept = kept_reuse(f, rule)
    if kept is not None and kept >= use.reuse:
        return StartPlan(kind=KEEP, reason=R_KEPT_MORE, rule=rule, divergence=use.divergence)
    if not worth(f.costs, use.reuse, point.n_tokens):
        return StartPlan(kind=ERASE, reason=R_NOT_WORTH, rule=rule, divergence=use.divergence)
    return StartPlan(
        kind=CARRY_OVER if point.carry else RESTORE,
        reason=R_PROVEN,
        rule=rule,
        expected_reuse=use.reuse,
        proved=True,
        point=point.generation,
        divergence=use.divergence,
    )


def _own_unproven(f: StartFacts, rule: str) -> StartPlan:
    """The prompt's tokens are unknown: the newest point where the class allows a restore unproven."""
    newest = f.points[0]
    kind = CARRY_OVER if newest.carry else RESTORE
    if rule == NEVER:
        return StartPlan(kind=ERASE, reason=R_SWA_NO_FULL, rule=rule)
    if rule == SWA_FULL:
        return StartPlan(kind=ERASE, reason=R_SWA_UNKNOWN, rule=rule)
    if rule == PLAIN:
        return StartPlan(kind=kind, reason=R_UNPROVEN_PLAIN, rule=rule, point=newest.generation)
    ram_may_hold = f.flags.ram_cache == "on" and f.flags.ran_on_instance  # unknown: cannot prove it
    if ram_may_hold:
        return StartPlan(kind=KEEP, reason=R_UNKNOWN_RAM, rule=rule)
    return StartPlan(kind=kind, reason=R_UNPROVEN_NO_RAM, rule=rule, point=newest.generation)


def _donor(f: StartFacts, rule: str) -> StartPlan | None:
    """A donor's point as the session's starting prefix, or why not (None: no donor)."""
    d = f.donor
    if d is None:
        return None
    if d.scope != f.scope:
        return StartPlan(kind=ERASE, reason=R_DONOR_OTHER_SCOPE, rule=rule)
    if not (f.flags.share and f.flags.share_prefix):
        return StartPlan(kind=ERASE, reason=R_ISOLATED, rule=rule)
    if f.prompt.tokens is None or d.point.tokens is None:
        if rule != PLAIN:
            return StartPlan(kind=ERASE, reason=R_DONOR_USELESS, rule=rule)
        return StartPlan(
            kind=DONOR, reason=R_DONOR_UNPROVEN, rule=rule, donor=d.key, point=d.point.generation
        )
    use = use_of(rule, d.point.tokens, f.prompt.tokens)
    if use.reason is not None:
        return StartPlan(kind=ERASE, reason=R_DONOR_USELESS, rule=rule, divergence=use.divergence)
    kept = kept_reuse(f, rule)
    if kept is not None and kept >= use.reuse:
        return StartPlan(kind=KEEP, reason=R_KEPT_MORE, rule=rule, divergence=use.divergence)
    if not worth(f.costs, use.reuse, d.point.n_tokens):
        return StartPlan(kind=ERASE, reason=R_DONOR_NOT_WORTH, rule=rule, divergence=use.divergence)
    return StartPlan(
        kind=DONOR,
        reason=R_DONOR_PROVEN,
        rule=rule,
        expected_reuse=use.reuse,
        proved=True,
        donor=d.key,
        point=d.point.generation,
        divergence=use.divergence,
    )
