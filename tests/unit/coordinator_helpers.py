"""A coordinator wired to the fake backend, and a simulated harness turn."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from kvsidecar.backend.fake import FakeKvBackend
from kvsidecar.config import Config, config_from_mapping
from kvsidecar.coordinator.core import AcquireResult, Coordinator
from kvsidecar.fingerprint.llama_process import ProcessInfo
from kvsidecar.store.snapshots import SnapshotStore


def make_config(tmp_path: Path, **overrides: Any) -> Config:
    data: dict[str, Any] = {
        "state_dir": str(tmp_path / "state"),
        "servers": {"local": {"snapshot_dir": str(tmp_path / "snaps"), "probe_interval_s": 3600}},
        "routes": {"local": "local"},
        # the tests of the cost-aware policy opt in: its timers would otherwise add background saves
        "checkpoint": {"idle_s": 30, "policy": "save-before-evict"},
    }
    for key, value in overrides.items():
        if key == "servers":
            value = {name: {**data["servers"].get(name, {}), **cfg} for name, cfg in value.items()}
        data[key] = {**data[key], **value} if isinstance(data.get(key), dict) else value
    return config_from_mapping(data)


def conversation(session: str, turns: int, tokens_per_turn: int = 50) -> list[int]:
    """A session's prompt after `turns` turns: each turn appends to the same prefix."""
    seed = xxhash.xxh32_intdigest(session.encode())
    return [(seed + i * 7919) % 32000 for i in range(turns * tokens_per_turn)]


@dataclass
class Harness:
    coordinator: Coordinator
    fake: FakeKvBackend
    turns: dict[str, int] = field(default_factory=dict)
    process: list[ProcessInfo | None] = field(default_factory=lambda: [None])

    async def turn(
        self, session: str, *, model: str = "m", purpose: str | None = None
    ) -> tuple[AcquireResult, dict[str, Any], int, int]:
        """acquire -> the engine processes the grown prompt on the slot -> release with its numbers."""
        result = await self.coordinator.acquire(
            None if purpose else session, provider="local", model=model, purpose=purpose
        )
        n = self.turns.get(session, 0) + 1
        self.turns[session] = n
        assert result.slot_id is not None and result.lease_id is not None
        prompt_n, cache_n = self.fake.infer(result.slot_id, conversation(session, n))
        out = await self.coordinator.release(
            result.lease_id, status="ok", prompt_tokens=prompt_n, cached_tokens=cache_n
        )
        return result, out, prompt_n, cache_n

    def calls(self) -> list[str]:
        calls = [c[0] for c in self.fake.calls]
        self.fake.calls.clear()
        return calls


async def start_harness(
    tmp_path: Path, *, total_slots: int = 1, monotonic: Callable[[], float] | None = None, **overrides: Any
) -> Harness:
    config = make_config(tmp_path, **overrides)
    fake = FakeKvBackend(tmp_path / "snaps", total_slots=total_slots)
    store = SnapshotStore(
        state_dir=config.state_dir,
        snapshot_dirs={"local": tmp_path / "snaps"},
        verify_checksum=config.restore.verify_checksum,
    )
    store.open()
    process: list[ProcessInfo | None] = [None]
    coordinator = Coordinator(
        config=config,
        store=store,
        backends={"local": fake},
        process_finder=lambda _url: process[0],
        process_check=lambda p: process[0] is not None and process[0].identity == p.identity,
        monotonic=monotonic or time.monotonic,
    )
    await coordinator.start()
    fake.calls.clear()  # the runtime canary measured at start
    return Harness(coordinator=coordinator, fake=fake, process=process)
