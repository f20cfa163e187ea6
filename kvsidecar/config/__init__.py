"""Configuration: one YAML file, validated by pydantic into frozen, keyword-only objects.

Defaults live in the section models and nowhere else. `load_config()` is the only entry point; any problem
with the file raises `ConfigError` (`ConfigInvalid` carries every problem, each starting with its dotted
key: `servers.local.base_url: ...`), never a traceback. Checks that span keys (routes, the proxy's wiring,
a listener beyond loopback) are part of the model, so `config check` refuses what `serve` would.
Environment overrides (for the few things operators change): `KVSIDECAR_CONFIG` (the file),
`KVSIDECAR_TOKEN_FILE` (api.token_file), `KVSIDECAR_STATE_DIR` (state_dir).

This package's public names, re-exported here (`from kvsidecar.config import Config`), live in:

- `values`: the value types of keys (sizes, paths, URLs, listen addresses) and the `Section` base;
- `servers`: `ServerConfig` and its `Mode`;
- `sections`: checkpoint, restore, failure, retention and logging;
- `network`: the `api` and `proxy` listeners, `is_loopback`, `http_origin`;
- `fleet`: the `fleet` section and `HOST_ID`;
- `model`: the top-level `Config`, its cross-key checks, `REMOVED_KEYS` and `RESTART_ONLY`;
- `loading`: finding, reading and validating the file (`load_config`, `read_config`, `find_config`);
- `file` (the strict YAML reader) and `errors` (how problems are reported), imported by their own names.
"""

from __future__ import annotations

from kvsidecar.config.errors import ConfigInvalid, config_problems
from kvsidecar.config.file import read_mapping
from kvsidecar.config.fleet import HOST_ID, FleetConfig
from kvsidecar.config.loading import (
    DEFAULT_CONFIG_PATH,
    ConfigSource,
    config_from_mapping,
    config_search_paths,
    find_config,
    load_config,
    read_config,
)
from kvsidecar.config.model import REMOVED_KEYS, RESTART_ONLY, Config
from kvsidecar.config.network import ApiConfig, ProxyConfig, http_origin, is_loopback
from kvsidecar.config.sections import (
    CheckpointConfig,
    FailureConfig,
    LoggingConfig,
    RestoreConfig,
    RetentionConfig,
)
from kvsidecar.config.servers import Mode, ServerConfig
from kvsidecar.config.values import BaseUrl, Bytes, ListenAddress, PathValue, expand_path, size_spelling

__all__ = [
    "DEFAULT_CONFIG_PATH",
    "HOST_ID",
    "REMOVED_KEYS",
    "RESTART_ONLY",
    "ApiConfig",
    "BaseUrl",
    "Bytes",
    "CheckpointConfig",
    "Config",
    "ConfigInvalid",
    "ConfigSource",
    "FailureConfig",
    "FleetConfig",
    "ListenAddress",
    "LoggingConfig",
    "Mode",
    "PathValue",
    "ProxyConfig",
    "RestoreConfig",
    "RetentionConfig",
    "ServerConfig",
    "config_from_mapping",
    "config_problems",
    "config_search_paths",
    "expand_path",
    "find_config",
    "http_origin",
    "is_loopback",
    "load_config",
    "read_config",
    "read_mapping",
    "size_spelling",
]
