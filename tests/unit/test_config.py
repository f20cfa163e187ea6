from __future__ import annotations

from pathlib import Path

import pytest

from kvsidecar.config import Config, Mode, config_from_mapping, load_config
from kvsidecar.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_shipped_config_yaml_equals_the_defaults() -> None:
    assert load_config(REPO / "config.yaml", env={}) == Config()


def test_defaults_target_a_local_llama_server() -> None:
    c = Config()
    assert c.servers["local"].base_url == "http://127.0.0.1:8080"
    assert c.servers["local"].mode is Mode.SINGLE_SLOT
    assert c.api.host == "127.0.0.1" and c.api.port == 8377
    assert c.server_for("local") == "local"
    assert c.server_for("openai") is None


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ("servers:\n  local:\n    base_url: ftp://x\n", "servers.local"),
        ("checkpoint:\n  idle_s: -1\n", "checkpoint.idle_s"),
        ("routes:\n  qwen: nowhere\n", "routes.qwen"),
        ("api:\n  listen: nonsense\n", "api"),
        ("restore:\n  min_reuse_ratio: 2\n", "restore.min_reuse_ratio"),
        ("retention:\n  max_total_bytes: lots\n", "retention.max_total_bytes"),
        ("unknown_key: 1\n", "unknown_key"),
        ("failure:\n  strict: maybe\n", "failure.strict"),
    ],
)
def test_bad_values_name_the_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, text), env={})
    assert info.value.message.startswith(key)
    assert "\n" not in info.value.message


def test_invalid_yaml_names_the_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="line 2"):
        load_config(write(tmp_path, "a: 1\nb: c: d\n"), env={})


def test_top_level_must_be_a_mapping(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="mapping"):
        load_config(write(tmp_path, "- 1\n- 2\n"), env={})


def test_missing_explicit_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "nope.yaml", env={})


def test_environment_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, "api:\n  listen: 127.0.0.1:9000\n")
    env = {
        "KVSIDECAR_CONFIG": str(path),
        "KVSIDECAR_TOKEN_FILE": "/etc/tok",
        "KVSIDECAR_STATE_DIR": "/srv/kv",
    }
    c = load_config(env=env)
    assert c.api.port == 9000
    assert c.api.token_file == Path("/etc/tok")
    assert c.state_dir == Path("/srv/kv")


def test_paths_expand_user_and_vars(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVTEST_ROOT", "/data")
    c = load_config(write(tmp_path, "state_dir: $KVTEST_ROOT/state\n"), env={})
    assert c.state_dir == Path("/data/state")


def size(value: object) -> int | None:
    return config_from_mapping({"retention": {"max_total_bytes": value}}).retention.max_total_bytes


@pytest.mark.parametrize(
    ("text", "value"),
    [
        ("100GB", 100 * 10**9),
        ("1.5GiB", int(1.5 * 2**30)),
        ("512M", 512 * 10**6),
        ("512Mi", 512 * 2**20),
        ("512 mib", 512 * 2**20),
        ("1k", 1000),
        ("2TB", 2 * 10**12),
        ("1PiB", 2**50),
        ("42", 42),
        ("42B", 42),
        (" 7 kb ", 7000),
        (7, 7),
        (1e9, 10**9),
        (0, 0),
    ],
)
def test_sizes(text: object, value: int) -> None:
    """Every spelling the old hand-written parser took still means the same (pydantic ByteSize now)."""
    assert size(text) == value


@pytest.mark.parametrize(
    "text", ["1.5.3GB", "5.GB", "1Gbit", "GB", "-5", -5, 2.5, True, "١٢٣", "1e9", "10 XB", "", float("nan")]
)
def test_bad_sizes_name_the_key(text: object) -> None:
    """ByteSize alone would read "1.5.3GB" as 1, "5.GB" as 5 and True as 1: refused here."""
    with pytest.raises(ConfigError) as info:
        size(text)
    assert info.value.message.startswith("retention.max_total_bytes: not a size")


def test_removed_keys_load_with_a_warning_naming_them(tmp_path: Path) -> None:
    """restore.verify (never read) and auxiliary_requests (one value only) are gone: an old file that
    sets them still loads, and says which keys to delete."""
    text = "auxiliary_requests: isolate\nrestore:\n  verify: false\n  min_reuse_ratio: 0.3\n"
    c = load_config(write(tmp_path, text), env={})
    assert c.restore.min_reuse_ratio == 0.3
    assert c.ignored_keys == ("restore.verify", "auxiliary_requests")
    notes = c.deprecations()
    assert len(notes) == 2 and notes[0].startswith("restore.verify is no longer a setting")
    dump = c.model_dump()
    assert "auxiliary_requests" not in dump and "verify" not in dump["restore"]
    with pytest.raises(ConfigError, match=r"restore\.verifyy: Extra inputs"):  # any other: an error
        load_config(write(tmp_path, "restore:\n  verifyy: true\n"), env={})


def test_shipped_config_sets_no_removed_key() -> None:
    assert load_config(REPO / "config.yaml", env={}).deprecations() == []


def test_config_objects_are_frozen() -> None:
    c = Config()
    with pytest.raises(ValueError):
        c.enabled = False  # type: ignore[misc]


def test_config_check_warns_about_removed_keys(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvsidecar.cli import main

    assert main(["-c", str(write(tmp_path, "restore:\n  verify: true\n")), "config", "check"]) == 0
    out = capsys.readouterr()
    assert out.out.strip() == "config OK"
    assert out.err.startswith("kvsidecar: warning: restore.verify is no longer a setting and is ignored")
