"""What the daemon's listeners need before anything binds: the API token (`api.token_file`), the sockets
(loopback TCP with TCP_NODELAY, the 0600 unix socket, the proxy's), and a file-descriptor budget that their
connection caps cannot exhaust. `serve()` (kvsidecar.daemon.service) uses all three; the CLI reads the
token to talk to the daemon."""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import socket
from pathlib import Path
from typing import Literal

from kvsidecar.config import Config
from kvsidecar.config.errors import ConfigInvalid
from kvsidecar.errors import ConfigError, ListenInUse


def read_token(config: Config) -> str | None:
    path = config.api.token_file
    if path is None:
        return None
    try:
        token = Path(path).read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise ConfigError(f"api.token_file: cannot read {path} ({exc.strerror})") from None
    if len(token) < 16:
        raise ConfigError("api.token_file: the token must be at least 16 characters")
    return token


def tcp_socket(what: str, host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    tcp = socket.socket(family, socket.SOCK_STREAM)
    tcp.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted connections inherit this: a hook answer must not wait for the client's delayed ACK (~40 ms).
    tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        tcp.bind((host, port))
    except OSError as exc:
        tcp.close()
        if exc.errno == errno.EADDRINUSE:
            raise ListenInUse(f"{what}: {host}:{port} is already in use ({exc.strerror})") from None
        raise ConfigError(f"{what}: cannot bind {host}:{port} ({exc.strerror})") from None
    return tcp


def check_bind(config: Config, section: Literal["api", "proxy"]) -> None:
    # The config model refuses these already (so `config check` fails as serve does); a Config built
    # without validation (model_construct) still cannot open a public listener.
    if problems := config.bind_problems(section):
        raise ConfigInvalid(problems)


def listen_sockets(config: Config) -> list[socket.socket]:
    api = config.api
    check_bind(config, "api")
    socks = [tcp_socket("api.listen", api.host, api.port)]
    if api.unix_socket is not None:
        path = Path(api.unix_socket)
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        uds = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            uds.bind(str(path))
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        socks.append(uds)
    return socks


# Descriptors kept free for everything that is not a client connection: snapshot files, the state
# directory, the watcher, connections to llama-server made by the backend, logging.
FD_RESERVE = 128


def ensure_fd_budget(config: Config) -> int:
    """Raise the soft RLIMIT_NOFILE as far as the hard limit allows, and refuse to start when the
    listeners' connection caps could still exhaust it (a full table fails every accept, /healthz too)."""
    need = config.api.max_connections + FD_RESERVE
    if config.proxy.enabled:
        need += 2 * config.proxy.max_connections  # each proxied request also holds an upstream connection
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < need:
        target = need if hard == resource.RLIM_INFINITY else min(max(need, 65536), hard)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft != resource.RLIM_INFINITY and soft < need:
        raise ConfigError(
            f"api.max_connections: the listeners may hold {need} file descriptors but the limit is {soft}",
            hint="Raise LimitNOFILE (the unit sets 65536) or lower api/proxy.max_connections.",
        )
    return int(soft)
