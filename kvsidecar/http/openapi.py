"""The OpenAPI document of the hook API's route table, written by FastAPI from the same `Route`s that
`kvsidecar.http.router` serves, so it says what the server answers:

- every route's 200 answer has its schema (`Route.returns`, models in `kvsidecar.api.models`);
- every error status a route can answer is declared with the `ErrorBody` schema and the stable codes
  behind it (`x-kv-codes`, from `kvsidecar.errors.HTTP_STATUS`), from the steps every request takes
  (the listener's HTTP parsing and connection cap, Host, token, body cap, shutdown, path parameters,
  query and body) plus the route's own `errors`;
  FastAPI's 422 `HTTPValidationError` is never declared: bad input is 400 `KV_BAD_REQUEST`;
- the bearer scheme (HTTP bearer) is declared on every route but the public ones when a token is
  configured; without one the routes need no credentials and the document says none.

The document is built once per app, on first use; building it costs nothing on the request path.
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Annotated, Any

from fastapi import FastAPI, Query, Security
from fastapi.responses import JSONResponse, PlainTextResponse
from fastapi.security import HTTPBearer
from pydantic import BaseModel, Field

from kvsidecar.errors import (
    HTTP_STATUS,
    BadRequest,
    InvariantViolation,
    KvError,
    ModelBusy,
    PayloadTooLarge,
    ShuttingDown,
    SlotBusy,
    TooManyConnections,
    Unauthorized,
)
from kvsidecar.http.routes import Param, Route, path_params

BEARER = "bearer"  # the security scheme's name in the document
_RETRY = {
    SlotBusy.code,
    ModelBusy.code,
    ShuttingDown.code,
    TooManyConnections.code,
}  # 503s that say Retry-After


class ErrorDetail(BaseModel):
    code: str = Field(pattern=r"^KV_[A-Z_]+$", description="a stable code (docs/API.md, Error codes)")
    message: str
    hint: str


class ErrorBody(BaseModel):
    """Every error the hook API answers: `{"error": {"code", "message", "hint"}}`."""

    error: ErrorDetail


def error_codes(
    route: Route, params: Mapping[str, Param], *, token: bool, check_host: bool
) -> dict[int, list[str]]:
    """Status -> the error codes this route can answer with it, in the order of the request's steps."""
    # 400 on every route: a request the HTTP parser refuses (the listener answers it,
    # kvsidecar.http.listener), and, with `check_host`, a Host header that is not loopback (DNS rebinding).
    kinds: list[type[KvError]] = [BadRequest]
    if not route.public:
        kinds += [Unauthorized] if token else []
        kinds.append(ShuttingDown)  # the app is stopping (lifespan shutdown, or the request cancelled)
    kinds.append(PayloadTooLarge)
    for name in path_params(route.path):
        kinds += params[name].errors
    if route.query is not None or route.body is not None:
        kinds.append(BadRequest)
    kinds += [*route.errors, InvariantViolation, TooManyConnections]  # 503 from the listener at its cap
    out: dict[int, list[str]] = {}
    for kind in kinds:
        codes = out.setdefault(HTTP_STATUS[kind.code], [])
        if kind.code not in codes:
            codes.append(kind.code)
    return dict(sorted(out.items()))


def _responses(route: Route, codes: dict[int, list[str]]) -> dict[int | str, dict[str, Any]]:
    ok: dict[str, Any] = {"description": (inspect.getdoc(route.handler) or "OK").split("\n")[0]}
    if route.media_type != "application/json":
        ok["content"] = {route.media_type: {"schema": {"type": "string"}}}
    elif route.returns is not None:
        ok["model"] = route.returns
    out: dict[int | str, dict[str, Any]] = {200: ok}
    for status, names in codes.items():
        out[status] = {"model": ErrorBody, "description": ", ".join(names), "x-kv-codes": names}
        if _RETRY & set(names):
            out[status]["headers"] = {
                "Retry-After": {
                    "description": f"seconds; sent with {', '.join(sorted(_RETRY & set(names)))}",
                    "schema": {"type": "integer"},
                }
            }
    # Anything else (405 with `Allow` for a method the path does not take, 408 for a request head that
    # never completed) has the same body.
    out["default"] = {"model": ErrorBody, "description": "another error (codes: docs/API.md)"}
    return out


def document(
    routes: Sequence[Route],
    params: Mapping[str, Param],
    *,
    title: str,
    version: str,
    description: str,
    token: bool,
    check_host: bool,
) -> dict[str, Any]:
    """The OpenAPI document of `routes` (those with `in_schema`)."""
    app = FastAPI(
        title=title,
        version=version,
        description=description,
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    bearer = HTTPBearer(scheme_name=BEARER, description="the token in api.token_file", auto_error=False)
    for route in routes:
        if not route.in_schema:
            continue
        app.add_api_route(
            route.path,
            _stand_in(route, params),
            methods=[route.method],
            name=route.handler.__name__,
            description=inspect.getdoc(route.handler) or "",
            response_model=None,
            response_class=PlainTextResponse if route.media_type.startswith("text/") else JSONResponse,
            responses=_responses(route, error_codes(route, params, token=token, check_host=check_host)),
            dependencies=[Security(bearer)] if token and not route.public else None,
        )
    doc = app.openapi()
    error = {"application/json": {"schema": {"$ref": "#/components/schemas/ErrorBody"}}}
    for ops in doc["paths"].values():
        for op in ops.values():
            op["responses"].pop("422", None)  # never answered (FastAPI adds it for any parameter)
            for status, response in op["responses"].items():
                if status != "200":  # errors are JSON on every route, /metrics' text/plain too
                    response["content"] = error
    return doc


def _stand_in(route: Route, params: Mapping[str, Param]) -> Callable[..., Awaitable[None]]:
    """A stand-in endpoint whose signature tells FastAPI the route's parameters (never called)."""

    async def endpoint(**_: Any) -> None:
        raise AssertionError("documentation only")

    kw = inspect.Parameter.KEYWORD_ONLY
    signature = [inspect.Parameter(n, kw, annotation=params[n].schema) for n in path_params(route.path)]
    if route.query is not None:
        signature.append(inspect.Parameter("query", kw, annotation=Annotated[route.query, Query()]))
    if route.body is not None:
        signature.append(inspect.Parameter("body", kw, annotation=route.body))
    endpoint.__signature__ = inspect.Signature(signature)  # type: ignore[attr-defined]
    endpoint.__name__ = route.handler.__name__
    return endpoint
