"""What a session starts from (kvsidecar/coordinator/plan.py) against golden files, in the style of the
checkpoint decisions': tests/golden/plan/*.json each hold one plan's facts and its expected answer, with
`about` saying what the answer must show. Token lists are written as runs `[first, count]` (the ids first ..
first + count - 1). After a deliberate rule change, regenerate with KVSIDECAR_UPDATE_GOLDEN=1 and review the
diff against each `about`."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, NotRequired, TypedDict

import pytest

from kvsidecar.coordinator import plan
from kvsidecar.coordinator.costs import CostFigures
from kvsidecar.coordinator.plan import (
    DonorFacts,
    Flags,
    ModelFacts,
    Point,
    PromptFacts,
    SlotFacts,
    StartFacts,
    plan_start,
    use_of,
)

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "plan"
CASES = sorted(GOLDEN.glob("*.json"))


class Case(TypedDict):
    about: str
    inputs: dict[str, Any]
    expected: NotRequired[dict[str, Any]]


def load(path: Path) -> Case:
    data: Case = json.loads(path.read_text())
    return data


def runs(value: list[list[int]] | None) -> tuple[int, ...] | None:
    if value is None:
        return None
    return tuple(t for first, count in value for t in range(first, first + count))


def point(data: dict[str, Any]) -> Point:
    return Point(**{**data, "tokens": runs(data.get("tokens"))})


def facts(inputs: dict[str, Any]) -> StartFacts:
    prompt = inputs.get("prompt", {})
    slot = inputs.get("slot", {})
    donor = inputs.get("donor")
    return StartFacts(
        scope=inputs["scope"],
        model=ModelFacts(**inputs.get("model", {})),
        prompt=PromptFacts(tokens=runs(prompt.get("tokens")), unknown=prompt.get("unknown")),
        slot=SlotFacts(**{**slot, "tokens": runs(slot.get("tokens"))}),
        points=tuple(point(p) for p in inputs.get("points", ())),
        donor=None if donor is None else DonorFacts(**{**donor, "point": point(donor["point"])}),
        costs=CostFigures(**inputs.get("costs", {})),
        flags=Flags(**inputs.get("flags", {})),
    )


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_plan_matches_golden(path: Path) -> None:
    data = load(path)
    got = plan_start(facts(data["inputs"])).to_dict()
    if os.environ.get("KVSIDECAR_UPDATE_GOLDEN") == "1":
        data["expected"] = got
        path.write_text(json.dumps(data, indent=1) + "\n")
    assert "expected" in data, f"{path.name} has no expected answer: run with KVSIDECAR_UPDATE_GOLDEN=1"
    assert got == data["expected"], data["about"]


def test_goldens_cover_every_class_prompt_shape_and_ram_state() -> None:
    names = {p.stem for p in CASES}
    for m in ("plain", "hybrid", "unknown", "swafull", "swanofull"):
        for shape in ("extends", "equal", "k1", "k2", "k64", "k128", "k3000"):
            assert f"{m}_{shape}" in names
        for ram in ("ram_holds", "ram_off", "restarted", "ram_unknown_restarted"):
            assert f"{m}_prompt_unknown_{ram}" in names
    assert {load(p)["expected"]["reason"] for p in CASES} <= plan.REASONS


def test_every_reason_is_pinned_by_a_golden() -> None:
    seen = {load(p)["expected"]["reason"] for p in CASES}
    assert seen == plan.REASONS


def test_no_plan_ever_restores_what_the_engine_would_throw_away_or_get_wrong() -> None:
    """Across every golden: a planned restore with known tokens is one the class rule proves; SWA without
    --swa-full never restores; SWA with it never restores a point diverged 2 or more tokens before its end."""
    for path in CASES:
        f = facts(load(path)["inputs"])
        got = plan_start(f)
        if got.kind not in (plan.RESTORE, plan.CARRY_OVER, plan.DONOR):
            continue
        assert f.model.kind != "swa" or f.model.swa_full, path.name
        if f.model.kind == "swa":
            assert got.proved and got.divergence is not None and got.divergence <= 1, path.name
        if got.proved:
            assert got.expected_reuse, path.name
        else:  # unproven: only where the class allows it (plain as ever; hybrid the RAM cache cannot hold)
            assert got.reason in (plan.R_UNPROVEN_PLAIN, plan.R_UNPROVEN_NO_RAM, plan.R_DONOR_UNPROVEN)


def test_scope_rule_kv_of_another_scope_is_never_kept_nor_donated() -> None:
    for path in CASES:
        f = facts(load(path)["inputs"])
        got = plan_start(f)
        if got.kind == plan.KEEP:
            assert f.slot.scope == f.scope and not f.slot.empty, path.name
        if got.kind == plan.DONOR:
            assert f.donor is not None and f.donor.scope == f.scope, path.name


def test_plans_are_pure() -> None:
    for path in CASES:
        f = facts(load(path)["inputs"])
        assert plan_start(f) == plan_start(f), path.name


@pytest.mark.parametrize(
    ("rule", "saved", "prompt", "reuse", "reason"),
    [
        (plan.PLAIN, [1, 2, 3], [1, 2, 3], 2, None),  # P == T: one token evaluated again
        (plan.STRICT, [1, 2, 3], [1, 2, 3], 0, plan.R_HYBRID_DIVERGENCE),  # needs a rollback: a reset
        (plan.STRICT, [1, 2, 3], [1, 2, 3, 4], 3, None),
        (plan.SWA_FULL, [1, 2, 3], [1, 2, 9, 9], 2, None),  # k = 1
        (plan.SWA_FULL, [1, 2, 3], [1, 9, 9, 9], 0, plan.R_SWA_WINDOW),  # k = 2: wrong KV, refused
        (plan.NEVER, [1, 2, 3], [1, 2, 3, 4], 0, plan.R_SWA_NO_FULL),
        (plan.PLAIN, [1, 2, 3], [9], 0, plan.R_NO_COMMON),
    ],
)
def test_use_of_follows_llama_server(
    rule: str, saved: list[int], prompt: list[int], reuse: int, reason: str | None
) -> None:
    got = use_of(rule, saved, prompt)
    assert (got.reuse, got.reason) == (reuse, reason)
