"""Configuration: one YAML file, validated by pydantic into frozen, keyword-only objects.

Defaults live here and nowhere else. `load_config()` is the only entry point; any problem with the file
raises `ConfigError` with one line naming the key (`servers.local.base_url: ...`), never a traceback.
Environment overrides (for the few things operators change): `KVSIDECAR_CONFIG` (the file),
`KVSIDECAR_TOKEN_FILE` (api.token_file), `KVSIDECAR_STATE_DIR` (state_dir).
"""

from __future__ import annotations

import os
import re
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    model_validator,
)

from kvsidecar.errors import ConfigError

DEFAULT_CONFIG_PATH = Path("/etc/kvsidecar/config.yaml")

# The spellings a size may take: a number and an optional unit, K/M/G/T/P/E (powers of 1000) or
# Ki/Mi/Gi/Ti/Pi/Ei (powers of 1024), with or without a trailing B, any case, spaces allowed around the unit.
# pydantic's ByteSize does the arithmetic; this pattern is stricter than its own, which takes the leading
# number of "1.5.3GB" or "5.GB", any Unicode digit, and bit units ("1Gbit").
_SIZE = re.compile(r"\A\s*(\d+(?:\.\d+)?)\s*(?:([KMGTPE])(I)?B?|B)?\s*\Z", re.IGNORECASE | re.ASCII)


def size_spelling(value: object) -> object:
    """Accept 123, "100GB", "1.5GiB", "512M", "512Mi"; hand ByteSize its own spelling of them."""
    if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
        raise ValueError(f"not a size: {value!r} (a whole number of bytes, or e.g. 100GB)")
    if isinstance(value, int | float) and value < 0:
        raise ValueError(f"not a size: {value!r} (sizes are never negative)")
    if isinstance(value, str):
        m = _SIZE.match(value)
        if not m:
            raise ValueError(f"not a size: {value!r} (use e.g. 100GB, 512MiB or a number of bytes)")
        number, prefix, binary = m.groups()
        return f"{number}{prefix or ''}{'i' if binary else ''}B"
    return value


def expand_path(value: object) -> object:
    if isinstance(value, str):
        return Path(os.path.expandvars(os.path.expanduser(value)))
    return value


Bytes = Annotated[ByteSize, BeforeValidator(size_spelling), Field(ge=0)]
PathValue = Annotated[Path, BeforeValidator(expand_path)]


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Mode(StrEnum):
    SINGLE_SLOT = "single-slot"
    MANAGED_SLOTS = "managed-slots"


class ServerConfig(_Model):
    """One llama-server and the directory it saves slots into (its --slot-save-path)."""

    base_url: str = "http://127.0.0.1:8080"
    api_key_file: PathValue | None = None
    snapshot_dir: PathValue = Path("~/.local/state/kvsidecar/snapshots").expanduser()
    runtime_key: str | None = None
    mode: Mode = Mode.SINGLE_SLOT
    slot_id: int = Field(default=0, ge=0)
    # managed-slots: keep the highest slot for auxiliary requests (titles, compaction), spec §72
    reserve_aux_slot: bool = False
    # how long an acquire waits for a free slot before KV_SLOT_BUSY (503 + Retry-After)
    slot_wait_s: float = Field(default=300.0, gt=0)
    connect_timeout_s: float = Field(default=2.0, gt=0)
    request_timeout_s: float = Field(default=10.0, gt=0)
    persist_timeout_s: float = Field(default=120.0, gt=0)
    probe_interval_s: float = Field(default=5.0, gt=0)
    # Prefill a fixed prompt once per server start and fingerprint the bytes of its KV: catches what no
    # flag shows (LLAMA_ARG_* settings, a model replaced in place, a remote server's command line).
    # Turn off only for an engine whose KV is not bit-reproducible (some GPU backends).
    runtime_canary: bool = True

    @model_validator(mode="after")
    def _url(self) -> ServerConfig:
        if not re.match(r"^https?://[^/\s]+", self.base_url):
            raise ValueError(f"base_url must be an http(s) URL, got {self.base_url!r}")
        return self


class CheckpointConfig(_Model):
    on_switch: bool = True
    on_shutdown: bool = True
    on_session_flush: bool = True
    on_disposed: bool = True
    on_turn_end: bool = False
    on_step_end: bool = False
    idle_s: float | None = Field(default=30.0, gt=0)
    shutdown_timeout_s: float = Field(default=60.0, gt=0)
    # cost-aware: take the evicted session's save off the switch (a background save when the server is
    # idle and the session has been idle longer than its save is predicted to take; no save when
    # recomputing since the last snapshot is predicted cheaper than writing a new one). save-before-evict:
    # every dirty slot is saved at the switch (the behaviour before issue 15).
    policy: Literal["cost-aware", "save-before-evict"] = "cost-aware"
    # A background save blocks the whole llama-server (its slot actions run in its main loop): by default
    # one starts only when no other slot of that server is working.
    clean_ahead_while_busy: bool = False


class RestoreConfig(_Model):
    enabled: bool = True
    verify_checksum: bool = True
    # A restore after which the engine reused less than this share of the restored tokens is "ineffective".
    min_reuse_ratio: float = Field(default=0.5, ge=0, le=1)


class FailureConfig(_Model):
    strict: bool = False
    max_consecutive_failures: int = Field(default=3, ge=1)
    cooldown_s: float = Field(default=60.0, gt=0)


class RetentionConfig(_Model):
    delete: bool = True  # the switch that turns every deletion off
    interval_s: float = Field(default=60.0, gt=0)
    max_total_bytes: Bytes | None = None
    max_sessions: int | None = Field(default=None, ge=1)
    max_age_days: float | None = Field(default=30.0, gt=0)
    min_free_bytes: Bytes | None = None
    min_free_percent: float | None = Field(default=10.0, ge=0, lt=100)
    low_watermark: float = Field(default=0.9, gt=0, le=1)


class _Listener(_Model):
    """A config section with a `listen: HOST:PORT` address, and the limits every connection to it has."""

    listen: str
    # Open connections at most; at the cap, the oldest one still waiting for a request head is dropped
    # to make room, and when every one is busy with a request the newcomer is refused.
    max_connections: int = Field(default=256, ge=1, le=100_000)
    # A request head must arrive within this (from the connect, or from the end of the previous answer).
    header_timeout_s: float = Field(default=10.0, gt=0)
    # A request body must arrive within this once its head is in.
    body_timeout_s: float = Field(default=30.0, gt=0)
    # A client that does not take the answer (nothing drained) for this long is cut.
    client_stall_s: float = Field(default=60.0, gt=0)

    @model_validator(mode="after")
    def _listen(self) -> _Listener:
        host, _, port = self.listen.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"listen must be HOST:PORT, got {self.listen!r}")
        return self

    @property
    def host(self) -> str:
        return self.listen.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.listen.rpartition(":")[2])


class ApiConfig(_Listener):
    listen: str = "127.0.0.1:8377"
    unix_socket: PathValue | None = None
    token_file: PathValue | None = None
    allow_public_bind: bool = False
    max_body_bytes: Bytes = ByteSize(64 * 1024)
    lease_ttl_s: float = Field(default=600.0, gt=0)


class ProxyConfig(_Listener):
    """The OpenAI-compatible proxy listener (llama-server's own API, session-pinned)."""

    enabled: bool = False
    listen: str = "127.0.0.1:8378"
    server: str = "local"  # the llama-server it forwards to
    provider: str | None = None  # provider name used for acquire (default: the first routed to `server`)
    session_header: str = "X-Session-Id"
    session_field: str | None = None  # or a body field, e.g. "user" or "prompt_cache_key"
    max_body_bytes: Bytes = ByteSize(32 * 2**20)
    body_timeout_s: float = Field(default=120.0, gt=0)  # bodies here run to megabytes
    upstream_timeout_s: float = Field(default=600.0, gt=0)


class LoggingConfig(_Model):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["text", "json"] = "text"


class Config(_Model):
    enabled: bool = True
    servers: dict[str, ServerConfig] = Field(default_factory=lambda: {"local": ServerConfig()})
    # provider -> server name. Providers not listed here pass through untouched (spec §37).
    routes: dict[str, str] = Field(default_factory=lambda: {"local": "local"})
    state_dir: PathValue = Path("~/.local/state/kvsidecar/state").expanduser()
    checkpoint: CheckpointConfig = CheckpointConfig()
    restore: RestoreConfig = RestoreConfig()
    failure: FailureConfig = FailureConfig()
    retention: RetentionConfig = RetentionConfig()
    api: ApiConfig = ApiConfig()
    proxy: ProxyConfig = ProxyConfig()
    logging: LoggingConfig = LoggingConfig()
    # Removed keys the file still set (see REMOVED_KEYS): not a field, so never dumped as a setting.
    _ignored: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="after")
    def _routes(self) -> Config:
        if not self.servers:
            raise ValueError("servers: at least one server is required")
        for provider, server in self.routes.items():
            if server not in self.servers:
                raise ValueError(
                    f"routes.{provider}: unknown server {server!r} (known: {sorted(self.servers)})"
                )
        if self.proxy.enabled and self.proxy.server not in self.servers:
            raise ValueError(
                f"proxy.server: unknown server {self.proxy.server!r} (known: {sorted(self.servers)})"
            )
        chosen = self.proxy.provider
        if self.proxy.enabled and chosen is not None and self.routes.get(chosen) != self.proxy.server:
            # its leases would name slots of another server than the one the proxy forwards to
            raise ValueError(
                f"proxy.provider: {chosen!r} must be routed to proxy.server {self.proxy.server!r} "
                f"(routes.{chosen}: {self.routes.get(chosen)!r})"
            )
        if (
            self.proxy.enabled
            and self.servers[self.proxy.server].api_key_file is not None
            and self.api.token_file is None
        ):
            # The proxy adds llama-server's key to what it forwards: without a token of our own, any
            # local process would get llama-server's protection switched off for it.
            raise ValueError(
                f"api.token_file: required when the proxy forwards to a server with an api_key_file "
                f"(servers.{self.proxy.server}.api_key_file); set api.token_file (or KVSIDECAR_TOKEN_FILE) "
                "so that only clients holding kvsidecar's token get llama-server's key added"
            )
        return self

    def proxy_provider(self) -> str | None:
        """The provider name proxied requests are acquired under."""
        if self.proxy.provider is not None:
            return self.proxy.provider
        return next((p for p, s in self.routes.items() if s == self.proxy.server), None)

    def server_for(self, provider: str) -> str | None:
        return self.routes.get(provider)

    @property
    def ignored_keys(self) -> tuple[str, ...]:
        """Removed keys (REMOVED_KEYS) the config file still sets."""
        return self._ignored

    def deprecations(self) -> list[str]:
        """One line per removed key the config file still sets (logged at startup and reload)."""
        return [
            f"{key} is no longer a setting and is ignored ({REMOVED_KEYS[key]}); remove it from the file"
            for key in self._ignored
        ]


# Keys that were once accepted and no longer mean anything. A file that still sets one loads (the shipped
# config.yaml had `restore.verify: true`, so an upgrade must not stop the daemon), with a warning naming it;
# any other unknown key is an error.
REMOVED_KEYS: dict[str, str] = {
    "restore.verify": "it was never read; the engine's reuse is checked after every restore, against "
    "restore.min_reuse_ratio",
    "auxiliary_requests": "requests without a session id are always isolated; it had no other value",
}


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


def _format_error(exc: ValidationError) -> str:
    err = exc.errors()[0]
    loc = ".".join(str(p) for p in err["loc"])
    msg = err["msg"].removeprefix("Value error, ")
    if not loc:  # a model-level check already names its key at the start of the message
        loc, _, msg = msg.partition(": ") if ": " in msg else ("(top level)", "", msg)
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{loc}: {msg}{more}"


def config_from_mapping(data: dict[str, Any]) -> Config:
    data, ignored = _strip_removed(data)
    try:
        config = Config.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(_format_error(exc), hint="Fix the key named above in the config file.") from None
    config._ignored = ignored
    return config


def load_config(path: Path | str | None = None, *, env: dict[str, str] | None = None) -> Config:
    """Read, override from the environment, validate. `path=None` means $KVSIDECAR_CONFIG or the default."""
    environ = os.environ if env is None else env
    chosen = Path(path) if path is not None else Path(environ.get("KVSIDECAR_CONFIG", DEFAULT_CONFIG_PATH))
    data: dict[str, Any] = {}
    if chosen.exists():
        try:
            loaded = yaml.safe_load(chosen.read_text(encoding="utf-8"))
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" at line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"{chosen}: not valid YAML{where}") from None
        except OSError as exc:
            raise ConfigError(f"{chosen}: cannot read ({exc.strerror})") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"{chosen}: the top level must be a mapping of keys")
        data = loaded
    elif path is not None or "KVSIDECAR_CONFIG" in environ:
        raise ConfigError(f"{chosen}: no such config file")
    if token_file := environ.get("KVSIDECAR_TOKEN_FILE"):
        data = {**data, "api": {**(data.get("api") or {}), "token_file": token_file}}
    if state_dir := environ.get("KVSIDECAR_STATE_DIR"):
        data = {**data, "state_dir": state_dir}
    return config_from_mapping(data)
