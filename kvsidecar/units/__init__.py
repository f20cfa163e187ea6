"""systemd unit templates rendered by `kvsidecar install-systemd` (systemd/ holds the default rendering).

llama-server's unit runs `kvsidecar checkpoint --wait` in `ExecStop=`: a planned stop or restart saves
every dirty slot first. Directories under /var/lib/ become `StateDirectory=` entries, which systemd
creates with the unit's user, group and mode: the state directory in kvsidecar's unit (0700), the
snapshot directory in llama-server's (2770: setgid, shared with kvsidecar's group). Elsewhere they are
`ReadWritePaths=` the admin creates.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from importlib.resources import files
from pathlib import PurePosixPath

STATE_ROOT = PurePosixPath("/var/lib")
STATE_MODE = "0700"
SNAPSHOT_MODE = "2770"  # setgid, group rwx: kvsidecar reads and deletes what llama-server writes


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
    server: str = "local"  # the config's server llama-server.service runs (its ExecStop saves its slots)
    # More directories kvsidecar writes: the other servers' snapshot directories, api.unix_socket's.
    kv_writable: tuple[str, ...] = ()
    stop_timeout_s: int = 90
    checkpoint_timeout_s: int = 60  # how long llama-server's ExecStop waits for kvsidecar's saves
    # Every address kvsidecar listens on or connects to is loopback: the unit may deny all others.
    loopback_only: bool = True


UNITS = ("kvsidecar.service", "llama-server.service")


def state_directory(path: str) -> str | None:
    """The `StateDirectory=` name of a directory under /var/lib ("kvsidecar/state"), else None."""
    p = PurePosixPath(path)
    if not p.is_absolute() or ".." in p.parts or not p.is_relative_to(STATE_ROOT) or p == STATE_ROOT:
        return None
    return str(p.relative_to(STATE_ROOT))


def _directory_lines(path: str, mode: str, *, writable: bool) -> str:
    name = state_directory(path)
    if name is not None:
        return f"StateDirectory={name}\nStateDirectoryMode={mode}"
    note = f"# {path} is outside /var/lib: create it yourself (see install-systemd's output)."
    return f"{note}\nReadWritePaths={path}" if writable else note


def _derived(params: UnitParams) -> dict[str, str]:
    writable = [params.snapshot_dir, *params.kv_writable]
    if state_directory(params.state_dir) is None:
        writable.insert(0, params.state_dir)
    writable = list(dict.fromkeys(writable))
    ip_policy = (
        "# Every address in the config is loopback: nothing else is reachable.\n"
        "IPAddressDeny=any\nIPAddressAllow=localhost"
        if params.loopback_only
        else "# The config names a non-loopback address: no IPAddressDeny= (add your own allow list)."
    )
    return {
        "state_directory": _directory_lines(params.state_dir, STATE_MODE, writable=False),
        "snapshot_directory": _directory_lines(params.snapshot_dir, SNAPSHOT_MODE, writable=True),
        "read_write_paths": " ".join(writable),
        "ip_policy": ip_policy,
    }


def render(name: str, params: UnitParams) -> str:
    template = files("kvsidecar.units").joinpath(f"{name}.in").read_text(encoding="utf-8")
    values = {k: v for k, v in asdict(params).items() if k != "kv_writable"}
    return template.format(**values, **_derived(params))
