"""The local llama-server process: found by the port it serves, and what can be read about it.

`find_llama_process` matches a llama-server process on this host to a base URL (psutil). Its
`ProcessInfo` holds what the fingerprint needs: the command line and the llama.cpp-relevant part of its
environment (secrets left out; None when unreadable), its working directory and root (a container's files
are read through /proc/<pid>/root), a path to the binary it runs (/proc/<pid>/exe, which reads the file
even after it was replaced), the llama.cpp/ggml libraries it has mapped, and the llama.cpp config files
it reads at start (`/etc/llama.cpp/config.ini`, `~/.config/llama.cpp/config.ini`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import pwd
from collections.abc import Mapping
from dataclasses import dataclass
from functools import cached_property
from typing import Any
from urllib.parse import urlsplit

import psutil

from kvsidecar.store.llama_args import BY_ENV
from kvsidecar.store.llama_settings import RuntimeSettings, fingerprinted_env, legacy_flags, parse_settings

log = logging.getLogger("kvsidecar.fingerprint")


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

    @property
    def identity(self) -> tuple[int, float]:
        """Changes when llama-server restarts."""
        return (self.pid, self.create_time)

    @cached_property
    def settings(self) -> RuntimeSettings:
        return parse_settings(self.cmdline, self.environ)


def _is_local(host: str) -> bool:
    return host in {"127.0.0.1", "localhost", "::1", "0.0.0.0", "::", ""} or host.startswith("127.")


def _relevant_environ(proc: psutil.Process) -> dict[str, str] | None:
    try:
        environ = proc.environ()
    except (psutil.Error, OSError):
        return None
    keep = {"HOME", "XDG_CONFIG_HOME"}
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


def _mapped_libraries(pid: int) -> tuple[str, ...] | None:
    """The llama.cpp/ggml shared libraries in /proc/<pid>/maps ("... (deleted)" when replaced since)."""
    try:
        with open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    libs: set[str] = set()
    for line in lines:
        parts = line.split(maxsplit=5)
        path = parts[5] if len(parts) == 6 else ""
        base = os.path.basename(path.removesuffix(" (deleted)"))
        if base.startswith(("libllama", "libggml", "libmtmd")) and ".so" in base:
            libs.add(path)
    return tuple(sorted(libs))


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
    proc: psutil.Process, info: dict[str, Any], environ: dict[str, str] | None, settings: RuntimeSettings
) -> ProcessInfo:
    cwd = None
    with contextlib.suppress(psutil.Error, OSError):
        cwd = proc.cwd()
    pid = int(info["pid"])
    proc_exe = f"/proc/{pid}/exe"
    return ProcessInfo(
        pid=pid,
        create_time=info["create_time"],
        exe=info.get("exe"),
        cmdline=tuple(info.get("cmdline") or ()),
        flags=legacy_flags(settings),
        environ=environ,
        cwd=cwd,
        root=_proc_root(pid),
        binary=proc_exe if os.path.exists(proc_exe) else info.get("exe"),
        libraries=_mapped_libraries(pid),
        config_files=_config_files(proc, environ),
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
    found: list[tuple[psutil.Process, dict[str, Any], dict[str, str] | None, RuntimeSettings]] = []
    for proc in psutil.process_iter(["pid", "name", "cmdline", "create_time", "exe"]):
        info = proc.info
        cmdline = info.get("cmdline") or []
        if not cmdline or "llama-server" not in os.path.basename(cmdline[0]) + (info.get("name") or ""):
            continue
        environ = _relevant_environ(proc)
        settings = parse_settings(cmdline, environ)
        if (settings.effective("port") or "8080") == want_port:
            found.append((proc, info, environ, settings))
    if len(found) != 1:
        if found:
            log.debug("several llama-server processes on port %s: none trusted", want_port)
        return None
    return _process_info(*found[0])
