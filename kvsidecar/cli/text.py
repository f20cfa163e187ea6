"""How the `kvsidecar` command prints: plain-text tables of the views the daemon (or, offline, the
store and the doctor) returns. `--json` prints the views themselves instead."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

from kvsidecar.coordinator.verdict import persistence_now


def table(rows: Sequence[Sequence[Any]], head: Sequence[str]) -> str:
    cells = [[str(h) for h in head]] + [["" if c is None else str(c) for c in r] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def persistence_state(srv: dict[str, Any], enabled: bool = True) -> str:
    """What persistence can do on this server now (the daemon's `persistence_now`), in words. `enabled`
    (the status's top-level flag) is only read for an older daemon that does not send `persistence_now`."""
    now = srv.get("persistence_now")
    if not isinstance(now, dict):  # a daemon from before it (upgraded, not yet restarted): the same verdict
        now = persistence_now(srv, enabled=enabled)
    reason = now["reason"]
    if reason == "DISABLED":
        return "persistence OFF (enabled: false)"
    if reason == "SERVER_DOWN":
        error = f": {srv['last_error']}" if srv.get("last_error") else ""
        return f"persistence UNAVAILABLE (server down{error})"
    if reason == "NO_SLOTS_ENDPOINT":
        return "persistence UNAVAILABLE (llama-server runs without --slots)"
    if reason == "SNAPSHOT_DIR_MOVED":
        return "persistence UNAVAILABLE (SNAPSHOT_DIR_MOVED: the snapshot directory moved, see the warning)"
    if now["state"] == "degraded":
        return f"persistence {str(srv.get('persistence', 'unknown')).upper()} (circuit breaker)"
    if now["state"] == "misconfigured":
        return f"persistence MISCONFIGURED ({reason}, see the warning)"
    return f"persistence {now['state']}"


def render_status(s: dict[str, Any]) -> str:
    out = []
    for srv in s["servers"]:
        out.append(
            f"server {srv['name']} ({srv['endpoint']}): {'up' if srv['available'] else 'DOWN'}, "
            f"{persistence_state(srv, s.get('enabled', True))}, mode {srv['mode']}"
        )
        memory = srv.get("memory")
        if memory:
            out.append(f"  model memory: {_memory(memory)}")
        for w in srv.get("warnings", []):
            out.append(f"  warning {w['code']}: {w['message']}\n    fix: {w['fix']}")
        out.append(
            table(
                [[sl["id"], sl["state"], sl["owner"], sl["tokens"]] for sl in srv["slots"]],
                ["slot", "state", "owner", "tokens"],
            )
        )
    for entry, d in (s.get("router_discovery") or {}).items():
        line = f"router {entry}: {len(d['models'])} model(s) discovered, {len(d['missing'])} no longer listed"
        if d["unmanaged_over_max"]:
            line += f"; {d['unmanaged_over_max']} left unmanaged past max_models {d['max_models']}"
        if d["skipped"]:
            line += f"; {len(d['skipped'])} id(s) skipped"
        out.append(line + (f"; last look failed: {d['last_error']}" if d["last_error"] else ""))
    snap = s["snapshots"]
    out.append(
        f"snapshots: {snap['known']} known, {snap['valid']} valid, {snap['invalid']} invalid, "
        f"{human_bytes(snap['bytes'])}; leases open: {s['leases']}"
    )
    st = s["stats"]
    out.append(
        f"acquires {st['acquires']} (resident {st['resident']}), "
        f"restores {st['restore_hits']}/{st['restores']} ok, cold {st['cold_starts']}, "
        f"fallbacks {st['cold_fallbacks']}, saves {st['saves']}"
        f" ({st['save_failures']} failed), ineffective restores {st['restore_ineffective']}"
    )
    return "\n".join(out)


def _memory(m: dict[str, Any]) -> str:
    """The model's memory class and what a restore keeps; where saves are off, why, the fix and its cost."""
    what = str(m["class"]) + (f" ({m['arch']})" if m.get("arch") else "")
    if m.get("n_swa"):
        what += f", window {m['n_swa']}, " + ("--swa-full" if m.get("swa_full") else "no --swa-full")
    if m.get("restore_keeps"):
        what += f"; a restore keeps: {m['restore_keeps']}"
    snapshot = m.get("snapshot")
    if snapshot:
        what += (
            f"; a snapshot: {snapshot['bytes_per_token']:,} B a token + about {snapshot['fixed_bytes']:,} B"
        )
    if m.get("saves") == "off":
        what += f"; saves off ({m['reason']})\n    fix: {m['fix']}: {m['cost']}"
    return what


def _outcome(v: dict[str, Any]) -> str:
    """Its latest acquire: `resident`, `restored`, `cold (NO_SNAPSHOT)`, ... (empty when not seen)."""
    outcome = v.get("last_outcome")
    if outcome is None:
        return ""
    reason = v.get("last_reason") or ("no snapshot" if outcome == "cold" else None)
    return f"{outcome} ({reason})" if reason else str(outcome)


def _reuse(v: dict[str, Any]) -> str:
    """The engine's reuse of its latest turns, oldest first: `cached/prompt` tokens each."""
    return " ".join(f"{t['cached_tokens']:,}/{t['prompt_tokens']:,}" for t in v.get("turns") or [])


def render_sessions(views: list[dict[str, Any]]) -> str:
    rows = []
    for v in views:
        snap = v.get("snapshot") or {}
        when = time.strftime("%Y-%m-%d %H:%M", time.localtime(snap["updated_at"])) if snap else ""
        rows.append(
            [
                v.get("id", ""),
                v["session"],
                v.get("client") or "",
                v.get("signal") or "",
                v["model"],
                v["state"],
                v.get("resident_slot"),
                _outcome(v),
                _reuse(v),
                human_bytes(snap.get("bytes", 0)) if snap else "",
                when,
            ]
        )
    head = ["id", "session", "client", "signal", "model", "state", "slot", "last", "reuse (cached/prompt)"]
    return table(rows, [*head, "snapshot", "saved"]) if rows else "no sessions"


def render_show(data: dict[str, Any]) -> str:
    """`kvsidecar show S`: each (provider, model) of the session, then its snapshot generations."""
    out = []
    for v in data["session"]:
        slot = v.get("resident_slot")
        out.append(
            f"session {v['session']} ({v['provider']}/{v['model']}) on {v['server']}: {v['state']}"
            + (f", resident in slot {slot}" if slot is not None else "")
            + f"; revision {v['dirty_revision']} (saved {v['saved_revision']})"
        )
        if v.get("client") is not None:
            out.append(f"  client {v['client']} (signal {v['signal']}); last: {_outcome(v)}")
        if v.get("turns"):
            out.append(f"  reuse of its latest turns (cached/prompt tokens): {_reuse(v)}")
        if v.get("last_error"):
            out.append(f"  last error: {v['last_error']}")
        snap = v.get("snapshot")
        if not snap:
            out.append("  no snapshot")
            continue
        rows = [
            [
                g + (" *" if g == snap["current"] else ""),
                r["tokens"],
                human_bytes(r["bytes"]),
                time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(r["saved_at"])) if r["saved_at"] else "",
                r["invalid_reason"] or "valid",
            ]
            for g, r in snap["generations"].items()
        ]
        out.append(table(rows, ["generation", "tokens", "bytes", "saved", "state"]))
    return "\n".join(out)


def render_gc(r: dict[str, Any]) -> str:
    rows = [
        [
            d["reason"],
            d["snapshot"] or "-",
            d["generation"] or "-",
            human_bytes(d["bytes"]),
            d["file"][:24],
            {True: "deleted", False: "kept"}.get(d.get("deleted"), "planned"),
        ]
        for d in r["deletions"]
    ]
    head = "dry run: nothing deleted" if r["dry_run"] else f"freed {human_bytes(r['freed_bytes'])}"
    lines = [
        table(rows, ["reason", "snapshot", "gen", "bytes", "file", "action"])
        if rows
        else "nothing to delete",
        f"{head}; {human_bytes(r['bytes_before'])} -> {human_bytes(r['bytes_after'])}, "
        f"{r['snapshots_before']} -> {r['snapshots_after']} snapshots",
    ]
    if r["unmet"]:
        lines.append(f"still over: {', '.join(r['unmet'])} (only protected snapshots left)")
    return "\n".join(lines)


def render_doctor(d: dict[str, Any]) -> str:
    out = []
    for srv in d["servers"]:
        out.append(f"server {srv['server']} ({srv['endpoint']})")
        for c in srv["checks"]:
            out.append(f"  {c['status']:<4}  {c['name']}: {c['detail']}")
            if c["fix"] and c["status"] in ("WARN", "FAIL"):
                out.append(f"        fix: {c['fix']}")
    out.append(f"Result: {d['result']}")
    return "\n".join(out)
