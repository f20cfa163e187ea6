"""A small async client for the hook API, for harnesses and tests.

    async with KvSidecarClient("http://127.0.0.1:8377", token=...) as kv:
        async with kv.acquire("session-1", provider="local", model="qwen") as lease:
            reply = await call_llama(id_slot=lease.slot_id, ...)
            lease.report(prompt_tokens=reply.prompt_n, cached_tokens=reply.cache_n)
        # released with status "ok" here, or "aborted" if the block raised

Errors from the daemon arrive as `SidecarError` with the daemon's stable `code`.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx


class SidecarError(Exception):
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
    actions: list[str] = field(default_factory=list)
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


class KvSidecarClient:
    def __init__(
        self,
        base_url: str = "http://127.0.0.1:8377",
        *,
        token: str | None = None,
        uds: str | None = None,
        timeout_s: float = 330.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        if transport is None and uds is not None:
            transport = httpx.AsyncHTTPTransport(uds=uds)
        self._http = httpx.AsyncClient(
            base_url=base_url, headers=headers, timeout=timeout_s, transport=transport
        )

    async def __aenter__(self) -> KvSidecarClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        response = await self._http.request(method, path, json=body)
        try:
            data = response.json()
        except ValueError:
            data = None
        if response.status_code >= 400:
            err = data.get("error", {}) if isinstance(data, dict) else {}
            raise SidecarError(
                status=response.status_code,
                code=str(err.get("code", "KV_HTTP_ERROR")),
                message=str(err.get("message", response.text[:200])),
                hint=str(err.get("hint", "")),
            )
        return data

    async def acquire_lease(
        self,
        session_id: str | None,
        *,
        provider: str,
        model: str,
        purpose: str | None = None,
        seq: int | None = None,
    ) -> Lease:
        body: dict[str, Any] = {"provider": provider, "model": model}
        if purpose is not None:
            body["purpose"] = purpose
        if seq is not None:
            body["seq"] = seq
        path = "/v1/acquire" if session_id is None else f"/v1/sessions/{_quote(session_id)}/acquire"
        data = await self._call("POST", path, body)
        known = {k: v for k, v in data.items() if k in Lease.__dataclass_fields__}
        return Lease(**known)

    async def release(
        self,
        lease_id: str,
        *,
        status: str,
        prompt_tokens: int | None = None,
        cached_tokens: int | None = None,
        prompt_ms: float | None = None,
    ) -> dict[str, Any]:
        body: dict[str, Any] = {"status": status}
        if prompt_ms is not None:
            body["prompt_ms"] = prompt_ms
        if prompt_tokens is not None:
            body["prompt_tokens"] = prompt_tokens
        if cached_tokens is not None:
            body["cached_tokens"] = cached_tokens
        result: dict[str, Any] = await self._call("POST", f"/v1/leases/{_quote(lease_id)}/release", body)
        return result

    @contextlib.asynccontextmanager
    async def acquire(
        self,
        session_id: str | None,
        *,
        provider: str,
        model: str,
        purpose: str | None = None,
        seq: int | None = None,
    ) -> AsyncIterator[Lease]:
        lease = await self.acquire_lease(session_id, provider=provider, model=model, purpose=purpose, seq=seq)
        status = "aborted"
        try:
            yield lease
            status = "ok"
        finally:
            if lease.lease_id is not None:
                lease.release_result = await self.release(
                    lease.lease_id,
                    status=status,
                    prompt_tokens=lease.prompt_tokens,
                    cached_tokens=lease.cached_tokens,
                    prompt_ms=lease.prompt_ms,
                )

    async def event(self, session_id: str, type_: str, *, seq: int | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"type": type_} | ({"seq": seq} if seq is not None else {})
        result: dict[str, Any] = await self._call("POST", f"/v1/sessions/{_quote(session_id)}/events", body)
        return result

    async def save(self, session_id: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("POST", f"/v1/sessions/{_quote(session_id)}/save")
        return result

    async def restore(self, session_id: str, *, provider: str, model: str) -> dict[str, Any]:
        body = {"provider": provider, "model": model}
        result: dict[str, Any] = await self._call("POST", f"/v1/sessions/{_quote(session_id)}/restore", body)
        return result

    async def invalidate(self, session_id: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("POST", f"/v1/sessions/{_quote(session_id)}/invalidate")
        return result

    async def purge(self, session_id: str) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("DELETE", f"/v1/sessions/{_quote(session_id)}")
        return result

    async def sessions(self) -> list[dict[str, Any]]:
        data = await self._call("GET", "/v1/sessions")
        return list(data["sessions"])

    async def status(self) -> dict[str, Any]:
        result: dict[str, Any] = await self._call("GET", "/v1/status")
        return result


def _quote(part: str) -> str:
    from urllib.parse import quote

    return quote(part, safe="")
