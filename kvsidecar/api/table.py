"""What every part of the hook API's route table shares: the path parameters (one check per name, on every
route), the groups of errors handlers raise (for the OpenAPI document: `kvsidecar.http.openapi` adds what
every request can meet), and `json_route`, the shape of a JSON route.
"""

from __future__ import annotations

from typing import Annotated

from fastapi import Path
from pydantic import BaseModel

from kvsidecar.errors import (
    BackendUnavailable,
    BackendUnsupported,
    EraseFailed,
    InvalidSessionId,
    KvError,
    MetadataIO,
    ModelBusy,
    OperationTimeout,
    RestoreFailed,
    SaveFailed,
    ShuttingDown,
    SlotBusy,
    SlotNotFound,
    SnapshotCorrupt,
    SnapshotIncompatible,
    SnapshotNotFound,
)
from kvsidecar.http.routes import Handler, Param, Route
from kvsidecar.store.naming import validate_session_id

# SLOT: the route waits for a slot. STRICT: a save or restore failure, raised only with failure.strict
# (otherwise it falls back to a cold start).
SLOT: tuple[type[KvError], ...] = (SlotBusy, ModelBusy, ShuttingDown)
STRICT: tuple[type[KvError], ...] = (
    SnapshotNotFound,
    SnapshotIncompatible,
    SnapshotCorrupt,
    MetadataIO,
    BackendUnavailable,
    BackendUnsupported,
    SlotNotFound,
    SaveFailed,
    RestoreFailed,
    EraseFailed,
    OperationTimeout,
)


def _lease_id(value: str) -> str:
    """Any string: a lease id the coordinator does not hold, however it looks, is 404 KV_LEASE_NOT_FOUND
    from the coordinator, so a malformed id and an expired one get the same answer."""
    return value


PARAMS = {
    "session_id": Param(
        convert=validate_session_id,
        schema=Annotated[
            str,
            Path(
                description="opaque harness session id, 1-128 of [A-Za-z0-9._:@+-]",
                pattern=r"^[A-Za-z0-9._:@+\-]{1,128}$",  # kvsidecar.store.naming's rule, for the document
            ),
        ],
        errors=(InvalidSessionId,),
    ),
    "lease_id": Param(
        convert=_lease_id, schema=Annotated[str, Path(description="the lease id acquire returned")]
    ),
}


def json_route(
    method: str,
    path: str,
    handler: Handler,
    returns: type[BaseModel],
    errors: tuple[type[KvError], ...] = (),
    *,
    body: type[BaseModel] | None = None,
    query: type[BaseModel] | None = None,
    waits: bool = False,
) -> Route:
    """A JSON route: its 200 model and the errors its handler raises are for the OpenAPI document.
    `waits`: it waits for a slot and watches its caller (`Call.caller`)."""
    return Route(
        method=method,
        path=path,
        handler=handler,
        body=body,
        query=query,
        returns=returns,
        errors=errors,
        waits=waits,
    )
