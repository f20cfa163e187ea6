"""The memory class of a running llama-server: its model's files as its process sees them, read under its
settings (`memory_class.model_class`); whether those settings were read whole (its command line and its
environment: `--swa-full` may come from `LLAMA_ARG_SWA_FULL`); and for a sliding-window model the SWA
cache's size with and without `--swa-full` (`swa_cache`); and what a snapshot costs, a token and fixed
(`snapshot_cost`). Read by the coordinator for each instance of a
server it sees (a restart with other settings reads it again) and by doctor; nothing here is a guess: a
remote server (no process to read) or an unreadable model file is `unknown`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvsidecar.backend.base import BackendCapabilities
from kvsidecar.fingerprint.gguf_meta import GgufError, read_gguf
from kvsidecar.fingerprint.llama_process import ProcessInfo
from kvsidecar.fingerprint.memory_class import SWA, UNKNOWN, MemoryClass, model_class
from kvsidecar.fingerprint.model_files import model_paths
from kvsidecar.fingerprint.process_files import ProcessFiles
from kvsidecar.fingerprint.snapshot_cost import SnapshotCost, snapshot_cost
from kvsidecar.fingerprint.swa_cache import SwaCache, swa_cache

SWA_FULL_FIX = "add --swa-full to llama-server"
_SWA_ARRAYS = ("attention.head_count", "attention.head_count_kv", "attention.sliding_window_pattern")


@dataclass(frozen=True, kw_only=True)
class ServerMemory:
    memory: MemoryClass
    settings_read: bool  # the process' command line and environment were both read
    swa_cache: SwaCache | None = None  # a sliding-window model's SWA cache, when its figures are known
    snapshot: SnapshotCost | None = None  # what a snapshot costs, predicted, when its figures are known

    @property
    def kind(self) -> str:
        return self.memory.kind

    @property
    def swa_without_full(self) -> bool:
        """A sliding-window model proven to run without `--swa-full`: no restore of it is ever reused."""
        return self.kind == SWA and self.memory.n_swa > 0 and not self.memory.swa_full and self.settings_read

    @property
    def key(self) -> tuple[Any, ...]:
        """What a change of is worth saying again (a restart with the same model and settings is not)."""
        m = self.memory
        return (m.kind, m.arch, m.n_swa, m.swa_full, m.recurrent_layers, self.settings_read, m.why)

    def describe(self) -> str:
        """One line: the class and what it holds."""
        m = self.memory
        if m.kind == UNKNOWN:
            return f"unknown memory class ({m.why or 'not read'})"
        if m.kind == SWA:
            full = "with --swa-full" if m.swa_full else "without --swa-full"
            if not m.swa_full and not self.settings_read:
                full = "--swa-full unknown (the environment cannot be read)"
            return f"sliding-window model ({m.arch}, window {m.n_swa}) {full}"
        if m.recurrent_layers:
            return (
                f"{m.kind} model ({m.arch}: {m.recurrent_layers} {m.recurrent_kind} layers, "
                f"{m.attention_layers} attention layers)"
            )
        return f"plain attention model ({m.arch}, {m.attention_layers} layers)"

    def swa_full_cost(self) -> str:
        """What the fix of a sliding-window model without `--swa-full` costs in memory."""
        if self.swa_cache is None:
            return "--swa-full keeps every position in the SWA cache (its size is not known here)"
        return self.swa_cache.text()

    def to_dict(self) -> dict[str, Any]:
        m = self.memory
        return {
            "class": m.kind,
            "arch": m.arch or None,
            "n_swa": m.n_swa,
            "swa_full": m.swa_full,
            "restore_keeps": m.restore_keeps if m.kind != UNKNOWN else None,
            "settings_read": self.settings_read,
            "why": m.why or None,
            "swa_cache": self.swa_cache.to_dict() if self.swa_cache is not None else None,
            "snapshot": self.snapshot.to_dict() if self.snapshot is not None else None,
        }


def _unknown(why: str) -> ServerMemory:
    return ServerMemory(
        memory=MemoryClass(kind=UNKNOWN, arch="", n_layer=0, attention_layers=0, why=why), settings_read=False
    )


def read_server_memory(caps: BackendCapabilities, process: ProcessInfo | None) -> ServerMemory:
    """The memory of the model `caps` says is loaded, as `process` runs it (reads files: call it off the
    event loop)."""
    if process is None:
        return _unknown("a remote server: its model and settings cannot be read")
    if not caps.model_path:
        return _unknown("llama-server names no model path")
    files = ProcessFiles(None, process)
    local = [files.local(p) for p in model_paths(caps.model_path)]
    paths = [Path(p) for p in local if p is not None]
    if len(paths) != len(local):
        return _unknown("the model's path cannot be resolved as llama-server sees it")
    settings = process.settings
    memory = model_class(paths, settings)
    read = process.environ is not None
    if memory.kind == UNKNOWN:
        return ServerMemory(memory=memory, settings_read=read)
    try:
        meta = read_gguf(paths[0], array_suffixes=_SWA_ARRAYS).meta
    except (OSError, GgufError):
        return ServerMemory(memory=memory, settings_read=read)
    cache = (
        swa_cache(meta, settings, n_ctx_seq=caps.n_ctx, n_slots=caps.total_slots)
        if memory.kind == SWA
        else None
    )
    cost = snapshot_cost(meta, memory, settings)
    return ServerMemory(memory=memory, settings_read=read, swa_cache=cache, snapshot=cost)
