"""Configuration: one YAML file, validated by pydantic into frozen, keyword-only objects.

Defaults live here and nowhere else. `load_config()` is the only entry point; any problem with the file
raises `ConfigError` (`ConfigInvalid` carries every problem, each starting with its dotted key:
`servers.local.base_url: ...`), never a traceback. Checks that span keys (routes, the proxy's wiring, a
listener beyond loopback) are part of the model, so `config check` refuses what `serve` would.
Environment overrides (for the few things operators change): `KVSIDECAR_CONFIG` (the file),
`KVSIDECAR_TOKEN_FILE` (api.token_file), `KVSIDECAR_STATE_DIR` (state_dir).
"""

from __future__ import annotations

import copy
import ipaddress
import os
import re
import socket
from collections.abc import Mapping
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ByteSize,
    ConfigDict,
    Field,
    GetJsonSchemaHandler,
    PrivateAttr,
    ValidationError,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue

from kvsidecar.config.errors import ConfigInvalid, config_problems
from kvsidecar.config.file import read_mapping
from kvsidecar.units.checks import overlaps

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
    if isinstance(value, str | Path):
        return Path(os.path.expandvars(os.path.expanduser(str(value))))
    return value


# The JSON Schema of a size: what size_spelling() takes, as an ECMA-262 pattern (for editors).
_SIZE_SCHEMA: JsonSchemaValue = {
    "anyOf": [
        {"type": "integer", "minimum": 0},
        {"type": "string", "pattern": r"^\s*\d+(\.\d+)?\s*([KMGTPEkmgtpe][Ii]?[Bb]?|[Bb])?\s*$"},
    ]
}


class _SizeJsonSchema:
    """Annotated metadata: the schema above, a fresh copy each time (pydantic 2.6 edits what it is given)."""

    def __get_pydantic_json_schema__(self, _core: Any, _handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return copy.deepcopy(_SIZE_SCHEMA)


Bytes = Annotated[ByteSize, BeforeValidator(size_spelling), Field(ge=0), _SizeJsonSchema()]
PathValue = Annotated[Path, BeforeValidator(expand_path)]


def _home_path(text: str) -> Any:
    """A default under ~: expanded when a config is built, shown as written in the JSON Schema."""
    return Field(default=Path(text), validate_default=True)


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Mode(StrEnum):
    SINGLE_SLOT = "single-slot"
    MANAGED_SLOTS = "managed-slots"


def _http_url(value: str) -> str:
    if not re.match(r"^https?://[^/\s]+", value):
        raise ValueError(f"must be an http(s) URL, got {value!r}")
    return value


BaseUrl = Annotated[str, AfterValidator(_http_url)]


class ServerConfig(_Model):
    """One llama-server and the directory it saves slots into (its --slot-save-path)."""

    base_url: BaseUrl = "http://127.0.0.1:8080"
    api_key_file: PathValue | None = None
    snapshot_dir: PathValue = _home_path("~/.local/state/kvsidecar/snapshots")
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
    # one starts only when no other slot of that server is working; true trades that stall in the other
    # slots' streams for more switches that find their slot clean.
    clean_ahead_while_busy: bool = False
    # Crash safety (issue 26): how stale a resident session's newest saved generation may get, in seconds
    # since its first unsaved turn and in turns (0 disables a bound; both 0: none of this, as before). Past a
    # bound the session is saved in the background at the next idle moment of its server (no slot working,
    # nobody waiting), even when the cost model predicts its next request may wait for it; before that it
    # is saved only when the save is predicted to end before its next request and is worth it (checkpoint.py
    # `protect`).
    max_unsaved_s: float = Field(default=300.0, ge=0)
    max_unsaved_turns: int = Field(default=0, ge=0)


class RestoreConfig(_Model):
    enabled: bool = True
    verify_checksum: bool = True
    # A restore after which the engine reused less than this share of the restored tokens is "ineffective".
    min_reuse_ratio: float = Field(default=0.5, ge=0, le=1)
    # After a llama.cpp upgrade, carry a session's snapshot over to the new build when the build is all that
    # changed and the new build is proven to compute bit-identical KV (docs/FINGERPRINT.md, issue 29).
    carry_over_builds: bool = True
    # Issue 28: a cold session starts from the KV another session of the same credential scope left in the
    # slot (no erase), or from that session's snapshot (the acquire's `prefix_from` hint). The engine reuses
    # only an exact token prefix, so this changes speed, never an answer; off: every cold start erases its
    # slot and the hint is ignored (no prefix timing can be observed across sessions). docs/CLIENTS.md
    share_prefix: bool = True


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


def _listen_address(value: str) -> str:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"must be HOST:PORT, got {value!r}")
    return value


ListenAddress = Annotated[str, AfterValidator(_listen_address)]


def is_loopback(host: str) -> bool:
    """A loopback host name or address (no port, no brackets)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _Listener(_Model):
    """A config section with a `listen: HOST:PORT` address, and the limits every connection to it has."""

    listen: ListenAddress
    # Open connections at most; at the cap, the oldest one still waiting for a request head is dropped
    # to make room, and when every one is busy with a request the newcomer is refused.
    max_connections: int = Field(default=256, ge=1, le=100_000)
    # A request head must arrive within this (from the connect, or from the end of the previous answer).
    header_timeout_s: float = Field(default=10.0, gt=0)
    # A request body must arrive within this once its head is in.
    body_timeout_s: float = Field(default=30.0, gt=0)
    # A client that does not take the answer (nothing drained) for this long is cut.
    client_stall_s: float = Field(default=60.0, gt=0)
    # Request bodies still arriving `slow_body_s` after their head, per credential (the bearer token; one
    # bucket for requests without it): one more is answered 429 KV_TOO_MANY_BODIES and closed.
    max_slow_bodies: int = Field(default=32, ge=1, le=100_000)
    slow_body_s: float = Field(default=1.0, gt=0)

    @property
    def host(self) -> str:
        return self.listen.rpartition(":")[0].strip("[]")

    @property
    def port(self) -> int:
        return int(self.listen.rpartition(":")[2])


class ApiConfig(_Listener):
    listen: ListenAddress = "127.0.0.1:8377"
    unix_socket: PathValue | None = None
    token_file: PathValue | None = None
    allow_public_bind: bool = False
    max_body_bytes: Bytes = ByteSize(64 * 1024)
    lease_ttl_s: float = Field(default=600.0, gt=0)
    # A lease not yet seen in use (no model call on its slot, no renewal) ends this long after its grant
    # instead of after lease_ttl_s: nobody holds it (its caller left as it was granted). Issue 26 C.
    lease_claim_ttl_s: float = Field(default=30.0, gt=0)


class ProxyConfig(_Listener):
    """The OpenAI-compatible proxy listener (llama-server's own API, session-pinned)."""

    enabled: bool = False
    listen: ListenAddress = "127.0.0.1:8378"
    server: str = "local"  # the llama-server it forwards to
    provider: str | None = None  # provider name used for acquire (default: the first routed to `server`)
    session_header: str = "X-Session-Id"
    session_field: str | None = None  # or a body field, e.g. "user" or "prompt_cache_key"
    # What names a session's KV: the session id and the request's `model` string (two model strings are two
    # sessions), or the session id alone (for clients that vary `model`; llama-server runs its own model).
    identity: Literal["session+model", "session"] = "session+model"
    # Issue 28: a request that names no session (aider, curl, the openai SDK) continues the conversation of
    # the same credential whose messages it extends (a content-derived id, digests only); off: it runs as an
    # auxiliary request, as before. docs/CLIENTS.md
    content_identity: bool = True
    max_body_bytes: Bytes = ByteSize(32 * 2**20)
    body_timeout_s: float = Field(default=120.0, gt=0)  # bodies here run to megabytes
    upstream_timeout_s: float = Field(default=600.0, gt=0)


HOST_ID = re.compile(r"\A[A-Za-z0-9._-]{1,64}\Z")  # it names Redis keys: no separators, no spaces
# An origin and nothing else: http(s), a host (a name, an IPv4 or a bracketed IPv6 literal), an explicit
# port, at most a lone "/" (no path, query, fragment, userinfo, escapes, spaces or controls).
_ORIGIN = re.compile(
    r"\A(https?)://(?:\[([0-9A-Fa-f:.]{2,45})\]|([A-Za-z0-9](?:[A-Za-z0-9.-]{0,251}[A-Za-z0-9])?))"
    r":([0-9]{1,5})/?\Z"
)


def http_origin(value: object) -> str | None:
    """`scheme://host:port` (lower-cased host) when `value` is exactly an http(s) origin, else None.

    Fleet mode builds every URL it sends to from such an origin and a path of its own: a host record (a
    Redis value, input like any other) can name where a host is, never what is asked of it there."""
    if not isinstance(value, str) or len(value) > 300:
        return None
    m = _ORIGIN.match(value)
    if m is None:
        return None
    scheme, v6, name, port = m.groups()
    if not 0 < int(port) < 65536 or port.startswith("0"):
        return None
    if v6 is not None:
        try:
            host = f"[{ipaddress.IPv6Address(v6).compressed}]"
        except ValueError:
            return None
    else:
        host = name.lower()
        labels = host.split(".")
        if any(
            not label or len(label) > 63 or label.startswith("-") or label.endswith("-") for label in labels
        ):
            return None
        if all(label.isdigit() for label in labels):  # dotted digits: an IPv4 address, canonical only
            try:
                if str(ipaddress.IPv4Address(host)) != host:
                    return None
            except ValueError:
                return None
    return f"{scheme}://{host}:{int(port)}"


_REDIS_URL = re.compile(r"\A(?:rediss?://[^/\s]+(?:/\d{1,5})?/?|unix:///\S+)\Z")


def _host_id(value: str) -> str:
    if not HOST_ID.match(value):
        raise ValueError("must be 1-64 characters of A-Z a-z 0-9 . _ -")
    return value


def _redis_url(value: str) -> str:
    # The value is never echoed: it may carry a password.
    if not _REDIS_URL.match(value):
        raise ValueError("must be redis://[user:password@]host[:port][/db], rediss://... or unix:///path")
    return value


class FleetConfig(_Model):
    """Fleet mode (docs/FLEET.md): several hosts share a snapshot filesystem, coordinated through Redis.
    Off by default; then nothing of it is imported or started."""

    enabled: bool = False
    # Credentials in it are never logged or shown (kvsidecar.fleet.redacted).
    redis_url: Annotated[str, AfterValidator(_redis_url)] = Field(
        default="redis://127.0.0.1:6379/0", repr=False
    )
    host_id: Annotated[str, AfterValidator(_host_id)] | None = None  # null: this machine's hostname
    # This kvsidecar's hook API as the other hosts reach it (null: http://<api.listen>)
    advertise_url: BaseUrl | None = None
    # This kvsidecar's proxy listener as the other hosts reach it (null: http://<proxy.listen>)
    advertise_proxy_url: BaseUrl | None = None
    key_prefix: Annotated[str, AfterValidator(_host_id)] = "kvsidecar"  # two fleets may share a Redis
    heartbeat_s: float = Field(default=2.0, gt=0)
    host_ttl_s: float = Field(default=6.0, gt=0)  # a host whose record is older than this is gone
    owner_lease_ttl_s: float = Field(default=30.0, gt=0)
    # The directory on the shared filesystem for manifests, fingerprints and fence files (one copy for the
    # whole fleet; every host mounts it at the same path). Required when enabled.
    shared_dir: PathValue | None = None
    # Seconds a hook call forwarded to another host may take (it may wait for a slot and a restore).
    forward_timeout_s: float = Field(default=600.0, gt=0)

    def problems(self) -> list[str]:
        out = []
        if self.enabled and self.shared_dir is None:
            out.append("fleet.shared_dir: required when fleet.enabled (a directory on the shared filesystem)")
        if self.host_ttl_s <= self.heartbeat_s:
            out.append("fleet.host_ttl_s: must be longer than fleet.heartbeat_s (a live host would expire)")
        if self.owner_lease_ttl_s <= self.heartbeat_s:
            out.append("fleet.owner_lease_ttl_s: must be longer than fleet.heartbeat_s")
        if self.host_id is None and not HOST_ID.match(socket.gethostname()):
            out.append("fleet.host_id: this machine's hostname is not a valid host id; set one")
        return out

    def metadata_dir(self) -> Path | None:
        """Where the store keeps manifests, fingerprints and fences: the shared directory in fleet mode."""
        return self.shared_dir if self.enabled else None

    def effective_host_id(self) -> str:
        return self.host_id if self.host_id is not None else socket.gethostname()


class LoggingConfig(_Model):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["text", "json"] = "text"


class Config(_Model):
    enabled: bool = True
    servers: dict[str, ServerConfig] = Field(default_factory=lambda: {"local": ServerConfig()})
    # provider -> server name. Providers not listed here pass through untouched (spec §37).
    routes: dict[str, str] = Field(default_factory=lambda: {"local": "local"})
    state_dir: PathValue = _home_path("~/.local/state/kvsidecar/state")
    checkpoint: CheckpointConfig = CheckpointConfig()
    restore: RestoreConfig = RestoreConfig()
    failure: FailureConfig = FailureConfig()
    retention: RetentionConfig = RetentionConfig()
    api: ApiConfig = ApiConfig()
    proxy: ProxyConfig = ProxyConfig()
    logging: LoggingConfig = LoggingConfig()
    fleet: FleetConfig = FleetConfig()
    # Removed keys the file still set (see REMOVED_KEYS): not a field, so never dumped as a setting.
    _ignored: tuple[str, ...] = PrivateAttr(default=())

    @model_validator(mode="after")
    def _consistent(self) -> Config:
        # Every problem at once, one per line, each starting with its dotted key (split by _problems()).
        problems = self.cross_key_problems()
        if problems:
            raise ValueError("\n".join(problems))
        return self

    def cross_key_problems(self) -> list[str]:
        """What no single key shows: routes to unknown servers, the proxy's wiring, and every listener
        `serve` would refuse to open (checked here so that `config check` fails exactly as `serve` does)."""
        out: list[str] = []
        if not self.servers:
            out.append("servers: at least one server is required")
        known = sorted(self.servers)
        out += [
            f"routes.{provider}: unknown server {server!r} (known: {known})"
            for provider, server in self.routes.items()
            if server not in self.servers
        ]
        out += self.bind_problems("api")
        if self.proxy.enabled:
            out += self._proxy_problems(known) + self.bind_problems("proxy")
        if self.fleet.enabled:
            out += self.fleet.problems() + self._advertise_problems()
        return out

    def _advertise_problems(self) -> list[str]:
        out = []
        host = self.api.host
        if self.fleet.advertise_url is None and host in ("0.0.0.0", "::", ""):
            out.append(f"fleet.advertise_url: required when api.listen is the wildcard {host!r}")
        proxy_host = self.proxy.host
        wild = proxy_host in ("0.0.0.0", "::", "")
        if self.proxy.enabled and self.fleet.advertise_proxy_url is None and wild:
            out.append(
                f"fleet.advertise_proxy_url: required when proxy.listen is the wildcard {proxy_host!r}"
            )
        if self.fleet.enabled:
            advertised = [("fleet.advertise_url", self.advertise_url())]
            if self.proxy.enabled:
                advertised.append(("fleet.advertise_proxy_url", self.advertise_proxy_url() or ""))
            for key, url in advertised:
                if http_origin(url) is None:
                    out.append(
                        f"{key}: must be an origin only, http(s)://HOST:PORT with an explicit port and no "
                        "path, query or userinfo (the other hosts refuse anything else)"
                    )
        shared = self.fleet.shared_dir
        if shared is not None:
            others = [("state_dir", self.state_dir)]
            others += [(f"servers.{n}.snapshot_dir", s.snapshot_dir) for n, s in self.servers.items()]
            for key, path in others:
                if overlaps(os.path.abspath(shared), os.path.abspath(path)):
                    out.append(f"fleet.shared_dir: must be apart from {key} (neither inside the other)")
        return out

    def advertise_url(self) -> str:
        """The hook API as the fleet's other hosts reach it."""
        if self.fleet.advertise_url is not None:
            return self.fleet.advertise_url
        host = self.api.host
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.api.port}"

    def advertise_proxy_url(self) -> str | None:
        """The proxy listener as the fleet's other hosts reach it (None: no proxy here)."""
        if not self.proxy.enabled:
            return None
        if self.fleet.advertise_proxy_url is not None:
            return self.fleet.advertise_proxy_url
        host = self.proxy.host
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.proxy.port}"

    def _proxy_problems(self, known: list[str]) -> list[str]:
        proxy = self.proxy
        if proxy.server not in self.servers:
            return [f"proxy.server: unknown server {proxy.server!r} (known: {known})"]
        out = []
        chosen = proxy.provider
        if chosen is not None and self.routes.get(chosen) != proxy.server:
            # its leases would name slots of another server than the one the proxy forwards to
            out.append(
                f"proxy.provider: {chosen!r} must be routed to proxy.server {proxy.server!r} "
                f"(routes.{chosen}: {self.routes.get(chosen)!r})"
            )
        if self.servers[proxy.server].api_key_file is not None and self.api.token_file is None:
            # The proxy adds llama-server's key to what it forwards: without a token of our own, any
            # local process would get llama-server's protection switched off for it.
            out.append(
                f"api.token_file: required when the proxy forwards to a server with an api_key_file "
                f"(servers.{proxy.server}.api_key_file); set api.token_file (or KVSIDECAR_TOKEN_FILE) "
                "so that only clients holding kvsidecar's token get llama-server's key added"
            )
        return out

    def bind_problems(self, section: Literal["api", "proxy"]) -> list[str]:
        """Why `serve` would refuse to open that listener (beyond loopback without the flag and a token)."""
        listener: _Listener = self.api if section == "api" else self.proxy
        if is_loopback(listener.host):
            return []
        if not self.api.allow_public_bind:
            return [
                f"{section}.listen: refusing to listen on non-loopback {listener.host}; set "
                "api.allow_public_bind: true (and api.token_file) if you really mean it"
            ]
        if self.api.token_file is None:
            return [f"api.token_file: a token is required when {section}.listen is beyond loopback"]
        return []

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
    """Where a config file is looked for when none is named (-c, $KVSIDECAR_CONFIG): the user's
    ($XDG_CONFIG_HOME or ~/.config)/kvsidecar/config.yaml, then /etc/kvsidecar/config.yaml."""
    base = env.get("XDG_CONFIG_HOME") or (f"{env['HOME']}/.config" if env.get("HOME") else "")
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
