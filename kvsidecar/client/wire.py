"""What the Python clients send and how they read the answer: one definition for both transports.

`AsyncKvSidecar` (kvsidecar/client/__init__.py) and `KvSidecar` (kvsidecar/client/sync.py) only send the
`Call`s built here and hand the response to `Call.parse`; the request bodies, the paths (every client string
is percent-encoded into one path segment), the error mapping and the shape checks of the answers live here.
The CLI and the fleet router (which passes a peer's answer on as it came: `send`) use these calls too.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Literal, TypeVar
from urllib.parse import quote, urlencode

import httpx

T = TypeVar("T")
Method = Literal["GET", "POST", "DELETE"]
DEFAULT_URL = "http://127.0.0.1:8377"
DEFAULT_TIMEOUT_S = 330.0  # above the daemon's longest acquire wait


class SidecarError(Exception):
    """An error answer of the daemon, with its stable `code` (kvsidecar/errors.py) and HTTP status.

    A reply that is not the daemon's (no JSON error body) has code `KV_HTTP_ERROR`; a success reply whose body
    is not the documented shape has code `KV_BAD_RESPONSE`. Transport failures stay `httpx.HTTPError`.
    """

    def __init__(self, *, status: int, code: str, message: str, hint: str = "") -> None:
        super().__init__(f"{code}: {message}")
        self.status, self.code, self.message, self.hint = status, code, message, hint


@dataclass(kw_only=True)
class Lease:
    outcome: str
    lease_id: str | None
    server: str | None = None
    base_url: str | None = None
    slot_id: int | None = None
    restored_tokens: int | None = None
    restore_ms: float | None = None
    evicted: str | None = None
    reason: str | None = None
    shared_tokens: int | None = None  # issue 28: tokens of a prefix_from donor's snapshot restored
    actions: list[str] = field(default_factory=list)
    prompt_point: bool = False  # the plan asks for a save point at the prompt's end: call `prompt_point`
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    prompt_ms: float | None = None
    release_result: dict[str, Any] | None = None

    def report(
        self,
        *,
        prompt_tokens: int | None = None,
        cached_tokens: int | None = None,
        prompt_ms: float | None = None,
    ) -> None:
        """The engine's own numbers (timings.prompt_n, timings.cache_n, timings.prompt_ms), sent with the
        release: the reuse check after a restore, and the cost model's prefill speed."""
        self.prompt_tokens, self.cached_tokens, self.prompt_ms = prompt_tokens, cached_tokens, prompt_ms


@dataclass(frozen=True)
class Call(Generic[T]):
    """One request of the hook API and the reader of its successful answer."""

    method: Method
    path: str
    body: dict[str, Any] | None
    read: Callable[[Any], T]

    def parse(self, response: httpx.Response) -> T:
        """The answer's value, or `SidecarError` for an error answer or a body of the wrong shape."""
        try:
            data = response.json()
        except ValueError:
            data = None
        if response.status_code >= 400:
            raise _error_of(response, data)
        try:
            return self.read(data)
        except (TypeError, KeyError, ValueError) as exc:
            raise SidecarError(
                status=response.status_code,
                code="KV_BAD_RESPONSE",
                message=f"{self.method} {self.path}: unexpected answer ({exc})",
            ) from None


def _error_of(response: httpx.Response, data: object) -> SidecarError:
    err = data.get("error") if isinstance(data, dict) else None
    if not isinstance(err, dict):
        err = {}
    return SidecarError(
        status=response.status_code,
        code=str(err.get("code", "KV_HTTP_ERROR")),
        message=str(err.get("message", response.text[:200])),
        hint=str(err.get("hint", "")),
    )


def _object(data: Any) -> dict[str, Any]:
    if not isinstance(data, dict):
        raise TypeError(f"expected a JSON object, got {type(data).__name__}")
    return data


def _lease(data: Any) -> Lease:
    obj = _object(data)
    known = {k: v for k, v in obj.items() if k in Lease.__dataclass_fields__}
    if "outcome" not in known or "lease_id" not in known:
        raise KeyError("outcome/lease_id")
    return Lease(**known)


def _sessions(data: Any) -> list[dict[str, Any]]:
    sessions = _object(data)["sessions"]
    if not isinstance(sessions, list):
        raise TypeError("sessions is not a list")
    return [_object(s) for s in sessions]


def segment(value: str) -> str:
    """`value` as exactly one path segment: every reserved byte escaped, and `.`/`..` too (an HTTP client
    would fold them into the path: session ".." would become a request to another route)."""
    escaped = quote(value, safe="")
    return escaped.replace(".", "%2E") if escaped in {".", ".."} else escaped


def _nonempty(value: str, *, status: int, code: str, what: str) -> str:
    """An empty id would be an empty path segment (`/v1/sessions//save`), a route the daemon does not have:
    refused here with the code the daemon gives a bad id, and nothing is sent."""
    if value == "":
        raise SidecarError(status=status, code=code, message=f"{what} is empty")
    return value


def _session_path(session_id: str, action: str = "") -> str:
    sid = _nonempty(session_id, status=400, code="KV_INVALID_SESSION_ID", what="the session id")
    return f"/v1/sessions/{segment(sid)}" + (f"/{action}" if action else "")


def _optional(**values: Any) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


def headers(token: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"} if token else {}


def raw(method: Method, path: str, body: dict[str, Any] | None = None) -> Call[Any]:
    """Any route, its JSON answer as is (errors still mapped): for tools that need a field the typed
    methods do not read."""
    return Call(method, path, body, lambda data: data)


def acquire_lease(
    session_id: str | None,
    *,
    provider: str,
    model: str,
    purpose: str | None,
    seq: int | None,
    prefix_from: str | None = None,
    prompt: str | list[int] | dict[str, Any] | None = None,
) -> Call[Lease]:
    """`prefix_from` (issue 28): a session whose newest snapshot a cold start may begin from. `prompt`: the
    model call's prompt (a text, token ids, or a chat-completions body), what the session's start is
    planned from."""
    body = {"provider": provider, "model": model} | _optional(
        purpose=purpose, seq=seq, prefix_from=prefix_from, prompt=prompt
    )
    path = "/v1/acquire" if session_id is None else _session_path(session_id, "acquire")
    return Call("POST", path, body, _lease)


def release(
    lease_id: str,
    *,
    status: str,
    prompt_tokens: int | None,
    cached_tokens: int | None,
    prompt_ms: float | None,
) -> Call[dict[str, Any]]:
    body = {"status": status} | _optional(
        prompt_ms=prompt_ms, prompt_tokens=prompt_tokens, cached_tokens=cached_tokens
    )
    lease = _nonempty(lease_id, status=404, code="KV_LEASE_NOT_FOUND", what="the lease id")
    return Call("POST", f"/v1/leases/{segment(lease)}/release", body, _object)


def prompt_point(lease_id: str) -> Call[dict[str, Any]]:
    """Take the save point the lease's plan asked for (`Lease.prompt_point`), before the model call."""
    lease = _nonempty(lease_id, status=404, code="KV_LEASE_NOT_FOUND", what="the lease id")
    return Call("POST", f"/v1/leases/{segment(lease)}/prompt-point", None, _object)


def release_of(lease: Lease, *, completed: bool) -> Call[dict[str, Any]] | None:
    """The release at the end of an `acquire` block: "ok" with the reported numbers, or "aborted" when the
    block raised; None for a lease the daemon did not give (`bypass`)."""
    if lease.lease_id is None:
        return None
    return release(
        lease.lease_id,
        status="ok" if completed else "aborted",
        prompt_tokens=lease.prompt_tokens,
        cached_tokens=lease.cached_tokens,
        prompt_ms=lease.prompt_ms,
    )


def event(session_id: str, type_: str, *, seq: int | None) -> Call[dict[str, Any]]:
    body = {"type": type_} | _optional(seq=seq)
    return Call("POST", _session_path(session_id, "events"), body, _object)


def save(session_id: str) -> Call[dict[str, Any]]:
    return Call("POST", _session_path(session_id, "save"), None, _object)


def restore(session_id: str, *, provider: str, model: str) -> Call[dict[str, Any]]:
    body = {"provider": provider, "model": model}
    return Call("POST", _session_path(session_id, "restore"), body, _object)


def invalidate(session_id: str) -> Call[dict[str, Any]]:
    return Call("POST", _session_path(session_id, "invalidate"), None, _object)


def purge(session_id: str) -> Call[dict[str, Any]]:
    return Call("DELETE", _session_path(session_id), None, _object)


def sessions() -> Call[list[dict[str, Any]]]:
    return Call("GET", "/v1/sessions", None, _sessions)


def status() -> Call[dict[str, Any]]:
    return Call("GET", "/v1/status", None, _object)


def session(session_id: str) -> Call[dict[str, Any]]:
    """One session in detail (`kvsidecar show`)."""
    return Call("GET", _session_path(session_id), None, _object)


def _flag(value: bool) -> str:
    return "true" if value else "false"


def gc(*, dry_run: bool) -> Call[dict[str, Any]]:
    """Apply retention now, or (`dry_run`) only plan it."""
    return Call("POST", f"/v1/gc?dry_run={_flag(dry_run)}", None, _object)


def doctor(*, deep: bool) -> Call[dict[str, Any]]:
    """The daemon's check of its llama-servers (`deep`: a save/erase/restore round trip on a held slot)."""
    return Call("GET", f"/v1/doctor?deep={_flag(deep)}", None, _object)


def checkpoint(*, server: str | None, wait: bool, timeout_s: float | None) -> Call[dict[str, Any]]:
    """Save every dirty slot of `server` (None: every server) before a planned stop; `wait`: answer once
    every save has committed (KV_SAVE_FAILED / KV_OPERATION_TIMEOUT otherwise)."""
    query = {"wait": _flag(wait)} | _optional(server=server, timeout_s=timeout_s)
    return Call("POST", f"/v1/checkpoint?{urlencode(query)}", None, _object)


def health() -> Call[Any]:
    """The liveness probe (no token needed): its answer as is."""
    return raw("GET", "/healthz")
