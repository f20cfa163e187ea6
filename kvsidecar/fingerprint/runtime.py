"""Runtime fingerprints (spec §15, §31, §57): which server state a snapshot may be restored into.

Fail closed. A fingerprint is a set of named components; a snapshot is restored only into a server whose
components are all equal to the ones it was saved under. This module owns the components, how each is
encoded, the fingerprint's `FORMAT`, `RuntimeFingerprint` (its digest and `mismatch_reason`) and
`build_fingerprint`. What a difference in each component means is `fingerprint.reasons`. The components:

- what llama-server says about itself (`/props`: model path, build) and the operator's `runtime_key`;
- the model the process has loaded (`model_file`, `fingerprint.model_files`): a digest of every file of it,
  identified by what the process maps, not by what its path names now;
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
  llama-server applies before its command line (read as the process sees them: `process_files`);
- optionally a canary: a digest of the KV llama-server computes for a fixed prompt (computed by the
  coordinator), which also sees what neither flags nor files show.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import xxhash

from kvsidecar.backend.base import BackendCapabilities
from kvsidecar.fingerprint.file_digests import FileDigestCache
from kvsidecar.fingerprint.llama_process import ProcessInfo
from kvsidecar.fingerprint.llama_settings import PATH_OPTIONS, UNKNOWN, redacted_cmdline
from kvsidecar.fingerprint.model_files import model_files
from kvsidecar.fingerprint.process_files import ProcessFiles
from kvsidecar.fingerprint.reasons import HARMLESS, REASON_PRIORITY, reason_for

# Bumped when the components change meaning: a snapshot saved under another format is refused as such.
# 3: `model_file` is the JSON list of the loaded model's files (every shard), identified by the mapping.
FORMAT = "3"

_LONG_VALUE = 256  # a setting value longer than this is hashed, not kept readable


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


def _hashed(value: str) -> str:
    return "h:" + xxhash.xxh3_64_hexdigest(value.encode("utf-8", "surrogateescape"))


def _encode(key: str, values: Iterable[str]) -> str:
    """Known options keep readable values; unknown ones (maybe secrets) and long values are hashed."""
    unknown = key.startswith(UNKNOWN)
    return json.dumps([_hashed(v) if unknown or len(v) > _LONG_VALUE else v for v in values])


def _binary_state(process: ProcessInfo, files: ProcessFiles) -> str:
    if process.binary:
        return files.state(process.binary, ours=True)
    if process.exe:
        return files.state(process.exe)
    return "unreadable" if files.digests is not None else ""


def _process_components(process: ProcessInfo, files: ProcessFiles) -> dict[str, str]:
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
    files = ProcessFiles(digests, process)
    comp: dict[str, str] = {
        "format": FORMAT,
        "backend": caps.kind,
        "model_path": caps.model_path or "",
        "build_info": caps.build_info or "",
        "runtime_key": runtime_key or "",
        "canary_kv": canary or "",
        "model_file": model_files(caps, process, files),
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
