"""The `servers` section: each llama-server kvsidecar manages (`ServerConfig`), its slot `Mode`, the
directory it saves slots into, and the timeouts and probes of every call to it."""

from __future__ import annotations

from enum import StrEnum

from pydantic import ConfigDict, Field, field_validator, model_validator

from kvsidecar.config.values import BaseUrl, PathValue, Section, home_path


class Mode(StrEnum):
    SINGLE_SLOT = "single-slot"
    MANAGED_SLOTS = "managed-slots"


class ServerConfig(Section):
    """One llama-server and the directory it saves slots into (its --slot-save-path)."""

    # `model`, `model_wait_s`: a router's model and the wait for it (pydantic's own names start `model_` too)
    model_config = ConfigDict(extra="forbid", frozen=True, protected_namespaces=())

    base_url: BaseUrl = "http://127.0.0.1:8080"
    api_key_file: PathValue | None = None
    snapshot_dir: PathValue = home_path("~/.local/state/kvsidecar/snapshots")
    runtime_key: str | None = None
    # A llama-server router (started without a model, `--models-dir`/`--models-preset`): `base_url` is the
    # router and this entry is the one model of it named here, as `GET /models` lists its id. Each model is
    # its own server entry (its own slots, fingerprint and sessions); docs/SWAPS.md.
    model: str | None = Field(default=None, min_length=1, max_length=256)
    # A router whose models kvsidecar discovers (docs/SWAPS.md, "Discovered models"): this entry is not a
    # server itself; every model `GET /models` lists (include/exclude: fnmatch patterns on its id; empty
    # include: all) becomes a server of its own, named `NAME.MODEL`, with this entry's settings, up to
    # `max_models` of them. An entry with `model:` on the same router keeps its model.
    discover_models: bool = False
    include_models: list[str] = Field(default_factory=list, max_length=256)
    exclude_models: list[str] = Field(default_factory=list, max_length=256)
    max_models: int = Field(default=32, ge=1, le=1024)
    # ask the router to re-read its models directory or preset at each look (`GET /models?reload=1`): a model
    # added there is listed only after that; the router also unloads a running model whose file changed
    reload_models: bool = False
    mode: Mode = Mode.SINGLE_SLOT
    slot_id: int = Field(default=0, ge=0)
    # managed-slots: keep the highest slot for auxiliary requests (titles, compaction), spec §72
    reserve_aux_slot: bool = False
    # how long an acquire waits for a free slot before KV_SLOT_BUSY (503 + Retry-After)
    slot_wait_s: float = Field(default=300.0, gt=0)
    # a router's model (`model:`): how long an acquire waits for room on the router (the other models of
    # ours it keeps loaded busy with requests) before KV_MODEL_BUSY (503 + Retry-After); docs/SWAPS.md
    model_wait_s: float = Field(default=120.0, gt=0)
    connect_timeout_s: float = Field(default=2.0, gt=0)
    request_timeout_s: float = Field(default=10.0, gt=0)
    persist_timeout_s: float = Field(default=120.0, gt=0)
    probe_interval_s: float = Field(default=5.0, gt=0)
    # Prefill a fixed prompt once per server start and fingerprint the bytes of its KV: catches what no
    # flag shows (LLAMA_ARG_* settings, a model replaced in place, a remote server's command line).
    # Turn off only for an engine whose KV is not bit-reproducible (some GPU backends).
    runtime_canary: bool = True

    @field_validator("model")
    @classmethod
    def _model_id(cls, value: str | None) -> str | None:
        """A router's model id goes into a query string and a JSON body: printable, no controls."""
        if value is not None and not all(c.isprintable() for c in value):
            raise ValueError("a model id of printable characters (as GET /models lists it)")
        return value

    @model_validator(mode="after")
    def _discovers_or_names(self) -> ServerConfig:
        if self.discover_models and self.model is not None:
            raise ValueError("discover_models: a router's entry discovers its models or names one (`model`)")
        return self
