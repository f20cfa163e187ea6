"""The `fleet` section (docs/FLEET.md): several hosts share a snapshot filesystem, coordinated through
Redis. It owns the rules for a host id (`HOST_ID`, which names Redis keys) and a Redis URL, and the checks
among the fleet's own keys; the checks against other sections are the top-level model's."""

from __future__ import annotations

import re
import socket
from pathlib import Path
from typing import Annotated

from pydantic import AfterValidator, Field

from kvsidecar.config.values import BaseUrl, PathValue, Section

HOST_ID = re.compile(r"\A[A-Za-z0-9._-]{1,64}\Z")  # it names Redis keys: no separators, no spaces


_REDIS_URL = re.compile(r"\A(?:rediss?://[^/\s]+(?:/\d{1,5})?/?|unix:///\S+)\Z")


def _host_id(value: str) -> str:
    if not HOST_ID.match(value):
        raise ValueError("must be 1-64 characters of A-Z a-z 0-9 . _ -")
    return value


def _redis_url(value: str) -> str:
    # The value is never echoed: it may carry a password.
    if not _REDIS_URL.match(value):
        raise ValueError("must be redis://[user:password@]host[:port][/db], rediss://... or unix:///path")
    return value


class FleetConfig(Section):
    """Fleet mode (docs/FLEET.md): several hosts share a snapshot filesystem, coordinated through Redis.
    Off by default; then nothing of it is imported or started."""

    enabled: bool = False
    # Credentials in it are never logged or shown (kvsidecar.fleet.redacted).
    redis_url: Annotated[str, AfterValidator(_redis_url)] = Field(
        default="redis://127.0.0.1:6379/0", repr=False
    )
    host_id: Annotated[str, AfterValidator(_host_id)] | None = None  # null: this machine's hostname
    # This kvsidecar's hook API as the other hosts reach it (null: http://<api.listen>)
    advertise_url: BaseUrl | None = None
    # This kvsidecar's proxy listener as the other hosts reach it (null: http://<proxy.listen>)
    advertise_proxy_url: BaseUrl | None = None
    key_prefix: Annotated[str, AfterValidator(_host_id)] = "kvsidecar"  # two fleets may share a Redis
    heartbeat_s: float = Field(default=2.0, gt=0)
    host_ttl_s: float = Field(default=6.0, gt=0)  # a host whose record is older than this is gone
    owner_lease_ttl_s: float = Field(default=30.0, gt=0)
    # The directory on the shared filesystem for manifests, fingerprints and fence files (one copy for the
    # whole fleet; every host mounts it at the same path). Required when enabled.
    shared_dir: PathValue | None = None
    # Seconds a hook call forwarded to another host may take (it may wait for a slot and a restore).
    forward_timeout_s: float = Field(default=600.0, gt=0)

    def problems(self) -> list[str]:
        out = []
        if self.enabled and self.shared_dir is None:
            out.append("fleet.shared_dir: required when fleet.enabled (a directory on the shared filesystem)")
        if self.host_ttl_s <= self.heartbeat_s:
            out.append("fleet.host_ttl_s: must be longer than fleet.heartbeat_s (a live host would expire)")
        if self.owner_lease_ttl_s <= self.heartbeat_s:
            out.append("fleet.owner_lease_ttl_s: must be longer than fleet.heartbeat_s")
        if self.host_id is None and not HOST_ID.match(socket.gethostname()):
            out.append("fleet.host_id: this machine's hostname is not a valid host id; set one")
        return out

    def metadata_dir(self) -> Path | None:
        """Where the store keeps manifests, fingerprints and fences: the shared directory in fleet mode."""
        return self.shared_dir if self.enabled else None

    def effective_host_id(self) -> str:
        return self.host_id if self.host_id is not None else socket.gethostname()
