"""The `kvsidecar` command: a thin adapter over the daemon, the hook-API client (`kvsidecar.client`: every
call to a running daemon), the store and the doctor (its text output is in `cli.text`; `install-systemd` is
in `cli.systemd`, `config` in `cli.config`, `fleet` in `cli.fleet`).

Exit codes: 0 success (doctor: READY); 1 the operation failed (doctor: NOT READY); 2 bad usage or
configuration, or (serve) another daemon holds the state directory or a listen address is taken, or
(install-systemd) a path the units would hide; 3 the daemon is not reachable; 4 doctor says DEGRADED;
141 stdout's reader went away (`| head`), as for a Unix tool ended by SIGPIPE.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import socket
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeAlias

import httpx

from kvsidecar import __version__
from kvsidecar.api.models import worst_verdict
from kvsidecar.cli.config import add_config_commands, config_arg
from kvsidecar.cli.fleet import add_fleet_commands
from kvsidecar.cli.systemd import add_install_systemd
from kvsidecar.cli.text import render_doctor, render_gc, render_sessions, render_show, render_status
from kvsidecar.cli.text import table as table  # re-exported: tests import it from here
from kvsidecar.client import KvSidecar, SidecarError
from kvsidecar.config import Config, find_config, load_config
from kvsidecar.errors import KvError
from kvsidecar.logs import configure

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_UNREACHABLE, EXIT_DEGRADED = 0, 1, 2, 3, 4
# Errors that mean "this cannot start as configured", not "the operation failed".
USAGE_CODES = frozenset({"KV_CONFIG_INVALID", "KV_STATE_LOCKED", "KV_LISTEN_IN_USE", "KV_UNIT_PATH_UNSAFE"})
# A reader that went away (`kvsidecar status | head -2`): what a Unix tool killed by SIGPIPE exits with.
EXIT_BROKEN_PIPE = 128 + 13


class Unreachable(Exception):
    pass


def _load(args: argparse.Namespace) -> Config:
    return load_config(args.config)


# talking to the daemon -------------------------------------------------------------------------------
@contextlib.contextmanager
def _daemon(config: Config, *, timeout_s: float = 600) -> Iterator[KvSidecar]:
    """The hook-API client (`kvsidecar.client`) for the configured daemon: its unix socket when there is
    one, else TCP. A daemon that cannot be reached raises `Unreachable` (exit 3); its error answers are
    `SidecarError` (exit 1, see `_run`)."""
    from kvsidecar.daemon.listen import read_token

    token = read_token(config)
    if config.api.unix_socket is not None and Path(config.api.unix_socket).exists():
        base, uds, transport = "http://localhost", str(config.api.unix_socket), None
    else:
        base, uds = f"http://{config.api.listen}", None
        transport = httpx.HTTPTransport(socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)])
    try:
        with KvSidecar(base, token=token, uds=uds, transport=transport, timeout_s=timeout_s) as kv:
            yield kv
    except httpx.TransportError as exc:
        raise Unreachable(f"kvsidecar is not reachable at {base} ({exc})") from None


def _failure(exc: SidecarError) -> str:
    """How an error answer is shown: the daemon's code (the HTTP status for an answer that is not the
    daemon's) and its message."""
    return f"{exc.status if exc.code == 'KV_HTTP_ERROR' else exc.code}: {exc.message}"


def _emit(args: argparse.Namespace, data: Any, render: Callable[[Any], str]) -> None:
    print(json.dumps(data, indent=2, default=str) if args.json else render(data))


# commands ---------------------------------------------------------------------------------------------
def cmd_serve(args: argparse.Namespace) -> int:
    from kvsidecar.daemon.service import serve

    config = _load(args)
    configure(config.logging.level, config.logging.format)
    config_path = find_config(args.config).path  # None: no file, the defaults (SIGHUP looks again)
    try:
        import uvloop

        uvloop.run(serve(config, config_path=config_path))  # about a third less CPU per hook call
    except ImportError:
        asyncio.run(serve(config, config_path=config_path))
    return EXIT_OK


def cmd_wait_ready(args: argparse.Namespace) -> int:
    config = _load(args)
    deadline = time.monotonic() + args.timeout
    while time.monotonic() < deadline:
        try:
            with _daemon(config) as kv:
                kv.health()
            return EXIT_OK
        except Unreachable:
            time.sleep(0.2)
    print(f"kvsidecar: not ready after {args.timeout}s", file=sys.stderr)
    return EXIT_UNREACHABLE


def cmd_status(args: argparse.Namespace) -> int:
    with _daemon(_load(args)) as kv:
        _emit(args, kv.status(), render_status)
    return EXIT_OK


def _offline_sessions(config: Config) -> list[dict[str, Any]]:
    """What the daemon would list, read from the state directory of a daemon that is not running."""
    from kvsidecar.coordinator.views import session_view
    from kvsidecar.store.snapshots import SnapshotStore

    store = SnapshotStore.from_config(config)
    store.load_readonly()
    views = (
        session_view(m, None, None, full_id=False) for m in sorted(store.all(), key=lambda m: m.updated_at)
    )
    return [v for v in views if v is not None]


def cmd_sessions(args: argparse.Namespace) -> int:
    config = _load(args)
    try:
        if args.offline:
            views = _offline_sessions(config)
        else:
            with _daemon(config) as kv:
                views = kv.sessions()
    except Unreachable:
        print("kvsidecar: daemon not reachable; listing the state directory instead", file=sys.stderr)
        views = _offline_sessions(config)
    _emit(args, views, render_sessions)
    return EXIT_OK


def cmd_show(args: argparse.Namespace) -> int:
    with _daemon(_load(args)) as kv:
        data = kv.session(args.session)
    _emit(args, data, render_show)
    return EXIT_OK


def cmd_session_op(args: argparse.Namespace) -> int:
    with _daemon(_load(args)) as kv:
        if args.command == "restore":
            data = kv.restore(args.session, provider=args.provider, model=args.model)
        else:  # save, invalidate, purge
            data = {"save": kv.save, "invalidate": kv.invalidate, "purge": kv.purge}[args.command](
                args.session
            )
    _emit(args, data, lambda d: ", ".join(f"{k}: {v}" for k, v in d.items()))
    return EXIT_OK


def cmd_checkpoint(args: argparse.Namespace) -> int:
    """Save every dirty slot now, before llama-server stops (a unit's ExecStop, llama-swap's cmdStop, an
    upgrade script). With --wait it returns once the saves have committed: exit 0; 1 when a save failed
    (KV_SAVE_FAILED, each session named) or did not commit within --timeout (KV_OPERATION_TIMEOUT); 3 when
    the daemon cannot be reached."""
    config = _load(args)
    timeout = args.timeout if args.timeout is not None else config.checkpoint.shutdown_timeout_s
    with _daemon(config, timeout_s=timeout + 30) as kv:
        data = kv.checkpoint(server=args.server, wait=args.wait, timeout_s=args.timeout)
    servers = ", ".join(data["servers"])
    if data["waited"]:
        _emit(args, data, lambda d: f"saved {d['saved']} dirty session(s) of {servers}: nothing unsaved")
    else:
        _emit(args, data, lambda d: f"saving {d['dirty']} dirty session(s) of {servers} (--wait to wait)")
    return EXIT_OK


def _offline_gc(config: Config) -> dict[str, Any]:
    from kvsidecar.metrics import Metrics
    from kvsidecar.retention.job import RetentionJob
    from kvsidecar.store.snapshots import SnapshotStore

    store = SnapshotStore.from_config(config)
    store.load_readonly()
    job = RetentionJob(store=store, config=config.retention, metrics=Metrics(), protected_keys=set)
    return asyncio.run(job.run(dry_run=True))


def cmd_gc(args: argparse.Namespace) -> int:
    config = _load(args)
    if args.offline:
        if not args.dry_run:
            print("kvsidecar: offline gc is always a dry run (the daemon owns deletion)", file=sys.stderr)
        report = _offline_gc(config)
    else:
        with _daemon(config) as kv:
            report = kv.gc(dry_run=args.dry_run)
    _emit(args, report, render_gc)
    return EXIT_OK


def _offline_doctor(config: Config, deep: bool) -> dict[str, Any]:
    from kvsidecar.backend.llama_router import backend_for
    from kvsidecar.doctor.checks import Doctor

    async def run() -> dict[str, Any]:
        reports = []
        for name, server in config.servers.items():
            if server.discover_models:  # the router itself: its models are found by the running daemon
                continue
            backend = backend_for(server, name=name)
            try:
                reports.append(
                    (await Doctor(config=config, server=name, backend=backend).run(deep=deep)).to_dict()
                )
            finally:
                await backend.aclose()
        return {"result": worst_verdict(r["result"] for r in reports), "servers": reports}

    return asyncio.run(run())


def cmd_doctor(args: argparse.Namespace) -> int:
    config = _load(args)
    try:
        if args.offline:
            raise Unreachable("offline")
        with _daemon(config) as kv:
            data = kv.doctor(deep=args.deep)
    except Unreachable:
        data = _offline_doctor(config, args.deep)  # no daemon: nothing else holds the slot
    _emit(args, data, render_doctor)
    return {"READY": EXIT_OK, "DEGRADED": EXIT_DEGRADED}.get(data["result"], EXIT_FAILED)


_Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of seconds: {text!r}") from None
    if not 0 < value <= 86400:
        raise argparse.ArgumentTypeError("seconds must be over 0 and at most 86400")
    return value


def _add(
    sub: _Commands,
    name: str,
    func: Callable[[argparse.Namespace], int],
    help_: str,
    *,
    json_: bool = True,
) -> argparse.ArgumentParser:
    p = sub.add_parser(name, help=help_, description=help_)
    p.set_defaults(func=func)
    if json_:
        p.add_argument("--json", action="store_true", help="machine-readable output")
    return p


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvsidecar",
        description="KV-cache persistence daemon for llama-server.",
        epilog="Exit codes: 0 ok (READY), 1 failed (NOT READY), 2 usage/config error, state_dir locked or "
        "port in use, 3 daemon unreachable, 4 DEGRADED.",
    )
    parser.add_argument("--version", action="version", version=f"kvsidecar {__version__}")
    parser.add_argument(
        "-c",
        "--config",
        type=config_arg,  # a str: `config init -c DIR/` must see the trailing slash to refuse it
        default=None,
        help="config file (default: $KVSIDECAR_CONFIG, else the first that exists of "
        "($XDG_CONFIG_HOME or ~/.config)/kvsidecar/config.yaml and /etc/kvsidecar/config.yaml, in that "
        "order for root too, else the built-in defaults; `config init` writes the first)",
    )
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    _add(
        sub,
        "serve",
        cmd_serve,
        "run the daemon (SIGTERM: checkpoint and exit; SIGHUP: reload config)",
        json_=False,
    )
    _add(sub, "status", cmd_status, "the running daemon's servers, slots, snapshots and counters")
    _add_session_commands(sub)
    _add_maintenance_commands(sub)
    _add_install_commands(sub)
    return parser


def _add_session_commands(sub: _Commands) -> None:
    p = _add(sub, "sessions", cmd_sessions, "list known sessions (abbreviated ids)")
    p.add_argument("--offline", action="store_true", help="read the state directory, not the daemon")
    _add(sub, "show", cmd_show, "one session in detail").add_argument("session")
    for op, help_ in (
        ("save", "checkpoint a session now"),
        ("invalidate", "mark a session's snapshots unusable"),
        ("purge", "delete a session's snapshots and manifests"),
    ):
        _add(sub, op, cmd_session_op, help_).add_argument("session")
    p = _add(sub, "restore", cmd_session_op, "bring a session into its slot now")
    p.add_argument("session")
    p.add_argument("--provider", required=True)
    p.add_argument("--model", required=True)


def _add_maintenance_commands(sub: _Commands) -> None:
    p = _add(sub, "checkpoint", cmd_checkpoint, "save every dirty slot now, before llama-server stops")
    p.add_argument("--server", help="only this server's slots (default: every server)")
    p.add_argument("--wait", action="store_true", help="return once every save has committed (exit 1 if not)")
    p.add_argument(
        "--timeout",
        type=_seconds,
        default=None,
        help="with --wait: seconds to wait for the saves (default: checkpoint.shutdown_timeout_s)",
    )
    p = _add(sub, "gc", cmd_gc, "apply retention now (or plan it with --dry-run)")
    p.add_argument("--dry-run", action="store_true", help="show the plan, delete nothing")
    p.add_argument("--offline", action="store_true", help="plan from the state directory without the daemon")
    p = _add(sub, "doctor", cmd_doctor, "check the llama-server set-up: READY / DEGRADED / NOT READY")
    p.add_argument(
        "--deep", action="store_true", help="also save, erase, restore and confirm the engine reuses it"
    )
    p.add_argument("--offline", action="store_true", help="check directly, without asking the daemon")
    add_config_commands(sub)  # config init / check / schema (cli.config)
    add_fleet_commands(sub)  # fleet status (cli.fleet)


def _add_install_commands(sub: _Commands) -> None:
    add_install_systemd(sub)  # cli.systemd
    p = _add(
        sub, "wait-ready", cmd_wait_ready, "wait until the daemon answers (systemd readiness)", json_=False
    )
    p.add_argument("--timeout", type=float, default=30.0)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = _run(args)
        sys.stdout.flush()  # a reader that went away shows here, where it is handled, not at exit
        return code
    except BrokenPipeError:
        return _reader_gone()


def _reader_gone() -> int:
    """stdout's reader closed the pipe (`| head`): stop quietly, as Python's docs advise for CLIs. Point
    stdout at /dev/null so that the interpreter's own flush at exit cannot fail a second time."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    return EXIT_BROKEN_PIPE


def _run(args: argparse.Namespace) -> int:
    try:
        code: int = args.func(args)
        return code
    except KvError as exc:
        print(f"kvsidecar: {exc.code}: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"  hint: {exc.hint}", file=sys.stderr)
        return EXIT_USAGE if exc.code in USAGE_CODES else EXIT_FAILED
    except Unreachable as exc:
        print(f"kvsidecar: {exc}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except SidecarError as exc:  # the daemon's error answer
        print(f"kvsidecar: {_failure(exc)}", file=sys.stderr)
        return EXIT_FAILED
    except RuntimeError as exc:
        print(f"kvsidecar: {exc}", file=sys.stderr)
        return EXIT_FAILED
    except KeyboardInterrupt:
        return 130
