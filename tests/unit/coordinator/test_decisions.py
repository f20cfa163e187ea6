"""The checkpoint decisions (kvsidecar/coordinator/decisions.py) against golden files, in the style of the
retention plan's: tests/golden/checkpoint/*.json each hold one decision's inputs and its expected answer,
with `about` saying what the answer must show. After a deliberate policy change, regenerate with
KVSIDECAR_UPDATE_GOLDEN=1 and review the diff against each `about`."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any, NotRequired, TypedDict

import pytest

from kvsidecar.coordinator import decisions
from kvsidecar.coordinator.costs import CostFigures, CostModel
from kvsidecar.coordinator.decisions import (
    ModelFacts,
    Rules,
    SavedGeneration,
    ServerFacts,
    SessionFacts,
    SlotFacts,
)

GOLDEN = Path(__file__).resolve().parents[2] / "golden" / "checkpoint"
CASES = sorted(GOLDEN.glob("*.json"))
DECISIONS: dict[str, Callable[..., Any]] = {
    f.__name__: f
    for f in (
        decisions.skip_save,
        decisions.clean_ahead_delay,
        decisions.switches_coming,
        decisions.next_victims,
        decisions.clean_ahead,
        decisions.clean_next,
        decisions.protect_reason,
        decisions.protect_choice,
        decisions.protect_check_in,
        decisions.save_useless,
    )
}


class Case(TypedDict):
    about: str
    decision: str  # a function of decisions.py
    inputs: dict[str, Any]  # its keyword arguments, as JSON
    expected: NotRequired[Any]  # its answer, as JSON


def load(path: Path) -> Case:
    data: Case = json.loads(path.read_text())
    return data


def session(data: dict[str, Any]) -> SessionFacts:
    newest = data.get("newest")
    return SessionFacts(
        **{
            **data,
            "think_s": tuple(data.get("think_s", ())),
            "newest": None
            if newest is None
            else SavedGeneration(**{**newest, "refused": frozenset(newest.get("refused", ()))}),
        }
    )


def server(data: dict[str, Any]) -> ServerFacts:
    return ServerFacts(**{**data, "slots": tuple(SlotFacts(**s) for s in data["slots"])})


def costs(data: dict[str, Any]) -> CostFigures:
    return CostFigures(**{**data, "think_s": tuple(data.get("think_s", ()))})


ARGUMENTS: dict[str, Callable[[Any], Any]] = {
    "session": session,
    "sessions": lambda d: {key: session(s) for key, s in d.items()},
    "server": server,
    "costs": costs,
    "rules": lambda d: Rules(**d),
    "model": lambda d: ModelFacts(**d),
}


def as_json(value: Any) -> Any:
    if hasattr(value, "_asdict"):  # a decision's answer (a named tuple)
        return as_json(value._asdict())
    if isinstance(value, dict):
        return {k: as_json(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [as_json(v) for v in value]
    return value


def run_case(data: Case) -> Any:
    kwargs = {name: ARGUMENTS.get(name, lambda v: v)(value) for name, value in data["inputs"].items()}
    return as_json(DECISIONS[data["decision"]](**kwargs))


@pytest.mark.parametrize("path", CASES, ids=[p.stem for p in CASES])
def test_decision_matches_golden(path: Path) -> None:
    data = load(path)
    got = run_case(data)
    if os.environ.get("KVSIDECAR_UPDATE_GOLDEN") == "1":
        data["expected"] = got
        path.write_text(json.dumps(data, indent=1) + "\n")
    assert "expected" in data, (
        f"{path.name} has no expected answer: run with KVSIDECAR_UPDATE_GOLDEN=1 and review"
    )
    assert got == data["expected"], data["about"]


def test_every_decision_has_golden_cases() -> None:
    covered = {load(p)["decision"] for p in CASES}
    assert covered == set(DECISIONS)
    assert len(CASES) >= 40


def test_victims_are_never_the_aux_slot_nor_held_nor_handed_over() -> None:
    """Across every golden server: a victim is a free, unclaimed, dirty session slot, and there are never
    more victims than switches coming."""
    for path in CASES:
        data = load(path)
        if "server" not in data["inputs"]:
            continue
        facts = server(data["inputs"]["server"])
        slots = {s.id: s for s in facts.slots}
        victims = decisions.next_victims(facts)
        assert len(victims) <= max(0, facts.coming), path.name
        for i in victims:
            s = slots[i]
            assert s.free and not s.claimed and not s.aux and not s.cleaning and s.dirty, path.name
        used = [slots[i].last_used_at for i in victims]
        assert used == sorted(used), path.name  # least recently used first


def test_decisions_are_pure_the_same_inputs_give_the_same_answer() -> None:
    for path in CASES:
        data = load(path)
        assert run_case(data) == run_case(data), path.name


def test_cost_figures_predict_what_the_live_model_predicts() -> None:
    """The goldens' costs (CostFigures, a snapshot) predict exactly what the live model (ServerCosts, what
    the coordinator passes) does from the same figures: one rule for each prediction."""
    model = CostModel()
    model.observe_transfer("s", kind="save", nbytes=1 << 27, tokens=1000, server_ms=250.0, measured_ms=300.0)
    model.observe_transfer("s", kind="restore", nbytes=1 << 27, tokens=1000, server_ms=None, measured_ms=80.0)
    model.observe_prefill("s", tokens=500, ms=250.0)
    live = model.server("s")
    figures = CostFigures(
        kv_bytes_per_token=live.kv_bytes_per_token.value,
        save_bytes_per_s=live.save_bytes_per_s.value,
        restore_bytes_per_s=live.restore_bytes_per_s.value,
        prefill_tokens_per_s=live.prefill_tokens_per_s.value,
    )
    for tokens in (0, 1, 1000, 123_456):
        assert figures.save_s(tokens) == live.save_s(tokens) is not None
        assert figures.restore_s(tokens) == live.restore_s(tokens) is not None
        assert figures.prefill_s(tokens) == live.prefill_s(tokens) is not None
    assert live.save_s(1000) == pytest.approx(0.25) and live.prefill_s(1000) == pytest.approx(0.5)
    assert CostFigures().save_s(1000) is None and CostFigures().prefill_s(1000) is None
    assert (
        decisions.clean_ahead_delay(4000, [], live) == decisions.clean_ahead_delay(4000, [], figures) == 1.0
    )


def test_the_decisions_inputs_cannot_be_changed_by_a_decision() -> None:
    """Named tuples: a decision gets a snapshot it cannot write back into."""
    facts = SessionFacts(key="a", context_tokens=10)
    with pytest.raises(AttributeError):
        facts.context_tokens = 20  # type: ignore[misc]


def test_clean_due_is_false_only_where_clean_next_picks_nobody() -> None:
    """`clean_due` lets a give-back skip counting the demand: across every golden `clean_next` case, and the
    same cases at other times, it is True wherever `clean_next` picks a session."""
    checked = 0
    for path in CASES:
        data = load(path)
        if data["decision"] != "clean_next":
            continue
        inputs = data["inputs"]
        for shift in (-1000.0, -1.0, 0.0, 1.0, 1000.0):
            now = inputs["now"] + shift
            sessions = ARGUMENTS["sessions"](inputs["sessions"])
            picked = decisions.clean_next(server(inputs["server"]), sessions, Rules(**inputs["rules"]), now)
            if picked is not None:
                assert decisions.clean_due(sessions, now), (path.name, shift)
                checked += 1
    assert checked >= 3  # some cases do pick a session: the property is not vacuous


def test_clean_due_needs_a_session_whose_clean_ahead_came_due() -> None:
    base = session({"key": "a", "clean_due_at": 10.0})
    assert decisions.clean_due({"a": base}, 10.0)
    assert not decisions.clean_due({"a": base}, 9.9)  # not yet
    assert not decisions.clean_due({"a": base._replace(clean_timer_pending=True)}, 20.0)  # its timer checks
    assert not decisions.clean_due({"a": base._replace(cleaning=True)}, 20.0)  # under way already
    assert not decisions.clean_due({"a": base._replace(clean_due_at=None)}, 20.0)  # a request voided it
    assert not decisions.clean_due({}, 20.0)
