"""The hook API's answers as pydantic models, for the OpenAPI document only.

The handlers return plain dicts (the wire format of docs/PRODUCT.md); these models describe them, field for
field, and are never used to build or validate an answer, so the hot path (acquire, release) pays nothing
for them. tests/unit/http/test_openapi.py checks that what the server answers matches them.

A field that is always present but may be null is `X | None` with no default (required, nullable); a field
that is present only sometimes is `Absent[X]` (optional, never null).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field
from pydantic.json_schema import SkipJsonSchema

from kvsidecar.api.memory_models import MemoryView
from kvsidecar.config import Mode
from kvsidecar.coordinator.breaker import BreakerState
from kvsidecar.coordinator.core import EventType
from kvsidecar.coordinator.state import Outcome, SessionState

T = TypeVar("T")


def _no_default(schema: dict[str, Any]) -> None:
    schema.pop("default", None)


# Present only sometimes, never null: the schema says the type, and the key is not required.
Absent = Annotated[T | SkipJsonSchema[None], Field(default=None, json_schema_extra=_no_default)]


class Health(BaseModel):
    status: Literal["ok"]
    version: str


class RestoreResponse(BaseModel):
    """What an acquire did (restore: the same, without a lease: it was released at once)."""

    outcome: Outcome
    server: str | None
    base_url: str | None
    slot_id: int | None
    restored_tokens: int | None
    restore_ms: float | None
    restore_server_ms: float | None = Field(description="llama-server's own timings.restore_ms")
    evicted: str | None = Field(description="the short id of the session whose slot this was")
    reason: str | None = Field(description="why a cold_fallback or bypass (docs/API.md)")
    actions: list[str]
    shared_tokens: int | None = Field(
        description="tokens of another session's snapshot a cold start began from (prefix_from)"
    )
    plan: str | None = Field(
        description="what the start plan decided: restore, carry_over, donor, keep, erase (null: no plan)"
    )
    plan_reason: str | None = Field(description="the plan's stable reason code (docs/MODELS.md)")
    memory_class: str | None = Field(description="the model's memory class: plain, swa, hybrid, ...")
    expected_reuse: int | None = Field(description="tokens the plan expects llama-server to reuse")
    proved: bool | None = Field(description="the prompt's tokens proved that reuse")
    prompt_point: bool = Field(
        description="whether the plan asks for a save point at the prompt's end (the proxy takes it first)"
    )


class AcquireResponse(RestoreResponse):
    lease_id: str | None = Field(description="null for bypass: no lease, do nothing")


class ReleaseResponse(BaseModel):
    # False only with `queued` (fleet mode): the lease's host is not live; the release is recorded for it
    # and applied when it is back (docs/FLEET.md)
    released: bool
    dirty: bool
    revision: Absent[int]
    restore_verification: Absent[Literal["effective", "ineffective", "unknown"]]
    # issue 28: a cold start's reuse, KV another session left or donated; else what the slot held before
    shared_tokens: Absent[int]
    held_tokens: Absent[int]
    queued: Absent[bool]
    host: Absent[str]


class PromptPointResponse(BaseModel):
    """What taking the lease's save point at the prompt's end did (coordinator/savepoints.py)."""

    taken: bool = Field(
        description="false: the plan asked for none, or it was taken already, or the slot moved on"
    )
    tokens: int | None = Field(
        description="the tokens the slot held after the prefill (the prompt but its last)"
    )
    computed: int | None = Field(description="prompt tokens the prefill computed")
    saved: bool = Field(description="the point was committed as the session's newest generation")
    prefill_ms: float | None
    save_ms: float | None
    error: str | None = Field(description="why no point was saved (a stable code), null when saved")


class EventResponse(BaseModel):
    type: EventType
    saved: int


class SaveResponse(BaseModel):
    saved: int
    checked: int


class InvalidateResponse(BaseModel):
    invalidated: int


class PurgeResponse(BaseModel):
    purged: int
    bytes_freed: int


class CheckpointResponse(BaseModel):
    servers: list[str] = Field(description="the servers whose dirty slots were saved")
    dirty: int = Field(description="sessions with unsaved turns when it started")
    waited: bool
    saved: int | None = Field(description="with wait: the sessions saved (all of them); null without wait")


# -- sessions ----------------------------------------------------------------------------------------------
class GenerationView(BaseModel):
    tokens: int
    bytes: int
    invalid_reason: str | None
    saved_at: float


class SnapshotView(BaseModel):
    current: Literal["a", "b"] | None
    bytes: int
    updated_at: float
    generations: dict[str, GenerationView]


class TurnView(BaseModel):
    cached_tokens: int = Field(description="llama-server's cache_n: prompt tokens reused from the slot's KV")
    prompt_tokens: int = Field(description="the whole prompt: prompt_n + cache_n")


class SessionView(BaseModel):
    session: str = Field(
        description="the short id (the logs' hash of the id) in lists, the full id for GET /v1/sessions/{id}"
    )
    id: str = Field(
        description="the id's visible form, to match it to the id the client prints: its first 8 characters "
        "and, for an id over 16, its last 4 (docs/CLIENTS.md)"
    )
    client: str | None = Field(
        description="claude-code, codex, opencode, aider or unknown (a hook API caller: unknown); null when "
        "not seen since the daemon started"
    )
    signal: str | None = Field(description="what named the session at its latest acquire (X-KV-Signal; hook)")
    last_outcome: Outcome | None = Field(description="its latest acquire: resident, restored, cold, ...")
    last_reason: str | None = Field(description="why, when it was not warm (docs/API.md); null: none given")
    turns: list[TurnView] = Field(description="the engine's reuse of its latest turns, oldest first")
    provider: str
    model: str
    server: str
    state: SessionState
    resident_slot: int | None
    dirty_revision: int
    saved_revision: int
    last_error: str | None
    snapshot: SnapshotView | None
    unsaved_age_s: float | None = Field(
        description="seconds since its first turn no saved generation holds; null when nothing is unsaved"
    )
    unsaved_tokens: int | None = Field(
        description="tokens a llama-server crash would cost it now (past the saved generation its slot "
        "extends); 0 when nothing is unsaved, null when the slot's size is unknown"
    )
    unsaved_turns: int = Field(description="successful turns since its last save")


class SessionsResponse(BaseModel):
    sessions: list[SessionView]


class SessionResponse(BaseModel):
    session: list[SessionView] = Field(description="one entry per (provider, model) of the session")


# -- status ------------------------------------------------------------------------------------------------
class ModelIdentityView(BaseModel):
    code: Literal["KV_MODEL_BOUND_TO_PROCESS", "KV_MODEL_UNPROVEN"] = Field(
        description="KV_MODEL_BOUND_TO_PROCESS: a snapshot restores only into the llama-server process that "
        "saved it, never after it restarts; KV_MODEL_UNPROVEN: the process may load its model again, so a "
        "snapshot restores only until the next fingerprint (never after a restart or a reload)"
    )
    why: str
    fix: str


class RuntimeView(BaseModel):
    # `model_identity` is a field, not pydantic's `model_` namespace (older pydantic warns otherwise)
    model_config = ConfigDict(protected_namespaces=())

    state: str = Field(
        description="what is known of the llama-server now: unknown, probing (its fingerprint being built or "
        "its canary pending), proven, changed (a check failed; the next probe decides), gone (its process "
        "ended), unreachable, sleeping"
    )
    identity: str
    canary: str
    canary_failures: int
    restarts_seen: int
    model_identity: ModelIdentityView | None = Field(
        description="why the loaded model cannot be proven across a llama-server restart (issue 26 A); "
        "null when it can (or the server is not local)"
    )


class SlotView(BaseModel):
    id: int
    owner: str | None
    state: str = Field(description="idle, aux, ready, dirty, inference, or the operation holding it")
    tokens: int | None = Field(
        description="what it holds: its owner's prompt after its latest turn, else the tokens a restore or "
        "cold start left (null: unknown)"
    )
    unsaved_age_s: float | None = Field(description="its owner's unsaved age (see SessionView)")
    unsaved_tokens: int | None = Field(description="its owner's unsaved tokens (see SessionView)")
    unsaved_turns: int = Field(description="its owner's turns since its last save")


class SetupWarningView(BaseModel):
    code: Literal["KV_SAVE_PATH_MISMATCH", "KV_SNAPSHOT_DIR_MOVED"] = Field(
        description="KV_SAVE_PATH_MISMATCH: llama-server's --slot-save-path is not this server's "
        "snapshot_dir; KV_SNAPSHOT_DIR_MOVED: the snapshot directory's path (or manifests/, "
        "fingerprints/) no longer leads to the directory kvsidecar opened at start: nothing is saved or "
        "restored there until it does"
    )
    server: str
    message: str
    fix: str


class PersistenceNow(BaseModel):
    state: Literal["healthy", "off", "unavailable", "degraded", "misconfigured"]
    reason: str | None = Field(
        description="DISABLED, SERVER_DOWN, NO_SLOTS_ENDPOINT, SNAPSHOT_DIR_MOVED, CIRCUIT_DEGRADED, "
        "CIRCUIT_OPEN, CIRCUIT_HALF_OPEN, or a setup "
        "warning's code (KV_SAVE_PATH_MISMATCH); null when healthy"
    )


class ServerView(BaseModel):
    name: str
    kind: str
    endpoint: str
    mode: Mode
    available: bool
    persistence: BreakerState = Field(description="the persistence circuit breaker's state")
    persistence_now: PersistenceNow = Field(
        description="what persistence can do on this server now, from its whole state (use this one)"
    )
    slots_endpoint: bool | None = Field(
        description="GET /slots answers (llama-server --slots); null until the server was reached"
    )
    last_error: str | None
    fingerprint: str | None
    runtime: RuntimeView
    memory: MemoryView | None = Field(
        description="the model's memory class on this instance and whether its slots are saved; null "
        "until the server was read"
    )
    slots: list[SlotView]
    warnings: list[SetupWarningView] = Field(
        description="setup problems persistence cannot work around (empty when none, or when the "
        "llama-server process cannot be read: a remote server)"
    )


class SnapshotCounts(BaseModel):
    known: int
    valid: int
    invalid: int
    bad_manifests: int
    bytes: int


class CostView(BaseModel):
    save_bytes_per_s: float | None
    restore_bytes_per_s: float | None
    prefill_tokens_per_s: float | None
    kv_bytes_per_token: float | None
    think_median_s: float | None


class ConfigView(BaseModel):
    pending_restart: list[str]


class FleetView(BaseModel):
    """Fleet mode (docs/FLEET.md), as this host's last heartbeat saw it; no Redis call is made for it."""

    host_id: str
    advertise_url: str
    redis: str = Field(description="the Redis URL, any password replaced by ***")
    redis_up: bool
    ping_ms: float | None
    leader: bool = Field(description="this host holds the fleet's leader lease")
    hosts: list[str] = Field(description="live host ids (empty while Redis is down)")
    resident_sessions: int
    heartbeat_age_s: float | None = Field(description="since the last successful heartbeat")
    publish_queue: int
    publish_dropped: int
    owned_sessions: int = Field(description="session keys whose ownership (fencing token) this host holds")
    fenced: int = Field(description="writes of a session's files refused: another host owns it now")


class ProxyView(BaseModel):
    content_identity: bool
    conversations: int = Field(description="conversations the proxy's content table knows (digests only)")
    divergences: list[dict[str, Any]] = Field(
        description="the latest turns whose reuse was low or whose messages diverged (PROMPT_DIVERGED)"
    )


class StatusResponse(BaseModel):
    enabled: bool
    servers: list[ServerView]
    snapshots: SnapshotCounts
    sessions_in_memory: int
    leases: int
    stats: dict[str, int]
    cost_model: dict[str, CostView]
    config: ConfigView
    fleet: Absent[FleetView] = Field(description="present when fleet.enabled")
    proxy: Absent[ProxyView] = Field(description="present when the proxy runs (issue 28, docs/CLIENTS.md)")


# -- doctor and gc -----------------------------------------------------------------------------------------
Verdict = Literal["READY", "DEGRADED", "NOT READY"]
VERDICT_ORDER: tuple[Verdict, ...] = ("READY", "DEGRADED", "NOT READY")  # the worst server's is the answer


def worst_verdict(results: Iterable[str]) -> str:
    """The doctor's answer over several servers (the daemon's and the CLI's offline one): the worst."""
    order: list[str] = list(VERDICT_ORDER)
    return max(results, key=order.index)


class DoctorCheck(BaseModel):
    name: str
    status: Literal["OK", "WARN", "FAIL", "SKIP"]
    detail: str
    fix: str


class CompatibilityEvidence(BaseModel):
    cold_tokens: int
    saved_tokens: int
    restored_tokens: int
    extension_tokens: int = Field(description="the same prompt plus a few new tokens")
    extension_reused: int = Field(description="llama-server's cache_n for it after the restore")
    diverge_before_end: int
    divergent_reused: int | None = Field(
        description="cache_n after a second restore for a prompt diverging diverge_before_end tokens "
        "before the saved end (asked only when the extension was reused)"
    )
    swa_window_saved: list[int] | None = Field(
        description="the first and last position the probe file's SWA layers hold (sliding-window models)"
    )
    bytes_per_token: int | None = Field(
        description="what a snapshot costs a token, from two probe saves' sizes (P, then P + new)"
    )
    fixed_bytes: int | None = Field(
        description="and what it costs whatever its length (a recurrent state, an SWA window, headers)"
    )


class Compatibility(BaseModel):
    verdict: Literal["supported", "experimental", "broken"] = Field(
        description="spec §61 for this server's memory class (docs/MODELS.md, What doctor says)"
    )
    memory: dict[str, Any] = Field(description="the memory class read from the model and settings")
    evidence: CompatibilityEvidence


class DoctorServer(BaseModel):
    server: str
    endpoint: str
    result: Verdict
    checks: list[DoctorCheck]
    compatibility: Compatibility | None = Field(description="with deep=true: the §61 check; else null")


class DoctorResponse(BaseModel):
    result: Verdict
    servers: list[DoctorServer]


class GcDeletion(BaseModel):
    file: str
    server: str
    bytes: int
    reason: str
    kind: str
    generation: str | None
    snapshot: str | None
    deleted: Absent[bool]
    skipped: Absent[str]


class GcPolicy(BaseModel):
    max_total_bytes: int | None
    max_sessions: int | None
    max_age_s: float | None
    min_free_bytes: int | None
    min_free_percent: float | None
    low_watermark: float
    orphan_grace_s: float


class GcResponse(BaseModel):
    dry_run: bool
    deletion_enabled: bool
    deletions: list[GcDeletion]
    freed_bytes: int
    planned_bytes: int
    bytes_before: int
    bytes_after: int
    snapshots_before: int
    snapshots_after: int
    unmet: list[str]
    policy: GcPolicy
    fleet: str | None = Field(
        None, description="fleet mode: `leader` (this pass covered the shared directory) or `not leader`"
    )
