"""The sections that tune what the coordinator does: `checkpoint` (when a session is saved), `restore`
(what a restore must prove and reuse), `failure` (the circuit breaker), `retention` (what snapshots are
kept) and `logging`. Each is self-contained: no key here is checked against another section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kvsidecar.config.values import Bytes, Section


class CheckpointConfig(Section):
    on_switch: bool = True
    on_shutdown: bool = True
    on_session_flush: bool = True
    on_disposed: bool = True
    on_turn_end: bool = False
    on_step_end: bool = False
    idle_s: float | None = Field(default=30.0, gt=0)
    shutdown_timeout_s: float = Field(default=60.0, gt=0)
    # cost-aware: take the evicted session's save off the switch (a background save when the server is
    # idle and the session has been idle longer than its save is predicted to take; no save when
    # recomputing since the last snapshot is predicted cheaper than writing a new one). save-before-evict:
    # every dirty slot is saved at the switch (the behaviour before issue 15).
    policy: Literal["cost-aware", "save-before-evict"] = "cost-aware"
    # A background save blocks the whole llama-server (its slot actions run in its main loop): by default
    # one starts only when no other slot of that server is working; true trades that stall in the other
    # slots' streams for more switches that find their slot clean.
    clean_ahead_while_busy: bool = False
    # Crash safety (issue 26): how stale a resident session's newest saved generation may get, in seconds
    # since its first unsaved turn and in turns (0 disables a bound; both 0: none of this, as before). Past a
    # bound the session is saved in the background at the next idle moment of its server (no slot working,
    # nobody waiting), even when the cost model predicts its next request may wait for it; before that it
    # is saved only when the save is predicted to end before its next request and is worth it
    # (kvsidecar/coordinator/decisions.py `protect_reason`).
    max_unsaved_s: float = Field(default=300.0, ge=0)
    max_unsaved_turns: int = Field(default=0, ge=0)


class RestoreConfig(Section):
    enabled: bool = True
    verify_checksum: bool = True
    # A restore after which the engine reused less than this share of the restored tokens is "ineffective".
    min_reuse_ratio: float = Field(default=0.5, ge=0, le=1)
    # After a llama.cpp upgrade, carry a session's snapshot over to the new build when the build is all that
    # changed and the new build is proven to compute bit-identical KV (docs/FINGERPRINT.md, issue 29).
    carry_over_builds: bool = True
    # Issue 28: a cold session starts from the KV another session of the same credential scope left in the
    # slot (no erase), or from that session's snapshot (the acquire's `prefix_from` hint). The engine reuses
    # only an exact token prefix, so this changes speed, never an answer; off: every cold start erases its
    # slot and the hint is ignored (no prefix timing can be observed across sessions). docs/CLIENTS.md
    share_prefix: bool = True


class FailureConfig(Section):
    strict: bool = False
    max_consecutive_failures: int = Field(default=3, ge=1)
    cooldown_s: float = Field(default=60.0, gt=0)


class RetentionConfig(Section):
    delete: bool = True  # the switch that turns every deletion off
    interval_s: float = Field(default=60.0, gt=0)
    max_total_bytes: Bytes | None = None
    max_sessions: int | None = Field(default=None, ge=1)
    max_age_days: float | None = Field(default=30.0, gt=0)
    min_free_bytes: Bytes | None = None
    min_free_percent: float | None = Field(default=10.0, ge=0, lt=100)
    low_watermark: float = Field(default=0.9, gt=0, le=1)


class LoggingConfig(Section):
    level: Literal["debug", "info", "warning", "error"] = "info"
    format: Literal["text", "json"] = "text"
