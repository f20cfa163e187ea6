"""Finding, reading and validating the config file: `load_config()` is the only entry point. Where a file
is looked for (`-c`, `$KVSIDECAR_CONFIG`, then the user's path and the system's, in that order for root
too), the environment overrides (`KVSIDECAR_TOKEN_FILE`: api.token_file, `KVSIDECAR_STATE_DIR`:
state_dir), and the dropping of removed keys before validation. Any problem raises `ConfigError`
(`ConfigInvalid` with every problem), never a traceback."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from kvsidecar.config.errors import ConfigInvalid, config_problems
from kvsidecar.config.file import read_mapping
from kvsidecar.config.model import REMOVED_KEYS, Config

DEFAULT_CONFIG_PATH = Path("/etc/kvsidecar/config.yaml")


def _strip_removed(data: dict[str, Any]) -> tuple[dict[str, Any], tuple[str, ...]]:
    out, found = dict(data), []
    for key in REMOVED_KEYS:
        section, _, leaf = key.rpartition(".")
        parent = out.get(section) if section else out
        if isinstance(parent, dict) and leaf in parent:
            parent = {k: v for k, v in parent.items() if k != leaf}
            out = {**out, section: parent} if section else parent
            found.append(key)
    return out, tuple(found)


def config_from_mapping(data: dict[str, Any]) -> Config:
    data, ignored = _strip_removed(data)
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigInvalid(
            config_problems(exc, Config), hint="Fix the keys named above in the config file."
        ) from None
    config._ignored = ignored
    return config


def config_search_paths(env: Mapping[str, str]) -> tuple[Path, ...]:
    """Where a config file is looked for when none is named (-c, $KVSIDECAR_CONFIG), in this order, for
    every user, root included: the user's ($XDG_CONFIG_HOME or ~/.config)/kvsidecar/config.yaml, then
    /etc/kvsidecar/config.yaml. `config init` without --path writes the first of them, so the file it
    writes is the one `check` and `serve` read. A relative $XDG_CONFIG_HOME or $HOME is ignored (the XDG
    rule: it would name another file in every working directory)."""
    xdg, home = env.get("XDG_CONFIG_HOME", ""), env.get("HOME", "")
    base = xdg if xdg.startswith("/") else f"{home}/.config" if home.startswith("/") else ""
    user = (Path(base) / "kvsidecar" / "config.yaml",) if base else ()
    return (*user, DEFAULT_CONFIG_PATH)


@dataclass(frozen=True, kw_only=True)
class ConfigSource:
    """Which file a config comes from: `path` None means none was found and the defaults apply."""

    path: Path | None
    named: bool  # given with -c or $KVSIDECAR_CONFIG (then it must exist)
    searched: tuple[Path, ...] = ()  # the places looked at when none was named
    empty: bool = False  # the file sets no key (empty, only comments): every value is a default


def find_config(path: Path | str | None = None, *, env: Mapping[str, str] | None = None) -> ConfigSource:
    environ = os.environ if env is None else env
    if path is not None or environ.get("KVSIDECAR_CONFIG"):
        return ConfigSource(path=Path(path or environ["KVSIDECAR_CONFIG"]), named=True)
    searched = config_search_paths(environ)
    return ConfigSource(path=next((p for p in searched if p.exists()), None), named=False, searched=searched)


def read_config(
    path: Path | str | None = None, *, env: Mapping[str, str] | None = None
) -> tuple[Config, ConfigSource]:
    """The config and where it came from (`config check` says when the built-in defaults were used)."""
    environ = os.environ if env is None else env
    source = find_config(path, env=environ)
    data = read_mapping(source.path) if source.path is not None else {}
    if source.path is not None and not data:
        source = replace(source, empty=True)
    if token_file := environ.get("KVSIDECAR_TOKEN_FILE"):
        data = {**data, "api": {**(data.get("api") or {}), "token_file": token_file}}
    if state_dir := environ.get("KVSIDECAR_STATE_DIR"):
        data = {**data, "state_dir": state_dir}
    return config_from_mapping(data), source


def load_config(path: Path | str | None = None, *, env: Mapping[str, str] | None = None) -> Config:
    """Read, override from the environment, validate. `path=None`: $KVSIDECAR_CONFIG, else the first of
    `config_search_paths()` that exists, else the defaults."""
    return read_config(path, env=env)[0]
