"""Does llama-server save where kvsidecar looks? A server's `snapshot_dir` must be the directory of its
`--slot-save-path` (or `LLAMA_ARG_SLOT_SAVE_PATH`): otherwise every save lands where kvsidecar never
finds it and every restore misses. Known only when the local process and its settings can be read
(`fingerprint.llama_process.find_llama_process`); a remote server, or one that cannot be read, is not judged.

`serve` logs the result at start (`kv.config.save_path_mismatch`, code `KV_SAVE_PATH_MISMATCH`) and
`status` shows it; `doctor` checks the same thing with a probe save.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from kvsidecar.config import ServerConfig
from kvsidecar.fingerprint.llama_process import ProcessInfo
from kvsidecar.logs import event

log = logging.getLogger("kvsidecar.service")

SAVE_PATH_MISMATCH = "KV_SAVE_PATH_MISMATCH"


@dataclass(frozen=True, kw_only=True)
class SetupWarning:
    code: str
    server: str
    message: str
    fix: str

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _their_dir(process: ProcessInfo, path: str) -> str | None:
    """`path` from llama-server's settings, as this process sees it (its cwd, its root)."""
    if not os.path.isabs(path):
        if process.cwd is None:
            return None
        path = os.path.join(process.cwd, path)
    return process.root + path if process.root else path


def llama_save_dir(process: ProcessInfo | None) -> str | None:
    """The directory llama-server `process` saves into, as a path this host can resolve the way the
    server does (its --slot-save-path string, under its root, a relative one from its working directory);
    None when there is no local process or it has no --slot-save-path. The store checks, before every save
    and restore, that this still leads to the snapshot directory it holds (`SNAPSHOT_DIR_MOVED`)."""
    if process is None:
        return None
    theirs = process.flags.get("slot_save_path")
    if not theirs:
        return None
    if not os.path.isabs(theirs) and not process.root:
        cwd = f"/proc/{process.pid}/cwd"  # the server's own working directory, even if renamed since
        if os.path.isdir(cwd):
            return os.path.join(cwd, theirs)
    return _their_dir(process, theirs)


def same_directory(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:  # one of them does not exist (yet): compare the resolved names
        return os.path.realpath(a) == os.path.realpath(b)


def save_path_warning(name: str, server: ServerConfig, process: ProcessInfo | None) -> SetupWarning | None:
    """A warning when the local llama-server `process` of server `name` saves elsewhere than its
    `snapshot_dir` (or nowhere); None when they agree or nothing can be said (process None)."""
    if process is None:
        return None
    ours = str(server.snapshot_dir)
    theirs = process.flags.get("slot_save_path")
    fix = f"make servers.{name}.snapshot_dir and llama-server's --slot-save-path the same directory"
    if not theirs:
        return SetupWarning(
            code=SAVE_PATH_MISMATCH,
            server=name,
            message=f"llama-server (pid {process.pid}) runs without --slot-save-path: it cannot save a slot",
            fix=f"start llama-server with --slot-save-path {ours}",
        )
    seen = _their_dir(process, theirs)
    if seen is None or same_directory(seen, ours):  # a relative path and no cwd: cannot tell
        return None
    return SetupWarning(
        code=SAVE_PATH_MISMATCH,
        server=name,
        message=f"llama-server (pid {process.pid}) saves into {theirs} but kvsidecar manages {ours}",
        fix=fix,
    )


def log_save_path_warnings(
    servers: Mapping[str, tuple[ServerConfig, ProcessInfo | None]],
) -> list[SetupWarning]:
    """`serve` at start: one WARNING (`kv.config.save_path_mismatch`) per server that saves elsewhere."""
    found = [w for name, (cfg, proc) in servers.items() if (w := save_path_warning(name, cfg, proc))]
    for w in found:
        event(
            log,
            logging.WARNING,
            "kv.config.save_path_mismatch",
            code=w.code,
            server=w.server,
            detail=w.message,
            fix=w.fix,
        )
    return found
