"""When a snapshot may cross a llama.cpp upgrade (issue 29): only a build difference, a matching canary, and
the first rows of a real snapshot bit-identical under the new build."""

from __future__ import annotations

import io
import os
from pathlib import Path

import pytest

from kvsidecar.errors import DirMoved
from kvsidecar.files.confined import DirAnchor
from kvsidecar.store.carryover import RowsProof, Verdicts, build_only_difference, rows_match
from tests.unit.store.test_state_format import build

OLD = {
    "model_file": "m1",
    "build_info": "b0-unknown",
    "server_libs": "libs-11401",
    "server_binary": "bin-11401",
    "arg:cache-type-k": "f16",
    "canary_kv": "c1",
}


def test_only_a_build_difference_with_the_same_canary_carries_over() -> None:
    new = {**OLD, "server_libs": "libs-11434", "server_binary": "bin-11434"}
    assert build_only_difference(OLD, new) is None


def test_anything_else_that_differs_is_refused() -> None:
    base = {**OLD, "server_libs": "libs-11434"}
    assert "model_file" in (build_only_difference(OLD, {**base, "model_file": "m2"}) or "")
    assert "arg:cache-type-k" in (build_only_difference(OLD, {**base, "arg:cache-type-k": "q8_0"}) or "")
    assert "arg:flash-attn" in (build_only_difference(OLD, {**base, "arg:flash-attn": "on"}) or "")
    assert "canary" in (build_only_difference(OLD, {**base, "canary_kv": "c2"}) or "")
    no_canary = {k: v for k, v in base.items() if k != "canary_kv"}
    assert "canary" in (
        build_only_difference({k: v for k, v in OLD.items() if k != "canary_kv"}, no_canary) or ""
    )
    assert build_only_difference(OLD, dict(OLD)) == "the same runtime"


def test_rows_of_the_same_kv_match_across_formats() -> None:
    proof = rows_match(io.BytesIO(build(version=3)), io.BytesIO(build(version=4)), rows=3)
    assert proof.equal and proof.rows == 3
    trans = rows_match(io.BytesIO(build(version=3, v_trans=True)), io.BytesIO(build(version=4, v_trans=True)))
    assert trans.equal and trans.rows == 5


def test_rows_that_differ_are_no_proof() -> None:
    assert not rows_match(io.BytesIO(build(version=3)), io.BytesIO(build(version=4, seed=2))).equal
    other_types = rows_match(io.BytesIO(build(version=3)), io.BytesIO(build(version=4, k_type=8, row=272)))
    assert not other_types.equal and "types" in other_types.detail
    assert not rows_match(io.BytesIO(build(version=3)), io.BytesIO(b"junk")).equal
    assert not rows_match(io.BytesIO(build(version=3)), io.BytesIO(build(version=4, streams=2))).equal


def test_verdicts_are_remembered_and_a_hostile_record_is_no_verdict(tmp_path: Path) -> None:
    state = DirAnchor(tmp_path, area="state")
    path = tmp_path / Verdicts.NAME
    verdicts = Verdicts(state)
    assert verdicts.get("a", "b") is None
    verdicts.record("a", "b", RowsProof(equal=True, rows=256, detail=""))
    assert Verdicts(state).get("a", "b") is True
    assert Verdicts(state).get("b", "a") is None
    for hostile in (b"not json", b"[1,2]", b'{"a>b": {"equal": "yes"}}', b"{" + b" " * (2 << 20) + b"}"):
        path.write_bytes(hostile)
        assert Verdicts(state).get("a", "b") is None
    path.unlink()
    target = tmp_path / "elsewhere.json"
    target.write_bytes(b'{"a>b": {"equal": true, "rows": 1}}')
    os.symlink(target, path)
    assert Verdicts(state).get("a", "b") is None  # never read through a link
    path.unlink()
    os.mkfifo(path)
    assert Verdicts(state).get("a", "b") is None  # nor a FIFO (and it does not block)


def test_a_verdict_on_fewer_rows_does_not_serve_a_longer_snapshot(tmp_path: Path) -> None:
    verdicts = Verdicts(DirAnchor(tmp_path, area="state"))
    verdicts.record("a", "b", RowsProof(equal=True, rows=40, detail=""))
    assert verdicts.get("a", "b", min_rows=40) is True
    assert verdicts.get("a", "b", min_rows=256) is None  # prove again, on the longer snapshot's rows
    verdicts.record("a", "b", RowsProof(equal=True, rows=256, detail=""))
    assert Verdicts(DirAnchor(tmp_path, area="state")).get("a", "b", min_rows=256) is True


def test_verdicts_are_never_written_through_a_moved_state_dir(tmp_path: Path) -> None:
    real, link = tmp_path / "state", tmp_path / "link"
    real.mkdir()
    link.symlink_to(real)
    state = DirAnchor(real, area="state", views=(str(link),))  # as StoreLayout holds a configured link
    state.hold()
    verdicts = Verdicts(state)
    link.unlink()
    (tmp_path / "other").mkdir()
    link.symlink_to(tmp_path / "other")
    with pytest.raises(DirMoved):
        verdicts.record("a", "b", RowsProof(equal=True, rows=1, detail=""))
    assert not list((tmp_path / "other").iterdir())
