"""The hook API's one router: every route is one `Route` (`kvsidecar.http.routes`) in one table. This
module serves the table and describes it (OpenAPI, written by FastAPI from the same table in
`kvsidecar.http.openapi`), so what is served and what is documented cannot drift apart, and no route has a
second definition that could answer differently.

Why FastAPI does not dispatch: acquire and release run around every model call. With FastAPI routing every
request, bench/bench_hooks.py measured p50 0.97 ms and 0.43 ms of daemon CPU per call, against 0.76 ms and
0.27 ms for a direct dispatcher in the same run (2 cores, loaded): the p50 < 1 ms target with no margin.

Every request takes the same steps, in this order, whatever the route:

1. Host header (loopback listeners: DNS-rebinding guard) and bearer token (`kvsidecar.http.guards`),
   except on public routes;
   once the app's lifespan shutdown has begun, 503 `KV_SHUTTING_DOWN` (with `Retry-After`), except on
   public routes; a declared Content-Length over the cap: 413. Nothing is read before these pass.
2. The body, up to `max_body_bytes` (413 beyond).
3. The route: 404 `KV_NOT_FOUND`; a path served only for other methods: 405 `KV_METHOD_NOT_ALLOWED`
   with `Allow`. The path is matched as sent, segment by segment (split at its literal slashes, then each
   segment percent-decoded once; no slash redirects, no dot-segment folding); a parameter is one whole,
   non-empty segment, so `a%2Fb` is the value `a/b`.
4. Path parameters, each name with one converter for every route (`session_id`: 400
   `KV_INVALID_SESSION_ID`, which refuses `a/b`, `%2F`, NUL, non-UTF-8 and anything else off its alphabet).
5. Query parameters, then the JSON body, each validated by the route's pydantic model: 400
   `KV_BAD_REQUEST` naming the first offending field. Routes without a body model ignore the body.
6. The handler. A `KvError` becomes its status and `{"error": {"code", "message", "hint"}}`
   (`kvsidecar.errors.HTTP_STATUS`); any other exception is logged and answered 500 `KV_INVARIANT`. A
   handler cancelled under it (uvicorn cancels what is still running when its graceful-shutdown timeout
   ends, e.g. an acquire waiting for a slot) is answered 503 `KV_SHUTTING_DOWN`, not a bare 500.
   A route that waits for a slot (`Route.waits`: acquire, restore) gets a `Call.caller` that is gone
   once the client disconnects (watched for while the handler runs: uvicorn does not cancel a handler
   whose client left) or its `X-KV-Deadline-Ms` budget is spent (1-9 digits, else 400 `KV_BAD_REQUEST`).

The OpenAPI document (`kvsidecar.http.openapi`) is written from the same table and declares exactly these
answers. There is no `/docs` or `/redoc`: FastAPI's pages load Swagger UI / ReDoc from a CDN, which an
offline box cannot reach; `/openapi.json` is served (same auth) for any viewer.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import traceback
from collections.abc import Callable, Mapping, Sequence
from contextlib import AbstractAsyncContextManager
from typing import Any
from urllib.parse import parse_qsl, quote, unquote

from pydantic import ValidationError
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from kvsidecar.coordinator.caller import Caller, deadline_from_budget
from kvsidecar.errors import (
    BadRequest,
    InvariantViolation,
    KvError,
    MethodNotAllowed,
    NotFound,
    PayloadTooLarge,
    ShuttingDown,
)
from kvsidecar.http.guards import deadline_budget, hop_count, refuse
from kvsidecar.http.messages import (
    ClientGone,
    JsonResponse,
    error_response,
    read_body,
    validation_message,
    watch_disconnect,
)
from kvsidecar.http.openapi import document
from kvsidecar.http.routes import PARAM, Call, M, Param, Route, path_params

log = logging.getLogger("kvsidecar.api")
Lifespan = Callable[[Any], AbstractAsyncContextManager[None]]


class Router:
    """The hook API as one ASGI app (see the module docstring for the order of checks)."""

    def __init__(
        self,
        routes: Sequence[Route],
        params: Mapping[str, Param],
        *,
        token: str | None,
        check_host: bool,
        max_body_bytes: int,
        lifespan: Lifespan | None = None,
        title: str = "API",
        version: str = "0",
        description: str = "",
    ) -> None:
        self.params = dict(params)
        self.title, self.version, self.description = title, version, description
        self.stopping = False  # the lifespan shutdown has begun: non-public routes answer 503
        self.routes = [*routes, *self._doc_routes()]
        self.expected = f"Bearer {token}".encode() if token is not None else None
        self.check_host = check_host
        self.max_bytes = max_body_bytes
        self.lifespan = lifespan
        self._static: dict[tuple[str, ...], dict[str, Route]] = {}
        self._templates: dict[str, tuple[tuple[tuple[bool, str], ...], dict[str, Route]]] = {}
        for route in self.routes:
            self._add(route)
        self._public = frozenset(tuple(r.path.split("/")) for r in self.routes if r.public)
        self._openapi: dict[str, Any] | None = None

    def _add(self, route: Route) -> None:
        names = path_params(route.path)
        unknown = set(names) - set(self.params)
        if unknown:
            raise ValueError(f"{route.path}: no converter for {sorted(unknown)}")
        if route.public and names:
            raise ValueError(f"{route.path}: a public route cannot have path parameters")
        if not names:
            by_method = self._static.setdefault(tuple(route.path.split("/")), {})
        else:
            # per segment: (False, literal) or (True, parameter name); a parameter is a whole segment
            parts: list[tuple[bool, str]] = []
            for part in route.path.split("/"):
                m = PARAM.fullmatch(part)
                if m is None and "{" in part:
                    raise ValueError(f"{route.path}: a parameter must be a whole path segment")
                parts.append((True, m.group(1)) if m else (False, part))
            by_method = self._templates.setdefault(route.path, (tuple(parts), {}))[1]
        if route.method in by_method:
            raise ValueError(f"{route.method} {route.path} is defined twice")
        by_method[route.method] = route

    def match(self, method: str, segments: Sequence[str]) -> tuple[Route, dict[str, str]] | JSONResponse:
        """The route and its path parameters (percent-decoded, not yet converted), or the 404 / 405
        answer. `segments`: the raw path split at its slashes (`path_segments`)."""
        decoded = tuple(unquote(s) for s in segments)  # UTF-8; a byte that is not is U+FFFD
        by_method, raw = self._static.get(decoded), {}
        if by_method is None:
            for parts, candidates in self._templates.values():
                if len(parts) == len(decoded) and all(
                    bool(raw_seg) if is_param else text == seg
                    for (is_param, text), seg, raw_seg in zip(parts, decoded, segments, strict=True)
                ):
                    raw = {
                        text: seg for (is_param, text), seg in zip(parts, decoded, strict=True) if is_param
                    }
                    by_method = candidates
                    break
        if by_method is None:
            return error_response(NotFound("no such route"))
        route = by_method.get(method)
        if route is None:
            allow = ", ".join(sorted(by_method))
            return error_response(
                MethodNotAllowed(f"{method[:16]!r} is not allowed here ({allow})"), {"Allow": allow}
            )
        return route, raw

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        segments = path_segments(scope)
        matched = self.match(scope["method"], segments)
        headers = dict(scope.get("headers", []))
        # by path: any method there, answered or 405, needs no token
        public = tuple(unquote(s) for s in segments) in self._public
        refusal = refuse(scope, headers, expected=self.expected, check_host=self.check_host, exempt=public)
        if refusal is None and self.stopping and not public:
            refusal = ShuttingDown("kvsidecar is shutting down")
        if refusal is None:
            length = headers.get(b"content-length", b"")
            if length.isdigit() and int(length) > self.max_bytes:
                refusal = PayloadTooLarge(f"request body is over {self.max_bytes} bytes")
        if refusal is not None:
            await error_response(refusal)(scope, receive, send)
            return
        try:
            body = await read_body(receive, self.max_bytes)
        except ClientGone:
            return  # nobody to answer
        caller: Caller | None = None
        watch: asyncio.Task[None] | None = None
        if isinstance(matched, tuple) and matched[0].waits and body is not None:
            try:
                budget = deadline_budget(scope.get("headers", ()))
            except KvError as exc:
                await error_response(exc)(scope, receive, send)
                return
            now = asyncio.get_running_loop().time()
            caller = Caller(deadline=None if budget is None else deadline_from_budget(budget, now))
            watch = asyncio.ensure_future(watch_disconnect(receive, caller))
        try:
            response = await self._respond(scope, matched, body, hop_count(headers), caller)
        finally:
            if watch is not None:
                watch.cancel()
                await asyncio.gather(watch, return_exceptions=True)
        await response(scope, receive, send)

    async def _respond(
        self,
        scope: Scope,
        matched: tuple[Route, dict[str, str]] | JSONResponse,
        body: bytes | None,
        hop: int = 0,
        caller: Caller | None = None,
    ) -> Response:
        if body is None:
            return error_response(PayloadTooLarge(f"request body is over {self.max_bytes} bytes"))
        if not isinstance(matched, tuple):
            return matched
        route, raw = matched
        try:
            call = Call(
                params={name: self.params[name].convert(value) for name, value in raw.items()},
                query=_query(route.query, scope) if route.query is not None else None,
                body=_body(route.body, body) if route.body is not None else None,
                hop=hop,
                caller=caller,
            )
            result = await route.handler(call)
            return result if isinstance(result, Response) else JsonResponse(result)
        except KvError as exc:
            return error_response(exc)
        except asyncio.CancelledError:
            # Only the server cancels a request's task, at shutdown: answer it (the task ends right after).
            return error_response(ShuttingDown("kvsidecar is shutting down"))
        except Exception:
            log.exception("kv.api.unexpected_error route=%s", route.path)
            return error_response(
                InvariantViolation("unexpected error while answering; see the daemon log", hint="A bug.")
            )

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        started = False
        await receive()  # lifespan.startup
        try:
            async with self.lifespan(self) if self.lifespan else contextlib.nullcontext():
                await send({"type": "lifespan.startup.complete"})
                started = True
                await receive()  # lifespan.shutdown
                self.stopping = True
        except BaseException:
            failed = "lifespan.shutdown.failed" if started else "lifespan.startup.failed"
            await send({"type": failed, "message": traceback.format_exc()})
            raise
        await send({"type": "lifespan.shutdown.complete"})

    # -- the document ------------------------------------------------------------------------------------
    def openapi(self) -> dict[str, Any]:
        """The OpenAPI document of the table (`kvsidecar.http.openapi`), built once, on first use."""
        if self._openapi is None:
            self._openapi = document(
                self.routes,
                self.params,
                title=self.title,
                version=self.version,
                description=self.description,
                token=self.expected is not None,
                check_host=self.check_host,
            )
        return self._openapi

    def _doc_routes(self) -> list[Route]:
        async def openapi_json(_: Call) -> Response:
            return JsonResponse(self.openapi())

        return [Route(method="GET", path="/openapi.json", handler=openapi_json, in_schema=False)]


def path_segments(scope: Scope) -> list[str]:
    """The request path as sent, split at its slashes, each segment still percent-encoded: a parameter
    is one segment whatever it decodes to (`a%2Fb` is the value `a/b`, refused by its converter, never
    two segments). Without `raw_path` (optional in ASGI) the decoded path, re-encoded."""
    raw: bytes | None = scope.get("raw_path")
    if raw is None:
        return [quote(s, safe="") for s in scope["path"].split("/")]
    return raw.split(b"?", 1)[0].decode("latin-1").split("/")


def _query(model: type[M], scope: Scope) -> M:
    raw = scope.get("query_string", b"").decode("latin-1")
    try:
        return model.model_validate(dict(parse_qsl(raw, keep_blank_values=True)))
    except ValidationError as exc:
        raise BadRequest(validation_message(exc.errors())) from None


def _body(model: type[M], raw: bytes) -> M:
    if not raw.strip():
        raise BadRequest("the request body must be a JSON object")
    try:
        return model.model_validate_json(raw)
    except ValidationError as exc:
        raise BadRequest(validation_message(exc.errors())) from None
