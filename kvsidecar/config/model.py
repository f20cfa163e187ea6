"""The top-level `Config`: every section, its defaults, and the checks that span keys (routes to unknown
servers, the proxy's wiring, a listener beyond loopback, the fleet's addresses and shared directory), made
part of the model so that `config check` refuses exactly what `serve` would. It also owns the list of
removed keys (`REMOVED_KEYS`) a file may still set, and the sections a reload cannot apply
(`RESTART_ONLY`)."""

from __future__ import annotations

import os
from typing import Literal

from pydantic import Field, PrivateAttr, model_validator

from kvsidecar.config.fleet import FleetConfig
from kvsidecar.config.network import ApiConfig, Listener, ProxyConfig, http_origin, is_loopback
from kvsidecar.config.sections import (
    CheckpointConfig,
    FailureConfig,
    LoggingConfig,
    RestoreConfig,
    RetentionConfig,
)
from kvsidecar.config.servers import ServerConfig
from kvsidecar.config.values import PathValue, Section, home_path
from kvsidecar.units.checks import overlaps

# The sections a reload (SIGHUP) cannot apply: they shape the listeners, routes, stores and clients built
# once at start, so a change keeps its running value until a restart. Everything else applies live.
RESTART_ONLY: tuple[str, ...] = ("servers", "routes", "state_dir", "api", "proxy", "fleet")


class Config(Section):
    enabled: bool = True
    servers: dict[str, ServerConfig] = Field(default_factory=lambda: {"local": ServerConfig()})
    # provider -> server name. Providers not listed here pass through untouched (spec §37).
    routes: dict[str, str] = Field(default_factory=lambda: {"local": "local"})
    state_dir: PathValue = home_path("~/.local/state/kvsidecar/state")
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
        out += self._router_problems()
        out += self.bind_problems("api")
        if self.proxy.enabled:
            out += self._proxy_problems(known) + self.bind_problems("proxy")
        if self.fleet.enabled:
            out += self.fleet.problems() + self._advertise_problems()
        return out

    def _router_problems(self) -> list[str]:
        """The models of a router share its address, one entry per model, and no entry without a model
        may claim the router's slots."""
        out: list[str] = []
        by_url: dict[str, list[tuple[str, ServerConfig]]] = {}
        for name, server in self.servers.items():
            by_url.setdefault(server.base_url.rstrip("/"), []).append((name, server))
        for url, entries in by_url.items():
            if len(entries) < 2:
                continue
            names = ", ".join(n for n, _ in entries)
            discovering = [n for n, s in entries if s.discover_models]
            models = [s.model for _, s in entries if not s.discover_models]
            if not discovering and all(m is None for m in models):
                continue  # not a router's (two entries on one llama-server are the operator's to avoid)
            if len(discovering) > 1:
                out.append(f"servers: {names} share base_url {url}: one entry at most discovers its models")
            if None in models:
                out.append(
                    f"servers: {names} share base_url {url}: only the models of a router may (set `model` "
                    "on each)"
                )
            elif len(set(models)) != len(models):
                out.append(f"servers: {names} name the same model of the router at {url}")
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
        listener: Listener = self.api if section == "api" else self.proxy
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

    def server_for(self, provider: str, model: str | None = None) -> str | None:
        """The server a provider's call runs on. A provider routed to a model of a router goes by `model`
        (the router runs each call on the model it names): the entry of that model on the same router, or
        None (a model no entry names: a discovered model's runtime, if any, else unmanaged: its calls pass
        through untouched)."""
        name = self.routes.get(provider)
        routed = self.servers.get(name) if name is not None else None
        if routed is None or (routed.model is None and not routed.discover_models) or model is None:
            return name
        url = routed.base_url.rstrip("/")
        for other, server in self.servers.items():
            if server.model == model and server.base_url.rstrip("/") == url:
                return other
        return None

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
