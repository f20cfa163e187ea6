"""The Python clients of the hook API, for harnesses and tests: `KvSidecar` (blocking) and `AsyncKvSidecar`.

Like the openai SDK's `OpenAI` / `AsyncOpenAI`, the two have the same methods, arguments, results and
errors; one module (kvsidecar/client/wire.py) builds every request and reads every answer, and each class
only sends them.

    with KvSidecar("http://127.0.0.1:8377", token=token) as kv:
        with kv.acquire("session-1", provider="local", model="qwen") as lease:
            timings = post_completion(lease.base_url, prompt, id_slot=lease.slot_id)["timings"]
            lease.report(prompt_tokens=timings["prompt_n"], cached_tokens=timings["cache_n"])
        # released with status "ok" here, or "aborted" if the block raised

`AsyncKvSidecar` is the same with `async with` / `await`. `KvSidecarClient` is its earlier name and stays.
Errors from the daemon arrive as `SidecarError` with the daemon's stable `code`. examples/ has runnable
harness loops.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Mapping
from typing import Any, TypeVar

import httpx

from kvsidecar.client import wire
from kvsidecar.client.sync import KvSidecar
from kvsidecar.client.wire import Lease, SidecarError

__all__ = ["AsyncKvSidecar", "KvSidecar", "KvSidecarClient", "Lease", "SidecarError"]
T = TypeVar("T")


class AsyncKvSidecar:
    def __init__(
        self,
        base_url: str = wire.DEFAULT_URL,
        *,
        token: str | None = None,
        uds: str | None = None,
        timeout_s: float | httpx.Timeout = wire.DEFAULT_TIMEOUT_S,
        transport: httpx.AsyncBaseTransport | None = None,
        trust_env: bool = True,
    ) -> None:
        if transport is None and uds is not None:
            transport = httpx.AsyncHTTPTransport(uds=uds)
        self._http = httpx.AsyncClient(
            base_url=base_url,
            headers=wire.headers(token),
            timeout=timeout_s,
            transport=transport,
            trust_env=trust_env,
        )

    async def __aenter__(self) -> AsyncKvSidecar:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def send(
        self, call: wire.Call[Any], *, origin: str | None = None, headers: Mapping[str, str] | None = None
    ) -> httpx.Response:
        """The daemon's answer to `call` as it came, errors included (nothing mapped): for a daemon that
        passes another's answers on (fleet routing). `origin`: another daemon than `base_url`'s."""
        url = call.path if origin is None else origin.rstrip("/") + call.path
        return await self._http.request(call.method, url, json=call.body, headers=headers)

    async def _send(self, call: wire.Call[T]) -> T:
        return call.parse(await self.send(call))

    async def _call(self, method: wire.Method, path: str, body: dict[str, Any] | None = None) -> Any:
        """A route's JSON answer as is (kept for tools written against the first client)."""
        return await self._send(wire.raw(method, path, body))

    async def acquire_lease(
        self,
        session_id: str | None,
        *,
        provider: str,
        model: str,
        purpose: str | None = None,
        seq: int | None = None,
        prefix_from: str | None = None,
        prompt: str | list[int] | dict[str, Any] | None = None,
    ) -> Lease:
        return await self._send(
            wire.acquire_lease(
                session_id,
                provider=provider,
                model=model,
                purpose=purpose,
                seq=seq,
                prefix_from=prefix_from,
                prompt=prompt,
            )
        )

    async def prompt_point(self, lease_id: str) -> dict[str, Any]:
        """Take the lease's save point at the prompt's end (`Lease.prompt_point`): docs/API.md."""
        return await self._send(wire.prompt_point(lease_id))

    async def release(
        self,
        lease_id: str,
        *,
        status: str,
        prompt_tokens: int | None = None,
        cached_tokens: int | None = None,
        prompt_ms: float | None = None,
    ) -> dict[str, Any]:
        return await self._send(
            wire.release(
                lease_id,
                status=status,
                prompt_tokens=prompt_tokens,
                cached_tokens=cached_tokens,
                prompt_ms=prompt_ms,
            )
        )

    @contextlib.asynccontextmanager
    async def acquire(
        self,
        session_id: str | None,
        *,
        provider: str,
        model: str,
        purpose: str | None = None,
        seq: int | None = None,
        prefix_from: str | None = None,
        prompt: str | list[int] | dict[str, Any] | None = None,
    ) -> AsyncIterator[Lease]:
        """A lease for the block: released "ok" with `lease.report()`'s numbers, or "aborted" if it raised.
        With `prompt`, the save point the plan asks for (`lease.prompt_point`) is taken before the block."""
        lease = await self.acquire_lease(
            session_id,
            provider=provider,
            model=model,
            purpose=purpose,
            seq=seq,
            prefix_from=prefix_from,
            prompt=prompt,
        )
        completed = False
        try:
            if lease.prompt_point and lease.lease_id is not None:
                with contextlib.suppress(SidecarError):  # a point not taken costs warmth, never the call
                    await self.prompt_point(lease.lease_id)
            yield lease
            completed = True
        finally:
            if (call := wire.release_of(lease, completed=completed)) is not None:
                lease.release_result = await self._send(call)

    async def event(self, session_id: str, type_: str, *, seq: int | None = None) -> dict[str, Any]:
        return await self._send(wire.event(session_id, type_, seq=seq))

    async def save(self, session_id: str) -> dict[str, Any]:
        return await self._send(wire.save(session_id))

    async def restore(self, session_id: str, *, provider: str, model: str) -> dict[str, Any]:
        return await self._send(wire.restore(session_id, provider=provider, model=model))

    async def invalidate(self, session_id: str) -> dict[str, Any]:
        return await self._send(wire.invalidate(session_id))

    async def purge(self, session_id: str) -> dict[str, Any]:
        return await self._send(wire.purge(session_id))

    async def sessions(self) -> list[dict[str, Any]]:
        return await self._send(wire.sessions())

    async def status(self) -> dict[str, Any]:
        return await self._send(wire.status())

    async def session(self, session_id: str) -> dict[str, Any]:
        return await self._send(wire.session(session_id))

    async def gc(self, *, dry_run: bool = False) -> dict[str, Any]:
        return await self._send(wire.gc(dry_run=dry_run))

    async def doctor(self, *, deep: bool = False) -> dict[str, Any]:
        return await self._send(wire.doctor(deep=deep))

    async def checkpoint(
        self, *, server: str | None = None, wait: bool = False, timeout_s: float | None = None
    ) -> dict[str, Any]:
        """Save every dirty slot of `server` (all servers: None) before a planned stop of llama-server."""
        return await self._send(wire.checkpoint(server=server, wait=wait, timeout_s=timeout_s))

    async def health(self) -> Any:
        return await self._send(wire.health())


KvSidecarClient = AsyncKvSidecar  # the async client's first name, kept for existing harnesses
