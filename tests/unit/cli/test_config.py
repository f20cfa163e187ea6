"""`kvsidecar config init / check / schema`, the snapshot_dir vs --slot-save-path check, and the packaging
facts a pip user depends on (package data, the lowest dependency set)."""

from __future__ import annotations

import argparse
import json
import os
import re
import stat
import tomllib
from pathlib import Path

import pytest
from packaging.version import Version

from kvsidecar.cli import build_parser, main
from kvsidecar.cli.config import default_config_text, init_path, schema
from kvsidecar.config import Config, ServerConfig, config_from_mapping, config_search_paths
from kvsidecar.fingerprint.llama_process import ProcessInfo
from kvsidecar.fingerprint.savepath import SAVE_PATH_MISMATCH, log_save_path_warnings, save_path_warning

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A user with no config anywhere we control (HOME moved; /etc/kvsidecar must not exist here)."""
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    for var in ("XDG_CONFIG_HOME", "KVSIDECAR_CONFIG", "KVSIDECAR_TOKEN_FILE", "KVSIDECAR_STATE_DIR"):
        monkeypatch.delenv(var, raising=False)
    return tmp_path / "home"


# config init ----------------------------------------------------------------------------------------
def test_init_writes_the_commented_default_0640(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "etc" / "config.yaml"
    assert main(["config", "init", "--path", str(path)]) == 0
    assert path.read_bytes() == default_config_text() == (REPO / "config.yaml").read_bytes()
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    assert f"wrote {path}" in capsys.readouterr().out
    assert [p.name for p in path.parent.iterdir()] == ["config.yaml"]  # no temp file left behind
    assert main(["-c", str(path), "config", "check"]) == 0


def test_init_refuses_to_overwrite_without_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "config.yaml"
    path.write_text("enabled: false\n")
    assert main(["config", "init", "--path", str(path)]) == 1
    assert "KV_CONFIG_EXISTS" in capsys.readouterr().err
    assert path.read_text() == "enabled: false\n"
    assert main(["config", "init", "--path", str(path), "--force"]) == 0
    assert path.read_bytes() == default_config_text()


def test_init_never_writes_through_a_link(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    target = tmp_path / "elsewhere"
    target.write_text("precious\n")
    link = tmp_path / "config.yaml"
    link.symlink_to(target)
    assert main(["config", "init", "--path", str(link), "--force"]) == 2
    assert "not a regular file" in capsys.readouterr().err
    assert target.read_text() == "precious\n" and link.is_symlink()


def test_init_without_path_writes_where_check_looks_first(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["config", "init"]) == 0
    assert (home / ".config/kvsidecar/config.yaml").read_bytes() == default_config_text()
    capsys.readouterr()
    assert main(["config", "check"]) == 0
    assert f"config file: {home}/.config/kvsidecar/config.yaml" in capsys.readouterr().out


@pytest.mark.parametrize("euid", [0, 1000], ids=["root", "user"])
def test_init_writes_exactly_the_file_serve_reads_first_for_root_too(
    home: Path, monkeypatch: pytest.MonkeyPatch, euid: int
) -> None:
    """A root user's init file written to /etc would be overridden without a word by one in ~/.config,
    which serve reads first: init writes the first place serve looks, whoever runs it."""
    monkeypatch.setattr(os, "geteuid", lambda: euid)
    args = build_parser().parse_args(["config", "init"])
    env = {"HOME": str(home)}
    assert init_path(args, env) == config_search_paths(env)[0] == home / ".config/kvsidecar/config.yaml"
    xdg = {"HOME": str(home), "XDG_CONFIG_HOME": str(home / "xdg")}
    assert init_path(args, xdg) == config_search_paths(xdg)[0] == home / "xdg/kvsidecar/config.yaml"
    # no usable home (a service's environment): /etc is then the first place, for init and serve alike
    for bare in ({}, {"HOME": "relative/home"}, {"HOME": str(home), "XDG_CONFIG_HOME": "rel"}):
        first = init_path(args, bare)
        assert first == config_search_paths(bare)[0]
        assert first in (Path("/etc/kvsidecar/config.yaml"), home / ".config/kvsidecar/config.yaml")
    assert init_path(args, {}) == Path("/etc/kvsidecar/config.yaml")


def test_init_on_a_fresh_home_makes_the_directories_llama_server_needs(
    home: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """README's "Running it" starts llama-server with --slot-save-path ~/.local/state/kvsidecar/snapshots
    right after `config init`: the directory must exist (llama-server exits "not a directory"), private."""
    old = os.umask(0o022)
    try:
        assert main(["config", "init"]) == 0
    finally:
        os.umask(old)
    out = capsys.readouterr().out
    for sub in (".config", ".config/kvsidecar"):
        assert stat.S_IMODE((home / sub).stat().st_mode) == 0o750
    for sub in (".local", ".local/state", ".local/state/kvsidecar", ".local/state/kvsidecar/snapshots"):
        assert stat.S_IMODE((home / sub).stat().st_mode) == 0o700, sub
    assert (home / ".local/state/kvsidecar/state").is_dir()
    assert f"servers.local.snapshot_dir: {home}/.local/state/kvsidecar/snapshots (created, 0700)" in out
    # an existing directory is left as it is; --no-dirs makes none
    os.chmod(home / ".local/state/kvsidecar/snapshots", 0o2770)
    assert main(["config", "init", "--force"]) == 0
    assert stat.S_IMODE((home / ".local/state/kvsidecar/snapshots").stat().st_mode) == 0o2770
    assert "(exists)" in capsys.readouterr().out
    other = home / "other"
    other.mkdir()
    monkeypatch.setenv("HOME", str(other))
    assert main(["config", "init", "--no-dirs"]) == 0
    assert (other / ".config/kvsidecar/config.yaml").is_file() and not (other / ".local").exists()


def test_init_refuses_a_file_where_a_data_directory_goes(
    home: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (home / ".local/state").mkdir(parents=True)
    (home / ".local/state/kvsidecar").write_text("not a directory")
    assert main(["config", "init"]) == 2
    err = capsys.readouterr().err
    assert (
        "KV_CONFIG_INVALID" in err and f"{home}/.local/state/kvsidecar: exists and is not a directory" in err
    )


def test_every_text_gives_the_search_order_serve_uses() -> None:
    """-c's help, config init's help, README and the docs say what config_search_paths does: the user's
    file first, then /etc, for root too; none says init writes /etc as root."""
    parser = build_parser()
    helps = parser.format_help() + _subcommand_help(parser, "config", "init")
    texts = {
        "help": helps,
        **{
            str(p.relative_to(REPO)): p.read_text()
            for p in [REPO / "README.md", *(REPO / "docs").glob("*.md")]
        },
    }
    flat = {name: " ".join(text.split()) for name, text in texts.items()}
    for name, text in flat.items():
        assert "/etc/kvsidecar/config.yaml as root" not in text, name
        assert "as root, otherwise" not in text, name
    assert (
        "($XDG_CONFIG_HOME or ~/.config)/kvsidecar/config.yaml and /etc/kvsidecar/config.yaml" in flat["help"]
    )
    assert "for root too" in flat["help"]
    readme = flat["README.md"]
    assert readme.index("`~/.config/kvsidecar/config.yaml`") < readme.index("`/etc/kvsidecar/config.yaml`")


def _subcommand_help(parser: argparse.ArgumentParser, *names: str) -> str:
    for name in names:
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        parser = action.choices[name]
    return parser.format_help()


# config check ---------------------------------------------------------------------------------------
def test_check_says_when_the_defaults_were_used(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    if Path("/etc/kvsidecar/config.yaml").exists():
        pytest.skip("this machine has /etc/kvsidecar/config.yaml")
    assert main(["config", "check"]) == 0
    out = capsys.readouterr().out
    assert "no config file found" in out and "using the built-in defaults" in out
    assert f"{home}/.config/kvsidecar/config.yaml" in out and "/etc/kvsidecar/config.yaml" in out


def test_check_lists_every_problem_with_suggestions(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text("retension: {}\ncheckpoint:\n  idle: 5\n  policy: sometimes\n")
    assert main(["-c", str(path), "config", "check"]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"kvsidecar: KV_CONFIG_INVALID: {path}: 3 problems"
    assert "  retension: unknown key (did you mean 'retention'?)" in err
    assert "  checkpoint.idle: unknown key (did you mean 'idle_s'?)" in err
    assert any(line.startswith("  checkpoint.policy: ") for line in err)


def test_check_fails_exactly_as_serve_does_on_a_public_listen(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"state_dir: {tmp_path / 'state'}\napi:\n  listen: 0.0.0.0:8377\n")
    assert main(["-c", str(path), "config", "check"]) == 2
    check = capsys.readouterr().err
    assert main(["-c", str(path), "serve"]) == 2
    serve = capsys.readouterr().err
    problem = "api.listen: refusing to listen on non-loopback 0.0.0.0"
    assert problem in check and problem in serve
    assert not (tmp_path / "state").exists()  # serve refused before it touched anything


def test_check_refuses_what_serve_refuses_in_the_token_file(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "c.yaml"
    path.write_text(f"api:\n  token_file: {tmp_path / 'missing'}\n")
    assert main(["-c", str(path), "config", "check"]) == 2
    assert "api.token_file: cannot read" in capsys.readouterr().err


def test_check_json_keeps_stdout_machine_readable(home: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "check", "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out) == Config().model_dump(mode="json")
    assert "config" in out.err


# config schema --------------------------------------------------------------------------------------
def test_schema_prints_the_json_schema(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["config", "schema"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc == schema() and doc["$schema"].endswith("2020-12/schema")
    assert doc["additionalProperties"] is False  # an editor flags an unknown key, as check does
    assert set(doc["properties"]) == set(Config.model_fields)


# snapshot_dir vs llama-server's --slot-save-path --------------------------------------------------------
def process(tmp_path: Path, **flags: str) -> ProcessInfo:
    return ProcessInfo(pid=42, create_time=1.0, exe=None, cmdline=(), flags=flags, cwd=str(tmp_path))


def server(snapshot_dir: Path) -> ServerConfig:
    return config_from_mapping({"servers": {"local": {"snapshot_dir": str(snapshot_dir)}}}).servers["local"]


def test_save_path_agreeing_or_unknown_is_no_warning(tmp_path: Path) -> None:
    (tmp_path / "snaps").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "snaps")
    srv = server(tmp_path / "snaps")
    assert save_path_warning("local", srv, None) is None  # remote, or the process cannot be read
    assert save_path_warning("local", srv, process(tmp_path, slot_save_path=str(tmp_path / "snaps"))) is None
    assert save_path_warning("local", srv, process(tmp_path, slot_save_path=str(tmp_path / "alias"))) is None
    assert save_path_warning("local", srv, process(tmp_path, slot_save_path="snaps")) is None  # its cwd


def test_save_path_elsewhere_or_missing_is_a_warning_with_a_stable_code(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    srv = server(tmp_path / "snaps")
    other = save_path_warning("local", srv, process(tmp_path, slot_save_path=str(tmp_path / "other")))
    none = save_path_warning("local", srv, process(tmp_path))
    assert other is not None and none is not None
    assert other.code == none.code == SAVE_PATH_MISMATCH == "KV_SAVE_PATH_MISMATCH"
    assert str(tmp_path / "other") in other.message and "without --slot-save-path" in none.message
    with caplog.at_level("WARNING"):
        found = log_save_path_warnings({"local": (srv, process(tmp_path, slot_save_path="/x"))})
    assert [w.server for w in found] == ["local"]
    assert "kv.config.save_path_mismatch" in caplog.text and SAVE_PATH_MISMATCH in caplog.text


# packaging ------------------------------------------------------------------------------------------
def _lower_bounds() -> dict[str, str]:
    deps = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
    out = {}
    for dep in deps:
        m = re.match(r"([A-Za-z0-9_.-]+)\s*>=\s*([^,;\s]+)\s*,\s*<\s*[^,;\s]+", dep)
        assert m, f"{dep}: every runtime dependency is bounded: >=lowest,<next major"
        out[m.group(1).lower()] = m.group(2)
    return out


def test_lowest_constraints_pin_exactly_the_lower_bounds() -> None:
    pins = {}
    for line in (REPO / "constraints/lowest.txt").read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            name, _, version = line.partition("==")
            pins[name.strip().lower()] = version.strip()
    assert {k: Version(v) for k, v in pins.items()} == {k: Version(v) for k, v in _lower_bounds().items()}


def test_package_data_a_wheel_needs_is_in_the_package() -> None:
    pkg = REPO / "kvsidecar"
    assert (pkg / "py.typed").exists() and (pkg / "defaults/config.yaml").exists()
    assert sorted(p.name for p in (pkg / "units").glob("*.in")) == [
        "kvsidecar.service.in",
        "llama-server.service.in",
    ]
    data = tomllib.loads((REPO / "pyproject.toml").read_text())
    assert data["project"]["license-files"] == ["LICENSE"] and (REPO / "LICENSE").read_text().startswith(
        "MIT"
    )
    assert data["tool"]["setuptools"]["package-data"]["kvsidecar.defaults"] == ["config.yaml"]


def test_a_canary_saved_elsewhere_is_a_save_failure_not_a_crash(tmp_path: Path) -> None:
    """With snapshot_dir not llama-server's --slot-save-path, the canary's file is not where kvsidecar
    looks: that was a FileNotFoundError that ended `serve` (exit 3); it is a canary failure now."""
    from kvsidecar.coordinator.canary import hash_canary_file
    from kvsidecar.errors import SaveFailed

    with pytest.raises(SaveFailed, match="--slot-save-path"):
        hash_canary_file(tmp_path / "kvsidecar-canary.0123456789abcdef.bin")
