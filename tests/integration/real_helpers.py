"""A coordinator on a real llama-server, with the management calls it makes recorded."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from kvsidecar.backend.base import EraseResult, RestoreResult, SaveResult
from kvsidecar.backend.llamacpp import LlamaCppBackend
from kvsidecar.config import config_from_mapping
from kvsidecar.coordinator.core import AcquireResult, Coordinator
from kvsidecar.fingerprint.file_digests import FileDigestCache
from kvsidecar.fingerprint.llama_process import find_llama_process
from kvsidecar.store.snapshots import SnapshotStore
from kvsidecar.testing.llama import LlamaServer, complete, words

TOKENS_PER_TURN = 600


class RecordingBackend(LlamaCppBackend):
    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.calls: list[str] = []

    async def save_slot(self, slot_id: int, filename: str) -> SaveResult:
        self.calls.append("save")
        return await super().save_slot(slot_id, filename)

    async def restore_slot(self, slot_id: int, filename: str) -> RestoreResult:
        self.calls.append("restore")
        return await super().restore_slot(slot_id, filename)

    async def erase_slot(self, slot_id: int) -> EraseResult:
        self.calls.append("erase")
        return await super().erase_slot(slot_id)


def prompt(session: str, turn: int) -> str:
    return words(session, TOKENS_PER_TURN * turn)


@dataclass
class RealHarness:
    coordinator: Coordinator
    backend: RecordingBackend
    server: LlamaServer
    turns: dict[str, int] = field(default_factory=dict)

    async def turn(
        self, session: str, *, purpose: str | None = None
    ) -> tuple[AcquireResult, dict[str, Any], int, int]:
        r = await self.coordinator.acquire(
            None if purpose else session, provider="local", model="tiny", purpose=purpose
        )
        n = self.turns.get(session, 0) + 1
        self.turns[session] = n
        assert r.lease_id is not None and r.slot_id is not None
        try:
            timings = await asyncio.to_thread(
                complete, self.server.base_url, prompt(session, n), slot_id=r.slot_id
            )
        except BaseException:
            await self.coordinator.release(r.lease_id, status="error")
            raise
        pn, cn = timings["prompt_n"], timings["cache_n"]
        out = await self.coordinator.release(
            r.lease_id, status="ok", prompt_tokens=pn, cached_tokens=cn, prompt_ms=timings["prompt_ms"]
        )
        return r, out, pn, cn

    def calls(self) -> list[str]:
        calls = list(self.backend.calls)
        self.backend.calls.clear()
        return calls


async def real_harness(server: LlamaServer, tmp_path: Path, **overrides: Any) -> RealHarness:
    assert server.slot_save_path is not None
    data: dict[str, Any] = {
        "state_dir": str(tmp_path / "state"),
        "servers": {
            "local": {
                "base_url": server.base_url,
                "snapshot_dir": str(server.slot_save_path),
                "probe_interval_s": 3600,
            }
        },
        "routes": {"local": "local"},
        # tests of the cost-aware policy opt in: its background saves would change the call sequences
        "checkpoint": {"policy": "save-before-evict"},
    }
    data.update(overrides)
    config = config_from_mapping(data)
    store = SnapshotStore(state_dir=config.state_dir, snapshot_dirs={"local": server.slot_save_path})
    store.open()
    backend = RecordingBackend(base_url=server.base_url)
    coordinator = Coordinator(
        config=config,
        store=store,
        backends={"local": backend},
        process_finder=find_llama_process,
        digests=FileDigestCache(config.state_dir / "digests.json"),
    )
    await coordinator.start()
    backend.calls.clear()  # the runtime canary measured at start
    return RealHarness(coordinator=coordinator, backend=backend, server=server)


def generate(base_url: str, text: str, slot_id: int, *, n_predict: int = 12) -> str:
    """What the model writes after `text` at temperature 0 on a pinned slot (reusing what it caches)."""
    body = {
        "prompt": text,
        "n_predict": n_predict,
        "temperature": 0,
        "cache_prompt": True,
        "id_slot": slot_id,
    }
    response = httpx.post(f"{base_url}/completion", json=body, timeout=600)
    response.raise_for_status()
    content = response.json()["content"]
    assert isinstance(content, str)
    return content


def erase(base_url: str, slot_id: int) -> None:
    httpx.post(f"{base_url}/slots/{slot_id}?action=erase", timeout=30).raise_for_status()
