"""The ASGI messages every listener's app reads and writes the same way (hook API and proxy): the request
body, whole or refused; the client leaving while its call runs; JSON answers and the error body
`{"error": {"code", "message", "hint"}}` with the status `kvsidecar.errors.HTTP_STATUS` gives its code.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi.encoders import jsonable_encoder
from starlette.responses import JSONResponse
from starlette.types import Receive

from kvsidecar.coordinator.caller import Caller
from kvsidecar.errors import KvError, ShuttingDown, SlotBusy, http_status


class JsonResponse(JSONResponse):
    """Compact JSON; a value JSON has no type for (an enum, a path, a datetime) goes through FastAPI's
    encoder instead of failing the answer."""

    def render(self, content: Any) -> bytes:
        return json.dumps(
            content,
            ensure_ascii=False,
            allow_nan=False,
            separators=(",", ":"),
            default=jsonable_encoder,
        ).encode()


def error_response(exc: KvError, headers: Mapping[str, str] | None = None) -> JSONResponse:
    retry = {"Retry-After": "1"} if isinstance(exc, SlotBusy | ShuttingDown) else {}
    return JSONResponse(
        {"error": exc.to_dict()}, status_code=http_status(exc), headers={**retry, **(headers or {})}
    )


def validation_message(errors: Sequence[Any]) -> str:
    """One line naming the first offending field."""
    err = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    where = ".".join(str(p) for p in err.get("loc", ()) if p != "body")
    return f"{where}: {err.get('msg')}" if where else str(err.get("msg"))


class ClientGone(Exception):
    """The client left (or was cut by a listener limit) before its request body was complete."""


async def read_body(receive: Receive, limit: int) -> bytes | None:
    """The whole request body, or None when it is over `limit` bytes. Raises `ClientGone` when the
    connection ends first: a partial body is never taken for a whole one."""
    body = bytearray()
    while True:
        message = await receive()
        if message["type"] != "http.request":
            raise ClientGone("the client left before its request body was complete")
        body += message.get("body", b"")
        if len(body) > limit:
            return None
        if not message.get("more_body", False):
            return bytes(body)


async def watch_disconnect(receive: Receive, caller: Caller) -> None:
    """Tell `caller` when the client disconnects (its request body is already read: the next ASGI message
    is `http.disconnect`). uvicorn does not cancel a handler whose client left; this is how we know."""
    while (await receive())["type"] != "http.disconnect":
        pass
    caller.leave()
