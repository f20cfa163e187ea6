"""The status view of a server's model memory (its class, the SWA cache, what a snapshot costs, whether
saves are made) as pydantic models, for the OpenAPI document only (`kvsidecar.api.models`)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field


class SwaCacheView(BaseModel):
    layers: int = Field(description="the model's sliding-window layers")
    streams: int = Field(description="1 with a unified KV cache, else one per slot")
    cells: int = Field(description="cells a stream of the SWA cache has without --swa-full")
    cells_full: int = Field(description="and with it (every position of a slot's context)")
    bytes_per_cell: int
    mib: float = Field(description="the SWA cache without --swa-full, MiB")
    mib_swa_full: float = Field(description="the SWA cache with --swa-full, MiB")


class SnapshotCostView(BaseModel):
    bytes_per_token: int = Field(description="what a saved token adds")
    fixed_bytes: int = Field(description="whatever the length: a recurrent state, an SWA window")


class MemoryView(BaseModel):
    class_: Literal["plain", "swa", "hybrid", "recurrent", "unknown"] = Field(
        alias="class", description="the model's memory class, read from its files and the server's settings"
    )
    arch: str | None
    n_swa: int = Field(description="the sliding window (0: none)")
    swa_full: bool
    restore_keeps: Literal["prefix", "extension", "nothing"] | None = Field(
        description="what a restored state can give the next prompt (docs/MODELS.md); null when unknown"
    )
    settings_read: bool = Field(description="llama-server's command line and environment were both read")
    why: str | None = Field(description="why the class is unknown")
    swa_cache: SwaCacheView | None = Field(description="a sliding-window model's SWA cache, when known")
    snapshot: SnapshotCostView | None = Field(
        description="what a snapshot costs, predicted from the model and settings (docs/MODELS.md)"
    )
    saves: Literal["on", "off"] = Field(description="off: no restore could use a save, none is made")
    reason: Literal["swa_window_not_saved"] | None
    fix: str | None
    cost: str | None = Field(description="what the fix costs in memory")
