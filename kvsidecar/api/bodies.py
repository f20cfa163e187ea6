"""The hook API's request models: the JSON bodies and query strings its routes validate (400
`KV_BAD_REQUEST` naming the first offending field, `kvsidecar.http.router`).

A leaf of the API: the fleet router (`kvsidecar.fleet.routing`) checks the releases other hosts queued for
this one with the release route's own `ReleaseBody`, and imports it from here, not from the routes.
"""

from __future__ import annotations

from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field

from kvsidecar.coordinator.core import EventType, ReleaseStatus

_Label = Annotated[str, Field(min_length=1, max_length=256)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")


class AcquireBody(_Body):
    provider: _Label
    model: _Label
    purpose: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    seq: Annotated[int, Field(ge=0)] | None = None
    # Issue 28: a cold start may begin from this session's newest snapshot (same provider, model and
    # credential scope: the operator's, as its manifest recorded it); the id is checked as a session id
    # (400 KV_INVALID_SESSION_ID), never used as a path
    prefix_from: (
        Annotated[
            str,
            Field(
                min_length=1,
                max_length=256,
                description="a session (same provider and model, of the operator's scope as its manifest "
                "recorded it: a proxy client's session of that id is another session) whose newest "
                "snapshot a cold start of this one may begin from; checked as a session id "
                "(400 KV_INVALID_SESSION_ID)",
            ),
        ]
        | None
    ) = None


class ReleaseBody(_Body):
    status: ReleaseStatus
    prompt_tokens: Annotated[int, Field(ge=0)] | None = None
    cached_tokens: Annotated[int, Field(ge=0)] | None = None
    # llama-server's timings.prompt_ms for the computed tokens: teaches the cost model the prefill speed
    prompt_ms: Annotated[float, Field(ge=0, lt=1e9)] | None = None


class EventBody(_Body):
    type: EventType
    seq: Annotated[int, Field(ge=0)] | None = None


class DoctorQuery(_Body):
    deep: bool = Field(False, description="also run a save/erase/restore round trip on a held slot")


class GcQuery(_Body):
    dry_run: bool = Field(False, description="plan only: delete nothing")
