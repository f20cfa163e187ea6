"""The local llama-server process: found by the port it serves, and what can be read about it.

`find_llama_process` matches a llama-server process on this host to a base URL (psutil): `llama-server`,
or llama.cpp's unified binary running the same server (`llama serve ...`, alias `server`: its comm is
`llama`, and a router that is that binary starts its children so, with `LLAMA_APP_CMD=serve` in their
environment). Its
`ProcessInfo` holds what the fingerprint needs: the command line and the llama.cpp-relevant part of its
environment (secrets left out; None when unreadable), its working directory and root (a container's files
are read through /proc/<pid>/root), a path to the binary it runs (/proc/<pid>/exe, which reads the file
even after it was replaced), the llama.cpp/ggml libraries it has mapped, and the llama.cpp config files
it reads at start (`/etc/llama.cpp/config.ini`, `~/.config/llama.cpp/config.ini`), and the model files it
has mapped (`MappedFile`: device, inode and address ranges from /proc/<pid>/maps; a model replaced on disk
since it was loaded is still found there, as "... (deleted)", and read through /proc/<pid>/map_files/).
`model_mappings()` re-reads only those: cheap enough to bracket every restore, and it changes when the
process loads its model again (after sleep mode, `--sleep-idle-seconds`), since that maps the file anew.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any
from urllib.parse import urlsplit

import psutil

from kvsidecar.fingerprint.file_digests import file_identity
from kvsidecar.fingerprint.llama_args import BY_ENV
from kvsidecar.fingerprint.llama_settings import (
    SERVER_SUBCOMMANDS,
    RuntimeSettings,
    fingerprinted_env,
    legacy_flags,
    parse_settings,
)

log = logging.getLogger("kvsidecar.fingerprint")


@dataclass(frozen=True, kw_only=True)
class MappedFile:
    """A file the process has mapped shared and read-only, the way llama.cpp maps a GGUF (`r--s`)."""

    path: str  # as /proc/<pid>/maps shows it, without " (deleted)"
    deleted: bool  # unlinked (or renamed over) since it was mapped
    dev: int  # os.makedev(major, minor) as maps shows it
    ino: int
    ranges: tuple[tuple[int, int], ...]  # its address ranges (start, end), in address order
    # size, mtime and ctime of the file it maps (`file_identity`), None when it cannot be stat'ed: a rewrite
    # in place keeps the inode and the ranges, and the process sees the new bytes through MAP_SHARED
    content: str | None = None

    @property
    def key(self) -> tuple[int, int]:
        return (self.dev, self.ino)

    def map_files(self, pid: int) -> list[str]:
        """/proc/<pid>/map_files/ entries that read this file (opening one needs CAP_SYS_ADMIN)."""
        return [f"/proc/{pid}/map_files/{a:x}-{b:x}" for a, b in self.ranges]


LoadIdentity = tuple[tuple[int, int, tuple[tuple[int, int], ...], str], ...]


def load_identity(mapped: tuple[MappedFile, ...] | None) -> LoadIdentity | None:
    """What changes when the process maps its model again (each mapped file's device, inode and ranges)
    or when a file it maps is rewritten in place (its size, mtime or ctime)."""
    if mapped is None:
        return None
    return tuple(sorted((m.dev, m.ino, m.ranges, m.content or "") for m in mapped))


@dataclass(frozen=True, kw_only=True)
class ProcessInfo:
    pid: int
    create_time: float
    exe: str | None
    cmdline: tuple[str, ...]
    flags: dict[str, str]  # effective values of a few settings (legacy_flags)
    # llama.cpp-relevant variables of its environment (secrets left out); None: could not be read
    environ: Mapping[str, str] | None = None
    cwd: str | None = None  # to resolve relative paths in its settings
    root: str = ""  # prefix under which its files are seen from here: "" or /proc/<pid>/root
    binary: str | None = None  # a path that reads the binary it runs, even if replaced: /proc/<pid>/exe
    libraries: tuple[str, ...] | None = None  # llama.cpp/ggml shared libraries it has mapped; None: unknown
    config_files: tuple[str, ...] = ()  # llama.cpp config files it reads at start (present or not)
    # files mapped like a model (shared, read-only, not code): None when /proc/<pid>/maps is unreadable
    mapped_models: tuple[MappedFile, ...] | None = None
    # how it runs the server: `llama-server`, or llama.cpp's unified binary (`llama serve`)
    program: str = "llama-server"

    @property
    def identity(self) -> tuple[int, float]:
        """Changes when llama-server restarts."""
        return (self.pid, self.create_time)

    @property
    def load_identity(self) -> LoadIdentity | None:
        return load_identity(self.mapped_models)

    @cached_property
    def settings(self) -> RuntimeSettings:
        return parse_settings(self.cmdline, self.environ)


def server_program(cmdline: Sequence[str], name: str, environ: Mapping[str, str] | None = None) -> str | None:
    """`llama-server` or `llama serve`/`llama server` when this command line (and process name, `comm`)
    runs llama.cpp's server; None otherwise. The unified binary runs the server only as its `serve`
    subcommand; where the first argument was rewritten, `LLAMA_APP_CMD=serve` in its environment says so."""
    if not cmdline:
        return None
    program = os.path.basename(cmdline[0])
    if "llama-server" in program + name:
        return "llama-server"
    if "llama" not in program + name:
        return None
    if len(cmdline) > 1 and cmdline[1] in SERVER_SUBCOMMANDS:
        return f"llama {cmdline[1]}"
    if environ is not None and environ.get("LLAMA_APP_CMD") == "serve":
        return "llama serve"
    return None


def _is_local(host: str) -> bool:
    return host in {"127.0.0.1", "localhost", "::1", "0.0.0.0", "::", ""} or host.startswith("127.")


def _relevant_environ(proc: psutil.Process) -> dict[str, str] | None:
    try:
        environ = proc.environ()
    except (psutil.Error, OSError):
        return None
    keep = {"HOME", "XDG_CONFIG_HOME", "LLAMA_APP_CMD"}
    return {
        k: v
        for k, v in environ.items()
        if k in keep or ((k in BY_ENV or fingerprinted_env(k)) and k not in {"HF_TOKEN", "LLAMA_API_KEY"})
    }


def _proc_root(pid: int) -> str:
    """/proc/<pid>/root when the process sees another root directory (a container), else ""."""
    try:
        theirs, ours = os.stat(f"/proc/{pid}/root"), os.stat("/")
    except OSError:
        return ""
    return "" if (theirs.st_dev, theirs.st_ino) == (ours.st_dev, ours.st_ino) else f"/proc/{pid}/root"


def _read_maps(pid: int) -> list[str] | None:
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="surrogateescape") as f:
            return f.read().splitlines()
    except OSError:
        return None


def _mapped_libraries(lines: list[str] | None) -> tuple[str, ...] | None:
    """The llama.cpp/ggml shared libraries in /proc/<pid>/maps ("... (deleted)" when replaced since)."""
    if lines is None:
        return None
    libs: set[str] = set()
    for line in lines:
        parts = line.split(maxsplit=5)
        path = parts[5] if len(parts) == 6 else ""
        base = os.path.basename(path.removesuffix(" (deleted)"))
        if base.startswith(("libllama", "libggml", "libmtmd")) and ".so" in base:
            libs.add(path)
    return tuple(sorted(libs))


def _content(
    pid: int, root: str, path: str, deleted: bool, key: tuple[int, int], start: int, end: int
) -> str | None:
    """`MappedFile.content`: the mapped file's stat through /proc/<pid>/map_files/ (the file itself), else
    through its path when that still names the same device and inode."""
    candidates = [f"/proc/{pid}/map_files/{start:x}-{end:x}"]
    if not deleted:
        candidates.append(root + path)
    for i, candidate in enumerate(candidates):
        try:
            st = os.stat(candidate)
        except (OSError, ValueError):
            continue
        if i == 0 or (st.st_dev, st.st_ino) == key:
            return file_identity(st)
    return None


def _parse_mapped(lines: list[str], pid: int | None = None, root: str = "") -> tuple[MappedFile, ...]:
    """Regular files mapped shared and read-only and never executable: how llama.cpp maps a model."""
    found: dict[tuple[int, int], tuple[str, list[tuple[int, int]]]] = {}
    code: set[tuple[int, int]] = set()
    for line in lines:
        parts = line.split(maxsplit=5)
        if len(parts) != 6 or not parts[5].startswith("/"):
            continue
        addr, perms, _, dev, inode, path = parts
        try:
            start, end = (int(x, 16) for x in addr.split("-", 1))
            major, minor = (int(x, 16) for x in dev.split(":", 1))
            key = (os.makedev(major, minor), int(inode))
        except ValueError:
            continue
        if key[1] == 0 or path.startswith("/dev/") or len(perms) < 4:
            continue
        if "x" in perms or "w" in perms or perms[3] != "s":
            if "x" in perms:
                code.add(key)
            continue
        found.setdefault(key, (path, []))[1].append((start, end))
    out = []
    for key, (path, ranges) in found.items():
        if key in code:
            continue
        deleted = path.endswith(" (deleted)")
        path = path.removesuffix(" (deleted)")
        ranges.sort()
        content = None if pid is None else _content(pid, root, path, deleted, key, *ranges[0])
        out.append(
            MappedFile(
                path=path, deleted=deleted, dev=key[0], ino=key[1], ranges=tuple(ranges), content=content
            )
        )
    return tuple(sorted(out, key=lambda m: (m.ranges, m.key)))


def model_mappings(pid: int) -> tuple[MappedFile, ...] | None:
    """The files the process maps like a model now; None when its maps cannot be read."""
    lines = _read_maps(pid)
    return None if lines is None else _parse_mapped(lines, pid, _proc_root(pid))


def _config_files(proc: psutil.Process, environ: Mapping[str, str] | None) -> tuple[str, ...]:
    """llama.cpp's config.ini locations for this process (common_params_apply_system_config)."""
    env = environ or {}
    user_dir = env.get("XDG_CONFIG_HOME") or (env.get("HOME") and os.path.join(env["HOME"], ".config"))
    if not user_dir:
        with contextlib.suppress(psutil.Error, KeyError, OSError):
            user_dir = os.path.join(pwd.getpwuid(proc.uids().real).pw_dir, ".config")
    files = ["/etc/llama.cpp/config.ini"]
    if user_dir:
        files.append(os.path.join(user_dir, "llama.cpp", "config.ini"))
    return tuple(files)


def _process_info(
    proc: psutil.Process,
    info: dict[str, Any],
    environ: dict[str, str] | None,
    settings: RuntimeSettings,
    program: str,
) -> ProcessInfo:
    cwd = None
    with contextlib.suppress(psutil.Error, OSError):
        cwd = proc.cwd()
    pid = int(info["pid"])
    proc_exe = f"/proc/{pid}/exe"
    maps = _read_maps(pid)
    root = _proc_root(pid)
    return ProcessInfo(
        pid=pid,
        create_time=info["create_time"],
        exe=info.get("exe"),
        cmdline=tuple(info.get("cmdline") or ()),
        flags=legacy_flags(settings),
        environ=environ,
        cwd=cwd,
        root=root,
        binary=proc_exe if os.path.exists(proc_exe) else info.get("exe"),
        libraries=_mapped_libraries(maps),
        config_files=_config_files(proc, environ),
        mapped_models=None if maps is None else _parse_mapped(maps, pid, root),
        program=program,
    )


def find_llama_process(base_url: str) -> ProcessInfo | None:
    """The local llama-server process serving `base_url` (matched by its port, from --port or LLAMA_ARG_PORT).

    None when the server is not on this host, or when several processes claim the port (--reuse-port):
    then nothing can be said about which one answers.
    """
    parts = urlsplit(base_url)
    if not _is_local(parts.hostname or ""):
        return None
    want_port = str(parts.port or (443 if parts.scheme == "https" else 80))
    found: list[tuple[psutil.Process, dict[str, Any], dict[str, str] | None, RuntimeSettings, str]] = []
    for proc in psutil.process_iter(["pid", "name", "cmdline", "create_time", "exe"]):
        info = proc.info
        cmdline = info.get("cmdline") or []
        name = info.get("name") or ""
        if not cmdline or "llama" not in os.path.basename(cmdline[0]) + name:
            continue
        environ = _relevant_environ(proc)
        program = server_program(cmdline, name, environ)
        if program is None:
            continue
        settings = parse_settings(cmdline, environ)
        if (settings.effective("port") or "8080") == want_port:
            found.append((proc, info, environ, settings, program))
    if len(found) != 1:
        if found:
            log.debug("several llama-server processes on port %s: none trusted", want_port)
        return None
    return _process_info(*found[0])
