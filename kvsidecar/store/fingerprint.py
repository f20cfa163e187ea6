"""Runtime fingerprints (spec §15, §31, §57): which server state a snapshot may be restored into.

Fail closed. A fingerprint is a set of named components; a snapshot is restored only into a server whose
components are all equal to the ones it was saved under. This module owns the components, what a
difference in each means (the reason codes, `HARMLESS`, `SETTING_CLASSES`) and `build_fingerprint`.
The components are:

- what llama-server says about itself (`/props`: model path, build) and the operator's `runtime_key`;
- a whole-file xxh3-128 digest of the model file, of the running server binary and of the llama.cpp
  libraries it has mapped (`file_digests.FileDigestCache`: hashed once per change of the file);
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

import json
import os
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import xxhash

from kvsidecar.backend.base import BackendCapabilities
from kvsidecar.store.file_digests import (
    FileChanging,
    FileDigestCache,
    file_digest,
    file_identity,
    load_digest_cache,
)
from kvsidecar.store.llama_process import ProcessInfo, find_llama_process
from kvsidecar.store.llama_settings import (
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
    "ProcessInfo",
    "RuntimeFingerprint",
    "RuntimeSettings",
    "_identity",
    "build_fingerprint",
    "file_digest",
    "find_llama_process",
    "legacy_flags",
    "load_digest_cache",
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
