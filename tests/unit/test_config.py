from __future__ import annotations

from pathlib import Path

import pytest

from kvsidecar.config import Config, Mode, load_config, parse_bytes
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


@pytest.mark.parametrize(
    ("text", "value"),
    [("100GB", 100 * 10**9), ("1.5GiB", int(1.5 * 2**30)), ("512M", 512 * 10**6), ("42", 42), (7, 7)],
)
def test_sizes(text: object, value: int) -> None:
    assert parse_bytes(text) == value


def test_config_objects_are_frozen() -> None:
    c = Config()
    with pytest.raises(ValueError):
        c.enabled = False  # type: ignore[misc]
