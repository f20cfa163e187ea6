"""`kvsidecar install-systemd`: render the two units (kvsidecar.units) for this config, after checking
(kvsidecar.units.checks) that every path they use means the same inside their sandbox.

Paths given on the command line are made absolute (a bare executable name is looked up on PATH). Paths
from the config are the daemon's to resolve, so they are checked as the file writes them: one written with
a leading '~' or a '$VARIABLE' (the daemon expands them with its own user's home and environment), a
relative one, a '..', a path or name systemd would split or expand, a state directory overlapping a
snapshot directory, or a unix socket whose directory cannot be made writable is refused. So is a
--config-path that is not an existing regular file, and a token or key file that exists but is not one.
So is a path the sandbox hides (PrivateTmp=yes: /tmp, /var/tmp, /dev/shm are private per unit;
ProtectHome=yes: /home, /root, /run/user are absent), unless --force. Each is reported
with a stable reason; with any, nothing is written and the command fails with KV_UNIT_PATH_UNSAFE
(exit 2). The units are written atomically and never through a link (a masked unit is an error).
"""

from __future__ import annotations

import argparse
import math
import os
import shlex
import shutil
import sys
from pathlib import Path
from typing import TypeAlias
from urllib.parse import urlsplit

from pydantic import BaseModel

from kvsidecar.config import (
    ApiConfig,
    Config,
    FleetConfig,
    ServerConfig,
    find_config,
    is_loopback,
    load_config,
)
from kvsidecar.config.file import read_mapping
from kvsidecar.errors import UnitPathUnsafe
from kvsidecar.files.atomic import atomic_write_bytes
from kvsidecar.units import SNAPSHOT_MODE, STATE_MODE, UNITS, UnitParams, render, state_directory
from kvsidecar.units.checks import (
    FORCEABLE,
    PathProblem,
    file_problems,
    form_problems,
    hidden_problems,
    literal_problems,
    nested_problems,
    socket_directory,
    syntax_problems,
)

SOCKET_DIR_MODE = "0750"
UNIT_MODE = 0o644


def _config_paths(config: Config) -> dict[str, str]:
    """Every path the config hands the daemon, which resolves them itself."""
    paths = {"state_dir": str(config.state_dir)}
    for name, server in config.servers.items():
        paths[f"servers.{name}.snapshot_dir"] = str(server.snapshot_dir)
        if server.api_key_file is not None:
            paths[f"servers.{name}.api_key_file"] = str(server.api_key_file)
    for key in ("token_file", "unix_socket"):
        if (value := getattr(config.api, key)) is not None:
            paths[f"api.{key}"] = str(value)
    if (shared := config.fleet.metadata_dir()) is not None:
        paths["fleet.shared_dir"] = str(shared)
    return paths


def _written(section: object, key: str, model: type[BaseModel]) -> str:
    value = section.get(key) if isinstance(section, dict) else None
    return str(model.model_fields[key].default if value is None else value)


def _written_paths(config_file: Path | None, config: Config) -> dict[str, str]:
    """The paths of `_config_paths` as the file writes them, or as the model's default is written when it
    sets none: before `~` and `$VAR` are expanded, which the daemon does itself under systemd (another
    user, another environment). Overrides from this shell's environment never reach the unit either."""
    data = read_mapping(config_file) if config_file is not None else {}
    servers, api = data.get("servers"), data.get("api")
    written = {"state_dir": _written(data, "state_dir", Config)}
    for name in config.servers:
        section = servers.get(name) if isinstance(servers, dict) else None
        for key in ("snapshot_dir", "api_key_file"):
            written[f"servers.{name}.{key}"] = _written(section, key, ServerConfig)
    for key in ("token_file", "unix_socket"):
        written[f"api.{key}"] = _written(api, key, ApiConfig)
    written["fleet.shared_dir"] = _written(data.get("fleet"), "shared_dir", FleetConfig)
    return {what: written[what] for what in _config_paths(config)}


def _loopback_only(config: Config) -> bool:
    hosts = [config.api.host, *(urlsplit(s.base_url).hostname or "" for s in config.servers.values())]
    if config.proxy.enabled:
        hosts.append(config.proxy.host)
    return all(is_loopback(h) for h in hosts)


def _executable(value: str, what: str, problems: list[PathProblem]) -> str:
    """An absolute path: a bare name is looked up on PATH, a relative path made absolute."""
    if "/" not in value:
        found = shutil.which(value)
        if found is None:
            problems.append(PathProblem("NOT_FOUND", what, value))
            return value
        value = found
    return os.path.abspath(value)


def _snapshot_dirs(config: Config) -> dict[str, str]:
    return {f"servers.{name}.snapshot_dir": str(s.snapshot_dir) for name, s in config.servers.items()}


def _kv_dirs(config: Config) -> dict[str, str]:
    """Every directory kvsidecar writes besides state_dir: the snapshot directories and, in fleet mode, the
    shared metadata directory (fleet.shared_dir)."""
    shared = config.fleet.metadata_dir()
    return _snapshot_dirs(config) | ({"fleet.shared_dir": str(shared)} if shared is not None else {})


def unit_params(args: argparse.Namespace, config: Config, problems: list[PathProblem]) -> UnitParams:
    """The units' values, every path absolute; what cannot be made so is added to problems."""
    server_name, server = next(iter(config.servers.items()))
    default_exe = shutil.which("kvsidecar") or str(Path(sys.executable).with_name("kvsidecar"))
    config_path = args.config_path or find_config(args.config).path or "/etc/kvsidecar/config.yaml"
    snapshots = list(dict.fromkeys(_kv_dirs(config).values()))
    writable = snapshots[1:]
    if config.api.unix_socket is not None and str(config.api.unix_socket).startswith("/"):
        directory, problem = socket_directory(
            str(config.api.unix_socket), [str(config.state_dir), *snapshots]
        )
        writable += [directory] if directory else []
        problems += [problem] if problem else []
    return UnitParams(
        user=args.user,
        llama_user=args.llama_user,
        group=args.group,
        kvsidecar=_executable(args.kvsidecar or default_exe, "--kvsidecar", problems),
        config=str(Path(config_path).resolve()),
        state_dir=str(config.state_dir),
        snapshot_dir=str(server.snapshot_dir),
        llama_server=_executable(args.llama_server, "--llama-server", problems),
        model=os.path.abspath(args.model),
        llama_port=urlsplit(server.base_url).port or 8080,
        stop_timeout_s=int(config.checkpoint.shutdown_timeout_s + 30),
        server=server_name,
        checkpoint_timeout_s=max(1, math.ceil(config.checkpoint.shutdown_timeout_s)),
        loopback_only=_loopback_only(config),
        kv_writable=tuple(writable),
    )


def check(config: Config, params: UnitParams, written: dict[str, str]) -> list[PathProblem]:
    """Every problem, each path once: one written with '~'/'$' or malformed is not looked at further."""
    config_paths = _config_paths(config)
    literal = literal_problems(written)
    not_literal = {p.what for p in literal}
    form = literal + form_problems({k: v for k, v in config_paths.items() if k not in not_literal})
    malformed = {p.what for p in form}
    well_formed = {k: v for k, v in config_paths.items() if k not in malformed}
    snapshots = {k: v for k, v in _kv_dirs(config).items() if k not in malformed}
    nested = nested_problems(params.state_dir, snapshots) if "state_dir" not in malformed else []
    given = {
        "--kvsidecar": params.kvsidecar,
        "--config-path": params.config,
        "--llama-server": params.llama_server,
        "--model": params.model,
    }
    rendered = {**given, "state_dir": params.state_dir, **_kv_dirs(config)}
    rendered = {k: v for k, v in rendered.items() if k not in not_literal}
    rendered |= {f"ReadWritePaths= {p}": p for p in params.kv_writable}
    names = {"--user": params.user, "--llama-user": params.llama_user, "--group": params.group}
    names["servers (its ExecStop's --server)"] = params.server
    hidden = hidden_problems({**well_formed, **{k: v for k, v in given.items() if v.startswith("/")}})
    read = {k: v for k, v in well_formed.items() if k.endswith(("token_file", "api_key_file"))}
    files = file_problems({"--config-path": params.config, **read}, must_exist=frozenset({"--config-path"}))
    return form + syntax_problems(rendered, names) + nested + hidden + files


def _mkdir(path: str, owner: str, mode: str) -> str:
    q = shlex.quote(path)
    return f"mkdir -p {q}; chown {shlex.quote(owner)} {q}; chmod {mode} {q}"


def _next_steps(p: UnitParams, config: Config) -> str:
    user, llama = shlex.quote(p.user), shlex.quote(p.llama_user)
    steps = [f"create users {user} and {llama} sharing group {shlex.quote(p.group)}"]
    if state_directory(p.state_dir) is None:
        steps.append(_mkdir(p.state_dir, f"{p.user}:{p.group}", STATE_MODE))
    snapshots = set(_snapshot_dirs(config).values())
    if state_directory(p.snapshot_dir) is None:
        steps.append(_mkdir(p.snapshot_dir, f"{p.llama_user}:{p.group}", SNAPSHOT_MODE))
    for path in p.kv_writable:  # no unit creates these
        owner, mode = (p.llama_user, SNAPSHOT_MODE) if path in snapshots else (p.user, SOCKET_DIR_MODE)
        steps.append(_mkdir(path, f"{owner}:{p.group}", mode))
    steps += _readable_steps(p, config)
    steps.append("systemctl daemon-reload && systemctl enable --now llama-server kvsidecar")
    return "next: " + "; ".join(steps)


def _readable_steps(p: UnitParams, config: Config) -> list[str]:
    """The service runs as its own user: it must be able to read its config (`config init` as root writes
    it root:root 0640) and its secrets: its own API token (only it, 0600), llama-server's API key (shared
    with llama-server through the group, 0640)."""
    q = shlex.quote
    shared = [p.config, *(str(s.api_key_file) for s in config.servers.values() if s.api_key_file)]
    steps = [f"chown root:{q(p.group)} {q(path)}; chmod 0640 {q(path)}" for path in dict.fromkeys(shared)]
    if config.api.token_file is not None:
        token = q(str(config.api.token_file))
        steps.append(f"chown {q(p.user)} {token}; chmod 0600 {token}")
    return steps


def _servers_note(config: Config) -> str | None:
    if len(config.servers) < 2:
        return None
    first, *others = config.servers
    return (
        f"note: llama-server.service is an example for server {shlex.quote(first)} only; write one like it "
        f"for each of {', '.join(shlex.quote(n) for n in others)} (its port and --slot-save-path "
        "its snapshot_dir) and add it to kvsidecar.service's After=/Wants=. kvsidecar.service can write "
        "every server's snapshot_dir."
    )


def cmd_install_systemd(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    problems: list[PathProblem] = []
    params = unit_params(args, config, problems)
    problems += check(config, params, _written_paths(find_config(args.config).path, config))
    for problem in problems:
        print(f"kvsidecar: warning: {UnitPathUnsafe.code} {problem}", file=sys.stderr)
    fatal = [p for p in problems if p.reason not in FORCEABLE]
    if fatal or (problems and not args.force):
        hint = "Fix the paths named above (--force only overrides PRIVATE_TMP and PROTECT_HOME)."
        raise UnitPathUnsafe(f"{len(problems)} path(s) the units cannot use; no unit written", hint=hint)
    _write_units(Path(os.path.abspath(args.dest)), params)
    if note := _servers_note(config):
        print(note)
    print(_next_steps(params, config))
    return 0


def _write_units(dest: Path, params: UnitParams) -> None:
    """Each unit written atomically (a temporary file in `dest` renamed over it), never through a link:
    a unit `systemctl mask` linked to /dev/null would stay masked while we said we wrote it. Every target
    is checked before any is written."""
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UnitPathUnsafe(
            f"--dest {dest}: cannot create the directory ({exc.strerror}); no unit written",
            hint="Name a directory, or one to create: not a file, nor a path under a file.",
        ) from None
    for name in UNITS:
        path = dest / name
        if path.is_symlink():
            masked = os.path.realpath(path) == os.devnull
            what = f"masked (a link to {os.devnull})" if masked else f"a link to {os.readlink(path)}"
            hint = f"systemctl unmask {name} first" if masked else "Remove the link, or choose another --dest"
            raise UnitPathUnsafe(f"{path} is {what}: not written through; no unit written", hint=hint + ".")
        if path.exists() and not path.is_file():
            raise UnitPathUnsafe(f"{path} exists and is not a regular file; no unit written")
    for name in UNITS:
        try:
            atomic_write_bytes(dest / name, render(name, params).encode(), mode=UNIT_MODE)
        except OSError as exc:
            raise UnitPathUnsafe(f"{dest / name}: cannot write ({exc.strerror})") from None
        print(f"wrote {dest / name}")


_Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def add_install_systemd(sub: _Commands) -> None:
    help_ = "render systemd units for kvsidecar and llama-server"
    p = sub.add_parser("install-systemd", help=help_, description=help_)
    p.set_defaults(func=cmd_install_systemd)
    p.add_argument("--dest", default="/etc/systemd/system")
    p.add_argument("--user", default="kvsidecar")
    p.add_argument("--llama-user", default="llama")
    p.add_argument("--group", default="llama", help="group shared by both services (snapshot files)")
    p.add_argument("--kvsidecar", help="path of the kvsidecar executable (default: this one)")
    p.add_argument("--config-path", help="config path the unit passes (default: --config)")
    p.add_argument("--llama-server", default="/usr/local/bin/llama-server")
    p.add_argument("--model", default="/var/lib/llama/models/model.gguf")
    p.add_argument(
        "--force",
        action="store_true",
        help="write the units even when a path is under /tmp, /var/tmp, /home or /root (hidden from them); "
        "never for a relative, unparseable or nested path",
    )
