"""Runtime fingerprints (spec §15, §31, §57): which server state a snapshot may be restored into.

Fail closed. A fingerprint is a set of named components; a snapshot is restored only into a server whose
components are all equal to the ones it was saved under. The components are:

- what llama-server says about itself (`/props`: model path, build) and the operator's `runtime_key`;
- a whole-file xxh3-128 digest of the model file, of the running server binary and of the llama.cpp
  libraries it has mapped (`FileDigestCache`: hashed once per change of the file, see below);
- when llama-server runs on this host (found with psutil), **every** command-line flag and every
  `LLAMA_ARG_*` environment variable it was started with, unless the setting is on the `HARMLESS` list
  (settings that cannot change the KV a prompt produces: host, port, threads, timeouts, logging, API key,
  sampling defaults, chat template, slot count and context size, which are recorded in `info` and checked
  against the snapshot separately, ...). A flag this module does not know is fingerprinted too. Other
  llama.cpp/ggml variables (`LLAMA_*`, `GGML_*`, `*_VISIBLE_DEVICES`, ...) are fingerprinted, and a process
  whose environment cannot be read records that fact (`environ: unreadable`) instead of nothing;
- the files those settings name (LoRA adapters, control vectors, multimodal projector) by digest, and
  llama.cpp's own config files (`/etc/llama.cpp/config.ini`, `~/.config/llama.cpp/config.ini`), which
  llama-server applies before its command line;
- optionally a canary: a digest of the KV llama-server computes for a fixed prompt (computed by the
  coordinator), which also sees what neither flags nor files show.

Command-line parsing follows llama.cpp's (common/arg.cpp): `--x_y` is `--x-y`; the environment is applied
first and the command line after it; for a switch with a negated form (`--no-x`, `LLAMA_ARG_NO_X`) the
value is `on`/`off`. Aliases (`-ctk`, `--cache-type-k`, `LLAMA_ARG_CACHE_TYPE_K`) share one canonical key.
`--flag=value` is read as `--flag value`. Every occurrence is kept in order (several `--lora`, or a value
given both in the environment and on the command line), so two spellings that llama.cpp might resolve
alike can still differ here: a false mismatch costs a cold prefill, a false match a wrong conversation.
A flag of unknown arity takes the next token as its value when that token does not look like a flag
(llama-server has no positional arguments, so such a token can only be a value); a value-taking flag
followed by a known flag name takes no value, so a flag whose arity changed between llama.cpp versions
does not shift the parsing of the rest. Stray tokens are fingerprinted as well.

The file digests hash every byte (xxh3-128, 16 MiB reads; xxhash releases the GIL). They are cached in the
state directory by (device, inode, size, mtime_ns, ctime_ns): a rewrite in place changes ctime, which `utime`
cannot put back, and a replacement changes the inode. A file modified during hashing is not cached, and
neither is one changed within the last 2 s (timestamps are coarse: a second write in the same tick would
keep the key). The cache file is read with a size cap and a strict schema; anything wrong with it starts
an empty cache.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import json
import logging
import os
import pwd
import re
import shlex
import stat
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import psutil
import xxhash

from kvsidecar.backend.base import BackendCapabilities
from kvsidecar.logs import event
from kvsidecar.store.atomic import atomic_write_bytes
from kvsidecar.store.jsonlimits import loads_capped
from kvsidecar.store.llama_args import BY_ENV, BY_NAME, LlamaOption

log = logging.getLogger("kvsidecar.fingerprint")

# ------------------------------------------------------------------------------------------------------
# What a difference in each component means.

# Reason codes, most specific first: when several components differ, the first code in this order wins.
REASON_PRIORITY: tuple[str, ...] = (
    "FINGERPRINT_FORMAT_CHANGED",
    "RUNTIME_KEY_CHANGED",
    "BACKEND_CHANGED",
    "MODEL_FINGERPRINT_CHANGED",
    "BUILD_CHANGED",
    "PROCESS_VISIBILITY_CHANGED",
    "MODEL_OVERRIDE_CHANGED",
    "KV_LAYOUT_CHANGED",
    "ROPE_CHANGED",
    "LORA_CHANGED",
    "CONTROL_VECTOR_CHANGED",
    "DEVICE_PLACEMENT_CHANGED",
    "LLAMA_CONFIG_CHANGED",
    "ENVIRONMENT_CHANGED",
    "RUNTIME_SETTINGS_CHANGED",
    "KV_CANARY_CHANGED",
)

# Bumped when the components change meaning: a snapshot saved under another format is refused as such.
FORMAT = "2"

# fixed component -> reason code given when a snapshot's fingerprint differs in it
REASONS: dict[str, str] = {
    "format": "FINGERPRINT_FORMAT_CHANGED",
    "runtime_key": "RUNTIME_KEY_CHANGED",
    "backend": "BACKEND_CHANGED",
    "model_path": "MODEL_FINGERPRINT_CHANGED",
    "model_file": "MODEL_FINGERPRINT_CHANGED",
    "build_info": "BUILD_CHANGED",
    "server_binary": "BUILD_CHANGED",
    "server_libs": "BUILD_CHANGED",
    "process": "PROCESS_VISIBILITY_CHANGED",
    "config_files": "LLAMA_CONFIG_CHANGED",
    "environ": "ENVIRONMENT_CHANGED",
    "canary_kv": "KV_CANARY_CHANGED",
}


def _words(*groups: str) -> list[str]:
    return " ".join(groups).split()


def _classes(code: str, names: str) -> dict[str, str]:
    return dict.fromkeys(_words(names), code)


# canonical llama-server option -> reason code (a fingerprinted option not listed: RUNTIME_SETTINGS_CHANGED)
SETTING_CLASSES: dict[str, str] = {
    **_classes(
        "MODEL_FINGERPRINT_CHANGED",
        "model model-url docker-repo hf-repo hf-file mmproj mmproj-url mmproj-auto embd-gemma-default "
        "fim-qwen-1.5b-default fim-qwen-3b-default fim-qwen-7b-default fim-qwen-7b-spec fim-qwen-14b-spec "
        "fim-qwen-30b-default gpt-oss-20b-default gpt-oss-120b-default vision-gemma-4b-default "
        "vision-gemma-12b-default",
    ),
    **_classes("MODEL_OVERRIDE_CHANGED", "override-kv"),
    **_classes(
        "KV_LAYOUT_CHANGED",
        "cache-type-k cache-type-v flash-attn swa-full kv-unified kv-unified-per-slot kv-offload",
    ),
    **_classes(
        "ROPE_CHANGED",
        "rope-scaling rope-scale rope-freq-base rope-freq-scale yarn-orig-ctx yarn-ext-factor "
        "yarn-attn-factor yarn-beta-slow yarn-beta-fast",
    ),
    **_classes("LORA_CHANGED", "lora lora-scaled lora-init-without-apply"),
    **_classes("CONTROL_VECTOR_CHANGED", "control-vector control-vector-scaled control-vector-layer-range"),
    **_classes(
        "DEVICE_PLACEMENT_CHANGED",
        "device gpu-layers split-mode tensor-split main-gpu override-tensor cpu-moe n-cpu-moe n-cpu-ffn "
        "fit fit-target fit-ctx rpc repack no-host op-offload mmproj-offload mmproj-device",
    ),
}

# Settings that cannot change the KV a given token sequence produces, nor its layout in a state file.
HARMLESS: frozenset[str] = frozenset(
    _words(
        # informational commands (a server started with them does not serve)
        "help version cache-list completion-bash list-devices",
        # CPU scheduling, loading, batching: how fast, not what
        "threads threads-batch cpu-mask cpu-range cpu-strict prio poll cpu-mask-batch cpu-range-batch "
        "cpu-strict-batch prio-batch poll-batch numa load-mode lazy-mode mmap mlock direct-io check-tensors "
        "warmup cont-batching batch-size ubatch-size spec-draft-threads spec-draft-threads-batch "
        "spec-draft-cpu-mask spec-draft-cpu-range spec-draft-cpu-strict spec-draft-prio spec-draft-poll "
        "spec-draft-cpu-mask-batch spec-draft-cpu-strict-batch spec-draft-prio-batch spec-draft-poll-batch",
        # slots and prompt caches (ctx-size and parallel are recorded and checked against each snapshot)
        "ctx-size parallel cache-ram cache-idle-slots ctx-checkpoints checkpoint-min-step context-shift "
        "keep cache-prompt cache-reuse slot-prompt-similarity slot-save-path sleep-idle-seconds "
        "defrag-thold predict",
        # HTTP, API, web UI, credentials
        "host port reuse-port path api-prefix cors-origins cors-methods cors-headers cors-credentials "
        "timeout sse-ping-interval threads-http api-key api-key-file ssl-key-file ssl-cert-file metrics "
        "props slots media-path ui ui-config ui-config-file ui-mcp-proxy tools tools-runtime "
        "mcp-servers-config mcp-servers-json agent alias tags offline hf-token",
        # logging
        "log-disable log-file log-jsonl log-prompts-dir log-colors verbose verbosity log-prefix "
        "log-timestamps perf",
        # sampling defaults (which token is picked, not the KV of the tokens)
        "samplers seed sampler-seq ignore-eos temp top-k top-p min-p top-nsigma xtc-probability "
        "xtc-threshold typical repeat-last-n repeat-penalty presence-penalty frequency-penalty "
        "dry-multiplier dry-base dry-allowed-length dry-penalty-last-n dry-sequence-breaker "
        "adaptive-target adaptive-decay dynatemp-range dynatemp-exp mirostat mirostat-lr mirostat-ent "
        "logit-bias grammar grammar-file json-schema json-schema-file backend-sampling reverse-prompt "
        "special escape",
        # prompt construction: another template makes other tokens, and only a matching prefix is reused
        "chat-template chat-template-file chat-template-kwargs jinja reasoning-format reasoning "
        "reasoning-effort reasoning-budget reasoning-budget-message reasoning-preserve skip-chat-parsing "
        "prefill-assistant spm-infill embd-normalize",
    )
)

# Environment variables outside the option table that are fingerprinted, and the harmless ones among them.
_ENV_PREFIXES = ("LLAMA_", "GGML_", "MTMD_")
_ENV_NAMES = frozenset({"ONEAPI_DEVICE_SELECTOR", "GPU_DEVICE_ORDINAL"})
_HARMLESS_ENV = frozenset({"LLAMA_CACHE", "LLAMA_TRACE", "LLAMA_MEDIA_MARKER", "GGML_NO_BACKTRACE"})
_SECRET_OPTIONS = frozenset({"api-key", "hf-token"})
# options whose values name files that shape the KV: (canonical, how to get the paths from one value)
_PATH_OPTIONS: dict[str, Callable[[str], list[str]]] = {}

_TRUTHY = frozenset({"on", "enabled", "true", "1"})
_FALSEY = frozenset({"off", "disabled", "false", "0"})
_NEGATIVE_NUMBER = re.compile(r"-\.?[0-9]")
_LONG_VALUE = 256
_UNKNOWN = "?"  # key prefix of a flag llama_args does not know (its dashes kept: "?--foo")
_POSITIONAL = "?positional"


def _csv_paths(value: str) -> list[str]:
    """llama.cpp's parse_csv_row: comma-separated, double quotes group and "" escapes."""
    return next(csv.reader([value]), [])


def _scaled_paths(value: str) -> list[str]:
    return [item.split(":")[0] if item.count(":") == 1 else item for item in _csv_paths(value)]


_PATH_OPTIONS.update(
    {
        "lora": _csv_paths,
        "lora-scaled": _scaled_paths,
        "control-vector": _csv_paths,
        "control-vector-scaled": _scaled_paths,
        "mmproj": lambda v: [v],
    }
)


# ------------------------------------------------------------------------------------------------------
# Settings: the command line and environment of a llama-server process.


def _looks_like_flag(token: str) -> bool:
    return len(token) > 1 and token.startswith("-") and not _NEGATIVE_NUMBER.match(token)


def _flag_name(token: str) -> str:
    return token.replace("_", "-") if token.startswith("--") else token


def _is_known_flag(token: str) -> bool:
    return _flag_name(token.partition("=")[0]) in BY_NAME


def _switch(negated: bool, raw: str | None) -> str:
    """on/off of a switch given as a flag (raw None) or with a value (`--x=false`)."""
    if raw is not None and raw not in _TRUTHY:
        if raw not in _FALSEY:
            return f"invalid:{raw}"
        negated = not negated
    return "off" if negated else "on"


def _take_values(opt: LlamaOption, inline: str | None, args: Sequence[str], i: int) -> tuple[str, int]:
    values = [] if inline is None else [inline]
    while len(values) < opt.arity and i < len(args) and not _is_known_flag(args[i]):
        values.append(args[i])
        i += 1
    return " ".join(values), i


def parse_cmdline(argv: Sequence[str]) -> list[tuple[str, str]]:
    """(canonical key, value) for each setting on a llama-server command line (argv[0] skipped), in order."""
    out: list[tuple[str, str]] = []
    args = list(argv[1:])
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        if not _looks_like_flag(token):
            out.append((_POSITIONAL, token))
            continue
        name, eq, inline = token.partition("=")
        if eq and not (name.startswith("--") or _flag_name(name) in BY_NAME):
            name, eq, inline = token, "", ""
        name = _flag_name(name)
        known = BY_NAME.get(name)
        if known is None:
            value: str | None = inline if eq else None
            if value is None and i < len(args) and not _looks_like_flag(args[i]):
                value, i = args[i], i + 1
            out.append((_UNKNOWN + name, "switch" if value is None else f"={value}"))
            continue
        opt, negated = known
        if opt.switch:
            out.append((opt.canonical, _switch(negated, inline if eq else None)))
        else:
            joined, i = _take_values(opt, inline if eq else None, args, i)
            out.append((opt.canonical, joined))
    return out


def _env_value(opt: LlamaOption, negated: bool, raw: str) -> str | None:
    """What llama.cpp makes of LLAMA_ARG_* (common_arg::get_value_from_env); None: it ignores the variable."""
    if negated:
        return "off"  # LLAMA_ARG_NO_X: present with any value
    if not opt.switch:
        return raw
    if not opt.negated:  # a plain switch: set when truthy, otherwise ignored
        return "on" if raw in _TRUTHY else None
    return _switch(False, raw)


def _fingerprinted_env(name: str) -> bool:
    if name in _HARMLESS_ENV or name.endswith("_DEBUG"):
        return False
    return name.startswith(_ENV_PREFIXES) or name.endswith("_VISIBLE_DEVICES") or name in _ENV_NAMES


def parse_environ(environ: Mapping[str, str]) -> tuple[list[tuple[str, str]], dict[str, str]]:
    """Settings given as LLAMA_ARG_* (canonical key, value), and the other fingerprinted variables."""
    occurrences: list[tuple[str, str]] = []
    other: dict[str, str] = {}
    negated_present = {BY_ENV[n][0].canonical for n in environ if n in BY_ENV and BY_ENV[n][1]}
    for name in sorted(environ):
        known = BY_ENV.get(name)
        if known is None:
            if _fingerprinted_env(name):
                other[name] = environ[name]
            continue
        opt, negated = known
        if not negated and opt.canonical in negated_present:
            continue  # llama.cpp reads LLAMA_ARG_NO_X first and stops there
        value = _env_value(opt, negated, environ[name])
        if value is not None:
            occurrences.append((opt.canonical, value))
    return occurrences, other


@dataclass(frozen=True, kw_only=True)
class RuntimeSettings:
    # canonical option (or "?--flag", "?positional") -> its values in the order llama.cpp applies them
    values: dict[str, tuple[str, ...]]
    environ: dict[str, str]  # other fingerprinted environment variables
    environ_readable: bool

    def effective(self, key: str) -> str | None:
        """The value llama.cpp ends up with for a single-valued option (the last one applied)."""
        values = self.values.get(key)
        return values[-1] if values else None


def parse_settings(cmdline: Sequence[str], environ: Mapping[str, str] | None) -> RuntimeSettings:
    """environ None: the process' environment could not be read."""
    from_env, other = parse_environ(environ or {})
    values: dict[str, list[str]] = {}
    for key, value in [*from_env, *parse_cmdline(cmdline)]:
        values.setdefault(key, []).append(value)
    return RuntimeSettings(
        values={k: tuple(v) for k, v in values.items()},
        environ=other,
        environ_readable=environ is not None,
    )


_LEGACY_VALUES = {
    "model": "model",
    "cache_type_k": "cache-type-k",
    "cache_type_v": "cache-type-v",
    "flash_attn": "flash-attn",
    "slot_save_path": "slot-save-path",
    "parallel": "parallel",
    "ctx_size": "ctx-size",
    "port": "port",
    "host": "host",
    "cache_ram": "cache-ram",
}
_LEGACY_SWITCHES = {
    "swa_full": ("swa-full", "on"),
    "kv_unified": ("kv-unified", "on"),
    "no_cache_idle_slots": ("cache-idle-slots", "off"),
    "no_kv_offload": ("kv-offload", "off"),
}


def legacy_flags(settings: RuntimeSettings) -> dict[str, str]:
    """The effective values the doctor and process discovery read (snake_case keys; switches as "on")."""
    flags = {k: v for k, key in _LEGACY_VALUES.items() if (v := settings.effective(key)) is not None}
    for k, (key, when) in _LEGACY_SWITCHES.items():
        if settings.effective(key) == when:
            flags[k] = "on"
    loras = [*settings.values.get("lora", ()), *settings.values.get("lora-scaled", ())]
    if loras:
        flags["lora"] = ",".join(loras)
    return flags


def parse_flags(cmdline: Sequence[str], environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Effective values of the llama-server settings the doctor reads (see `legacy_flags`)."""
    return legacy_flags(parse_settings(cmdline, environ or {}))


def redacted_cmdline(cmdline: Sequence[str]) -> list[str]:
    """The command line with the values of secret flags (--api-key, --hf-token) replaced."""
    out = list(cmdline)
    for i, token in enumerate(out):
        name, eq, _ = token.partition("=")
        known = BY_NAME.get(_flag_name(name))
        if known is None or known[0].canonical not in _SECRET_OPTIONS:
            continue
        if eq:
            out[i] = f"{name}=***"
        elif i + 1 < len(out):
            out[i + 1] = "***"
    return out


# ------------------------------------------------------------------------------------------------------
# The local llama-server process.


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
        if k in keep or ((k in BY_ENV or _fingerprinted_env(k)) and k not in {"HF_TOKEN", "LLAMA_API_KEY"})
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


# ------------------------------------------------------------------------------------------------------
# File digests.

_BLOCK = 16 << 20
_CACHE_VERSION = 2
_CACHE_MAX_BYTES = 1 << 20
_CACHE_MAX_ENTRIES = 512
_CACHE_MAX_DEPTH = 2  # {"version": 2, "entries": {identity: digest}}
_CACHE_KEY = re.compile(r"[0-9]{1,20}(:[0-9]{1,20}){4}")
_HEX128 = re.compile(r"[0-9a-f]{32}")


class FileChanging(OSError):
    """The file changed while it was being read."""


def _identity(st: os.stat_result) -> str:
    return f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"


def file_digest(path: Path | str) -> tuple[str, os.stat_result]:
    """xxh3-128 of every byte of a regular file, and its stat; FileChanging if it changed meanwhile."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        before = os.fstat(fd)
        if not stat.S_ISREG(before.st_mode):
            raise OSError(errno.EINVAL, "not a regular file", str(path))
        with contextlib.suppress(OSError, AttributeError):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        h = xxhash.xxh3_128()
        buf = bytearray(_BLOCK)
        view = memoryview(buf)
        while n := os.readv(fd, [buf]):
            h.update(view[:n])
        after = os.fstat(fd)
    finally:
        os.close(fd)
    if _identity(before) != _identity(after) or _identity(os.stat(path)) != _identity(after):
        raise FileChanging(errno.EAGAIN, "changed while read", str(path))
    return h.hexdigest(), after


def _validate_cache(data: Any) -> dict[str, str]:
    if not isinstance(data, dict) or set(data) != {"version", "entries"}:
        raise ValueError("not an object with exactly version and entries")
    if type(data["version"]) is not int or data["version"] != _CACHE_VERSION:
        raise ValueError(f"version is not {_CACHE_VERSION}")
    entries = data["entries"]
    if not isinstance(entries, dict) or len(entries) > _CACHE_MAX_ENTRIES:
        raise ValueError(f"entries is not an object of at most {_CACHE_MAX_ENTRIES} items")
    for key, value in entries.items():
        if not _CACHE_KEY.fullmatch(key) or not isinstance(value, str) or not _HEX128.fullmatch(value):
            raise ValueError("an entry is not file identity -> 32 hex digits")
    return dict(entries)


def _read_capped(path: Path, cap: int) -> bytes | None:
    """The file's bytes if it is a regular file (not a link) of at most `cap` bytes; None if absent."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > cap:
            raise ValueError(f"not a regular file of at most {cap} bytes")
        data = bytearray()
        while len(data) <= cap and (chunk := os.read(fd, cap + 1 - len(data))):
            data += chunk
    finally:
        os.close(fd)
    if len(data) > cap:
        raise ValueError(f"grew beyond {cap} bytes")
    return bytes(data)


def load_digest_cache(path: Path) -> dict[str, str]:
    """The persisted digests; empty (with a warning) when the file is unreadable or not exactly our format."""
    try:
        raw = _read_capped(path, _CACHE_MAX_BYTES)
        if raw is None:
            return {}
        return _validate_cache(loads_capped(raw, max_bytes=_CACHE_MAX_BYTES, max_depth=_CACHE_MAX_DEPTH))
    except (OSError, ValueError) as exc:  # JsonLimitError is a ValueError
        event(log, logging.WARNING, "kv.digest_cache.ignored", path=str(path), error=str(exc)[:200])
        return {}


class FileDigestCache:
    """Whole-file digests keyed by (device, inode, size, mtime_ns, ctime_ns), persisted in the state dir.

    Thread-safe: `digest()` is called from worker threads. A second call for an unchanged file is a stat
    and a dict lookup; two concurrent calls for the same new file hash it once.
    """

    def __init__(self, path: Path, *, racy_window_s: float = 2.0) -> None:
        self.path = path
        self._racy_ns = int(racy_window_s * 1e9)
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._busy: dict[str, threading.Lock] = {}
        self._entries = load_digest_cache(path)
        self.computed = 0

    def digest(self, path: Path | str) -> str | None:
        """None when the file cannot be read as a regular file, or kept changing while being read."""
        try:
            st = os.stat(path)
        except OSError:
            return None
        key = _identity(st)
        with self._lock:
            if (hit := self._lookup(key)) is not None:
                return hit
            busy = self._busy.setdefault(key, threading.Lock())
        with busy:
            with self._lock:
                hit = self._lookup(key)
            result = hit if hit is not None else self._compute(path)
        with self._lock:
            self._busy.pop(key, None)
        return result

    def _lookup(self, key: str) -> str | None:
        hit = self._entries.pop(key, None)
        if hit is not None:
            self._entries[key] = hit  # most recently used last
        return hit

    def _compute(self, path: Path | str) -> str | None:
        for _ in range(3):
            try:
                digest, st = file_digest(path)
                break
            except FileChanging:
                continue
            except OSError:
                return None
        else:
            return None
        with self._lock:
            self.computed += 1
            if time.time_ns() - st.st_ctime_ns < self._racy_ns:
                return digest  # changed moments ago: another write in the same timestamp tick could follow
            self._entries[_identity(st)] = digest
            while len(self._entries) > _CACHE_MAX_ENTRIES:
                del self._entries[next(iter(self._entries))]
        self._save()
        return digest

    def _save(self) -> None:
        with self._write_lock:
            with self._lock:
                data = {"version": _CACHE_VERSION, "entries": dict(self._entries)}
            with contextlib.suppress(OSError):
                atomic_write_bytes(self.path, json.dumps(data).encode(), durable=False)


# ------------------------------------------------------------------------------------------------------
# The fingerprint.


@dataclass(frozen=True, kw_only=True)
class RuntimeFingerprint:
    components: dict[str, str]
    info: dict[str, str] = field(default_factory=dict)  # recorded, not compared (n_ctx, slots, pid)

    @property
    def digest(self) -> str:
        canon = json.dumps(self.components, sort_keys=True, separators=(",", ":"))
        return xxhash.xxh3_128_hexdigest(canon.encode())

    def mismatch_reason(self, other: Mapping[str, Any] | None) -> str:
        """Why a snapshot saved under `other` may not be restored here (the most specific difference)."""
        if other is None:
            return "FINGERPRINT_CHANGED"
        keys = set(self.components) | {str(k) for k in other}
        differ = {k for k in keys if self.components.get(k) != other.get(k)}
        if "process" in differ:  # one side could not see the process: its settings say nothing more
            differ = {
                k for k in differ if k not in _PROCESS_PARTS and not k.startswith(("arg:", "file:", "env:"))
            }
        codes = {reason_for(k) for k in differ}
        return next((code for code in REASON_PRIORITY if code in codes), "FINGERPRINT_CHANGED")


_PROCESS_PARTS = frozenset({"environ", "server_binary", "server_libs", "config_files"})


def reason_for(component: str) -> str:
    """The reason code a difference in `component` is reported as."""
    if component in REASONS:
        return REASONS[component]
    kind, _, name = component.partition(":")
    if kind in ("arg", "file"):
        return SETTING_CLASSES.get(name, "RUNTIME_SETTINGS_CHANGED")
    if kind == "env":
        return "ENVIRONMENT_CHANGED"
    return "FINGERPRINT_CHANGED"


def _hashed(value: str) -> str:
    return "h:" + xxhash.xxh3_64_hexdigest(value.encode("utf-8", "surrogateescape"))


def _encode(key: str, values: Iterable[str]) -> str:
    """Known options keep readable values; unknown ones (maybe secrets) and long values are hashed."""
    unknown = key.startswith(_UNKNOWN)
    return json.dumps([_hashed(v) if unknown or len(v) > _LONG_VALUE else v for v in values])


class _Files:
    """Digests (or a stable word for why there is none) of paths as the llama-server process sees them."""

    def __init__(self, digests: FileDigestCache | None, process: ProcessInfo | None) -> None:
        self.digests, self.process = digests, process

    def local(self, path: str) -> str | None:
        p = self.process
        if not os.path.isabs(path):
            if p is None or p.cwd is None:
                return None
            path = os.path.join(p.cwd, path)
        return (p.root + path) if p is not None and p.root else path

    def state(self, path: str | None, *, ours: bool = False) -> str:
        """`ours`: a path in this process' view already (/proc/<pid>/exe), not in the server's."""
        if self.digests is None or not path:
            return ""
        local = path if ours else self.local(path)
        if local is None:
            return "unresolved"
        digest = self.digests.digest(local)
        if digest is not None:
            return digest
        return "unreadable" if os.path.lexists(local) else "absent"


def _binary_state(process: ProcessInfo, files: _Files) -> str:
    if process.binary:
        return files.state(process.binary, ours=True)
    if process.exe:
        return files.state(process.exe)
    return "unreadable" if files.digests is not None else ""


def _process_components(process: ProcessInfo, files: _Files) -> dict[str, str]:
    settings = process.settings
    comp = {
        "process": "local",
        "environ": "readable" if settings.environ_readable else "unreadable",
        "server_binary": _binary_state(process, files),
        "config_files": json.dumps({p: files.state(p) for p in process.config_files}, sort_keys=True),
    }
    if process.libraries is None:
        comp["server_libs"] = "unreadable"
    else:
        libs = [("deleted" if p.endswith(" (deleted)") else files.state(p)) for p in process.libraries]
        comp["server_libs"] = json.dumps(sorted(libs))
    for key, values in settings.values.items():
        if key in HARMLESS:
            continue
        comp[f"arg:{key}"] = _encode(key, values)
        if key in _PATH_OPTIONS:
            paths = [path for v in values for path in _PATH_OPTIONS[key](v)]
            comp[f"file:{key}"] = json.dumps([files.state(path) for path in paths])
    for name, value in settings.environ.items():
        comp[f"env:{name}"] = _hashed(value)
    return comp


def build_fingerprint(
    *,
    caps: BackendCapabilities,
    process: ProcessInfo | None,
    runtime_key: str | None,
    digests: FileDigestCache | None,
    canary: str | None = None,
) -> RuntimeFingerprint:
    """May read whole files (model, libraries, adapters) the first time they are seen: call off the loop."""
    # The fixed components are always present ("" when unknown); "process" says whether the settings of a
    # local process are part of it, so a fingerprint that could not see them never equals one that did.
    files = _Files(digests, process)
    comp: dict[str, str] = {
        "format": FORMAT,
        "backend": caps.kind,
        "model_path": caps.model_path or "",
        "build_info": caps.build_info or "",
        "runtime_key": runtime_key or "",
        "canary_kv": canary or "",
        "model_file": files.state(caps.model_path),
        "process": "not-found",
        "environ": "",
        "server_binary": "",
        "server_libs": "",
        "config_files": "",
    }
    info = {"total_slots": str(caps.total_slots), "n_ctx": str(caps.n_ctx or "")}
    if process is not None:
        comp.update(_process_components(process, files))
        info["pid"] = str(process.pid)
        info["cmdline"] = shlex.join(redacted_cmdline(process.cmdline))
        for key in ("ctx-size", "parallel"):
            info[key] = process.settings.effective(key) or ""
    return RuntimeFingerprint(components=comp, info=info)
