"""`KvSidecar`: the blocking twin of `AsyncKvSidecar` (kvsidecar/client/__init__.py), for harnesses
without a loop.

Same methods, arguments, results and errors; the requests and the reading of answers are
kvsidecar/client/wire.py's, shared with the async client. Import it from `kvsidecar.client`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any, TypeVar

import httpx

from kvsidecar.client import wire
from kvsidecar.client.wire import Lease, SidecarError

T = TypeVar("T")


class KvSidecar:
    def __init__(
        self,
        base_url: str = wire.DEFAULT_URL,
        *,
        token: str | None = None,
        uds: str | None = None,
        timeout_s: float | httpx.Timeout = wire.DEFAULT_TIMEOUT_S,
        transport: httpx.BaseTransport | None = None,
        trust_env: bool = True,
    ) -> None:
        if transport is None and uds is not None:
            transport = httpx.HTTPTransport(uds=uds)
        self._http = httpx.Client(
            base_url=base_url,
            headers=wire.headers(token),
            timeout=timeout_s,
            transport=transport,
            trust_env=trust_env,
        )

    def __enter__(self) -> KvSidecar:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._http.close()

    def send(
        self, call: wire.Call[Any], *, origin: str | None = None, headers: Mapping[str, str] | None = None
    ) -> httpx.Response:
        """The daemon's answer to `call` as it came, errors included (nothing mapped). `origin`: another
        daemon than `base_url`'s."""
        url = call.path if origin is None else origin.rstrip("/") + call.path
        return self._http.request(call.method, url, json=call.body, headers=headers)

    def _send(self, call: wire.Call[T]) -> T:
        return call.parse(self.send(call))

    def _call(self, method: wire.Method, path: str, body: dict[str, Any] | None = None) -> Any:
        """A route's JSON answer as is (kept for tools written against the first client)."""
        return self._send(wire.raw(method, path, body))

    def acquire_lease(
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
        return self._send(
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

    def prompt_point(self, lease_id: str) -> dict[str, Any]:
        """Take the lease's save point at the prompt's end (when `Lease.prompt_point` says the plan asks for
        one), between the acquire and the model call: docs/API.md."""
        return self._send(wire.prompt_point(lease_id))

    def release(
        self,
        lease_id: str,
        *,
        status: str,
        prompt_tokens: int | None = None,
        cached_tokens: int | None = None,
        prompt_ms: float | None = None,
    ) -> dict[str, Any]:
        return self._send(
            wire.release(
                lease_id,
                status=status,
                prompt_tokens=prompt_tokens,
                cached_tokens=cached_tokens,
                prompt_ms=prompt_ms,
            )
        )

    @contextlib.contextmanager
    def acquire(
        self,
        session_id: str | None,
        *,
        provider: str,
        model: str,
        purpose: str | None = None,
        seq: int | None = None,
        prefix_from: str | None = None,
        prompt: str | list[int] | dict[str, Any] | None = None,
    ) -> Iterator[Lease]:
        """A lease for the block: released "ok" with `lease.report()`'s numbers, or "aborted" if it raised.
        With `prompt`, the save point the plan asks for (`lease.prompt_point`) is taken before the block."""
        lease = self.acquire_lease(
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
                    self.prompt_point(lease.lease_id)
            yield lease
            completed = True
        finally:
            if (call := wire.release_of(lease, completed=completed)) is not None:
                lease.release_result = self._send(call)

    def event(self, session_id: str, type_: str, *, seq: int | None = None) -> dict[str, Any]:
        return self._send(wire.event(session_id, type_, seq=seq))

    def save(self, session_id: str) -> dict[str, Any]:
        return self._send(wire.save(session_id))

    def restore(self, session_id: str, *, provider: str, model: str) -> dict[str, Any]:
        return self._send(wire.restore(session_id, provider=provider, model=model))

    def invalidate(self, session_id: str) -> dict[str, Any]:
        return self._send(wire.invalidate(session_id))

    def purge(self, session_id: str) -> dict[str, Any]:
        return self._send(wire.purge(session_id))

    def sessions(self) -> list[dict[str, Any]]:
        return self._send(wire.sessions())

    def status(self) -> dict[str, Any]:
        return self._send(wire.status())

    def session(self, session_id: str) -> dict[str, Any]:
        return self._send(wire.session(session_id))

    def gc(self, *, dry_run: bool = False) -> dict[str, Any]:
        return self._send(wire.gc(dry_run=dry_run))

    def doctor(self, *, deep: bool = False) -> dict[str, Any]:
        return self._send(wire.doctor(deep=deep))

    def checkpoint(
        self, *, server: str | None = None, wait: bool = False, timeout_s: float | None = None
    ) -> dict[str, Any]:
        """Save every dirty slot of `server` (all servers: None) before a planned stop of llama-server."""
        return self._send(wire.checkpoint(server=server, wait=wait, timeout_s=timeout_s))

    def health(self) -> Any:
        return self._send(wire.health())
