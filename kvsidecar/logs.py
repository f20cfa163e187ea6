"""Structured logs (spec §45): `kv.<noun>.<verb> key=value ...` lines, or JSON objects.

Session ids never appear in full at info level: callers pass `session=short_id(...)`.
"""

from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any

ROOT = "kvsidecar"


def event(logger: logging.Logger, level: int, name: str, **fields: Any) -> None:
    if not logger.isEnabledFor(level):
        return
    text = " ".join(f"{k}={_fmt(v)}" for k, v in fields.items() if v is not None)
    logger.log(level, "%s %s", name, text, extra={"kv_event": name, "kv_fields": fields})


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.1f}"
    s = str(value)
    return f'"{s}"' if " " in s else s


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
        }
        name = getattr(record, "kv_event", None)
        if name is not None:
            out["event"] = name
            out.update({k: v for k, v in getattr(record, "kv_fields", {}).items() if v is not None})
        else:
            out["message"] = record.getMessage()
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def formatter(fmt: str) -> logging.Formatter:
    if fmt == "json":
        return JsonFormatter()
    return logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")


def configure(level: str = "info", fmt: str = "text") -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.set_name(ROOT)  # how reconfigure() finds it
    handler.setFormatter(formatter(fmt))
    root = logging.getLogger(ROOT)
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    root.propagate = False


def reconfigure(level: str, fmt: str) -> None:
    """A live change (SIGHUP): the level, and the format of the handler configure() installed. Handlers
    that an embedding application added itself keep their own format."""
    root = logging.getLogger(ROOT)
    root.setLevel(level.upper())
    for handler in root.handlers:
        if handler.get_name() == ROOT:
            handler.setFormatter(formatter(fmt))
