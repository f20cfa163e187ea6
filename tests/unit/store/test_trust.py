"""The trust rule: whether a snapshot's recorded runtime lets it restore into the runtime running now.

A table of decisions: the same runtime proven now restores; any field that differs, any identity state but
PROVEN, any restart seen across a bracket, any record that is missing refuses (fail closed); a difference in
the build alone, with the same canary measured under both, is carried over only once proven on enough rows.
"""

from __future__ import annotations

import dataclasses

import pytest

from kvsidecar.fingerprint.identity import IdentityFacts, IdentityState
from kvsidecar.fingerprint.runtime import RuntimeFingerprint
from kvsidecar.store.carryover import ROWS_TO_PROVE
from kvsidecar.store.trust import (
    RUNTIME_NOT_PROVEN,
    RUNTIME_RESTARTED,
    Decision,
    Saved,
    proven,
    trust,
)

BASE = {
    "format": "7",
    "runtime_key": "default",
    "backend": "llama-server",
    "model_path": "/models/a.gguf",
    "model_file": "m1",
    "build_info": "b11434",
    "server_binary": "bin1",
    "server_libs": "libs1",
    "process": "visible",
    "environ": "e1",
    "config_files": "c1",
    "arg:cache-type-k": '["f16"]',
    "arg:rope-freq-base": '["10000"]',
    "arg:lora": "[]",
    "env:LLAMA_ARG_X": "1",
    "canary_kv": "k1",
}


def fp(**changes: str | None) -> RuntimeFingerprint:
    comps = {k: v for k, v in {**BASE, **changes}.items() if v is not None}
    return RuntimeFingerprint(components=comps)


def saved_under(f: RuntimeFingerprint, *, tokens: int = 1000, epoch: int | None = None) -> Saved:
    return Saved(fingerprint=f.digest, components=dict(f.components), tokens=tokens, epoch=epoch)


NOW = fp()


def test_the_same_runtime_proven_now_restores() -> None:
    t = trust(saved_under(NOW), proven(NOW))
    assert (t.decision, t.reason) == (Decision.RESTORE, None)


@pytest.mark.parametrize(
    ("changed", "reason"),
    [
        ({"model_file": "m2"}, "MODEL_FINGERPRINT_CHANGED"),
        ({"model_path": "/models/b.gguf"}, "MODEL_FINGERPRINT_CHANGED"),
        ({"runtime_key": "other"}, "RUNTIME_KEY_CHANGED"),
        ({"format": "6"}, "FINGERPRINT_FORMAT_CHANGED"),
        ({"backend": "other"}, "BACKEND_CHANGED"),
        ({"arg:cache-type-k": '["q8_0"]'}, "KV_LAYOUT_CHANGED"),
        ({"arg:rope-freq-base": '["20000"]'}, "ROPE_CHANGED"),
        ({"arg:lora": '["x.gguf"]'}, "LORA_CHANGED"),
        ({"env:LLAMA_ARG_X": "2"}, "ENVIRONMENT_CHANGED"),
        ({"environ": "e2"}, "ENVIRONMENT_CHANGED"),
        ({"config_files": "c2"}, "LLAMA_CONFIG_CHANGED"),
        ({"canary_kv": "k2"}, "KV_CANARY_CHANGED"),
        ({"arg:cache-type-k": None}, "KV_LAYOUT_CHANGED"),  # a setting only one side has
        ({"arg:new-setting": '["1"]'}, "RUNTIME_SETTINGS_CHANGED"),
        # the model and the build both differ: the model's reason, and never a carry-over
        ({"model_file": "m2", "build_info": "b2"}, "MODEL_FINGERPRINT_CHANGED"),
        ({"build_info": "b2", "arg:cache-type-k": '["q8_0"]'}, "BUILD_CHANGED"),
    ],
)
def test_any_other_field_that_differs_refuses_with_its_reason(
    changed: dict[str, str | None], reason: str
) -> None:
    old = fp(**changed)
    t = trust(saved_under(old), proven(NOW))
    assert (t.decision, t.reason) == (Decision.REFUSE, reason)
    # the same whichever side has it, and whatever proof of rows the pair has
    t = trust(saved_under(NOW), proven(old), proven_rows=ROWS_TO_PROVE)
    assert (t.decision, t.reason) == (Decision.REFUSE, reason)


def test_a_snapshot_whose_components_are_not_on_record_refuses() -> None:
    old = fp(model_file="m2")
    t = trust(Saved(fingerprint=old.digest, components=None), proven(NOW), proven_rows=ROWS_TO_PROVE)
    assert (t.decision, t.reason) == (Decision.REFUSE, "FINGERPRINT_CHANGED")
    # a build-only difference cannot be shown without the record either
    old = fp(build_info="b2")
    t = trust(Saved(fingerprint=old.digest, components=None), proven(NOW), proven_rows=ROWS_TO_PROVE)
    assert t.decision is Decision.REFUSE


def test_components_that_do_not_match_their_digest_do_not_pass_for_the_same_runtime() -> None:
    """The digest decides sameness: a record claiming today's components under another digest is refused
    (it cannot be shown to be the runtime running now)."""
    old = fp(model_file="m2")
    t = trust(Saved(fingerprint=old.digest, components=dict(NOW.components)), proven(NOW))
    assert t.decision is not Decision.RESTORE


@pytest.mark.parametrize("state", [s for s in IdentityState if s is not IdentityState.PROVEN])
def test_a_runtime_not_proven_now_refuses_even_the_same_fingerprint(state: IdentityState) -> None:
    now = IdentityFacts(state=state, fingerprint=NOW)
    t = trust(saved_under(NOW), now, proven_rows=ROWS_TO_PROVE)
    assert (t.decision, t.reason) == (Decision.REFUSE, RUNTIME_NOT_PROVEN)
    assert state.value in t.detail


def test_proven_without_a_fingerprint_refuses() -> None:
    now = dataclasses.replace(proven(NOW), fingerprint=None)
    assert trust(saved_under(NOW), now).reason == RUNTIME_NOT_PROVEN


def test_a_bracket_across_a_restart_refuses_and_within_one_restores() -> None:
    now = proven(NOW, epoch=3)
    assert trust(saved_under(NOW, epoch=3), now).decision is Decision.RESTORE
    for epoch in (2, 4, 0):
        t = trust(saved_under(NOW, epoch=epoch), now)
        assert (t.decision, t.reason) == (Decision.REFUSE, RUNTIME_RESTARTED)
    assert trust(saved_under(NOW, epoch=None), now).decision is Decision.RESTORE  # not a bracket


@pytest.mark.parametrize("component", ["build_info", "server_binary", "server_libs"])
def test_the_build_alone_differing_is_proven_then_carried(component: str) -> None:
    old = fp(**{component: "other"})
    saved = saved_under(old, tokens=1000)
    t = trust(saved, proven(NOW))
    assert (t.decision, t.reason) == (Decision.PROVE, "BUILD_CHANGED")
    assert trust(saved, proven(NOW), proven_rows=ROWS_TO_PROVE - 1).decision is Decision.PROVE
    t = trust(saved, proven(NOW), proven_rows=ROWS_TO_PROVE)
    assert (t.decision, t.reason) == (Decision.CARRY, "BUILD_CHANGED")


def test_a_short_snapshot_is_carried_on_a_proof_of_its_own_length() -> None:
    saved = saved_under(fp(build_info="b2"), tokens=10)
    assert trust(saved, proven(NOW), proven_rows=9).decision is Decision.PROVE
    assert trust(saved, proven(NOW), proven_rows=10).decision is Decision.CARRY
    empty = saved_under(fp(build_info="b2"), tokens=0)
    assert trust(empty, proven(NOW), proven_rows=0).decision is Decision.PROVE  # never on no rows at all
    assert trust(empty, proven(NOW), proven_rows=1).decision is Decision.CARRY


@pytest.mark.parametrize(
    ("old_canary", "new_canary"),
    [("k1", "k2"), (None, "k1"), ("k1", None), ("pending", "pending"), ("", ""), ("absent", "absent")],
)
def test_a_build_change_without_the_same_measured_canary_refuses(
    old_canary: str | None, new_canary: str | None
) -> None:
    old = fp(build_info="b2", canary_kv=old_canary)
    now = fp(canary_kv=new_canary)
    t = trust(saved_under(old), proven(now), proven_rows=ROWS_TO_PROVE)
    assert t.decision is Decision.REFUSE


def test_a_carry_over_across_a_restart_is_refused_too() -> None:
    saved = saved_under(fp(build_info="b2"), epoch=1)
    t = trust(saved, proven(NOW, epoch=2), proven_rows=ROWS_TO_PROVE)
    assert (t.decision, t.reason) == (Decision.REFUSE, RUNTIME_RESTARTED)
