"""`RouterModelBackend`: one model of a llama-server router, as a backend of its own.

A llama-server started without a model (`--models-dir`, `--models-preset`) is a router: it starts one child
llama-server per model it loads (`--models-max` at once, the least recently used unloaded first), on a port
of its own on 127.0.0.1, and forwards each request by the body's `model` (POST) or the `model` query
parameter (GET), `/slots` included. This backend is `LlamaCppBackend` with the model named on every call:
`?model=ID&autoload=false` on each call (so that no call of ours ever loads a model: a model that is not
loaded answers 400) and `"model": ID` in each POST body. What the router says of the model (`GET /models`)
is read on each probe:

- loaded: the child is probed through the router as a llama-server of its own; its address (`--port` in
  the arguments the router started it with) is `process_url`, where the child's process is found;
- anything else (unloaded, loading, a failed start): the model and every slot's KV are gone, as in sleep
  mode (`sleeping`), and `wake()` loads it (`POST /models/load`, then waits until it is loaded);
- gone from the list: unavailable.

Each time the model is seen going from loaded to not loaded, the cause is recorded (`Unload`): `kvsidecar`
when `unload()` asked for it, `crash` when the router says the child failed (an exit code other than 0),
else `router` (its own LRU unload, or an operator's `POST /models/unload`). The coordinator drains them
(`take_unloads`) to log, count and show them.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import httpx

from kvsidecar.backend.base import BackendCapabilities, TokenizerInfo
from kvsidecar.backend.llama_body import read_json
from kvsidecar.backend.llamacpp import LlamaCppBackend, _tokenizer_info, _wire_json
from kvsidecar.errors import BackendUnavailable, KvError, OperationTimeout

# The router's model states (server-models.cpp `server_model_status_to_string`); "sleeping" is a loaded
# child in its own sleep mode (its /props says so, as a server of its own would).
RUNNING = frozenset({"loaded", "sleeping"})
LOAD_POLL_S = 0.1  # how often a load or unload in progress is looked at (GET /models is cheap)


@dataclass(frozen=True, kw_only=True)
class RouterModel:
    """One entry of the router's `GET /models`."""

    id: str
    status: str
    port: int | None = None  # the child's port (`--port` in its arguments), while it runs
    parallel: int | None = None  # its slots, when its arguments say (`--parallel`)
    slot_save_path: str | None = None  # where its slots are saved (`--slot-save-path`, the router's own)
    failed: bool = False
    exit_code: int | None = None
    aliases: frozenset[str] = frozenset()  # other names the router runs it under (its preset's --alias)

    @property
    def running(self) -> bool:
        return self.status in RUNNING and self.port is not None


@dataclass(frozen=True, kw_only=True)
class RouterState:
    """The router's models and how many it keeps loaded at once (`--models-max`; 0: no limit)."""

    models: dict[str, RouterModel] = field(default_factory=dict)
    max_loaded: int = 0

    def loaded(self) -> list[str]:
        return [m.id for m in self.models.values() if m.status not in ("unloaded", "downloading")]


@dataclass(frozen=True, kw_only=True)
class Unload:
    """A model seen going from loaded to not loaded, and why."""

    model: str
    cause: str  # kvsidecar | router | crash
    exit_code: int | None
    at: float


def _last_int(args: Any, flags: tuple[str, ...]) -> int | None:
    """The value after the last of `flags` in a child's arguments, as a decimal integer."""
    if not isinstance(args, list):
        return None
    found = None
    for flag, value in itertools.pairwise(args):
        if flag in flags and isinstance(value, str) and value.isdigit() and len(value) < 10:
            found = int(value)
    return found


def _last_str(args: Any, flag: str) -> str | None:
    if not isinstance(args, list):
        return None
    found = [v for f, v in itertools.pairwise(args) if f == flag and isinstance(v, str) and v]
    return found[-1] if found else None


def server_entries(base_url: str, models: dict[str, RouterModel]) -> dict[str, dict[str, Any]]:
    """The `servers:` entries of a router's models (`kvsidecar config router`): one per model, named after
    it (letters, digits, `-` and `_`), its slots managed when its arguments give it more than one."""
    out: dict[str, dict[str, Any]] = {}
    for model in models.values():
        name = "".join(c if c.isascii() and (c.isalnum() or c in "-_") else "-" for c in model.id)[:64]
        while name in out or not name:
            name += "_"
        entry: dict[str, Any] = {"base_url": base_url, "model": model.id}
        if model.slot_save_path is not None:
            entry["snapshot_dir"] = model.slot_save_path
        entry["mode"] = "managed-slots" if (model.parallel or 0) > 1 else "single-slot"
        out[name] = entry
    return out


def _port(args: Any) -> int | None:
    """The child's port (`--port`; 0 before the router picked one)."""
    port = _last_int(args, ("--port",))
    return port if port is not None and 0 < port < 65536 else None


def _parallel(args: Any) -> int | None:
    """The child's slots as its arguments give them (`--parallel N`, N > 0; absent or auto: unknown)."""
    n = _last_int(args, ("--parallel", "-np"))
    return n if n is not None and n > 0 else None


def parse_models(data: Any) -> dict[str, RouterModel]:
    """`GET /models` of a router: `data[].id` and `data[].status` (`value`, `args`, `failed`,
    `exit_code`); entries that are not shaped so are skipped (nothing of them is trusted)."""
    entries = data.get("data") if isinstance(data, dict) else None
    out: dict[str, RouterModel] = {}
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, dict) or not isinstance(entry.get("id"), str):
            continue
        status = entry.get("status")
        status = status if isinstance(status, dict) else {}
        value = status.get("value")
        code = status.get("exit_code")
        out[entry["id"]] = RouterModel(
            id=entry["id"],
            status=value if isinstance(value, str) else "unknown",
            port=_port(status.get("args")),
            parallel=_parallel(status.get("args")),
            slot_save_path=_last_str(status.get("args"), "--slot-save-path"),
            failed=status.get("failed") is True,
            exit_code=code if isinstance(code, int) and not isinstance(code, bool) else None,
            aliases=_aliases(entry.get("aliases")),
        )
    return out


def unload_cause(model: RouterModel, *, ours: bool) -> str:
    if ours:
        return "kvsidecar"
    if model.failed or (model.exit_code is not None and model.exit_code != 0):
        return "crash"
    return "router"


class RouterModelBackend(LlamaCppBackend):
    """One model of a router (`servers.NAME.model`); every call names the model and never loads it."""

    def __init__(self, *, model: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        # A new connection per call: the router closes an idle kept-alive connection on its own (5 s), and a
        # call sent on one as it closes is lost ("disconnected without sending a response"); loopback
        # connections cost next to nothing.
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers=self._client.headers,
            timeout=self._request_timeout,
            transport=kwargs.get("transport"),
            limits=httpx.Limits(max_keepalive_connections=0),
        )
        self.model = model
        self.last: RouterModel | None = None  # what the last look at GET /models said of the model
        self._unloading = False  # an unload() of ours is in flight: the next unload seen is ours
        self._unloads: list[Unload] = []
        self._slots: int | None = None  # the slots the model's child had when last loaded
        # the router keeps fewer models loaded than kvsidecar manages on it: this model's slots will be
        # lost to an unload (its sessions are evicted as if they outnumbered its slots); set by ModelSwaps
        self.crowded = False

    @classmethod
    def from_config(
        cls, server: Any, *, name: str | None = None, transport: httpx.AsyncBaseTransport | None = None
    ) -> RouterModelBackend:
        base = LlamaCppBackend.from_config(server, name=name, transport=transport)
        out = cls(
            model=server.model,
            base_url=server.base_url,
            connect_timeout_s=server.connect_timeout_s,
            request_timeout_s=server.request_timeout_s,
            persist_timeout_s=server.persist_timeout_s,
            transport=transport,
        )
        out._client.headers.update(base._client.headers)  # the API key, read once by the base
        return out

    async def _request(
        self,
        method: str,
        path: str,
        *,
        json_body: dict[str, Any] | None = None,
        content: bytes | None = None,
        params: dict[str, str] | None = None,
        **kwargs: Any,
    ) -> Any:
        """The model named on the call: in the query (GET, and `autoload=false` on every call) and in the
        body (POST; a body of the caller's with another `model` is sent with ours)."""
        if path.startswith("/models"):  # the router's own routes
            return await super()._request(
                method, path, json_body=json_body, content=content, params=params, **kwargs
            )
        params = {**(params or {}), "autoload": "false"}
        if method == "GET":
            params["model"] = self.model
        elif content is not None:
            body = read_json(content)  # never recurses on the caller's nesting
            if not isinstance(body, dict):
                content = _wire_json({"model": self.model})  # llama-server refuses a body that is no object
            else:
                content = _wire_json({**body, "model": self.model})
        else:
            json_body = {**(json_body or {}), "model": self.model}
        return await super()._request(
            method, path, json_body=json_body, content=content, params=params, **kwargs
        )

    async def tokenizer_info(self) -> TokenizerInfo:
        """The router answers `GET /v1/models` itself, with every model it knows (a running one with its
        child's `meta`, `n_vocab` included): this model's entry, never the first one listed."""
        if self._tokenizer is None:
            data = await self._request("GET", "/v1/models", what="tokenizer /v1/models")
            entries = data.get("data") if isinstance(data, dict) else None
            listed = entries if isinstance(entries, list) else []
            mine = [e for e in listed if isinstance(e, dict) and e.get("id") == self.model]
            self._tokenizer = _tokenizer_info({"data": mine[:1]})
        return self._tokenizer

    def known_as(self, name: str) -> bool:
        """Whether the router, as last seen, runs this entry's model under `name` (an alias)."""
        return self.last is not None and name in self.last.aliases

    async def router_state(self) -> RouterState:
        """`GET /models` and the router's `GET /props` (`max_instances`: its `--models-max`)."""
        models = parse_models(await self._request("GET", "/models", what="router /models"))
        props = await super()._request("GET", "/props", what="router /props")
        limit = props.get("max_instances") if isinstance(props, dict) else None
        max_loaded = limit if isinstance(limit, int) and not isinstance(limit, bool) and limit > 0 else 0
        return RouterState(models=models, max_loaded=max_loaded)

    async def _look(self) -> RouterModel:
        models = parse_models(await self._request("GET", "/models", what="router /models"))
        now = models.get(self.model)
        if now is None:
            raise BackendUnavailable(f"the router at {self.base_url} lists no model {self.model[:64]!r}")
        before, self.last = self.last, now
        # not running now, or running on another port: it was unloaded (and loaded again) in between
        if before is not None and before.running and (not now.running or now.port != before.port):
            cause = unload_cause(now, ours=self._unloading) if not now.running else "router"
            self._unloads.append(
                Unload(model=self.model, cause=cause, exit_code=now.exit_code, at=time.time())
            )
        return now

    def take_unloads(self) -> list[Unload]:
        """The unloads seen since the last call (the coordinator logs and counts each once)."""
        out, self._unloads = self._unloads, []
        return out

    async def probe(self) -> BackendCapabilities:
        now = await self._look()
        if not now.running:
            return BackendCapabilities(
                kind=self.kind,
                alive=True,
                slots_endpoint=True,
                # the slots it had, else what its arguments say; unknown (1, and `slots_known` false: the
                # proxy sends it nothing unpinned) until it loads
                total_slots=self._slots or now.parallel or 1,
                n_ctx=None,
                model_path=None,
                build_info=None,
                props={"router_status": now.status, "slots_known": bool(self._slots or now.parallel)},
                sleeping=True,
            )
        caps = await super().probe()
        self._slots = caps.total_slots or self._slots
        return replace(caps, process_url=f"http://127.0.0.1:{now.port}")

    async def health(self) -> bool:
        try:
            return (await self._look()).running
        except KvError:
            return False

    async def wake(self) -> None:
        """`POST /models/load`, then wait until the router says the model is loaded (a failed start:
        unavailable), bounded like a persistence call."""
        now = await self._look()
        if now.running:
            return
        if now.status != "loading":  # another request's load is waited for, not asked again
            # "already running": loaded by another request meanwhile; the wait below decides
            with contextlib.suppress(BackendUnavailable):
                body = {"model": self.model}
                await self._request("POST", "/models/load", json_body=body, what="router load")
        await self._wait(lambda m: m.running, "load", failed_is_error=True)

    async def unload(self) -> None:
        """`POST /models/unload`, then wait until the router says it is unloaded; counted as ours."""
        self._unloading = True
        try:
            if (await self._look()).running:
                body = {"model": self.model}
                await self._request("POST", "/models/unload", json_body=body, what="router unload")
                await self._wait(lambda m: m.status == "unloaded", "unload", failed_is_error=False)
        finally:
            self._unloading = False

    async def _wait(self, done: Callable[[RouterModel], bool], what: str, *, failed_is_error: bool) -> None:
        deadline = time.monotonic() + (self._persist_timeout.read or 0.0)
        while True:
            now = await self._look()
            if done(now):
                return
            if failed_is_error and now.status == "unloaded":  # the load asked for (or seen) has ended
                raise BackendUnavailable(
                    f"router {what} of {self.model[:64]!r}: not loaded (exit code {now.exit_code})"
                )
            if time.monotonic() > deadline:
                raise OperationTimeout(f"router {what} of {self.model[:64]!r}: still {now.status}")
            await asyncio.sleep(LOAD_POLL_S)


async def read_router(base_url: str, *, api_key: str | None = None) -> dict[str, RouterModel]:
    """A router's models (`GET /models`), for `kvsidecar config router`; a failure is a `BackendError`."""
    backend = LlamaCppBackend(base_url=base_url, api_key=api_key)
    try:
        return parse_models(await backend._request("GET", "/models", what="router /models"))
    finally:
        await backend.aclose()


def backend_for(server: Any, *, name: str | None = None) -> LlamaCppBackend:
    """The backend of one `ServerConfig`: a router's model, or a llama-server of its own."""
    if getattr(server, "model", None) is not None:
        return RouterModelBackend.from_config(server, name=name)
    return LlamaCppBackend.from_config(server, name=name)


__all__ = [
    "RouterModel",
    "RouterModelBackend",
    "RouterState",
    "Unload",
    "backend_for",
    "parse_models",
    "read_router",
    "server_entries",
    "unload_cause",
]


def _aliases(value: object) -> frozenset[str]:
    if not isinstance(value, list):
        return frozenset()
    return frozenset(a for a in value[:256] if isinstance(a, str) and 0 < len(a) <= 256)
