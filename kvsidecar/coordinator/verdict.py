"""What persistence can do on a server now, read from the fields of its status view (`available`,
`slots_endpoint`, `persistence` (the breaker), `warnings`). The daemon publishes it as `persistence_now`;
`kvsidecar status` derives the same verdict from an older daemon's view that lacks it. Imports nothing
heavy: the CLI uses it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


def persistence_now(view: Mapping[str, Any], *, enabled: bool) -> dict[str, Any]:
    """`state` healthy | off | unavailable | degraded | misconfigured, and a stable `reason` token."""
    if not enabled:
        return {"state": "off", "reason": "DISABLED"}
    if not view.get("available", False):
        return {"state": "unavailable", "reason": "SERVER_DOWN"}
    if view.get("slots_endpoint") is False:
        return {"state": "unavailable", "reason": "NO_SLOTS_ENDPOINT"}
    if any(w.get("code") == "KV_SNAPSHOT_DIR_MOVED" for w in view.get("warnings") or ()):
        return {"state": "unavailable", "reason": "SNAPSHOT_DIR_MOVED"}  # nothing saved or restored
    breaker = str(view.get("persistence", "unknown"))
    if breaker != "healthy":
        return {"state": "degraded", "reason": f"CIRCUIT_{breaker.upper()}"}
    if warnings := view.get("warnings"):
        return {"state": "misconfigured", "reason": str(warnings[0].get("code", "?"))}
    return {"state": "healthy", "reason": None}
