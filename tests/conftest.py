"""Shared fixtures; integration fixtures start a real llama-server (scripts/provision-llama-server)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from kvsidecar.testing.llama import LlamaServer, llama_server_binary, vocab_dir
from kvsidecar.testing.models import TINY, generate_llama_model
from tests.fleet_helpers import RedisServer


@pytest.fixture(scope="session")
def llama_bin() -> Path:
    return llama_server_binary()


@pytest.fixture(scope="session")
def tiny_model(llama_bin: Path) -> Path:
    return generate_llama_model(TINY, vocab_dir=vocab_dir(llama_bin))


StartServer = Callable[..., LlamaServer]


@pytest.fixture
def start_llama(llama_bin: Path, tiny_model: Path, tmp_path: Path) -> Iterator[StartServer]:
    """Factory: start a real llama-server on a free loopback port; every one started is stopped."""
    started: list[LlamaServer] = []

    def start(
        *,
        model: Path | None = None,
        slot_save_path: Path | None = None,
        ctx_size: int = 4096,
        parallel: int = 1,
        extra_args: tuple[str, ...] = ("--cache-ram", "0"),
        save: bool = True,
    ) -> LlamaServer:
        server = LlamaServer(
            binary=llama_bin,
            model=model or tiny_model,
            slot_save_path=(slot_save_path or tmp_path / "snapshots") if save else None,
            log_path=tmp_path / f"llama-{len(started)}.log",
            ctx_size=ctx_size,
            parallel=parallel,
            extra_args=extra_args,
        )
        started.append(server)
        return server.start()

    yield start
    for server in started:
        server.stop()


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    """A real redis-server on a free loopback port, no persistence; stopped (killed) after the test."""
    server = RedisServer(tmp_path / "redis").start()
    yield server
    server.stop()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if "integration" in str(item.path):
            item.add_marker(pytest.mark.integration)
        # Fleet mode's tests against a real redis-server: `-m "not redis"` leaves them out.
        if "redis_server" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.redis)
    if os.environ.get("KVSIDECAR_SKIP_INTEGRATION") == "1" and not os.environ.get("CI"):
        skip = pytest.mark.skip(reason="KVSIDECAR_SKIP_INTEGRATION=1 (never honoured in CI)")
        for item in items:
            if "integration" in item.keywords:
                item.add_marker(skip)
