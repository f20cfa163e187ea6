"""systemd unit templates rendered by `kvsidecar install-systemd` (systemd/ holds the default rendering)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from importlib.resources import files


@dataclass(frozen=True, kw_only=True)
class UnitParams:
    user: str = "kvsidecar"
    llama_user: str = "llama"
    group: str = "llama"
    kvsidecar: str = "/usr/local/bin/kvsidecar"
    config: str = "/etc/kvsidecar/config.yaml"
    state_dir: str = "/var/lib/kvsidecar/state"
    snapshot_dir: str = "/var/lib/kvsidecar/snapshots"
    llama_server: str = "/usr/local/bin/llama-server"
    model: str = "/var/lib/llama/models/model.gguf"
    llama_port: int = 8080
    llama_unit: str = "llama-server.service"
    stop_timeout_s: int = 90


UNITS = ("kvsidecar.service", "llama-server.service")


def render(name: str, params: UnitParams) -> str:
    template = files("kvsidecar.units").joinpath(f"{name}.in").read_text(encoding="utf-8")
    return template.format(**asdict(params))
