"""The model llama-server has loaded, as the fingerprint's `model_file` component and as the doctor's
"model identity": `model_files` and `model_proof`.

`model_file` is a JSON list with a whole-file xxh3-128 digest of every file of the model (each shard of a
split GGUF, `model_paths`), identified by what the process maps (device and inode in /proc/<pid>/maps),
not by what its path names now: a model renamed over the path while the server runs the old one is the old
one, read through /proc/<pid>/map_files/. A loaded file that cannot be proven (not mapped: `--no-mmap`, a
shard fully offloaded; mapped but unreadable) is recorded as bound to this process (`loaded@<pid>:<start>`),
or, when the process can load its model again (`reload_possible`: sleep mode, a config file, an
unreadable environment) or is a router, as `unproven:<random>`, which equals nothing. `model_proof` says
which of those limits applies now, and how to lift it, without reading a digest.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass

from kvsidecar.backend.base import BackendCapabilities
from kvsidecar.fingerprint.llama_process import MappedFile, ProcessInfo
from kvsidecar.fingerprint.process_files import ProcessFiles

_SPLIT = re.compile(r"(?P<prefix>.+)-(?P<no>[0-9]{5})-of-(?P<n>[0-9]{5})\.gguf")
_MAX_SPLITS = 65535  # llama.cpp reads the split count as a uint16 (split.count)
_GGUF_MAGIC = b"GGUF"


def model_paths(path: str) -> list[str]:
    """The files llama.cpp loads for `path`: every shard of `<name>-00001-of-0000N.gguf`
    (llama_get_list_splits), else the file itself."""
    m = _SPLIT.fullmatch(path)
    if m is None or int(m["no"]) != 1 or not 1 < int(m["n"]) <= _MAX_SPLITS:
        return [path]
    n = int(m["n"])
    return [f"{m['prefix']}-{i:05d}-of-{n:05d}.gguf" for i in range(1, n + 1)]


def _is_gguf(path: str) -> bool | None:
    """True/False when the file can be read, None when it cannot."""
    try:
        with open(path, "rb") as f:
            return f.read(4) == _GGUF_MAGIC
    except (OSError, ValueError):
        return None


def reload_possible(process: ProcessInfo, files: ProcessFiles) -> bool:
    """Can this process load its model again without restarting (sleep mode)? Unknown counts as yes."""
    settings = process.settings
    sleep = settings.effective("sleep-idle-seconds")
    if sleep is not None and sleep.strip() != "-1":
        return True
    if not settings.environ_readable:
        return True  # LLAMA_ARG_SLEEP_IDLE_SECONDS could be set
    for path in process.config_files:  # a config.ini may set it
        local = files.local(path)
        if local is None or os.path.lexists(local):
            return True
    return False


class _ModelFiles:
    """The digest of each file of the model a local process has loaded, from what it maps."""

    def __init__(self, process: ProcessInfo, files: ProcessFiles, mapped: tuple[MappedFile, ...]) -> None:
        self.process, self.files, self.mapped = process, files, mapped
        self.bound = _bound(process)
        self.used: set[tuple[int, int]] = set()

    def _via_map_files(self, m: MappedFile) -> str | None:
        if self.files.digests is None:
            return None
        for entry in m.map_files(self.process.pid):
            digest = self.files.digests.digest(entry, expect=lambda st: st.st_ino == m.ino)
            if digest is not None:
                return digest
        return None

    def _via_path(self, local: str | None, m: MappedFile) -> str | None:
        if local is None or self.files.digests is None:
            return None
        return self.files.digests.digest(local, expect=lambda st: (st.st_dev, st.st_ino) == m.key)

    def _mapping_at(self, path: str, local: str | None) -> MappedFile | None:
        """The mapped file that `path` names now, or that was at `path` when mapped (replaced since)."""
        if local is not None:
            with contextlib.suppress(OSError, ValueError):
                st = os.stat(local)
                for m in self.mapped:
                    if m.key == (st.st_dev, st.st_ino) and m.key not in self.used:
                        return m
        names = {path, os.path.normpath(path)}
        if local is not None:
            with contextlib.suppress(OSError, ValueError):
                real = os.path.realpath(local)
                names.add(real.removeprefix(self.process.root) if self.process.root else real)
        free = [m for m in self.mapped if m.key not in self.used]
        return next((m for m in free if m.deleted and m.path in names), None)

    def entry(self, path: str, unmapped: Callable[[str], str]) -> str:
        local = self.files.local(path)
        m = self._mapping_at(path, local)
        if m is None:
            return unmapped(path)
        self.used.add(m.key)
        digest = (None if m.deleted else self._via_path(local, m)) or self._via_map_files(m)
        return digest or f"mapped:{m.dev}:{m.ino}{self.bound}"

    def extras(self) -> list[str]:
        """Other model files it maps (a draft model, or a file mapped under another name)."""
        out = []
        for m in self.mapped:
            if m.key in self.used:
                continue
            local = None if m.deleted else self.files.local(m.path)
            readable = next(
                (r for r in [*m.map_files(self.process.pid), local] if r and _is_gguf(r) is not None), None
            )
            if readable is not None and not _is_gguf(readable):
                continue  # a shared read-only mapping that is not a GGUF
            digest = self._via_map_files(m) or self._via_path(local, m)
            out.append(digest or f"mapped:{m.dev}:{m.ino}{self.bound}")
        return sorted(out)


def model_files(caps: BackendCapabilities, process: ProcessInfo | None, files: ProcessFiles) -> str:
    """`model_file`: a JSON list, one entry per loaded model file (see the module docstring); "" when
    nothing is read (`files` without digests) or the server names no model."""
    if files.digests is None:
        return ""
    if caps.props.get("role") == "router":
        # a router loads and unloads models in child processes: nothing here says which one answers
        return json.dumps(["unproven:" + secrets.token_hex(8)])
    if not caps.model_path:
        return ""
    paths = model_paths(caps.model_path)
    if process is None:  # remote, or not visible: the files at those paths as readable from here
        return json.dumps([files.state(p) for p in paths])
    reloads = reload_possible(process, files)

    def unmapped(path: str) -> str:
        # what it read at its start (bound to this process), never matched when it may have read again;
        # the path's digest too: a mapping that could not be seen still shows a rewrite in place
        if reloads:
            return "unproven:" + secrets.token_hex(8)
        return f"loaded{_bound(process)}:{files.state(path)}"

    if process.mapped_models is None:
        return json.dumps([unmapped(p) for p in paths])
    model = _ModelFiles(process, files, process.mapped_models)
    entries = [model.entry(p, unmapped) for p in paths]
    return json.dumps(entries + model.extras())


@dataclass(frozen=True, kw_only=True)
class ModelProof:
    """Why the loaded model cannot be proven across a llama-server restart, and how to make it provable.

    `code`: KV_MODEL_BOUND_TO_PROCESS (a snapshot restores only into the process that saved it, never after
    llama-server restarts) or KV_MODEL_UNPROVEN (the process may load its model again: a snapshot restores
    only until the fingerprint is next rebuilt, never after a restart or a reload)."""

    code: str
    why: str
    fix: str

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code, "why": self.why, "fix": self.fix}


_SAME_USER = (
    "run kvsidecar as llama-server's user (systemd: the same User= in both units) or as root, so it can "
    "read /proc/<pid>/maps and /proc/<pid>/environ"
)


def model_proof(caps: BackendCapabilities, process: ProcessInfo | None) -> ModelProof | None:
    """The limit `model_files` puts on the loaded model now (None: proven by what the process maps, or
    a remote server, whose files are read by path). No digest is computed: cheap, for doctor and status."""
    if caps.props.get("role") == "router":
        return ModelProof(
            code="KV_MODEL_UNPROVEN",
            why="llama-server runs in router mode: its models load and unload in child processes",
            fix="point base_url at a llama-server that serves one model (-m), not at the router",
        )
    if process is None or not caps.model_path:
        return None
    files = ProcessFiles(None, process)
    reasons: list[str] = []
    fixes: list[str] = []
    if process.mapped_models is None:
        reasons.append(f"/proc/{process.pid}/maps is not readable (llama-server runs as another user)")
        fixes.append(_SAME_USER)
    else:
        model = _ModelFiles(process, files, process.mapped_models)
        if any(model._mapping_at(p, files.local(p)) is None for p in model_paths(caps.model_path)):
            reasons.append("the model is not mapped (--no-mmap, --load-mode none/dio, --mlock, or offloaded)")
            fixes.append("start llama-server with the model memory-mapped (the default load mode)")
    if not reasons:
        return None
    code = "KV_MODEL_BOUND_TO_PROCESS"
    if reload_possible(process, files):
        code = "KV_MODEL_UNPROVEN"
        sleep = process.settings.effective("sleep-idle-seconds")
        if sleep is not None and sleep.strip() != "-1":
            reasons.append(f"sleep mode (--sleep-idle-seconds {sleep}) reloads the model from its path")
            fixes.append("start llama-server without --sleep-idle-seconds")
        elif not process.settings.environ_readable:
            reasons.append(f"/proc/{process.pid}/environ is not readable (it may set sleep mode)")
            if _SAME_USER not in fixes:
                fixes.append(_SAME_USER)
        else:
            reasons.append("a llama.cpp config.ini is present (it may set sleep mode)")
            fixes.append("remove the llama.cpp config.ini files: " + ", ".join(process.config_files))
    return ModelProof(
        code=code,
        why="snapshots cannot be restored after llama-server restarts: " + "; ".join(reasons),
        fix="; ".join(fixes),
    )


def _bound(process: ProcessInfo) -> str:
    return f"@{process.pid}:{process.create_time!r}"
