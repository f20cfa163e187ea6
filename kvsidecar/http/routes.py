"""What a route table is made of: `Route`, its path `Param`s, and the checked `Call` a handler gets.

A leaf: the dispatcher (`kvsidecar.http.router`) serves a table of these and the document
(`kvsidecar.http.openapi`) describes the same table, and neither is imported here, so each can change
without the other in its imports.
"""

from __future__ import annotations

import re
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from pydantic import BaseModel

from kvsidecar.coordinator.caller import Caller
from kvsidecar.errors import KvError

M = TypeVar("M", bound=BaseModel)
# A path parameter in a route's template: `{session_id}`, always a whole path segment.
PARAM = re.compile(r"\{(\w+)\}")


def path_params(template: str) -> list[str]:
    """The parameter names of a path template, in order."""
    return PARAM.findall(template)


@dataclass(frozen=True, kw_only=True)
class Param:
    """A path parameter: the one check its value gets on every route, and its OpenAPI description."""

    convert: Callable[[str], str]
    schema: Any  # Annotated[str, fastapi.Path(...)], for the document only
    errors: tuple[type[KvError], ...] = ()  # what `convert` raises, for the document


@dataclass(frozen=True, kw_only=True)
class Call:
    """One request, checked: converted path parameters, the validated query and body models."""

    params: dict[str, str]
    query: BaseModel | None = None
    body: BaseModel | None = None
    hop: int = 0  # fleet mode: how many hosts forwarded this call already (X-KV-Fleet-Hop)
    # Routes that wait for a slot (`Route.waits`): whether the client still waits for the answer (its
    # connection, its X-KV-Deadline-Ms budget). None on the other routes.
    caller: Caller | None = None

    def body_as(self, model: type[M]) -> M:
        if not isinstance(self.body, model):
            raise TypeError(f"route declared no {model.__name__} body")  # a table bug, never the client's
        return self.body

    def query_as(self, model: type[M]) -> M:
        if not isinstance(self.query, model):
            raise TypeError(f"route declared no {model.__name__} query")
        return self.query


Handler = Callable[[Call], Awaitable[Any]]


@dataclass(frozen=True, kw_only=True)
class Route:
    """One route. The handler returns JSON-able data, or a `Response` it built itself."""

    method: str
    path: str  # a template: `/v1/sessions/{session_id}/acquire`
    handler: Handler
    body: type[BaseModel] | None = None
    query: type[BaseModel] | None = None
    public: bool = False  # no bearer token on this path (liveness); only for a path without parameters
    in_schema: bool = True
    # For the document only (never used to build or check an answer): the 200 answer's model, its media
    # type, and the errors the handler raises beyond those every request can meet (kvsidecar.http.openapi).
    returns: type[BaseModel] | None = None
    media_type: str = "application/json"
    errors: tuple[type[KvError], ...] = ()
    # The handler may wait (for a slot): it gets a `Call.caller` that is gone once the client disconnects
    # or its X-KV-Deadline-Ms budget is spent (an acquire then grants nothing; issue 26 C).
    waits: bool = False
