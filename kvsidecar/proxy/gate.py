"""The one gate every proxied request passes before anything of its body reaches llama-server (pinned,
converted, unpinned and information routes alike, and before a session goes to a peer's proxy in fleet
mode), and before any slot is acquired:

- the body as llama-server will parse it: on every route, JSON text within the limits llama-server is
  measured to parse safely (`kvsidecar.backend.llama_body`: nesting, values, members, a schema's `$ref`s, a
  `grammar`'s groups and rules): 400 `KV_BODY_LIMIT` beyond them, `KV_BAD_REQUEST` for what is not JSON and
  for llama-server's own `chat_parser` / `grammar_triggers`. A `GET`/`HEAD` may have no body at all, a
  `POST` must; `multipart/form-data` only on the transcription routes (llama-server turns its fields into a
  flat JSON object of strings). A compressed body is not JSON text, so it is refused (llama-server 11434 is
  built without zlib and inflates nothing), and so is an encoded form; a `Content-Encoding` on a body read as
  plain JSON is dropped on the way out. An integer beyond 64 bits and a lone surrogate escape are refused as
  llama-server's parser refuses them; `/detokenize` ids are held to the vocabulary (`check_token_ids`);
- the modalities: an image, audio or video part for a model llama-server runs without that input is 400
  `KV_MODALITY_UNSUPPORTED` (llama-server answers 500 for it, or 501 for a transcription), found where
  llama-server loads media from (tools/server/server-common.cpp, server-chat.cpp at build 11434): a chat
  message's content parts (`image_url`, `input_audio`, `input_video`, `video_url`); a Responses item's
  `content` or `function_call_output` `output` parts (`input_image`); an Anthropic message's `image` blocks
  with a `base64` or `url` source, in tool results too; a prompt object's `multimodal_data` and an
  embedding input's content parts. What the server takes is its `/props` `modalities`; a server that has not
  answered a probe yet, or says nothing of them, is not second-guessed.

Refusals are `KvError`s with stable codes; the proxy answers them in the route's own shape (Anthropic's on
`/v1/messages` and `/v1/messages/count_tokens`, OpenAI's elsewhere).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Final

from kvsidecar.backend.base import BackendCapabilities
from kvsidecar.backend.llama_body import check_fields, read_json
from kvsidecar.backend.llama_http import ANTHROPIC_ROUTES
from kvsidecar.errors import BadRequest, ModalityUnsupported

VISION: Final = "vision"
AUDIO: Final = "audio"
VIDEO: Final = "video"
ANY_MEDIA: Final = "media"  # `multimodal_data`: any modality llama-server's projector takes

_CHAT_ROUTES: Final = frozenset(
    {
        "/chat/completions",
        "/v1/chat/completions",
        "/chat/completions/input_tokens",
        "/v1/chat/completions/input_tokens",
        "/apply-template",
    }
)
_RESPONSES_ROUTES: Final = frozenset(
    {"/responses", "/v1/responses", "/responses/input_tokens", "/v1/responses/input_tokens"}
)
_PROMPT_ROUTES: Final = frozenset(
    {
        "/completion",
        "/completions",
        "/v1/completions",
        "/infill",
        "/embedding",
        "/embeddings",
        "/v1/embeddings",
        "/rerank",
        "/reranking",
        "/v1/rerank",
        "/v1/reranking",
    }
)
_PROMPT_FIELDS: Final = ("prompt", "content", "input", "query", "documents", "input_extra")
TRANSCRIPTION_ROUTES: Final = frozenset({"/audio/transcriptions", "/v1/audio/transcriptions"})
CHAT_MEDIA: Final = {"image_url": VISION, "input_audio": AUDIO, "input_video": VIDEO, "video_url": VIDEO}
_NAMES: Final = {VISION: "image", AUDIO: "audio", VIDEO: "video", ANY_MEDIA: "multimodal"}


def admit(
    method: str,
    path: str,
    headers: Iterable[tuple[bytes, bytes]],
    body: bytes,
    caps: BackendCapabilities | None,
) -> Any:
    """Check a request to the route `path` (canonical) before anything of it is forwarded, `caps` being the
    server's as last probed; returns the body as JSON (None when it has none, or is a transcription's form).
    Raises `KvError`s only."""
    props = caps.props if caps is not None else None
    if method in ("GET", "HEAD") and not body:
        return None  # llama-server reads no body there; one that is sent is held to the same rules
    types = [v.strip().lower() for k, v in headers if k.lower() == b"content-type"]
    if path in TRANSCRIPTION_ROUTES and len(types) == 1 and types[0].startswith(b"multipart/form-data"):
        encodings = {v.strip().lower() for k, v in headers if k.lower() == b"content-encoding"} - {
            b"identity"
        }
        if encodings:  # a form is forwarded as it came, and llama-server inflates nothing
            raise BadRequest("Content-Encoding: the proxy takes a form unencoded")
        _need({AUDIO}, props)  # a form of flat string fields and the audio file: nothing nests
        return None
    if not body:
        raise BadRequest(f"{path} needs a JSON request body")
    data = read_json(body)
    check_fields(data)
    _need(media(path, data), props)
    return data


DETOKENIZE_ROUTES: Final = frozenset({"/detokenize"})


def token_ids(path: str, data: Any) -> list[Any] | None:
    """The token ids a request asks llama-server to look up in its vocabulary unchecked (`/detokenize`:
    one outside it is a 500 there), None for any other route or a body without them."""
    if path not in DETOKENIZE_ROUTES or not isinstance(data, dict):
        return None
    tokens = data.get("tokens")
    return tokens if isinstance(tokens, list) else None


def check_token_ids(ids: list[Any], n_vocab: int) -> None:
    """Every id an integer of the vocabulary (a float such as 5.0 is llama-server's 5 and passes)."""
    for t in ids:
        ok = isinstance(t, (int, float)) and not isinstance(t, bool) and float(t).is_integer()
        if not ok or not 0 <= t < n_vocab:
            raise BadRequest(f"tokens: {str(t)[:40]} is not a token id of the model (n_vocab {n_vocab})")


def _need(kinds: set[str], props: Mapping[str, Any] | None) -> None:
    if not kinds:
        return
    offered = modalities(props)
    if offered is None:
        return
    missing = sorted(k for k in kinds if k not in offered and not (k == ANY_MEDIA and offered))
    if missing:
        what = " and ".join(_NAMES[k] for k in missing)
        takes = " and ".join(["text", *sorted(_NAMES[k] for k in offered)])
        raise ModalityUnsupported(
            f"the request has {what} input, and the model llama-server runs takes {takes} only "
            "(llama-server reads other inputs through a multimodal projector, --mmproj)"
        )


def modalities(props: Mapping[str, Any] | None) -> frozenset[str] | None:
    """The inputs besides text the running model takes (its `/props` `modalities`); None: not said."""
    said = props.get("modalities") if props is not None else None
    if not isinstance(said, dict):
        return None
    return frozenset(k for k in (VISION, AUDIO, VIDEO) if said.get(k) is True)


def media(path: str, data: Any) -> set[str]:
    """The modalities the body's parts need, read where llama-server loads media from (module docstring)."""
    if not isinstance(data, dict):
        return set()
    if path in _CHAT_ROUTES:
        return {
            CHAT_MEDIA[t]
            for t in _part_types(_contents(data.get("messages"), ("content",)))
            if t in CHAT_MEDIA
        }
    if path in _RESPONSES_ROUTES:
        parts = _part_types(_contents(data.get("input"), ("content", "output")))
        return {VISION} if "input_image" in parts else set()
    if path in ANTHROPIC_ROUTES:
        return {VISION} if _anthropic_images(data.get("messages")) else set()
    if path in _PROMPT_ROUTES:
        return _prompt_media(data.get(k) for k in _PROMPT_FIELDS)
    return set()


def _contents(items: Any, keys: tuple[str, ...]) -> Iterator[Any]:
    """The content lists of a list of messages (or Responses items)."""
    if isinstance(items, list):
        for item in items:
            if isinstance(item, dict):
                yield from (item.get(k) for k in keys)


def _part_types(contents: Iterable[Any]) -> set[str]:
    out: set[str] = set()
    for content in contents:
        if isinstance(content, list):
            out.update(p["type"] for p in content if isinstance(p, dict) and isinstance(p.get("type"), str))
    return out


def _anthropic_image(block: Any) -> bool:
    """An image block llama-server converts (it drops other source types, as the proxy's converter does)."""
    if not isinstance(block, dict) or block.get("type") != "image":
        return False
    source = block.get("source")
    return isinstance(source, dict) and source.get("type") in ("base64", "url")


def _anthropic_images(messages: Any) -> bool:
    for content in _contents(messages, ("content",)):
        if not isinstance(content, list):
            continue
        for block in content:
            if _anthropic_image(block):
                return True
            inner = (
                block.get("content")
                if isinstance(block, dict) and block.get("type") == "tool_result"
                else None
            )
            if isinstance(inner, list) and any(_anthropic_image(b) for b in inner):
                return True
    return False


def _prompt_media(fields: Iterable[Any]) -> set[str]:
    """`multimodal_data` in a prompt object, media parts in an embedding input's content, at any depth of
    the prompt fields (bounded: the body is within llama_body's limits)."""
    out: set[str] = set()
    stack = [f for f in fields if isinstance(f, dict | list)]
    while stack:
        value = stack.pop()
        items = value.values() if isinstance(value, dict) else value
        if isinstance(value, dict):
            if value.get("multimodal_data"):
                out.add(ANY_MEDIA)
            kind = value.get("type")
            if isinstance(kind, str) and kind in CHAT_MEDIA:
                out.add(CHAT_MEDIA[kind])
        stack.extend(v for v in items if isinstance(v, dict | list))
    return out
