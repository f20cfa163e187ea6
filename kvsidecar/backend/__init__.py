"""Backends: the engines kvsidecar manages KV state for (spec §12)."""

from kvsidecar.backend.base import (
    BackendCapabilities,
    BackendSlot,
    EraseResult,
    KvBackend,
    PromptResult,
    RestoreResult,
    SaveResult,
)

__all__ = [
    "BackendCapabilities",
    "BackendSlot",
    "EraseResult",
    "KvBackend",
    "PromptResult",
    "RestoreResult",
    "SaveResult",
]
