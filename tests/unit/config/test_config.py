from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pydantic
import pytest
import yaml
from pydantic import BaseModel

from kvsidecar.cli.config import default_config_text, schema, schema_text
from kvsidecar.config import (
    Config,
    Mode,
    ServerConfig,
    config_from_mapping,
    config_search_paths,
    find_config,
    load_config,
    read_config,
)
from kvsidecar.config.errors import ConfigInvalid, known_keys
from kvsidecar.errors import ConfigError

REPO = Path(__file__).resolve().parents[3]


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
    with pytest.raises(ConfigError, match=r"restore\.verifyy: unknown key"):  # any other: an error
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
    assert out.out.strip().endswith("config.yaml\nconfig OK")
    assert out.err.startswith("kvsidecar: warning: restore.verify is no longer a setting and is ignored")


# issue 17: the shipped default, every problem at once, serve's refusals in the model, the JSON Schema ----
def test_packaged_default_config_is_the_repository_config_yaml() -> None:
    """`config init` writes kvsidecar/defaults/config.yaml: it must be the same bytes as ./config.yaml."""
    assert default_config_text() == (REPO / "config.yaml").read_bytes()


def _fields(model: type[BaseModel], prefix: str) -> list[tuple[str, Any]]:
    out: list[tuple[str, Any]] = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        if isinstance(ann, type) and issubclass(ann, BaseModel):
            out += _fields(ann, f"{prefix}{name}.")
        else:
            out.append((f"{prefix}{name}", field))
    return out


def test_every_setting_appears_in_the_shipped_config_with_its_default() -> None:
    """config.yaml says it shows every default: each field of the model (a server's under servers.local)
    is set there to its default, or, for a default of null, shown as a commented-out example line."""
    text = (REPO / "config.yaml").read_text()
    raw = yaml.safe_load(text)
    loaded = load_config(REPO / "config.yaml", env={}).model_dump(mode="json")
    default = Config().model_dump(mode="json")
    paths = [(k, f) for k, f in _fields(Config, "") if k not in ("servers", "routes")]
    paths += [(f"servers.local.{k}", f) for k, f in _fields(ServerConfig, "")]
    missing = []
    for key, field in paths:
        node: Any = raw
        for part in key.split("."):
            node = node.get(part, KeyError) if isinstance(node, dict) else KeyError
        if node is KeyError:
            leaf = key.rsplit(".", 1)[-1]
            if field.default is not None or not re.search(rf"^\s*# {re.escape(leaf)}:", text, re.M):
                missing.append(key)
            continue
        want, got = default, loaded
        for part in key.split("."):
            want, got = want[part], got[part]
        assert got == want, key
    assert missing == []
    assert raw["routes"] == default["routes"] and list(raw["servers"]) == list(default["servers"])


def test_every_problem_is_listed_with_its_key_and_a_suggestion() -> None:
    data = {
        "retension": {},
        "api": {"listn": "127.0.0.1:1", "max_body_bytes": "lots"},
        "servers": {"local": {"base_urll": "http://x", "slot_wait": 3}},
    }
    with pytest.raises(ConfigInvalid) as info:
        config_from_mapping(data)
    assert sorted(info.value.problems) == [
        "api.listn: unknown key (did you mean 'listen'?)",
        "api.max_body_bytes: not a size: 'lots' (use e.g. 100GB, 512MiB or a number of bytes)",
        "retension: unknown key (did you mean 'retention'?)",
        "servers.local.base_urll: unknown key (did you mean 'base_url'?)",
        "servers.local.slot_wait: unknown key (did you mean 'slot_wait_s'?)",
    ]
    assert "\n" not in info.value.message and info.value.code == "KV_CONFIG_INVALID"


def test_known_keys_walks_sections_and_named_servers() -> None:
    assert "base_url" in known_keys(Config, ("servers", "anyname"))
    assert "min_reuse_ratio" in known_keys(Config, ("restore",))
    assert "retention" in known_keys(Config, ())
    assert known_keys(Config, ("routes",)) == [] and known_keys(Config, ("nope", "x")) == []


@pytest.mark.parametrize(
    ("data", "first"),
    [
        ({"api": {"listen": "0.0.0.0:8377"}}, "api.listen: refusing to listen on non-loopback 0.0.0.0"),
        ({"api": {"listen": "[::]:8377", "allow_public_bind": True}}, "api.token_file: a token is required"),
        ({"proxy": {"enabled": True, "listen": "192.0.2.1:8378"}}, "proxy.listen: refusing to listen"),
    ],
)
def test_what_serve_refuses_the_model_refuses(data: dict[str, Any], first: str) -> None:
    """`api.listen: 0.0.0.0` used to pass `config check` and fail at `serve`: the check is the model's now."""
    with pytest.raises(ConfigInvalid) as info:
        config_from_mapping(data)
    assert info.value.problems[0].startswith(first)


def test_public_bind_with_the_flag_and_a_token_is_accepted(tmp_path: Path) -> None:
    c = config_from_mapping(
        {"api": {"listen": "0.0.0.0:8377", "allow_public_bind": True, "token_file": str(tmp_path / "t")}}
    )
    assert c.bind_problems("api") == []


def test_cross_key_problems_are_all_listed() -> None:
    with pytest.raises(ConfigInvalid) as info:
        config_from_mapping({"routes": {"a": "x", "b": "y"}, "api": {"listen": "0.0.0.0:1"}})
    assert [p.split(":")[0] for p in info.value.problems] == ["routes.a", "routes.b", "api.listen"]


def test_no_file_means_the_defaults_and_says_where_it_looked(tmp_path: Path) -> None:
    env = {"HOME": str(tmp_path)}
    config, source = read_config(env=env)
    assert config == Config() and source.path is None and not source.named
    assert source.searched == (tmp_path / ".config/kvsidecar/config.yaml", Path("/etc/kvsidecar/config.yaml"))
    user = tmp_path / ".config/kvsidecar/config.yaml"
    user.parent.mkdir(parents=True)
    user.write_text("enabled: false\n")
    assert find_config(env=env).path == user and load_config(env=env).enabled is False
    xdg = {"XDG_CONFIG_HOME": str(tmp_path / "x"), "HOME": str(tmp_path)}
    assert config_search_paths(xdg)[0] == tmp_path / "x/kvsidecar/config.yaml"


def test_schema_file_is_current() -> None:
    """docs/config.schema.json is `kvsidecar config schema`; regenerate it with that command."""
    shipped = json.loads((REPO / "docs" / "config.schema.json").read_text())
    if f"(pydantic {pydantic.VERSION})" not in shipped["$comment"]:  # scripts/test-lowest: pydantic 2.6
        pytest.skip(
            f"{shipped['$comment']}; this is pydantic {pydantic.VERSION}, which spells it differently"
        )
    assert (REPO / "docs" / "config.schema.json").read_text() == schema_text()


def test_schema_defaults_do_not_depend_on_who_generates_it() -> None:
    text = json.dumps(schema())
    assert str(Path.home()) not in text and "~/.local/state/kvsidecar/state" in text


@pytest.mark.parametrize(
    "text",
    [
        "100GB",
        "1.5GiB",
        "512M",
        "512Mi",
        "512 mib",
        "1k",
        "42",
        "42B",
        " 7 kb ",
        "1.5.3GB",
        "5.GB",
        "1Gbit",
        "GB",
        "-5",
        "10 XB",
        "",
    ],
)
def test_schema_size_pattern_accepts_what_the_loader_accepts(text: str) -> None:
    """An editor using the schema must not flag a size the daemon takes, nor pass one it refuses."""
    prop = schema()["$defs"]["RetentionConfig"]["properties"]["max_total_bytes"]
    pattern = next(a["pattern"] for a in prop["anyOf"] if a.get("type") == "string")
    try:
        config_from_mapping({"retention": {"max_total_bytes": text}})
        accepted = True
    except ConfigError:
        accepted = False
    assert (re.search(pattern, text) is not None) == accepted


def _router_config(**extra: Any) -> Config:
    url = "http://127.0.0.1:8080"
    servers = {"coder": {"base_url": url, "model": "coder-7b"}, "chat": {"base_url": url, "model": "chat-3b"}}
    return config_from_mapping({"servers": servers, "routes": {"local": "coder"}, **extra})


def test_a_provider_routed_to_a_router_goes_by_the_model_the_call_names() -> None:
    config = _router_config()
    assert config.server_for("local", "chat-3b") == "chat"
    assert config.server_for("local", "coder-7b") == "coder"
    assert config.server_for("local") == "coder"  # no model named: the route as written
    assert config.server_for("local", "not-managed") is None  # the router's other models pass through
    assert config.server_for("unknown", "chat-3b") is None
    plain = config_from_mapping({})
    assert plain.server_for("local", "anything") == "local"  # a plain llama-server runs its one model


def test_the_models_of_a_router_need_an_entry_each() -> None:
    url = "http://127.0.0.1:8080"
    with pytest.raises(ConfigError, match="only the models of a router may"):
        config_from_mapping({"servers": {"local": {"base_url": url}, "b": {"base_url": url, "model": "b"}}})
    with pytest.raises(ConfigError, match="name the same model"):
        config_from_mapping(
            {
                "servers": {
                    "local": {"base_url": url, "model": "m"},
                    "b": {"base_url": url + "/", "model": "m"},
                }
            }
        )
    with pytest.raises(ConfigError, match="printable"):
        config_from_mapping({"servers": {"local": {"model": "a\nb"}}})
    assert _router_config().servers["chat"].model == "chat-3b"


def test_one_entry_may_discover_a_routers_models_beside_the_named_ones() -> None:
    url = "http://127.0.0.1:8080"
    found = config_from_mapping(
        {
            "servers": {
                "local": {"base_url": url, "discover_models": True, "exclude_models": ["*-embed"]},
                "coder": {"base_url": url, "model": "coder-7b"},  # its own entry: never discovered
            }
        }
    )
    assert found.servers["local"].discover_models and found.servers["local"].max_models == 32
    assert found.server_for("local", "chat-3b") is None  # not an entry's: the discovered runtime, if any
    assert found.server_for("local", "coder-7b") == "coder"
    with pytest.raises(ConfigError, match="discovers its models or names one"):
        config_from_mapping({"servers": {"local": {"base_url": url, "model": "m", "discover_models": True}}})
    with pytest.raises(ConfigError, match="one entry at most discovers"):
        two = {"base_url": url, "discover_models": True}
        config_from_mapping({"servers": {"local": two, "b": two}})
    with pytest.raises(ConfigError, match="only the models of a router may"):  # no opt-in: still refused
        config_from_mapping(
            {"servers": {"local": {"base_url": url, "discover_models": True}, "c": {"base_url": url}}}
        )
    with pytest.raises(ConfigError, match="max_models"):
        config_from_mapping(
            {"servers": {"local": {"base_url": url, "discover_models": True, "max_models": 0}}}
        )
