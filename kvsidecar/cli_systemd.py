"""`kvsidecar install-systemd`: render the two units (kvsidecar.units) for this config, after checking that
every path they use survives their sandbox.

Both units have `PrivateTmp=yes` (and `PrivateDevices=yes`): each sees its own /tmp, /var/tmp and
/dev/shm, so a snapshot directory there would not be shared, and whatever was there is not seen. Both
have `ProtectHome=yes`: /home, /root and /run/user do not exist for them, so a binary, model, config or
directory there fails at start. Each such path is reported with a stable reason (PRIVATE_TMP,
PROTECT_HOME); with any, nothing is written and the command fails with KV_UNIT_PATH_UNSAFE (exit 2)
unless --force.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import TypeAlias
from urllib.parse import urlsplit

from kvsidecar.config import Config, find_config, is_loopback, load_config
from kvsidecar.errors import UnitPathUnsafe
from kvsidecar.units import UNITS, UnitParams, render, state_directory

# Compared with only; nothing is created there. PrivateTmp=yes, PrivateDevices=yes: private per unit.
PRIVATE = ("/tmp", "/var/tmp", "/dev/shm")  # noqa: S108
HIDDEN = ("/home", "/root", "/run/user")  # ProtectHome=yes: absent


@dataclass(frozen=True)
class PathProblem:
    reason: str  # PRIVATE_TMP | PROTECT_HOME
    what: str  # the setting: state_dir, servers.local.snapshot_dir, --model, ...
    path: str

    def __str__(self) -> str:
        if self.reason == "PRIVATE_TMP":
            why = "each unit has its own private /tmp, /var/tmp and /dev/shm (PrivateTmp=yes)"
        else:
            why = "the units cannot see /home, /root or /run/user (ProtectHome=yes)"
        return f"{self.reason}: {self.what} {self.path}: {why}"


def _under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == root or path.startswith(root + "/") for root in roots)


def _views(path: str) -> list[str]:
    """The path as written (made absolute, normalised) and, if it exists, where its links lead."""
    absolute = os.path.normpath(os.path.abspath(path))
    return list(dict.fromkeys([absolute, os.path.realpath(absolute)]))


def path_problems(paths: dict[str, str]) -> list[PathProblem]:
    problems = []
    for what, path in paths.items():
        for view in _views(path):
            if _under(view, PRIVATE):
                problems.append(PathProblem("PRIVATE_TMP", what, view))
                break
            if _under(view, HIDDEN):
                problems.append(PathProblem("PROTECT_HOME", what, view))
                break
    return problems


def _unit_paths(config: Config, params: UnitParams) -> dict[str, str]:
    paths = {"state_dir": params.state_dir}
    for name, server in config.servers.items():
        paths[f"servers.{name}.snapshot_dir"] = str(server.snapshot_dir)
        if server.api_key_file is not None:
            paths[f"servers.{name}.api_key_file"] = str(server.api_key_file)
    for key in ("token_file", "unix_socket"):
        if (value := getattr(config.api, key)) is not None:
            paths[f"api.{key}"] = str(value)
    paths |= {
        "--kvsidecar": params.kvsidecar,
        "--config-path": params.config,
        "--llama-server": params.llama_server,
        "--model": params.model,
    }
    return paths


def _loopback_only(config: Config) -> bool:
    hosts = [config.api.host, *(urlsplit(s.base_url).hostname or "" for s in config.servers.values())]
    if config.proxy.enabled:
        hosts.append(config.proxy.host)
    return all(is_loopback(h) for h in hosts)


def unit_params(args: argparse.Namespace, config: Config) -> UnitParams:
    server = next(iter(config.servers.values()))
    exe = shutil.which("kvsidecar") or str(Path(sys.executable).with_name("kvsidecar"))
    config_path = args.config_path or find_config(args.config).path or "/etc/kvsidecar/config.yaml"
    return UnitParams(
        user=args.user,
        llama_user=args.llama_user,
        group=args.group,
        kvsidecar=args.kvsidecar or exe,
        config=str(Path(config_path).resolve()),
        state_dir=str(config.state_dir),
        snapshot_dir=str(server.snapshot_dir),
        llama_server=args.llama_server,
        model=args.model,
        llama_port=urlsplit(server.base_url).port or 8080,
        stop_timeout_s=int(config.checkpoint.shutdown_timeout_s + 30),
        loopback_only=_loopback_only(config),
    )


def _next_steps(p: UnitParams) -> str:
    steps = [f"create users {p.user} and {p.llama_user} sharing group {p.group}"]
    if state_directory(p.state_dir) is None:
        steps.append(
            f"mkdir -p {p.state_dir}; chown {p.user}:{p.group} {p.state_dir}; chmod 0700 {p.state_dir}"
        )
    if state_directory(p.snapshot_dir) is None:
        steps.append(
            f"mkdir -p {p.snapshot_dir}; chown {p.llama_user}:{p.group} {p.snapshot_dir}; "
            f"chmod 2770 {p.snapshot_dir}"
        )
    steps.append("systemctl daemon-reload && systemctl enable --now llama-server kvsidecar")
    return "next: " + "; ".join(steps)


def cmd_install_systemd(args: argparse.Namespace) -> int:
    config = load_config(args.config)
    params = unit_params(args, config)
    problems = path_problems(_unit_paths(config, params))
    for problem in problems:
        print(f"kvsidecar: warning: {UnitPathUnsafe.code} {problem}", file=sys.stderr)
    if problems and not args.force:
        raise UnitPathUnsafe(f"{len(problems)} path(s) the units' sandbox would hide; no unit written")
    dest = Path(args.dest)
    dest.mkdir(parents=True, exist_ok=True)
    for name in UNITS:
        (dest / name).write_text(render(name, params))
        print(f"wrote {dest / name}")
    print(_next_steps(params))
    return 0


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
        help="write the units even when a path is under /tmp, /var/tmp, /home or /root (hidden from them)",
    )
