"""Runtime fingerprints (spec §15, §31, §57): which server state a snapshot may be restored into.

A fingerprint is built from what llama-server says about itself (`/props`: model path, build), what only
its command line says (read with psutil when it runs on this host: KV cache types, flash-attn, --swa-full,
--kv-unified, LoRA), a fast sampled xxh3 of the model file and of the server binary (cached by
size/mtime/inode, so a multi-GB model is not re-read at every start), and the operator's `runtime_key`.

Context size and slot count are recorded but are not part of the digest: llama.cpp restores a state into a
different context as long as it fits, which the coordinator checks against the slot's n_ctx.
"""

from __future__ import annotations

import contextlib
import json
import os
import shlex
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import psutil
import xxhash

from kvsidecar.backend.base import BackendCapabilities
from kvsidecar.store.atomic import atomic_write_bytes

_SAMPLE_BYTES = 1 << 20
_SAMPLES = 16

# component -> reason code given when a snapshot's fingerprint differs in it (first one wins)
REASONS: dict[str, str] = {
    "runtime_key": "RUNTIME_KEY_CHANGED",
    "backend": "BACKEND_CHANGED",
    "model_path": "MODEL_FINGERPRINT_CHANGED",
    "model_file": "MODEL_FINGERPRINT_CHANGED",
    "build_info": "BUILD_CHANGED",
    "server_binary": "BUILD_CHANGED",
    "cache_type_k": "KV_LAYOUT_CHANGED",
    "cache_type_v": "KV_LAYOUT_CHANGED",
    "flash_attn": "KV_LAYOUT_CHANGED",
    "swa_full": "KV_LAYOUT_CHANGED",
    "kv_unified": "KV_LAYOUT_CHANGED",
    "lora": "LORA_CHANGED",
}

_VALUE_FLAGS = {
    "-ctk": "cache_type_k",
    "--cache-type-k": "cache_type_k",
    "-ctv": "cache_type_v",
    "--cache-type-v": "cache_type_v",
    "-fa": "flash_attn",
    "--flash-attn": "flash_attn",
    "--lora": "lora",
    "--lora-scaled": "lora",
    "--slot-save-path": "slot_save_path",
    "-np": "parallel",
    "--parallel": "parallel",
    "-c": "ctx_size",
    "--ctx-size": "ctx_size",
    "-m": "model",
    "--model": "model",
    "--port": "port",
    "--host": "host",
    "--cache-ram": "cache_ram",
    "-cram": "cache_ram",
}
_LAYOUT_FLAGS = ("cache_type_k", "cache_type_v", "flash_attn", "swa_full", "kv_unified", "lora")
_BOOL_FLAGS = {
    "--swa-full": "swa_full",
    "-kvu": "kv_unified",
    "--kv-unified": "kv_unified",
    "--no-cache-idle-slots": "no_cache_idle_slots",
    "--no-kv-offload": "no_kv_offload",
}


def parse_flags(cmdline: list[str]) -> dict[str, str]:
    """The llama-server flags that matter to KV persistence (`--flag value` or `--flag=value`)."""
    flags: dict[str, str] = {}
    args = list(cmdline[1:])
    i = 0
    while i < len(args):
        arg = args[i]
        name, eq, inline = arg.partition("=")
        if name in _BOOL_FLAGS:
            flags[_BOOL_FLAGS[name]] = "on"
        elif name in _VALUE_FLAGS:
            value = inline if eq else (args[i + 1] if i + 1 < len(args) else "")
            if not eq:
                i += 1
            key = _VALUE_FLAGS[name]
            flags[key] = f"{flags[key]},{value}" if key == "lora" and key in flags else value
        i += 1
    return flags


@dataclass(frozen=True, kw_only=True)
class ProcessInfo:
    pid: int
    create_time: float
    exe: str | None
    cmdline: tuple[str, ...]
    flags: dict[str, str]

    @property
    def identity(self) -> tuple[int, float]:
        """Changes when llama-server restarts."""
        return (self.pid, self.create_time)


def _is_local(host: str) -> bool:
    return host in {"127.0.0.1", "localhost", "::1", "0.0.0.0", "::", ""} or host.startswith("127.")


def find_llama_process(base_url: str) -> ProcessInfo | None:
    """The local llama-server process serving `base_url` (matched by --port); None if not on this host."""
    parts = urlsplit(base_url)
    if not _is_local(parts.hostname or ""):
        return None
    want_port = str(parts.port or (443 if parts.scheme == "https" else 80))
    for proc in psutil.process_iter(["pid", "name", "cmdline", "create_time", "exe"]):
        info = proc.info
        cmdline = info.get("cmdline") or []
        if not cmdline or "llama-server" not in os.path.basename(cmdline[0]) + (info.get("name") or ""):
            continue
        flags = parse_flags(list(cmdline))
        if flags.get("port", "8080") != want_port:
            continue
        return ProcessInfo(
            pid=info["pid"],
            create_time=info["create_time"],
            exe=info.get("exe"),
            cmdline=tuple(cmdline),
            flags=flags,
        )
    return None


def sampled_file_digest(path: Path) -> str:
    """xxh3-128 of size + 16 evenly spaced 1 MiB samples (head and tail included): fast on huge files."""
    size = path.stat().st_size
    h = xxhash.xxh3_128()
    h.update(size.to_bytes(8, "little"))
    with path.open("rb") as f:
        if size <= _SAMPLE_BYTES * _SAMPLES:
            while block := f.read(1 << 22):
                h.update(block)
        else:
            last = size - _SAMPLE_BYTES
            for i in range(_SAMPLES):
                f.seek(last * i // (_SAMPLES - 1))  # i = 15 lands exactly on the tail
                h.update(f.read(_SAMPLE_BYTES))
    return h.hexdigest()


class FileDigestCache:
    """Sampled digests keyed by (path, size, mtime_ns, inode), persisted in the state directory."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._entries: dict[str, str] = {}
        with contextlib.suppress(OSError, ValueError):
            loaded = json.loads(path.read_bytes())
            if isinstance(loaded, dict):
                self._entries = {str(k): str(v) for k, v in loaded.items()}
        self.computed = 0

    def digest(self, path: Path) -> str | None:
        try:
            st = path.stat()
        except OSError:
            return None
        key = f"{path}|{st.st_size}|{st.st_mtime_ns}|{st.st_ino}"
        if key not in self._entries:
            try:
                self._entries[key] = sampled_file_digest(path)
            except OSError:
                return None
            self.computed += 1
            with contextlib.suppress(OSError):
                atomic_write_bytes(self.path, json.dumps(self._entries).encode(), durable=False)
        return self._entries[key]


@dataclass(frozen=True, kw_only=True)
class RuntimeFingerprint:
    components: dict[str, str]
    info: dict[str, str] = field(default_factory=dict)  # recorded, not compared (n_ctx, slots, pid)

    @property
    def digest(self) -> str:
        canon = json.dumps(self.components, sort_keys=True, separators=(",", ":"))
        return xxhash.xxh3_128_hexdigest(canon.encode())

    def mismatch_reason(self, other: dict[str, str] | None) -> str:
        """Why a snapshot saved under `other` may not be restored here."""
        if other is None:
            return "FINGERPRINT_CHANGED"
        for key, code in REASONS.items():
            if self.components.get(key) != other.get(key):
                return code
        return "FINGERPRINT_CHANGED"


def build_fingerprint(
    *,
    caps: BackendCapabilities,
    process: ProcessInfo | None,
    runtime_key: str | None,
    digests: FileDigestCache | None,
) -> RuntimeFingerprint:
    # Every component is always present ("" when unknown), so a fingerprint does not flip just because
    # process discovery succeeded once and failed once.
    flags = process.flags if process is not None else {}
    comp: dict[str, str] = {
        "backend": caps.kind,
        "model_path": caps.model_path or "",
        "build_info": caps.build_info or "",
        "runtime_key": runtime_key or "",
        **{key: flags.get(key, "") for key in _LAYOUT_FLAGS},
        "model_file": "",
        "server_binary": "",
    }
    info = {"total_slots": str(caps.total_slots), "n_ctx": str(caps.n_ctx or "")}
    if digests is not None and caps.model_path:
        comp["model_file"] = digests.digest(Path(caps.model_path)) or ""
    if process is not None:
        info["pid"] = str(process.pid)
        info["cmdline"] = shlex.join(process.cmdline)
        if digests is not None and process.exe:
            comp["server_binary"] = digests.digest(Path(process.exe)) or ""
    return RuntimeFingerprint(components=comp, info=info)
