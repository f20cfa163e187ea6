"""Config files that used to pass silently: a key given twice (the last one won), a file that sets nothing
(it said only "config OK"), and `config init --path DIR/` (it wrote a file named DIR)."""

from __future__ import annotations

import contextlib
import os
import stat
import threading
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from kvsidecar.backend.fake import FakeKvBackend
from kvsidecar.cli import main
from kvsidecar.cli.config import default_config_text
from kvsidecar.config import load_config
from kvsidecar.config.errors import ConfigInvalid
from kvsidecar.config.file import load_strict
from kvsidecar.daemon.service import Daemon
from kvsidecar.errors import ConfigError


@pytest.fixture(autouse=True)
def no_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("KVSIDECAR_CONFIG", "KVSIDECAR_TOKEN_FILE", "KVSIDECAR_STATE_DIR"):
        monkeypatch.delenv(var, raising=False)


def _problems(text: str) -> tuple[str, ...]:
    with pytest.raises(ConfigInvalid) as info:
        load_strict(text)
    assert info.value.code == "KV_CONFIG_INVALID"
    return info.value.problems


# duplicate keys -------------------------------------------------------------------------------------
def test_a_top_level_key_given_twice_is_refused_with_both_lines() -> None:
    assert _problems("enabled: true\nstate_dir: /x\nenabled: false\n") == (
        "enabled: given twice (lines 1 and 3); YAML would silently keep the last: keep one",
    )


def test_duplicates_at_any_depth_are_all_named_by_dotted_key() -> None:
    text = (
        "servers:\n"  # 1
        "  local:\n"  # 2
        "    snapshot_dir: /a\n"  # 3
        "    base_url: http://127.0.0.1:8080\n"  # 4
        "    snapshot_dir: /b\n"  # 5
        "routes:\n"  # 6
        "  - {match: x, server: local, server: other}\n"  # 7
        "servers:\n"  # 8
        "  more: {}\n"  # 9
    )
    assert _problems(text) == (
        "servers.local.snapshot_dir: given twice (lines 3 and 5); YAML would silently keep the last: keep one",
        "routes[0].server: given twice (lines 7 and 7); YAML would silently keep the last: keep one",
        "servers: given twice (lines 1 and 8); YAML would silently keep the last: keep one",
    )


def test_equal_keys_spelled_differently_are_duplicates_and_hostile_keys_are_quoted() -> None:
    assert _problems('enabled: 1\n"enabled": 2\n')[0].startswith("enabled: given twice (lines 1 and 2)")
    assert _problems("1: a\n0x1: b\n")[0].startswith('"1": given twice (lines 1 and 2)')
    problem = _problems('"a\\x1b[2Jb": 1\n"a\\x1b[2Jb": 2\n')[0]
    assert "\x1b" not in problem and problem.startswith('"a\\u001b[2Jb": given twice')


def test_merge_keys_and_distinct_keys_are_not_duplicates() -> None:
    text = "base: &b {idle_s: 5, policy: x}\ncheckpoint:\n  <<: *b\n  idle_s: 9\nother: {idle_s: 5}\n"
    assert load_strict(text) == {
        "base": {"idle_s": 5, "policy": "x"},
        "checkpoint": {"idle_s": 9, "policy": "x"},
        "other": {"idle_s": 5},
    }
    assert load_strict("") is None and load_strict("# only a comment\n") is None


def test_config_check_and_serve_refuse_a_duplicate_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"state_dir: {tmp_path / 'state'}\nenabled: true\nenabled: false\n")
    assert main(["-c", str(path), "config", "check"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"kvsidecar: KV_CONFIG_INVALID: {path}: 1 problem"
    assert err[1] == "  enabled: given twice (lines 2 and 3); YAML would silently keep the last: keep one"
    assert main(["-c", str(path), "serve"]) == 2
    serve = capsys.readouterr().err
    assert "KV_CONFIG_INVALID" in serve and "enabled: given twice (lines 2 and 3)" in serve
    assert not (tmp_path / "state").exists()  # refused before anything was created


@pytest.fixture
async def daemon(tmp_path: Path) -> AsyncIterator[Daemon]:
    path = tmp_path / "c.yaml"
    path.write_text(
        f"state_dir: {tmp_path / 'state'}\n"  # 1
        "servers:\n"  # 2
        f"  local: {{snapshot_dir: {tmp_path / 'snaps'}, probe_interval_s: 3600}}\n"  # 3
        "checkpoint:\n"  # 4
        "  idle_s: 30\n"  # 5
    )
    d = Daemon(
        load_config(path, env={}),
        backends={"local": FakeKvBackend(tmp_path / "snaps")},
        process_finder=None,
        watch=False,
        config_path=path,
    )
    await d.start()
    yield d
    await d.aclose()


async def test_a_reload_refuses_a_duplicate_key_and_changes_nothing(
    daemon: Daemon, caplog: pytest.LogCaptureFixture
) -> None:
    assert daemon.config_path is not None
    before = daemon.config
    daemon.config_path.write_text(daemon.config_path.read_text() + "  idle_s: 5\n")  # line 6
    daemon.reload()
    assert daemon.config is before and daemon.coordinator.config.checkpoint.idle_s == 30
    failed = [r.getMessage() for r in caplog.records if "kv.config.reload_failed" in r.getMessage()]
    assert len(failed) == 1 and "checkpoint.idle_s: given twice (lines 5 and 6)" in failed[0]


# a file that sets nothing ---------------------------------------------------------------------------
@pytest.mark.parametrize("text", ["", "# nothing here yet\n\n   # still nothing\n", "---\n", "{}\n"])
def test_check_says_a_file_that_sets_no_keys_means_the_defaults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert main(["-c", str(path), "config", "check"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out == [f"config file: {path} sets no keys: using the built-in defaults", "config OK"]


def test_check_of_dev_null_says_the_defaults_apply(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["-c", "/dev/null", "config", "check"]) == 0
    assert "config file: /dev/null sets no keys: using the built-in defaults" in capsys.readouterr().out


def test_check_of_a_file_with_keys_does_not_claim_defaults(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("enabled: true\n")
    assert main(["-c", str(path), "config", "check"]) == 0
    assert capsys.readouterr().out.splitlines() == [f"config file: {path}", "config OK"]


# config init --path DIR/ ----------------------------------------------------------------------------
def test_init_path_with_a_trailing_slash_writes_config_yaml_inside(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "newdir"
    assert main(["config", "init", "--path", f"{target}{os.sep}"]) == 0
    assert target.is_dir() and stat.S_IMODE(target.stat().st_mode) == 0o750
    assert (target / "config.yaml").read_bytes() == default_config_text()
    assert f"wrote {target / 'config.yaml'}" in capsys.readouterr().out


def test_init_path_naming_an_existing_directory_writes_config_yaml_inside(tmp_path: Path) -> None:
    target = tmp_path / "etc"
    target.mkdir(mode=0o755)
    assert main(["config", "init", "--path", str(target)]) == 0
    assert (target / "config.yaml").read_bytes() == default_config_text()
    assert stat.S_IMODE(target.stat().st_mode) == 0o755  # an existing directory is left as it is


def test_init_path_creates_every_missing_directory_0750_and_nothing_through_a_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A fresh HOME has no ~/.config: `--path ~/.config/kvsidecar/config.yaml` makes each missing directory
    (0750 whatever the umask), and stops at a component that is a file or a link to nothing."""
    old = os.umask(0o077)
    try:
        assert main(["config", "init", "--no-dirs", "--path", str(tmp_path / "a" / "b" / "config.yaml")]) == 0
    finally:
        os.umask(old)
    for made in (tmp_path / "a", tmp_path / "a" / "b"):
        assert made.is_dir() and stat.S_IMODE(made.stat().st_mode) == 0o750
    assert (tmp_path / "a" / "b" / "config.yaml").read_bytes() == default_config_text()
    (tmp_path / "file").write_text("x")
    assert main(["config", "init", "--path", str(tmp_path / "file" / "sub" / "config.yaml")]) == 2
    assert f"{tmp_path / 'file'}: " in capsys.readouterr().err
    (tmp_path / "dangling").symlink_to(tmp_path / "nowhere")
    assert main(["config", "init", "--path", str(tmp_path / "dangling" / "config.yaml")]) == 2
    assert "a link that leads nowhere" in capsys.readouterr().err
    assert not (tmp_path / "nowhere").exists()


def test_init_refuses_a_directory_given_as_the_config_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    assert main(["-c", f"{tmp_path}/newdir/", "config", "init"]) == 2
    assert "names a directory" in capsys.readouterr().err
    monkeypatch.setenv("KVSIDECAR_CONFIG", str(tmp_path))
    assert main(["config", "init", "--force"]) == 2
    assert "names a directory" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []
    assert main(["config", "init", "--path", ""]) == 2
    assert "--path is empty" in capsys.readouterr().err
    with pytest.raises(SystemExit) as usage:
        main(["-c", "", "config", "check"])
    assert usage.value.code == 2 and "empty path" in capsys.readouterr().err


def test_init_path_with_a_literal_tilde_means_home_never_a_file_named_tilde(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`--path '~'` (quoted, or from a tool) is expanded as a shell would; one that cannot be is refused."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    assert main(["config", "init", "--path", "~"]) == 0
    assert (home / "config.yaml").read_bytes() == default_config_text()
    assert main(["config", "init", "--path", "~/sub/"]) == 0
    assert (home / "sub" / "config.yaml").is_file()
    assert main(["-c", "~/c.yaml", "config", "init"]) == 0
    assert (home / "c.yaml").is_file()
    assert main(["-c", "~/c.yaml", "config", "check"]) == 0
    capsys.readouterr()
    assert main(["config", "init", "--path", "~no-such-user-17b/config.yaml"]) == 2
    assert "leading '~' cannot be expanded" in capsys.readouterr().err
    assert list(work.iterdir()) == []


# what is read at the config path --------------------------------------------------------------------
def test_a_config_over_1_mib_is_refused_before_it_is_parsed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "big.yaml"
    path.write_text("# padding\n" * 120_000 + "enabled: true\n")
    assert main(["-c", str(path), "config", "check"]) == 2
    err = capsys.readouterr().err
    assert "KV_CONFIG_INVALID" in err and f"{path.stat().st_size} bytes, over the 1048576 byte" in err
    path.write_text("# padding\n" * 100_000 + "enabled: true\n")  # under the cap: still read
    assert load_config(path, env={}).enabled is True


def test_a_fifo_at_the_config_path_is_refused_without_blocking(tmp_path: Path) -> None:
    """A writer feeds the FIFO so that reading it (the old way) ends; it is refused before any read."""
    fifo = tmp_path / "config.yaml"
    os.mkfifo(fifo)

    def feed() -> None:
        with contextlib.suppress(OSError):
            fd = os.open(fifo, os.O_WRONLY)  # blocks until a reader opens the FIFO
            try:
                os.write(fd, b"enabled: false\n")
            finally:
                os.close(fd)

    writer = threading.Thread(target=feed, daemon=True)
    writer.start()
    try:
        with pytest.raises(ConfigError) as info:
            load_config(fifo, env={})
        assert info.value.code == "KV_CONFIG_INVALID" and "not a regular file" in info.value.message
    finally:
        release = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)  # lets a writer still waiting in open() go
        writer.join()
        os.close(release)
