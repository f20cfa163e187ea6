"""Runtime fingerprints (spec §15, §31, §57): which server state a snapshot may be restored into.

Fail closed. A fingerprint is a set of named components; a snapshot is restored only into a server whose
components are all equal to the ones it was saved under. This module owns the components, what a
difference in each means (the reason codes, `HARMLESS`, `SETTING_CLASSES`) and `build_fingerprint`.
The components are:

- what llama-server says about itself (`/props`: model path, build) and the operator's `runtime_key`;
- the model the process has loaded (`model_file`, `_model_files`): a whole-file xxh3-128 digest of every
  file of it (each shard of a split GGUF), identified by what the process maps (device and inode in
  /proc/<pid>/maps), not by what its path names now: a model renamed over the path while the server runs
  the old one is the old one, read through /proc/<pid>/map_files/. A loaded file that cannot be proven
  (not mapped: `--no-mmap`, a shard fully offloaded; mapped but unreadable) is recorded as bound to this
  process (`loaded@<pid>:<start>`), or, when the process can load its model again (sleep mode, a config
  file, an unreadable environment, router mode), as `unproven:<random>`, which equals nothing;
- a whole-file xxh3-128 digest of the running server binary and of the llama.cpp libraries it has mapped
  (`file_digests.FileDigestCache`: hashed once per change of the file);
- when llama-server runs on this host (`llama_process`), **every** command-line flag and every
  `LLAMA_ARG_*` environment variable it was started with (`llama_settings`), unless the setting is on the
  `HARMLESS` list (settings that cannot change the KV a prompt produces: host, port, threads, timeouts,
  logging, API key, sampling defaults, chat template, slot count and context size, which are recorded in
  `info` and checked against the snapshot separately, ...). A flag this module does not know is
  fingerprinted too (its values hashed: it may be a secret). Other llama.cpp/ggml variables (`LLAMA_*`,
  `GGML_*`, `*_VISIBLE_DEVICES`, ...) are fingerprinted, and a process whose environment cannot be read
  records that fact (`environ: unreadable`) instead of nothing;
- the files those settings name (LoRA adapters, control vectors, multimodal projector) by digest, and
  llama.cpp's own config files (`/etc/llama.cpp/config.ini`, `~/.config/llama.cpp/config.ini`), which
  llama-server applies before its command line;
- optionally a canary: a digest of the KV llama-server computes for a fixed prompt (computed by the
  coordinator), which also sees what neither flags nor files show.

The names of the parts it is built from are re-exported here, so callers import them from one place.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shlex
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import xxhash

from kvsidecar.backend.base import BackendCapabilities
from kvsidecar.fingerprint.file_digests import (
    FileChanging,
    FileDigestCache,
    file_digest,
    file_identity,
    load_digest_cache,
)
from kvsidecar.fingerprint.llama_process import MappedFile, ProcessInfo, find_llama_process
from kvsidecar.fingerprint.llama_settings import (
    PATH_OPTIONS,
    UNKNOWN,
    RuntimeSettings,
    legacy_flags,
    parse_cmdline,
    parse_environ,
    parse_flags,
    parse_settings,
    redacted_cmdline,
)

__all__ = [
    "FORMAT",
    "HARMLESS",
    "REASONS",
    "REASON_PRIORITY",
    "SETTING_CLASSES",
    "FileChanging",
    "FileDigestCache",
    "ModelProof",
    "ProcessInfo",
    "RuntimeFingerprint",
    "RuntimeSettings",
    "_identity",
    "build_fingerprint",
    "file_digest",
    "find_llama_process",
    "legacy_flags",
    "load_digest_cache",
    "model_paths",
    "model_proof",
    "parse_cmdline",
    "parse_environ",
    "parse_flags",
    "parse_settings",
    "reason_for",
    "redacted_cmdline",
]

_identity = file_identity  # its name before the split (tests read it)

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
# 3: `model_file` is the JSON list of the loaded model's files (every shard), identified by the mapping.
FORMAT = "3"

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

_LONG_VALUE = 256  # a setting value longer than this is hashed, not kept readable


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
    unknown = key.startswith(UNKNOWN)
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
        if key in PATH_OPTIONS:
            paths = [path for v in values for path in PATH_OPTIONS[key](v)]
            comp[f"file:{key}"] = json.dumps([files.state(path) for path in paths])
    for name, value in settings.environ.items():
        comp[f"env:{name}"] = _hashed(value)
    return comp


# ------------------------------------------------------------------------------------------------------
# The model the process has loaded.

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


def reload_possible(process: ProcessInfo, files: _Files) -> bool:
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

    def __init__(self, process: ProcessInfo, files: _Files, mapped: tuple[MappedFile, ...]) -> None:
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


def _model_files(caps: BackendCapabilities, process: ProcessInfo | None, files: _Files) -> str:
    """`model_file`: a JSON list, one entry per loaded model file; see the module docstring."""
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
    """The limit `_model_files` puts on the loaded model now (None: proven by what the process maps, or
    a remote server, whose files are read by path). No digest is computed: cheap, for doctor and status."""
    if caps.props.get("role") == "router":
        return ModelProof(
            code="KV_MODEL_UNPROVEN",
            why="llama-server runs in router mode: its models load and unload in child processes",
            fix="point base_url at a llama-server that serves one model (-m), not at the router",
        )
    if process is None or not caps.model_path:
        return None
    files = _Files(None, process)
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
        "model_file": _model_files(caps, process, files),
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
