"""`kvsidecar fleet status [--json]`: the fleet as its Redis holds it (docs/FLEET.md), read directly with
the config's `fleet:` section; no daemon needed. redis is imported only when the command runs.

Exit codes: 0 Redis answered; 3 Redis unreachable (the report still says which URL, password hidden).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from typing import TypeAlias

from kvsidecar.config import load_config

_Commands: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

EXIT_OK, EXIT_UNREACHABLE = 0, 3


def cmd_fleet_status(args: argparse.Namespace) -> int:
    from kvsidecar.fleet.status import gather, render

    config = load_config(args.config)
    report = asyncio.run(gather(config.fleet, timeout_s=args.timeout))
    if not config.fleet.enabled:
        report["note"] = "fleet.enabled is false in this config: this host does not take part"
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        print(render(report))
        if "note" in report:
            print(f"note: {report['note']}", file=sys.stderr)
    return EXIT_OK if report["redis"]["up"] else EXIT_UNREACHABLE


def add_fleet_commands(sub: _Commands) -> None:
    fleet = sub.add_parser("fleet", help="fleet mode: status").add_subparsers(
        dest="fleet_command", required=True, metavar="SUBCOMMAND"
    )
    status = fleet.add_parser(
        "status",
        help="hosts (heartbeat age, slots), sessions per host, leader and Redis health, read from Redis",
        description="The fleet as its Redis holds it, read with the config's fleet: section.",
    )
    status.add_argument("--json", action="store_true", help="machine-readable output")
    status.add_argument("--timeout", type=float, default=2.0, help="seconds per Redis call (default 2)")
    status.set_defaults(func=cmd_fleet_status)
