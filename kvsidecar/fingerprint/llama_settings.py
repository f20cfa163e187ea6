"""llama-server's settings: its command line and environment, read the way llama.cpp reads them.

Parsing follows llama.cpp's (common/arg.cpp), with the option table in `llama_args`: `--x_y` is `--x-y`;
the environment is applied first and the command line after it; for a switch with a negated form
(`--no-x`, `LLAMA_ARG_NO_X`) the value is `on`/`off`. Aliases (`-ctk`, `--cache-type-k`,
`LLAMA_ARG_CACHE_TYPE_K`) share one canonical key. `--flag=value` is read as `--flag value`. Every
occurrence is kept in order (several `--lora`, or a value given both in the environment and on the command
line), so two spellings that llama.cpp might resolve alike can still differ here: a false mismatch costs a
cold prefill, a false match a wrong conversation. A flag of unknown arity takes the next token as its value
when that token does not look like a flag (llama-server has no positional arguments, so such a token can
only be a value); a value-taking flag followed by a known flag name takes no value, so a flag whose arity
changed between llama.cpp versions does not shift the parsing of the rest. Stray tokens are kept as well.

Besides `LLAMA_ARG_*`, the other llama.cpp/ggml variables (`LLAMA_*`, `GGML_*`, `MTMD_*`,
`*_VISIBLE_DEVICES`, ...) are collected, except a few harmless ones (`fingerprinted_env`).

llama.cpp's unified binary runs the same server as `llama serve ...` (alias `server`; a router starts its
children so when it is that binary): the subcommand is not a setting, and the settings are read past it
(`server_args`).
"""

from __future__ import annotations

import csv
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from kvsidecar.fingerprint.llama_args import BY_ENV, BY_NAME, LlamaOption

# Environment variables outside the option table that are fingerprinted, and the harmless ones among them.
_ENV_PREFIXES = ("LLAMA_", "GGML_", "MTMD_")
_ENV_NAMES = frozenset({"ONEAPI_DEVICE_SELECTOR", "GPU_DEVICE_ORDINAL"})
# LLAMA_APP_CMD: the unified binary's subcommand, set by the binary itself so that a router's children are
# started with it (`llama serve`); it names the server, and changes nothing it computes
_HARMLESS_ENV = frozenset(
    {"LLAMA_CACHE", "LLAMA_TRACE", "LLAMA_MEDIA_MARKER", "GGML_NO_BACKTRACE", "LLAMA_APP_CMD"}
)
# The unified binary's subcommands that run llama-server (app/llama.cpp: "serve", alias "server")
SERVER_SUBCOMMANDS = frozenset({"serve", "server"})
_SECRET_OPTIONS = frozenset({"api-key", "hf-token"})

_TRUTHY = frozenset({"on", "enabled", "true", "1"})
_FALSEY = frozenset({"off", "disabled", "false", "0"})
_NEGATIVE_NUMBER = re.compile(r"-\.?[0-9]")
UNKNOWN = "?"  # key prefix of a flag llama_args does not know (its dashes kept: "?--foo")
_POSITIONAL = "?positional"


def _csv_paths(value: str) -> list[str]:
    """llama.cpp's parse_csv_row: comma-separated, double quotes group and "" escapes (a value csv cannot
    read, such as one with a newline, is one path: it then names no file, and its text is fingerprinted)."""
    try:
        return next(csv.reader([value]), [])
    except csv.Error:
        return [value]


def _scaled_paths(value: str) -> list[str]:
    return [item.split(":")[0] if item.count(":") == 1 else item for item in _csv_paths(value)]


# options whose values name files that shape the KV: canonical -> how to get the paths from one value
PATH_OPTIONS: dict[str, Callable[[str], list[str]]] = {
    "lora": _csv_paths,
    "lora-scaled": _scaled_paths,
    "control-vector": _csv_paths,
    "control-vector-scaled": _scaled_paths,
    "mmproj": lambda v: [v],
}


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


def server_args(argv: Sequence[str]) -> list[str]:
    """The server's own arguments: argv[1:], past the subcommand of llama.cpp's unified binary
    (`llama serve -m ...`). llama-server itself takes no positional argument, so a running server whose
    first argument is `serve` or `server` is the unified binary's."""
    args = list(argv[1:])
    return args[1:] if args and args[0] in SERVER_SUBCOMMANDS else args


def parse_cmdline(argv: Sequence[str]) -> list[tuple[str, str]]:
    """(canonical key, value) for each setting on a llama-server command line (argv[0] skipped, and the
    `serve` of `llama serve`), in order."""
    out: list[tuple[str, str]] = []
    args = server_args(argv)
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
            out.append((UNKNOWN + name, "switch" if value is None else f"={value}"))
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


def fingerprinted_env(name: str) -> bool:
    """A variable outside the option table that can change what llama.cpp computes."""
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
            if fingerprinted_env(name):
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
