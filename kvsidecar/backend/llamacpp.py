"""`LlamaCppBackend`: the backend interface over llama-server's HTTP API, with httpx.

This module is kvsidecar's only client of llama-server's management and probe calls (`/props`, `/slots`,
`/completion` for the canary and the doctor, `/apply-template`, `/tokenize` and `/v1/models` for a prompt's
tokens), with the API key when one is configured, and the only place that sees httpx exceptions: every
failure leaves it as a `BackendError` subclass with a stable code (a prompt the server refuses to render or
tokenize, HTTP 4xx: `BadRequest`).
What the proxy needs to know about llama-server's routes comes from `kvsidecar.backend.llama_http`.
Responses are read defensively because their schema moves between llama.cpp builds.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import httpx

from kvsidecar.backend.base import (
    BackendCapabilities,
    BackendSlot,
    EraseResult,
    InstanceState,
    PromptResult,
    RestoreResult,
    SaveResult,
    TokenizerInfo,
)
from kvsidecar.backend.llama_http import SLOT_FIELD, read_api_key, token_counts
from kvsidecar.errors import (
    BackendError,
    BackendUnavailable,
    BackendUnsupported,
    BadRequest,
    ConnectionLost,
    EraseFailed,
    KvError,
    OperationTimeout,
    RestoreFailed,
    SaveFailed,
    SlotNotFound,
)

# llama-server's per-start media marker: `<__media_` + random characters + `__>`. A marker pinned by the
# operator (LLAMA_MEDIA_MARKER) or an older build's constant `<__media__>` is not a nonce: refused.
_NONCE = re.compile(r"^<__media_[A-Za-z0-9_-]{16,}__>$")


def _is_sleeping(props: dict[str, Any]) -> bool:
    """/props `is_sleeping`; absent (a build without sleep mode) is awake, anything but false is asleep:
    a value that is not a boolean cannot prove a model is loaded."""
    return "is_sleeping" in props and props["is_sleeping"] is not False


def _nonce(value: Any) -> str | None:
    return value if isinstance(value, str) and _NONCE.match(value) else None


# Names we send are our own opaque digests; this is a second fence after kvsidecar.store.naming.
_SAFE_FILENAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")

Action = Literal["save", "restore", "erase"]
_FAILURE: dict[Action, type[BackendError]] = {
    "save": SaveFailed,
    "restore": RestoreFailed,
    "erase": EraseFailed,
}


def _int(value: Any, default: int | None = None) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _float(value: Any) -> float | None:
    if isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    return None


def _wire_json(value: Any) -> bytes:
    """Compact UTF-8 JSON; text JSON cannot carry (a lone surrogate, NaN) is the caller's bad request."""
    try:
        return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
    except UnicodeEncodeError:
        raise BadRequest("text that is not valid Unicode (a lone surrogate)") from None
    except (ValueError, TypeError, RecursionError) as exc:
        raise BadRequest(f"not representable as JSON: {exc}") from None


def _tokenizer_info(data: Any) -> TokenizerInfo:
    """`GET /v1/models`: `data[0].meta.n_vocab` and `data[0].architecture.input_modalities`."""
    models = data.get("data") if isinstance(data, dict) else None
    model = models[0] if isinstance(models, list) and models and isinstance(models[0], dict) else {}
    meta, arch = model.get("meta"), model.get("architecture")
    n_vocab = _int(meta.get("n_vocab")) if isinstance(meta, dict) else None
    if n_vocab is None or not 0 < n_vocab < 2**31:
        raise BackendUnavailable("tokenizer /v1/models: no vocabulary size in the answer")
    modalities = arch.get("input_modalities") if isinstance(arch, dict) else None
    if not isinstance(modalities, list):
        raise BackendUnavailable("tokenizer /v1/models: no input modalities in the answer")
    return TokenizerInfo(n_vocab=n_vocab, multimodal=any(m != "text" for m in modalities))


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:200] or response.reason_phrase
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", ""))[:300]
    return str(body)[:200]


class LlamaCppBackend:
    """One llama-server. Save/restore use `persist_timeout_s`; everything else the short request bound."""

    kind = "llama.cpp"

    def __init__(
        self,
        *,
        base_url: str,
        api_key: str | None = None,
        connect_timeout_s: float = 2.0,
        request_timeout_s: float = 10.0,
        persist_timeout_s: float = 120.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self._request_timeout = httpx.Timeout(request_timeout_s, connect=connect_timeout_s)
        self._persist_timeout = httpx.Timeout(persist_timeout_s, connect=connect_timeout_s)
        self._client = httpx.AsyncClient(
            base_url=self.base_url, headers=headers, timeout=self._request_timeout, transport=transport
        )
        # Slot ids that GET /slots last reported; llama-server itself accepts ids it does not have.
        self._slot_ids: frozenset[int] | None = None
        # The vocabulary a prompt's tokens are checked against, fetched once per server instance: dropped
        # when /props shows a new start (another nonce) and when an answer holds an id beyond it.
        self._tokenizer: TokenizerInfo | None = None
        self._nonce_seen: str | None = None

    @classmethod
    def from_config(
        cls, server: Any, *, name: str | None = None, transport: httpx.AsyncBaseTransport | None = None
    ) -> LlamaCppBackend:
        """From a `ServerConfig`; its `api_key_file` is read once, here (`ConfigError` if unusable)."""
        api_key = None
        if server.api_key_file is not None:
            setting = f"servers.{name}.api_key_file" if name else "api_key_file"
            api_key = read_api_key(Path(server.api_key_file), setting=setting)
        return cls(
            base_url=server.base_url,
            api_key=api_key,
            connect_timeout_s=server.connect_timeout_s,
            request_timeout_s=server.request_timeout_s,
            persist_timeout_s=server.persist_timeout_s,
            transport=transport,
        )

    async def aclose(self) -> None:
        await self._client.aclose()

    async def _request(
        self,
        method: str,
        path: str,
        *,
        what: str,
        failure: type[BackendError] = BackendUnavailable,
        json_body: dict[str, Any] | None = None,
        content: bytes | None = None,
        params: dict[str, str] | None = None,
        timeout: httpx.Timeout | None = None,
        refusal: type[KvError] | None = None,
    ) -> Any:
        headers = {"Content-Type": "application/json"} if content is not None else None
        try:
            response = await self._client.request(
                method,
                path,
                json=json_body,
                content=content,
                headers=headers,
                params=params,
                timeout=timeout or self._request_timeout,
            )
        except httpx.TimeoutException as exc:
            raise OperationTimeout(
                f"{what}: llama-server did not answer in time ({type(exc).__name__})"
            ) from exc
        except httpx.ConnectError as exc:
            raise BackendUnavailable(
                f"{what}: cannot reach llama-server at {self.base_url} ({exc!s})"
            ) from exc
        except httpx.HTTPError as exc:
            # The request reached the server and the connection died under it: a crash, most likely.
            raise ConnectionLost(f"{what}: llama-server dropped the connection ({exc!s})") from exc
        if response.status_code == 501:
            raise BackendUnsupported(f"{what}: {_error_message(response)}")
        if refusal is not None and 400 <= response.status_code < 500:
            raise refusal(f"{what}: HTTP {response.status_code} {_error_message(response)}")
        if response.status_code >= 500 and failure is BackendUnavailable:
            raise BackendUnavailable(f"{what}: HTTP {response.status_code} {_error_message(response)}")
        if response.status_code >= 400:
            raise failure(f"{what}: HTTP {response.status_code} {_error_message(response)}")
        try:
            return response.json()
        except (ValueError, RecursionError) as exc:  # not JSON, or nested past the parser's depth
            raise BackendUnavailable(
                f"{what}: llama-server answered with something that is not JSON"
            ) from exc

    async def health(self) -> bool:
        """True when /health says ok (the model is loaded); False while loading or unreachable."""
        try:
            response = await self._client.get("/health")
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def probe(self) -> BackendCapabilities:
        """`/props`, which llama-server answers without waking from sleep mode and without resetting its
        idle timer; `/slots` (which does both) only when `/props` leaves the slots unknown (older builds)."""
        props = await self._request("GET", "/props", what="probe /props")
        props = props if isinstance(props, dict) else {}
        if props.get("role") == "router":  # its slots are its models' children's, never its own
            raise BackendUnsupported(
                f"probe /props: llama-server at {self.base_url} is a router (started without a model): give "
                "each of its models a server entry with `model:` (its id in GET /models), or let kvsidecar "
                "discover them (`discover_models: true`; docs/SWAPS.md)"
            )
        sleeping = _is_sleeping(props)
        settings = props.get("default_generation_settings")
        n_ctx = _int(settings.get("n_ctx")) if isinstance(settings, dict) else None
        total = _int(props.get("total_slots"))
        endpoint = props.get("endpoint_slots")
        slots: list[BackendSlot] = []
        if isinstance(endpoint, bool) and total is not None and (n_ctx is not None or sleeping):
            slots_endpoint = endpoint
        elif sleeping:
            slots_endpoint = True  # asking would wake it; a build with sleep mode has the endpoint
        else:
            try:
                slots = await self.inspect_slots()
                slots_endpoint = True
            except BackendUnsupported:
                slots, slots_endpoint = [], False
        model_path = props.get("model_path")
        build_info = props.get("build_info")
        marker = props.get("media_marker")
        self._saw_instance(_nonce(marker))
        return BackendCapabilities(
            kind=self.kind,
            alive=True,
            slots_endpoint=slots_endpoint,
            total_slots=total or len(slots),
            n_ctx=n_ctx if n_ctx is not None else (slots[0].n_ctx if slots else None),
            model_path=model_path if isinstance(model_path, str) else None,
            build_info=build_info if isinstance(build_info, str) else None,
            instance_id=_nonce(marker),
            props=props,
            sleeping=sleeping,
        )

    async def instance_id(self) -> str | None:
        return (await self.instance_state()).nonce

    async def instance_state(self) -> InstanceState:
        props = await self._request("GET", "/props", what="identity /props")
        if not isinstance(props, dict):
            return InstanceState(nonce=None, sleeping=False)
        sleeping = _is_sleeping(props)
        nonce = _nonce(props.get("media_marker"))
        self._saw_instance(nonce)
        return InstanceState(nonce=nonce, sleeping=sleeping)

    def _saw_instance(self, nonce: str | None) -> None:
        """Another start of the server may load another model: its vocabulary is asked again."""
        if nonce != self._nonce_seen:
            self._nonce_seen, self._tokenizer = nonce, None

    async def wake(self) -> None:
        """`GET /slots` waits for llama-server to leave sleep mode (its model loaded again) before it
        answers, even when the endpoint is disabled; bounded like a persistence call (a model load)."""
        with contextlib.suppress(BackendUnsupported):
            await self._request("GET", "/slots", what="wake /slots", timeout=self._persist_timeout)

    # -- a prompt's tokens, before it runs (kvsidecar.backend.prompts) --------------------------------------
    async def tokenizer_info(self) -> TokenizerInfo:
        if self._tokenizer is None:
            data = await self._request("GET", "/v1/models", what="tokenizer /v1/models")
            self._tokenizer = _tokenizer_info(data)
        return self._tokenizer

    async def tokenize(
        self, content: str | Sequence[str | int], *, add_special: bool, parse_special: bool
    ) -> list[int]:
        """`POST /tokenize`: llama-server's `tokenize_mixed`, the function its completion routes tokenize a
        prompt with (a text, or texts and ids mixed: only the first text gets the BOS). The answer must be
        a list of ids of the vocabulary (`tokenizer_info`, asked again once if an id is beyond it)."""
        body = {"content": content, "add_special": add_special, "parse_special": parse_special}
        data = await self._request(
            "POST", "/tokenize", content=_wire_json(body), what="tokenize", refusal=BadRequest
        )
        tokens = data.get("tokens") if isinstance(data, dict) else None
        if not isinstance(tokens, list) or not all(type(t) is int and t >= 0 for t in tokens):
            raise BackendUnavailable("tokenize: the answer is not a list of token ids")
        top = max(tokens, default=-1)
        if top >= (await self.tokenizer_info()).n_vocab:
            self._tokenizer = None  # the model may have changed under the same address
            if top >= (await self.tokenizer_info()).n_vocab:
                raise BackendUnavailable(f"tokenize: the answer holds id {top}, beyond the vocabulary")
        return tokens

    async def apply_template(self, chat_body: bytes | Mapping[str, Any]) -> str:
        """`POST /apply-template`: the very render (`oaicompat_chat_params_parse`) of llama-server's chat
        routes, prompt only. `bytes` go as they are (the client's own body parses the same way)."""
        content = chat_body if isinstance(chat_body, bytes) else _wire_json(dict(chat_body))
        data = await self._request(
            "POST", "/apply-template", content=content, what="apply-template", refusal=BadRequest
        )
        prompt = data.get("prompt") if isinstance(data, dict) else None
        if not isinstance(prompt, str):
            raise BackendUnavailable("apply-template: the answer holds no prompt text")
        return prompt

    async def prefill(self, slot_id: int, prompt: str | list[int]) -> int:
        """One prompt pass on a pinned slot with nothing generated (the runtime canary)."""
        result = await self.run_prompt(slot_id, prompt)
        return result.computed + result.reused

    async def run_prompt(self, slot_id: int, prompt: str | list[int], *, n_predict: int = 0) -> PromptResult:
        """`/completion` pinned to `slot_id` with prompt caching on, at temperature 0; the engine's own
        counts of prompt tokens computed and reused (`timings.prompt_n`, `timings.cache_n`).

        What the slot holds after it (build 11434, `server-context.cpp`, checked on the binary with GET
        /slots and a save's `n_saved`): the server always samples one token after the prompt, then stops
        when the budget is spent, and a sampled token is decoded into the KV only when the next one is
        asked for. So with `n_predict` 0 or 1 the slot holds exactly the prompt's tokens (a prefill-only
        call: a save then is a save point at the end of the prompt), and with `n_predict` k > 1 the prompt
        and the first k - 1 generated tokens."""
        await self._check_slot(slot_id)
        body = {
            "prompt": prompt,
            SLOT_FIELD: slot_id,
            "n_predict": n_predict,
            "cache_prompt": True,
            "temperature": 0.0,
            "stream": False,
        }
        data = await self._request(
            "POST",
            "/completion",
            json_body=body,
            what=f"prompt on slot {slot_id}",
            timeout=self._persist_timeout,
        )
        timings = data.get("timings") if isinstance(data, dict) else None
        computed, reused = token_counts(timings if isinstance(timings, dict) else None)
        return PromptResult(slot_id=slot_id, computed=computed or 0, reused=reused or 0)

    async def inspect_slots(self) -> list[BackendSlot]:
        data = await self._request("GET", "/slots", what="inspect /slots")
        if not isinstance(data, list):
            raise BackendUnavailable("inspect /slots: expected a JSON list")
        slots = []
        for item in data:
            if not isinstance(item, dict) or _int(item.get("id")) is None:
                continue
            n_tokens = _int(item.get("n_prompt_tokens"), _int(item.get("n_past")))
            slots.append(
                BackendSlot(
                    id=int(item["id"]),
                    n_ctx=_int(item.get("n_ctx")),
                    is_processing=bool(item.get("is_processing", False)),
                    n_tokens=n_tokens,
                    used="id_task" in item,  # 11434 shows a slot's last task once one ran on it
                )
            )
        self._slot_ids = frozenset(s.id for s in slots)
        return slots

    async def _check_slot(self, slot_id: int) -> None:
        if self._slot_ids is None or slot_id not in self._slot_ids:
            await self.inspect_slots()
        assert self._slot_ids is not None
        if slot_id not in self._slot_ids:
            raise SlotNotFound(f"slot {slot_id} does not exist (server has {sorted(self._slot_ids)})")

    @staticmethod
    def _check_filename(filename: str) -> None:
        if not _SAFE_FILENAME.match(filename) or ".." in filename:
            raise BackendUnsupported(
                f"refusing unsafe snapshot filename {filename[:40]!r}", hint="This is a bug."
            )

    async def _slot_action(self, action: Action, slot_id: int, filename: str | None) -> tuple[Any, float]:
        await self._check_slot(slot_id)
        body = None
        if filename is not None:
            self._check_filename(filename)
            body = {"filename": filename}
        started = time.perf_counter()
        data = await self._request(
            "POST",
            f"/slots/{slot_id}",
            params={"action": action},
            json_body=body,
            what=f"{action} slot {slot_id}",
            failure=_FAILURE[action],
            timeout=self._persist_timeout if action != "erase" else self._request_timeout,
        )
        measured_ms = (time.perf_counter() - started) * 1000.0
        if not isinstance(data, dict):
            raise _FAILURE[action](f"{action} slot {slot_id}: unexpected answer {str(data)[:100]}")
        return data, measured_ms

    async def save_slot(self, slot_id: int, filename: str) -> SaveResult:
        data, ms = await self._slot_action("save", slot_id, filename)
        timings = data.get("timings") if isinstance(data.get("timings"), dict) else {}
        return SaveResult(
            slot_id=slot_id,
            filename=filename,
            tokens=_int(data.get("n_saved"), 0) or 0,
            bytes_written=_int(data.get("n_written"), 0) or 0,
            server_ms=_float(timings.get("save_ms")),
            measured_ms=ms,
        )

    async def restore_slot(self, slot_id: int, filename: str) -> RestoreResult:
        data, ms = await self._slot_action("restore", slot_id, filename)
        timings = data.get("timings") if isinstance(data.get("timings"), dict) else {}
        return RestoreResult(
            slot_id=slot_id,
            filename=filename,
            tokens=_int(data.get("n_restored"), 0) or 0,
            bytes_read=_int(data.get("n_read"), 0) or 0,
            server_ms=_float(timings.get("restore_ms")),
            measured_ms=ms,
        )

    async def erase_slot(self, slot_id: int) -> EraseResult:
        data, ms = await self._slot_action("erase", slot_id, None)
        return EraseResult(slot_id=slot_id, tokens=_int(data.get("n_erased"), 0) or 0, measured_ms=ms)
