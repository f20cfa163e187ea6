"""What the proxy says by itself: OpenAI-shaped errors, and the `X-KV-*` headers of a session's answer.

Errors. Every answer the proxy makes up itself (a refused route, a bad body, llama-server down or silent, a
body too large, no free slot, ...) has the shape OpenAI-compatible clients parse:

    {"error": {"message": "...", "type": "invalid_request_error", "param": null,
               "code": "KV_PROXY_FORBIDDEN", "hint": "..."}}

`code` is kvsidecar's stable code (`kvsidecar.errors`), the status its HTTP status, `type` OpenAI's word
for that status; `hint` is ours (clients ignore a field they do not know). The openai SDK raises the class
of the status (`PermissionDeniedError` for 403, ...) with `.code` set to our code. On the routes of
Anthropic's API (`/v1/messages`, `/v1/messages/count_tokens`) the same error comes in Anthropic's shape,
`{"type": "error", "error": {"type": ..., "message": ..., "code": ...}}`. An error answer of
llama-server itself is forwarded unchanged.

Headers. A session's answer carries `X-KV-Outcome` and, whenever the session did not come back warm (or
came back from an older generation), `X-KV-Reason`: a fixed token from `REASONS` below, never text from a
client, a file or llama-server.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any, Final

from starlette.responses import Response

from kvsidecar.coordinator import plan
from kvsidecar.coordinator.core import INVALIDATED
from kvsidecar.coordinator.savepoints import PointTaken
from kvsidecar.coordinator.state import UNKNOWN_CLIENT, AcquireResult, Outcome
from kvsidecar.errors import (
    HTTP_STATUS,
    KvError,
    ShuttingDown,
    SlotBusy,
    TooManyBodies,
    TooManyConnections,
    http_status,
)
from kvsidecar.fingerprint import reasons as fingerprint
from kvsidecar.proxy import client_content, client_ids
from kvsidecar.proxy.anthropic_errors import anthropic_error
from kvsidecar.store import manifest, table

# OpenAI's error `type` for each status the proxy answers with (llama-server uses the same words).
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    408: "timeout_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    431: "invalid_request_error",
    500: "server_error",
    502: "server_error",
    503: "unavailable_error",
    504: "timeout_error",
}


def openai_error(exc: KvError) -> dict[str, dict[str, str | None]]:
    """The error body of `exc`, shaped as OpenAI's API shapes errors."""
    return {
        "error": {
            "message": exc.message,
            "type": ERROR_TYPES.get(http_status(exc), "server_error"),
            "param": None,
            "code": exc.code,
            "hint": exc.hint,
        }
    }


def error_answer(
    exc: KvError, headers: Mapping[str, str] | None = None, *, anthropic: bool = False
) -> Response:
    """A whole error answer: status, OpenAI-shaped JSON body (with `anthropic`, Anthropic's shape, for the
    routes of its API), `Retry-After` where waiting helps."""
    extra = (
        {"retry-after": "1"}
        if isinstance(exc, SlotBusy | ShuttingDown | TooManyConnections | TooManyBodies)
        else {}
    )
    if anthropic:
        body = anthropic_error(http_status(exc), exc.message, code=exc.code)
    else:
        body = json.dumps(openai_error(exc), ensure_ascii=False, separators=(",", ":")).encode()
    headers = {**extra, **(headers or {})}
    return Response(body, status_code=http_status(exc), headers=headers, media_type="application/json")


# -- X-KV-Reason ------------------------------------------------------------------------------------------
# The coordinator's reasons in words (its log and `AcquireResult.reason`), as tokens.
_WORDS: dict[str, str] = {
    "circuit open": "CIRCUIT_OPEN",
    "persistence unavailable": "PERSISTENCE_UNAVAILABLE",
    "server restarted during restore": "SERVER_RESTARTED",
    "unmanaged provider": "UNMANAGED",
    "disabled": "DISABLED",
    "previous generation": "PREVIOUS_GENERATION",  # "previous generation (<why the newest was not usable>)"
    # cold: its own KV may not be what its request runs on while other credentials' KV may be in
    # llama-server's RAM cache, and its prompt is not known to extend it (coordinator/scope.py)
    "isolated": "ISOLATED",
}
NO_SNAPSHOT = "NO_SNAPSHOT"  # cold, no reason given: nothing saved for this session (yet)
RESTORE_DISABLED = "RESTORE_DISABLED"  # cold because restore.enabled is false
OTHER = "OTHER"  # a reason this table does not know (a newer coordinator): never its text
# issue 28: the turn's messages do not extend its session's last request (X-KV-Diverged-Message: where)
PROMPT_DIVERGED = "PROMPT_DIVERGED"

# Every token `X-KV-Reason` can carry: the coordinator's words above, the store's and the fingerprint's
# reason codes (the same codes as the log, the metrics and `kvsidecar show`), and the error codes.
REASONS: frozenset[str] = frozenset(
    {
        *_WORDS.values(),
        NO_SNAPSHOT,
        RESTORE_DISABLED,
        OTHER,
        PROMPT_DIVERGED,
        INVALIDATED,
        "FINGERPRINT_CHANGED",
        *fingerprint.REASON_PRIORITY,
        *fingerprint.REASONS.values(),
        *fingerprint.SETTING_CLASSES.values(),
        *(v for k, v in vars(table).items() if k.isupper() and isinstance(v, str)),
        *(v for k, v in vars(manifest).items() if k.isupper() and isinstance(v, str) and v.isupper()),
        *HTTP_STATUS,
        *(r.upper() for r in plan.REASONS),  # the start plan's codes (coordinator/plan.py), upper case
    }
)
WARM = frozenset({Outcome.RESIDENT, Outcome.RESTORED})

# -- X-KV-Signal (issue 28, docs/CLIENTS.md) ---------------------------------------------------------------
# What named the session of a proxied request: one of these fixed names, never client text.
SIGNAL_NONE = "none"  # no session: an auxiliary request (no id and no content identity)
SIGNAL_AUX_DIVERGED = "aux:not-extending"  # under a session's id, but a side request (much shorter, no tools)
SIGNAL_VALUES: frozenset[str] = frozenset(
    {*client_ids.SIGNALS, client_content.SIGNAL, *client_ids.MARKERS, SIGNAL_NONE, SIGNAL_AUX_DIVERGED}
)


# -- which client (the session's view, its log events; docs/CLIENTS.md) -----------------------------------
# A fixed name, from the signal that named the session: never client text.
CLIENTS: Final = ("claude-code", "codex", "opencode", "aider", UNKNOWN_CLIENT)
_CLIENT_OF_SIGNAL: dict[str, str] = {
    client_ids.SIG_CLAUDE_HEADER: "claude-code",
    client_ids.SIG_CLAUDE_METADATA: "claude-code",
    client_ids.TITLE_CLAUDE: "claude-code",
    client_ids.SIG_CODEX_SESSION: "codex",
    client_ids.SIG_CODEX_THREAD: "codex",
    client_ids.SIG_CLIENT_METADATA: "codex",
    client_ids.TITLE_CODEX: "codex",
    client_ids.SIG_AFFINITY: "opencode",
    client_ids.TITLE_OPENCODE: "opencode",
}
_AIDER_SYSTEM = "Act as an expert software developer."  # the first words of every aider coder's prompt


def client_of(
    signal: str | None, raw_headers: Iterable[tuple[bytes, bytes]], data: Mapping[str, Any] | None
) -> str:
    """The client a session's request came from, one of `CLIENTS`. Two signals any client may send are told
    apart by what one client sends beside them: opencode sends `x-session-affinity` equal to its
    `x-session-id` (the proxy's default header, which your own harness may send too); aider sends no id (its
    session is named by content) and starts its system prompt with its fixed preamble."""
    known = _CLIENT_OF_SIGNAL.get(signal or "")
    if known is not None:
        return known
    if signal == client_ids.SIG_SESSION_HEADER:
        headers = client_ids.asgi_headers(raw_headers)
        ids, affinity = headers.get("x-session-id", ()), headers.get("x-session-affinity", ())
        return "opencode" if len(ids) == len(affinity) == 1 and ids[0] == affinity[0] else UNKNOWN_CLIENT
    if signal == client_content.SIGNAL and data is not None:
        messages = data.get("messages")
        first = messages[0] if isinstance(messages, list) and messages else None
        text = first.get("content") if isinstance(first, dict) and first.get("role") == "system" else None
        if isinstance(text, str) and text.startswith(_AIDER_SYSTEM):
            return "aider"
    return UNKNOWN_CLIENT


def reason_token(result: AcquireResult, *, restore_enabled: bool = True) -> str | None:
    """The `X-KV-Reason` of an acquire: None for a warm session with nothing to explain."""
    reason = result.reason
    if reason is None:
        if result.outcome in WARM:
            return None
        if result.outcome is Outcome.COLD:
            return NO_SNAPSHOT if restore_enabled else RESTORE_DISABLED
        return OTHER
    if reason in plan.REASONS:
        return reason.upper()
    if reason in REASONS:
        return reason
    return _WORDS.get(reason.partition(" (")[0], OTHER)


def kv_headers(result: AcquireResult, *, restore_enabled: bool = True) -> list[tuple[bytes, bytes]]:
    """The `X-KV-*` headers of a session's answer."""
    out = [(b"x-kv-outcome", result.outcome.value.encode())]
    reason = reason_token(result, restore_enabled=restore_enabled)
    if reason is not None:
        out.append((b"x-kv-reason", reason.encode()))
    if result.restored_tokens is not None:
        out.append((b"x-kv-restored-tokens", str(result.restored_tokens).encode()))
    if result.restore_ms is not None:
        out.append((b"x-kv-restore-ms", f"{result.restore_ms:.1f}".encode()))
    if result.shared_tokens is not None:  # a cold start began from another session's snapshot
        out.append((b"x-kv-shared-tokens", str(result.shared_tokens).encode()))
    if result.plan is not None:  # what the start plan decided, and why (coordinator/plan.py)
        out.append((b"x-kv-plan", result.plan.encode()))
        why = result.plan_reason if result.plan_reason in plan.REASONS else None
        out.append((b"x-kv-plan-reason", (why or OTHER.lower()).encode()))
        out.append((b"x-kv-memory-class", (result.memory_class or "unknown").encode()))
        if result.expected_reuse is not None:
            out.append((b"x-kv-expected-reuse", str(result.expected_reuse).encode()))
        out.append((b"x-kv-proved", b"true" if result.proved else b"false"))
    return out


def with_point(
    headers: list[tuple[bytes, bytes]] | None, taken: PointTaken | None
) -> list[tuple[bytes, bytes]] | None:
    """`headers` and, when a save point was taken at the prompt's end (coordinator/savepoints.py), what it
    did: the tokens it holds, the tokens its prefill computed (the request's own `timings` then count one),
    its cost in ms (prefill and save), and the error that left it unsaved."""
    if taken is None:
        return headers
    out = list(headers or ())
    out.append((b"x-kv-prompt-point-tokens", str(taken.tokens).encode()))
    if taken.computed is not None:
        out.append((b"x-kv-prompt-point-computed", str(taken.computed).encode()))
    out.append((b"x-kv-prompt-point-ms", f"{taken.prefill_ms:.1f};{taken.save_ms:.1f}".encode()))
    out.append((b"x-kv-prompt-point", b"saved" if taken.saved else (taken.error or "failed").encode()))
    return out
