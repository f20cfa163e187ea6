"""Which conversation a proxied request belongs to, from what unmodified agent clients send (issue 28).

Pure functions: no I/O, no logging, no exceptions out of `recognize()` whatever the request holds. Every
header and body value is a client's string and treated as hostile: bounded, parsed with caps, never passed
on raw (an id that is not a plain token is replaced by a digest of it; the caller hashes ids into file
names anyway, `kvsidecar.store.naming`).

Precedence (the first signal that yields a usable id names the session; a signal that is present but
unusable is reported in `Recognition.rejected` and the next one is tried):

1. the operator's configured header (`configured_header`, `proxy.session_header`), then the configured
   body field (`configured_field`, `proxy.session_field`). Signal `configured`, except that the default
   header `X-Session-Id` reports `header:x-session-id` (it is also opencode's built-in header).
2. Claude Code: header `X-Claude-Code-Session-Id` (`header:x-claude-code-session-id`), then the
   `session_id` inside the JSON string `metadata.user_id` of an Anthropic Messages body
   (`body:metadata.user_id.session_id`; the older `user_<hash>_account_<uuid>_session_<uuid>` string
   form too).
3. Codex CLI: header `session-id` (`header:session-id`), then `thread-id` (`header:thread-id`).
4. opencode (and anything that set the proxy's default header): `x-session-id` (`header:x-session-id`),
   then `x-session-affinity` (`header:x-session-affinity`).
5. OpenAI's `prompt_cache_key` body field on chat / responses / completions routes
   (`body:prompt_cache_key`; Codex sends its thread id there), then Codex's
   `client_metadata.session_id` (`body:client_metadata.session_id`).

Nothing recognized: `session_id` is None; the caller may derive a content identity
(`kvsidecar.proxy.client_content`) or run the request as auxiliary.

Auxiliary markers (`Recognition.markers`, whatever named the session): requests that the client makes
beside the conversation and that must never cost it its KV:

- `title:claude-code`: `/v1/messages` with `tools: []` and `output_config.format` a `json_schema` whose
  properties include `title` (Claude Code's UI, same session id as the conversation);
- `title:codex`: the JSON header `x-codex-turn-metadata` says `"thread_source": "thread_title"` (Codex's
  UI, with a **new** thread id);
- `title:opencode`: a chat completion with no tools whose system message starts like opencode's title
  generator (same session id as the conversation).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

import xxhash

# Stable signal names (logs, metrics labels, a response header): never client text.
CONFIGURED: Final = "configured"
SIG_CLAUDE_HEADER: Final = "header:x-claude-code-session-id"
SIG_CLAUDE_METADATA: Final = "body:metadata.user_id.session_id"
SIG_CODEX_SESSION: Final = "header:session-id"
SIG_CODEX_THREAD: Final = "header:thread-id"
SIG_SESSION_HEADER: Final = "header:x-session-id"
SIG_AFFINITY: Final = "header:x-session-affinity"
SIG_PROMPT_CACHE_KEY: Final = "body:prompt_cache_key"
SIG_CLIENT_METADATA: Final = "body:client_metadata.session_id"
SIGNALS: Final = (
    CONFIGURED,
    SIG_CLAUDE_HEADER,
    SIG_CLAUDE_METADATA,
    SIG_CODEX_SESSION,
    SIG_CODEX_THREAD,
    SIG_SESSION_HEADER,
    SIG_AFFINITY,
    SIG_PROMPT_CACHE_KEY,
    SIG_CLIENT_METADATA,
)

TITLE_CLAUDE: Final = "title:claude-code"
TITLE_CODEX: Final = "title:codex"
TITLE_OPENCODE: Final = "title:opencode"
MARKERS: Final = (TITLE_CLAUDE, TITLE_CODEX, TITLE_OPENCODE)

# Why a present signal gave no id (the second half of each `rejected` entry).
R_TYPE: Final = "not_a_string"
R_EMPTY: Final = "empty"
R_LONG: Final = "too_long"
R_CHARS: Final = "bad_characters"
R_AMBIGUOUS: Final = "ambiguous"  # a header sent more than once, with different values
R_JSON: Final = "bad_json"

DEFAULT_SESSION_HEADER: Final = "x-session-id"
HASHED_PREFIX: Final = "h:"
ID_MAX: Final = 256  # longer ids are refused, not hashed
_PLAIN_ID = re.compile(r"\A[A-Za-z0-9._:@+\-]{1,128}\Z", re.ASCII)  # kvsidecar.store.naming's charset
_JSON_MAX: Final = 16 * 1024  # a JSON-in-a-string field (metadata.user_id, x-codex-turn-metadata)
_HEADERS_MAX: Final = 512  # header lines looked at
_TITLE_PREFIX_MAX: Final = 200
_OPENCODE_TITLE = "You are a title generator"
_LEGACY_USER_ID = re.compile(r"_session_([A-Za-z0-9\-]{1,64})\Z", re.ASCII)

_MESSAGES_ROUTES: Final = frozenset({"/v1/messages"})
_OPENAI_ROUTES: Final = frozenset(
    {
        "/v1/chat/completions",
        "/chat/completions",
        "/v1/responses",
        "/responses",
        "/v1/completions",
        "/completions",
        "/completion",
    }
)
_CHAT_ROUTES: Final = frozenset({"/v1/chat/completions", "/chat/completions"})
_RESPONSES_ROUTES: Final = frozenset({"/v1/responses", "/responses"})

HeaderValue = str | Sequence[str]


@dataclass(frozen=True, kw_only=True)
class Recognition:
    """What a request says about its conversation."""

    session_id: str | None  # as the client sent it, or `h:<digest>` of it (`hashed`); None: none found
    signal: str | None  # which signal named it (one of SIGNALS)
    hashed: bool = False  # the client's id was not a plain token: this is a digest of it
    markers: frozenset[str] = field(default_factory=frozenset)  # auxiliary markers (MARKERS)
    rejected: tuple[tuple[str, str], ...] = ()  # (signal, reason) of present but unusable signals
    configured_rejected: bool = False  # the operator's header/field was sent but unusable (today: 400)

    @property
    def auxiliary(self) -> bool:
        """A title/summary request: it must run beside the conversation, never as one of its turns."""
        return bool(self.markers)


def asgi_headers(raw: Iterable[tuple[bytes, bytes]]) -> dict[str, tuple[str, ...]]:
    """ASGI header pairs as `recognize()` takes them: lower-case names, every value of a repeated name."""
    out: dict[str, tuple[str, ...]] = {}
    for n, (name, value) in enumerate(raw):
        if n >= _HEADERS_MAX:
            break
        key = name.decode("latin-1").lower()
        out[key] = (*out.get(key, ()), value.decode("latin-1"))
    return out


def normalize_session_id(value: object) -> tuple[str | None, bool, str | None]:
    """(id, hashed, reason): a plain token (kvsidecar's session-id charset, <= 128) is kept as sent; any
    other printable string up to ID_MAX characters becomes `h:` + its xxh3-128 digest; anything else is
    refused with a reason (R_*)."""
    if not isinstance(value, str):
        return None, False, R_TYPE
    if not value:
        return None, False, R_EMPTY
    if len(value) > ID_MAX:
        return None, False, R_LONG
    if _PLAIN_ID.match(value):
        return value, False, None
    if not value.isprintable():
        return None, False, R_CHARS
    digest = xxhash.xxh3_128_hexdigest(value.encode("utf-8", "surrogatepass"))
    return HASHED_PREFIX + digest, True, None


def _lowered(headers: Mapping[str, HeaderValue]) -> dict[str, tuple[str, ...]]:
    out: dict[str, tuple[str, ...]] = {}
    for n, (name, value) in enumerate(headers.items()):
        if n >= _HEADERS_MAX:
            break
        if not isinstance(name, str):
            continue
        values = (value,) if isinstance(value, str) else tuple(v for v in value if isinstance(v, str))
        key = name.lower()
        out[key] = (*out.get(key, ()), *values)
    return out


def _header(headers: Mapping[str, tuple[str, ...]], name: str) -> tuple[bool, object]:
    """(present, value); a name sent twice with different values is ambiguous (value None)."""
    values = headers.get(name)
    if not values:
        return False, None
    if len(set(values)) > 1:
        return True, None
    return True, values[0].strip()


def _json_object(value: object) -> dict[str, Any] | None:
    """A JSON object inside a string field, with a size cap; None for anything else."""
    if not isinstance(value, str) or len(value) > _JSON_MAX:
        return None
    try:
        parsed = json.loads(value)
    except (ValueError, RecursionError):
        return None
    return parsed if isinstance(parsed, dict) else None


class _Finder:
    """Tries signals in order; remembers the rejected ones."""

    def __init__(self) -> None:
        self.rejected: list[tuple[str, str]] = []
        self.found: tuple[str, str, bool] | None = None

    def offer(self, signal: str, present: bool, value: object, *, ambiguous: bool = False) -> bool:
        if self.found is not None or not present:
            return self.found is not None
        if ambiguous:
            self.rejected.append((signal, R_AMBIGUOUS))
            return False
        sid, hashed, reason = normalize_session_id(value)
        if sid is None:
            self.rejected.append((signal, reason or R_TYPE))
            return False
        self.found = (sid, signal, hashed)
        return True

    def header(self, signal: str, headers: Mapping[str, tuple[str, ...]], name: str) -> bool:
        present, value = _header(headers, name)
        return self.offer(signal, present, value, ambiguous=present and value is None)


def _claude_metadata_id(body: Mapping[str, Any]) -> tuple[bool, object, bool]:
    """(present, value, bad_json) of the session id in Claude Code's `metadata.user_id`."""
    metadata = body.get("metadata")
    if not isinstance(metadata, dict) or "user_id" not in metadata:
        return False, None, False
    user_id = metadata.get("user_id")
    if not isinstance(user_id, str):
        return True, user_id, False
    if user_id.lstrip().startswith("{"):
        parsed = _json_object(user_id)
        if parsed is None:
            return True, None, True
        if "session_id" not in parsed:
            return False, None, False
        return True, parsed.get("session_id"), False
    legacy = _LEGACY_USER_ID.search(user_id[: ID_MAX * 2])
    return (True, legacy.group(1), False) if legacy else (False, None, False)


def _configured(
    finder: _Finder,
    headers: Mapping[str, tuple[str, ...]],
    body: Mapping[str, Any],
    configured_header: str | None,
    configured_field: str | None,
) -> None:
    if configured_header:
        name = configured_header.lower()
        finder.header(SIG_SESSION_HEADER if name == DEFAULT_SESSION_HEADER else CONFIGURED, headers, name)
    if configured_field:
        finder.offer(CONFIGURED, configured_field in body, body.get(configured_field))


def _built_in(
    finder: _Finder, route: str, headers: Mapping[str, tuple[str, ...]], body: Mapping[str, Any]
) -> None:
    if finder.header(SIG_CLAUDE_HEADER, headers, "x-claude-code-session-id"):
        return
    if route in _MESSAGES_ROUTES:
        present, value, bad = _claude_metadata_id(body)
        if bad:
            finder.rejected.append((SIG_CLAUDE_METADATA, R_JSON))
        elif finder.offer(SIG_CLAUDE_METADATA, present, value):
            return
    for signal, name in (
        (SIG_CODEX_SESSION, "session-id"),
        (SIG_CODEX_THREAD, "thread-id"),
        (SIG_SESSION_HEADER, DEFAULT_SESSION_HEADER),
        (SIG_AFFINITY, "x-session-affinity"),
    ):
        if finder.header(signal, headers, name):
            return
    if route in _OPENAI_ROUTES:
        if finder.offer(SIG_PROMPT_CACHE_KEY, "prompt_cache_key" in body, body.get("prompt_cache_key")):
            return
        meta = body.get("client_metadata")
        if isinstance(meta, dict):
            finder.offer(SIG_CLIENT_METADATA, "session_id" in meta, meta.get("session_id"))


def _is_claude_title(body: Mapping[str, Any]) -> bool:
    if body.get("tools") != []:
        return False
    config = body.get("output_config")
    fmt = config.get("format") if isinstance(config, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type") != "json_schema":
        return False
    schema = fmt.get("schema")
    props = schema.get("properties") if isinstance(schema, dict) else None
    return isinstance(props, dict) and "title" in props


def _is_codex_title(headers: Mapping[str, tuple[str, ...]], body: Mapping[str, Any]) -> bool:
    present, value = _header(headers, "x-codex-turn-metadata")
    if not present:
        meta = body.get("client_metadata")
        value = meta.get("x-codex-turn-metadata") if isinstance(meta, dict) else None
    parsed = _json_object(value)
    return parsed is not None and parsed.get("thread_source") == "thread_title"


def _is_opencode_title(body: Mapping[str, Any]) -> bool:
    if body.get("tools"):
        return False
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not isinstance(messages[0], dict):
        return False
    first = messages[0]
    content = first.get("content")
    if isinstance(content, list) and content and isinstance(content[0], dict):
        content = content[0].get("text")
    return (
        first.get("role") == "system"
        and isinstance(content, str)
        and content[:_TITLE_PREFIX_MAX].lstrip().startswith(_OPENCODE_TITLE)
    )


def title_markers(
    route: str, headers: Mapping[str, tuple[str, ...]], body: Mapping[str, Any]
) -> frozenset[str]:
    """The auxiliary markers of a request (lower-cased headers as `asgi_headers()` gives them)."""
    found: set[str] = set()
    if route in _MESSAGES_ROUTES and _is_claude_title(body):
        found.add(TITLE_CLAUDE)
    if route in _RESPONSES_ROUTES and _is_codex_title(headers, body):
        found.add(TITLE_CODEX)
    if route in _CHAT_ROUTES and _is_opencode_title(body):
        found.add(TITLE_OPENCODE)
    return frozenset(found)


def recognize(
    route: str,
    headers: Mapping[str, HeaderValue],
    body: object,
    *,
    configured_header: str | None = None,
    configured_field: str | None = None,
) -> Recognition:
    """The conversation a request names, which signal named it, and its auxiliary markers.

    `route`: the canonical path (`/v1/messages`, `/v1/chat/completions`, `/v1/responses`, `/completion`,
    ...); `headers`: names in any case, each value a string or the sequence of a repeated header's values
    (`asgi_headers()`); `body`: the parsed JSON body (anything: only a JSON object is looked into).
    Never raises."""
    try:
        return _recognize(route, headers, body, configured_header, configured_field)
    except Exception:  # a bug here must never cost a request: it runs unrecognized
        return Recognition(session_id=None, signal=None)


def _recognize(
    route: str,
    headers: Mapping[str, HeaderValue],
    body: object,
    configured_header: str | None,
    configured_field: str | None,
) -> Recognition:
    low = _lowered(headers)
    data: Mapping[str, Any] = body if isinstance(body, dict) else {}
    finder = _Finder()
    _configured(finder, low, data, configured_header, configured_field)
    configured_rejected = bool(finder.rejected)
    if finder.found is None:
        _built_in(finder, route, low, data)
    markers = title_markers(route, low, data)
    if finder.found is None:
        sid, signal, hashed = None, None, False
    else:
        sid, signal, hashed = finder.found
    return Recognition(
        session_id=sid,
        signal=signal,
        hashed=hashed,
        markers=markers,
        rejected=tuple(finder.rejected),
        configured_rejected=configured_rejected,
    )
