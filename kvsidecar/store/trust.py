"""May a snapshot saved under one runtime be restored into the runtime running now: the one rule.

`trust(saved, now, proven_rows=None)` is a pure function of what the snapshot was recorded under (`Saved`:
its fingerprint's digest, the components on record, its tokens, and, for a bracket, the epoch the operation
was proven in), what is known of the runtime now (its identity's state, epoch and fingerprint:
`fingerprint/identity.py`) and the carry-over verdict for the pair (how many rows were proven equal). It
returns a decision and a stable reason. No I/O and no clock; tests/unit/store/test_trust.py pins it as a
table. Its callers: the candidate finder (`store/candidates.py`: which generation fits), the closing bracket
of every restore and save commit (`coordinator/runtime.py` `RuntimeGuard.still`) and the carry-over
(`coordinator/carry.py`).

1. The runtime is not proven now (its fingerprint being built, a check failed, its process gone, out of
   reach, asleep, never seen): REFUSE, `RUNTIME_NOT_PROVEN`.
2. A bracket (`saved.epoch` given) across a restart seen since: REFUSE, `RUNTIME_RESTARTED`.
3. The same fingerprint: RESTORE.
4. Else the most specific difference is the reason (`RuntimeFingerprint.mismatch_reason`: the codes of
   `x-kv-reason`, FINGERPRINT.md). When only the build differs and the runtime canary measured under both is
   the same (`carryover.build_only_difference`), the snapshot may be carried over to this build: CARRY when
   an "equal" verdict for the pair rests on at least min(`ROWS_TO_PROVE`, its tokens) rows, else PROVE (its
   own first rows recomputed and compared first). Anything else: REFUSE.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from typing import NamedTuple

from kvsidecar.fingerprint.identity import IdentityFacts, IdentityState
from kvsidecar.fingerprint.runtime import RuntimeFingerprint
from kvsidecar.store.carryover import ROWS_TO_PROVE, build_only_difference

RUNTIME_NOT_PROVEN = "RUNTIME_NOT_PROVEN"
RUNTIME_RESTARTED = "RUNTIME_RESTARTED"
BUILD_CHANGED = "BUILD_CHANGED"
NOT_ON_RECORD = "the old runtime is not on record"


class Decision(StrEnum):
    RESTORE = "restore"  # the runtime it was saved under, proven now: restore it as it is
    CARRY = "carry"  # another build only, proven to compute the same KV: carry it over, then restore
    PROVE = "prove"  # another build only, the canary the same: prove its rows, then carry it over
    REFUSE = "refuse"  # not into this runtime now


class Saved(NamedTuple):
    """What a snapshot (or an operation's result) was recorded under."""

    fingerprint: str  # the digest
    components: Mapping[str, str] | None = None  # on record (None: unknown); needed only when they differ
    tokens: int = 0
    epoch: int | None = None  # a bracket: the restarts seen when the operation was proven (None: any)


class Trust(NamedTuple):
    decision: Decision
    reason: str | None  # a stable code: None for RESTORE
    detail: str


def proven(fingerprint: RuntimeFingerprint, epoch: int = 0) -> IdentityFacts:
    """A runtime known proven under `fingerprint` (a caller that holds the fingerprint proven just now)."""
    return IdentityFacts(state=IdentityState.PROVEN, fingerprint=fingerprint, epoch=epoch)


def trust(saved: Saved, now: IdentityFacts, *, proven_rows: int | None = None) -> Trust:
    """The rule (the module docstring). `proven_rows`: the rows an "equal" verdict for the pair (saved's
    fingerprint, now's) rests on (None: no such verdict)."""
    fingerprint = now.fingerprint
    if now.state is not IdentityState.PROVEN or fingerprint is None:
        return Trust(Decision.REFUSE, RUNTIME_NOT_PROVEN, f"the runtime is {now.state.value}")
    if saved.epoch is not None and saved.epoch != now.epoch:
        since = f"restarted since (epoch {saved.epoch} -> {now.epoch})"
        return Trust(Decision.REFUSE, RUNTIME_RESTARTED, since)
    if saved.fingerprint == fingerprint.digest:
        return Trust(Decision.RESTORE, None, "the same runtime")
    reason = fingerprint.mismatch_reason(saved.components)
    if saved.components is None:
        return Trust(Decision.REFUSE, reason, NOT_ON_RECORD)
    if reason != BUILD_CHANGED:
        return Trust(Decision.REFUSE, reason, "saved under another runtime")
    why = build_only_difference(saved.components, fingerprint.components)
    if why is not None:
        return Trust(Decision.REFUSE, reason, why)
    if proven_rows is not None and proven_rows >= max(1, min(ROWS_TO_PROVE, saved.tokens)):
        return Trust(Decision.CARRY, reason, f"proven on {proven_rows} rows")
    return Trust(Decision.PROVE, reason, "the build alone differs: its rows to be proven")
