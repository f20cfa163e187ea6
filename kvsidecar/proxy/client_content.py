"""A conversation identity derived from content, for clients that send no id (aider, curl, the openai SDK).

Pure functions, no I/O; nothing raises on a hostile body (normalization gives None instead).

Normalization. A request's prompt becomes a sequence of *elements*, each a canonical byte string and its
xxh3-64 digest, in prompt order:

- a `tools` element when the request declares tools (the tool list as canonical JSON, `cache_control`
  removed);
- OpenAI chat (`/v1/chat/completions`): one element per message: role, then the message's other fields
  (`tool_calls`, `tool_call_id`, `name`, ...) as canonical JSON, then its content (a string and a list of
  `text` parts are the same thing);
- Anthropic Messages (`/v1/messages`): `system` (string or blocks) as one element, then one per message;
  `cache_control` is removed everywhere and string content equals a single `text` block, so Claude Code's
  moving cache breakpoints do not count as a change;
- Responses (`/v1/responses`): `instructions` as one element, then one per `input` item, without the
  items' volatile `id` and `status`; `input_text` / `output_text` parts are both text.

Each element ends with its text, so a text prefix is a byte prefix of the element.

Extension (`extends`). The table keeps, per known conversation, the elements' digests of its latest request
(`KnownConversation`; the reply is not recorded: the next request carries it). A request R extends a known
conversation K of n elements when:

1. R has more than n elements, or exactly n and all equal (a client retrying the same request);
2. the first n - 1 elements are equal;
3. element n - 1 is equal, or K's is a user message and R's is K's cut at a paragraph boundary (`\\n\\n`):
   aider drops the reminder it appended to the previous user message.

`find_conversation` picks, among the known conversations of the same credential that R extends, the one with
the most elements (exact matches before paragraph-cut ones; then the first in iteration order, so pass the
most recent first). A wrong guess costs warmth, never correctness: the id only names which KV to start
from, and llama-server reuses only the token-exact common prefix of whatever it holds.

New conversations get `conversation_id()`: a digest of the credential and the request's element digests, so
the same first request maps to the same id after a restart; a taken id gets a `.2`, `.3`, ... suffix. The
ids match kvsidecar's session-id charset.
"""

from __future__ import annotations

import json
from collections.abc import Container, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Final

import xxhash

MAX_ELEMENTS: Final = 4096  # a request with more is not normalized (no content identity)
MAX_CUTS: Final = 64  # paragraph cuts remembered for a known conversation's last element
CONTENT_PREFIX: Final = "c:"
SIGNAL: Final = "content"  # a content-derived id's signal name (beside client_ids.SIGNALS)
_SEP = "\x1f"
_BLOCK_SEP = "\x1e"
_VOLATILE_ITEM_KEYS: Final = frozenset({"id", "status"})

CHAT: Final = "chat"
ANTHROPIC: Final = "anthropic"
RESPONSES: Final = "responses"
_ROUTE_API: Final = {
    "/v1/chat/completions": CHAT,
    "/chat/completions": CHAT,
    "/v1/messages": ANTHROPIC,
    "/v1/responses": RESPONSES,
    "/responses": RESPONSES,
}


class _Unusable(Exception):
    """The body cannot be normalized (not the shape of its route, or too big)."""


@dataclass(frozen=True, kw_only=True)
class Normalized:
    """A request's prompt as canonical elements (see the module docstring)."""

    api: str
    elements: tuple[bytes, ...]
    digests: tuple[str, ...]
    roles: tuple[str, ...]


@dataclass(frozen=True, kw_only=True)
class KnownConversation:
    """What the table keeps of a conversation: digests only, never its text."""

    conversation_id: str
    credential: str
    digests: tuple[str, ...]
    last_role: str
    last_cuts: frozenset[str]  # digests of the last element's paragraph-boundary cuts

    @classmethod
    def of(cls, conversation_id: str, credential: str, request: Normalized) -> KnownConversation:
        last = request.elements[-1] if request.elements else b""
        return cls(
            conversation_id=conversation_id,
            credential=credential,
            digests=request.digests,
            last_role=request.roles[-1] if request.roles else "",
            last_cuts=frozenset(_digest(cut) for cut in paragraph_cuts(last)),
        )


@dataclass(frozen=True, kw_only=True)
class ContentMatch:
    conversation_id: str
    matched: int  # elements of the known conversation that the request carries
    exact: bool  # False: its last element matched as a paragraph cut


@dataclass(frozen=True, kw_only=True)
class Divergence:
    """Where two normalized requests first differ."""

    index: int  # the element (see the module docstring for what element 0 is)
    offset: int  # byte offset inside that element's canonical bytes
    role: str  # the role of that element in the later request ("" past its end)


def _digest(data: bytes) -> str:
    return xxhash.xxh3_64_hexdigest(data)


def _canonical(value: object) -> str:
    try:
        return json.dumps(
            _strip_cache_control(value), sort_keys=True, ensure_ascii=False, separators=(",", ":")
        )
    except (TypeError, ValueError, RecursionError) as exc:
        raise _Unusable from exc


def _strip_cache_control(value: object, depth: int = 0) -> object:
    if depth > 64:
        raise _Unusable
    if isinstance(value, dict):
        return {k: _strip_cache_control(v, depth + 1) for k, v in value.items() if k != "cache_control"}
    if isinstance(value, list):
        return [_strip_cache_control(v, depth + 1) for v in value]
    return value


def _text_blocks(content: object, text_types: frozenset[str]) -> str:
    """Content as one string: a plain string and a list of text parts are the same; other parts are kept
    as canonical JSON."""
    if content is None:
        return ""
    if isinstance(content, str):
        return "text:" + content
    if not isinstance(content, list):
        return _canonical(content)
    parts = []
    for block in content:
        kind = block.get("type") if isinstance(block, dict) else None
        if isinstance(kind, str) and kind in text_types and isinstance(block.get("text"), str):
            parts.append("text:" + block["text"])
        else:
            parts.append(_canonical(block))
    return _BLOCK_SEP.join(parts)


_TEXT: Final = frozenset({"text"})
_RESPONSE_TEXT: Final = frozenset({"input_text", "output_text", "text"})


def _element(role: str, extras: Mapping[str, Any], text: str) -> tuple[str, bytes]:
    head = role + _SEP + (_canonical(dict(extras)) if extras else "") + _SEP
    return role, (head + text).encode("utf-8", "surrogatepass")


def _chat(body: Mapping[str, Any]) -> list[tuple[str, bytes]]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise _Unusable
    out = []
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _Unusable
        extras = {k: v for k, v in message.items() if k not in ("role", "content")}
        out.append(_element(message["role"], extras, _text_blocks(message.get("content"), _TEXT)))
    return out


def _anthropic(body: Mapping[str, Any]) -> list[tuple[str, bytes]]:
    messages = body.get("messages")
    if not isinstance(messages, list):
        raise _Unusable
    out = []
    system = body.get("system")
    if system is not None:
        out.append(_element("system", {}, _text_blocks(system, _TEXT)))
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise _Unusable
        extras = {k: v for k, v in message.items() if k not in ("role", "content")}
        out.append(_element(message["role"], extras, _text_blocks(message.get("content"), _TEXT)))
    return out


def _responses(body: Mapping[str, Any]) -> list[tuple[str, bytes]]:
    items = body.get("input")
    out = []
    instructions = body.get("instructions")
    if isinstance(instructions, str) and instructions:
        out.append(_element("instructions", {}, "text:" + instructions))
    if isinstance(items, str):
        return [*out, _element("user", {}, "text:" + items)]
    if not isinstance(items, list):
        raise _Unusable
    for item in items:
        if not isinstance(item, dict):
            raise _Unusable
        kind = item.get("type", "message")
        if not isinstance(kind, str):  # any JSON value: its canonical form stands for it
            kind = _canonical(kind)
        if kind == "message" and isinstance(item.get("role"), str):
            extras = {
                k: v for k, v in item.items() if k not in ("role", "content", "type", *_VOLATILE_ITEM_KEYS)
            }
            out.append(_element(item["role"], extras, _text_blocks(item.get("content"), _RESPONSE_TEXT)))
        else:
            rest = {k: v for k, v in item.items() if k not in _VOLATILE_ITEM_KEYS}
            out.append(_element(kind[:64], {}, _canonical(rest)))
    return out


_BY_API = {CHAT: _chat, ANTHROPIC: _anthropic, RESPONSES: _responses}


def normalize(route: str, body: object) -> Normalized | None:
    """The request's canonical elements; None for a route without messages or a body that is not its
    shape (never raises)."""
    api = _ROUTE_API.get(route)
    if api is None or not isinstance(body, dict):
        return None
    try:
        items = _BY_API[api](body)
        tools = body.get("tools")
        if tools:
            items.insert(0, _element("tools", {}, _canonical(tools)))
    except (_Unusable, RecursionError):
        return None
    if len(items) > MAX_ELEMENTS:
        return None
    roles = tuple(role for role, _ in items)
    elements = tuple(data for _, data in items)
    return Normalized(api=api, elements=elements, digests=tuple(_digest(e) for e in elements), roles=roles)


def paragraph_cuts(element: bytes) -> list[bytes]:
    """The element cut just before each of its last MAX_CUTS paragraph breaks (`\\n\\n`) in its text, the
    role and fields kept; the whole element is not among them."""
    head_end = element.find(_SEP.encode(), element.find(_SEP.encode()) + 1) + 1
    if head_end <= 0:
        return []
    cuts: list[bytes] = []
    pos = len(element)
    while len(cuts) < MAX_CUTS:
        pos = element.rfind(b"\n\n", head_end, pos)
        if pos < 0:
            break
        if pos > head_end + len(b"text:"):
            cuts.append(element[:pos])
    return cuts


def extends(request: Normalized, known: KnownConversation) -> ContentMatch | None:
    """Does `request` continue `known` (the rules in the module docstring)? Never raises."""
    n, theirs = len(known.digests), request.digests
    if n == 0 or len(theirs) < n:
        return None
    if len(theirs) == n and theirs != known.digests:
        return None
    if theirs[: n - 1] != known.digests[: n - 1]:
        return None
    if theirs[n - 1] == known.digests[n - 1]:
        return ContentMatch(conversation_id=known.conversation_id, matched=n, exact=True)
    if known.last_role == "user" and request.roles[n - 1] == "user" and theirs[n - 1] in known.last_cuts:
        return ContentMatch(conversation_id=known.conversation_id, matched=n, exact=False)
    return None


def find_conversation(
    request: Normalized, credential: str, known: Iterable[KnownConversation]
) -> ContentMatch | None:
    """The known conversation of `credential` that `request` extends with the most elements (exact before
    paragraph-cut matches; ties: the first in iteration order)."""
    best: ContentMatch | None = None
    for candidate in known:
        if candidate.credential != credential:
            continue
        match = extends(request, candidate)
        if match is None:
            continue
        if best is None or (match.matched, match.exact) > (best.matched, best.exact):
            best = match
    return best


def conversation_id(credential: str, request: Normalized, taken: Container[str] = ()) -> str:
    """A new conversation's id: `c:` + a digest of the credential and the request's elements; a taken id
    gets `.2`, `.3`, ... (deterministic, within kvsidecar's session-id charset)."""
    seed = "\0".join((credential, request.api, *request.digests)).encode("utf-8", "surrogatepass")
    base = CONTENT_PREFIX + xxhash.xxh3_128_hexdigest(seed)
    candidate, n = base, 1
    while candidate in taken:
        n += 1
        candidate = f"{base}.{n}"
    return candidate


def first_divergence(earlier: Normalized, later: Normalized) -> Divergence | None:
    """Where `later` stops carrying `earlier`'s elements: None when it carries them all (it extends it)."""
    for index, (a, b) in enumerate(zip(earlier.elements, later.elements, strict=False)):
        if a != b:
            offset = next(
                (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
            )
            return Divergence(index=index, offset=offset, role=later.roles[index])
    if len(later.elements) >= len(earlier.elements):
        return None
    n = len(later.elements)
    return Divergence(index=n, offset=0, role="")


def divergence_index(request: Normalized, known: KnownConversation) -> int | None:
    """The first element where `request` differs from what the table knows (digests only); None when it
    carries every known element."""
    for index, (a, b) in enumerate(zip(known.digests, request.digests, strict=False)):
        if a != b:
            return index
    return None if len(request.digests) >= len(known.digests) else len(request.digests)
