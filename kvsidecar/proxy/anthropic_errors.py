"""Anthropic's error shape and the JSON encoding of the Messages conversion (`kvsidecar.proxy.anthropic`
for requests, `kvsidecar.proxy.anthropic_answer` and `kvsidecar.proxy.anthropic_stream` for answers):
the one exception a conversion raises, `ConversionError`, with its stable codes, and the bytes of an
Anthropic error answer.
"""

from __future__ import annotations

import json
from typing import Any

INVALID_FIELD = "KV_ANTHROPIC_INVALID_FIELD"  # a field of the wrong type or value
MISSING_FIELD = "KV_ANTHROPIC_MISSING_FIELD"  # a field llama-server requires
TOO_LARGE = "KV_ANTHROPIC_TOO_LARGE"  # nesting or counts over kvsidecar.proxy.anthropic's bounds
INVALID_TEXT = "KV_ANTHROPIC_INVALID_TEXT"  # text that is not valid Unicode, numbers JSON cannot carry
UPSTREAM_INVALID = "KV_ANTHROPIC_UPSTREAM_INVALID"  # llama-server's answer is not a chat completion
CODES = frozenset({INVALID_FIELD, MISSING_FIELD, TOO_LARGE, INVALID_TEXT, UPSTREAM_INVALID})

MAX_INT = 2**63 - 1  # nlohmann's int64 range; beyond it the number would change on the way

# Anthropic's error `type` for each status (https://docs.anthropic.com/en/api/errors).
ERROR_TYPES: dict[int, str] = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    502: "api_error",
    503: "overloaded_error",
    504: "api_error",
    529: "overloaded_error",
}


class ConversionError(Exception):
    """A request (or an answer) that cannot be converted. `code`: one of `CODES`; `param`: the JSON path of
    the field at fault (never its value); `status`: the HTTP status to answer with."""

    def __init__(self, code: str, message: str, *, param: str | None = None, status: int = 400) -> None:
        super().__init__(message)
        self.code, self.message, self.param, self.status = code, message, param, status

    def body(self) -> bytes:
        """The Anthropic-shaped error body (`error.code`/`param` are ours; the SDK ignores them)."""
        return anthropic_error(self.status, self.message, code=self.code, param=self.param)


def anthropic_error(status: int, message: str, *, code: str | None = None, param: str | None = None) -> bytes:
    error: dict[str, Any] = {"type": ERROR_TYPES.get(status, "api_error"), "message": message}
    if code is not None:
        error["code"] = code
    if param is not None:
        error["param"] = param
    return dumps({"type": "error", "error": error})


def error_to_anthropic(status: int, body: bytes) -> bytes:
    """llama-server's error answer (OpenAI-shaped, `{"error": {"message": ...}}`) in Anthropic's shape."""
    message = f"llama-server answered {status}"
    try:
        data = json.loads(body[: 1 << 20])
    except (ValueError, RecursionError):
        data = None
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        said = data["error"].get("message")
        if isinstance(said, str):
            message = said[:4000]
    return anthropic_error(status, message)


def dumps(value: Any) -> bytes:
    """Compact JSON in UTF-8, as llama-server's `dump()` writes it (insertion order, no ASCII escapes)."""
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode("utf-8")
    except UnicodeEncodeError as exc:  # a lone surrogate from a `\ud800` escape: not Unicode text
        raise ConversionError(INVALID_TEXT, "text that is not valid Unicode (a lone surrogate)") from exc
    except (ValueError, RecursionError) as exc:
        raise ConversionError(INVALID_TEXT, f"not representable as JSON: {exc}") from exc
