"""The atomic-write helper: a crash at any step leaves the old file or the new one, never half of one."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest
from pyfakefs.fake_filesystem_unittest import Patcher

from kvsidecar.files.atomic import TEMP_MARK, atomic_write_bytes, ensure_private_dir, sweep_temp_files


class Crash(BaseException):
    """Stands for the process dying: not an Exception, so nothing may swallow it."""


STEPS = ["open", "write", "fsync", "close", "replace", "dir_fsync"]


def crashing_at(step: str, monkeypatch: pytest.MonkeyPatch) -> None:
    real = {name: getattr(os, name) for name in ("open", "write", "fsync", "close", "replace")}
    fsyncs = {"n": 0}

    def wrap(name: str) -> Callable[..., object]:
        def fn(*args: object, **kwargs: object) -> object:
            if name == "fsync":
                fsyncs["n"] += 1
                if (step == "fsync" and fsyncs["n"] == 1) or (step == "dir_fsync" and fsyncs["n"] == 2):
                    raise Crash(step)
            elif name == step:
                raise Crash(step)
            return real[name](*args, **kwargs)

        return fn

    for name in real:
        monkeypatch.setattr(os, name, wrap(name))


@pytest.mark.parametrize("step", STEPS)
def test_crash_at_every_step_leaves_old_or_new(step: str, monkeypatch: pytest.MonkeyPatch) -> None:
    with Patcher():
        d = Path("/state")
        d.mkdir()
        target = d / "m.json"
        atomic_write_bytes(target, b'{"v": "old"}')
        with monkeypatch.context() as m:
            crashing_at(step, m)
            with pytest.raises(Crash):
                atomic_write_bytes(target, b'{"v": "new", "padding": "' + b"x" * 5000 + b'"}')
        content = target.read_bytes()
        assert content == b'{"v": "old"}' or content.startswith(b'{"v": "new"')
        assert content.endswith(b"}")
        # after replace, the new file is complete; before it, the old one is untouched
        if step in ("replace", "open", "write", "fsync", "close"):
            assert content == b'{"v": "old"}'
        sweep_temp_files(d)
        assert [p.name for p in d.iterdir()] == ["m.json"]


def test_writes_are_private_and_leave_no_temp() -> None:
    with Patcher():
        d = Path("/s")
        d.mkdir()
        atomic_write_bytes(d / "x.json", b"{}")
        assert (d / "x.json").stat().st_mode & 0o777 == 0o600
        assert [p.name for p in d.iterdir()] == ["x.json"]


def test_sweep_removes_only_our_temp_files() -> None:
    with Patcher():
        d = Path("/s")
        d.mkdir()
        (d / f".m.json{TEMP_MARK}abcd").write_text("half")
        (d / "keep.json").write_text("{}")
        (d / ".hidden").write_text("x")
        (d / f"visible{TEMP_MARK}x").write_text("not ours: no leading dot")
        removed = sweep_temp_files(d)
        assert [p.name for p in removed] == [f".m.json{TEMP_MARK}abcd"]
        assert sorted(p.name for p in d.iterdir()) == [".hidden", "keep.json", f"visible{TEMP_MARK}x"]


def test_private_dir(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        ensure_private_dir(tmp_path / "a" / "b")
    finally:
        os.umask(old)
    assert (tmp_path / "a" / "b").stat().st_mode & 0o777 == 0o700
