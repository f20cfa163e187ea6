"""SIGHUP (`Daemon.reload`): every live key applies, even when a restart-only key changed in the same
edit; the restart-only keys keep their running values and are reported; logging level and format apply."""

from __future__ import annotations

import io
import json
import logging
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvsidecar.backend.fake import FakeKvBackend
from kvsidecar.config import Config, load_config
from kvsidecar.daemon import service
from kvsidecar.daemon.service import Daemon, changed_keys
from kvsidecar.logs import ROOT, JsonFormatter, configure


@pytest.fixture
def kv_logging() -> Iterator[io.StringIO]:
    """kvsidecar's own handler, as `serve` installs it, writing here; the logger is restored afterwards."""
    root = logging.getLogger(ROOT)
    saved = (list(root.handlers), root.level, root.propagate)
    configure("info", "text")
    stream = io.StringIO()
    for handler in ours(root):
        assert isinstance(handler, logging.StreamHandler)
        handler.setStream(stream)
    yield stream
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    root.propagate = saved[2]


def ours(logger: logging.Logger) -> list[logging.Handler]:
    """The handler `configure` installed (pytest adds its own capture handlers beside it)."""
    return [h for h in logger.handlers if h.get_name() == ROOT]


def base(tmp_path: Path) -> dict[str, Any]:
    return {
        "state_dir": str(tmp_path / "state"),
        "servers": {"local": {"snapshot_dir": str(tmp_path / "snaps"), "probe_interval_s": 3600}},
        "routes": {"local": "local"},
        "api": {"listen": "127.0.0.1:8377"},
        "checkpoint": {"idle_s": 30},
    }


def write(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
async def daemon(tmp_path: Path) -> AsyncIterator[Daemon]:
    path = write(tmp_path / "config.yaml", base(tmp_path))
    d = Daemon(
        load_config(path, env={}),
        backends={"local": FakeKvBackend(tmp_path / "snaps")},
        process_finder=None,
        watch=False,
        config_path=path,
    )
    await d.start()
    yield d
    await d.aclose()


def edit(d: Daemon, tmp_path: Path, **sections: Any) -> None:
    data = base(tmp_path)
    for key, value in sections.items():
        data[key] = {**data[key], **value} if isinstance(data.get(key), dict) else value
    assert d.config_path is not None
    write(d.config_path, data)


LIVE = {
    "enabled": False,
    "checkpoint": {"idle_s": 5, "on_turn_end": True},
    "restore": {"verify_checksum": False, "min_reuse_ratio": 0.2},
    "failure": {"cooldown_s": 7, "max_consecutive_failures": 9, "strict": True},
    "retention": {"max_sessions": 3, "interval_s": 120},
    "logging": {"level": "debug", "format": "json"},
}


def assert_live_applied(d: Daemon) -> None:
    c = d.coordinator.config
    assert c.enabled is False and c.checkpoint.idle_s == 5 and c.checkpoint.on_turn_end
    assert c.restore.min_reuse_ratio == 0.2 and c.failure.strict
    assert d.store.verify_checksum is False
    breaker = d.coordinator.servers["local"].breaker
    assert (breaker.base_cooldown_s, breaker.max_consecutive_failures) == (7, 9)
    assert d.retention.policy.max_sessions == 3 and d.retention.config.interval_s == 120
    job = d.scheduler.get_job("retention")
    assert job is not None and job.trigger.interval.total_seconds() == 120
    root = logging.getLogger(ROOT)
    assert root.level == logging.DEBUG
    assert [type(h.formatter) for h in ours(root)] == [JsonFormatter]


async def test_live_keys_apply_even_when_a_restart_only_key_changed_too(
    daemon: Daemon, tmp_path: Path, kv_logging: io.StringIO
) -> None:
    """The bug: one restart-only change in the same edit (api.listen) used to throw away every live one."""
    edit(daemon, tmp_path, api={"listen": "127.0.0.1:9999"}, **LIVE)
    assert daemon.reload() == ["api.listen"]
    assert_live_applied(daemon)
    assert daemon.pending_restart == ["api.listen"]
    assert daemon.coordinator.status()["config"]["pending_restart"] == ["api.listen"]  # visible in status
    assert daemon.config.api.listen == daemon.coordinator.config.api.listen == "127.0.0.1:8377"
    line = json.loads(kv_logging.getvalue().splitlines()[-1])  # already in the new format
    assert line["event"] == "kv.config.reloaded" and line["level"] == "warning"
    assert line["needs_restart"] == "api.listen"
    changed = line["changed"].split(",")
    assert {"checkpoint.idle_s", "logging.format", "retention.interval_s", "enabled"} <= set(changed)
    assert not any(key.startswith("api.") for key in changed)


async def test_logging_format_alone_applies_live(
    daemon: Daemon, tmp_path: Path, kv_logging: io.StringIO
) -> None:
    edit(daemon, tmp_path, logging={"format": "json"})
    assert daemon.reload() == []
    root = logging.getLogger(ROOT)
    assert [type(h.formatter) for h in ours(root)] == [JsonFormatter]
    line = json.loads(kv_logging.getvalue().splitlines()[-1])
    assert line["event"] == "kv.config.reloaded" and line["changed"] == "logging.format"
    edit(daemon, tmp_path, logging={"format": "text", "level": "warning"})
    daemon.reload()
    assert root.level == logging.WARNING
    assert [type(h.formatter) for h in ours(root)] == [logging.Formatter]


async def test_an_embedding_applications_handler_keeps_its_format(daemon: Daemon, tmp_path: Path) -> None:
    root = logging.getLogger(ROOT)
    theirs = logging.StreamHandler()
    theirs.setFormatter(mine := logging.Formatter("%(message)s"))
    root.addHandler(theirs)
    try:
        edit(daemon, tmp_path, logging={"format": "json"})
        daemon.reload()
        assert theirs.formatter is mine
    finally:
        root.removeHandler(theirs)


async def test_new_servers_and_routes_wait_for_a_restart(daemon: Daemon, tmp_path: Path) -> None:
    servers = {"b": {"snapshot_dir": str(tmp_path / "b"), "base_url": "http://127.0.0.1:9"}}
    edit(daemon, tmp_path, servers=servers, routes={"other": "b"}, checkpoint={"idle_s": 5})
    assert daemon.reload() == ["routes.other", "servers.b"]
    assert set(daemon.coordinator.servers) == {"local"} and daemon.config.server_for("other") is None
    assert daemon.coordinator.config.checkpoint.idle_s == 5
    edit(daemon, tmp_path)  # the edit reverted: nothing pending any more
    assert daemon.reload() == [] and daemon.pending_restart == []
    assert daemon.coordinator.config.checkpoint.idle_s == 30


async def test_a_file_that_does_not_load_changes_nothing(
    daemon: Daemon, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    edit(daemon, tmp_path, api={"listen": "127.0.0.1:9999"})
    daemon.reload()
    before = daemon.config
    assert daemon.config_path is not None
    daemon.config_path.write_text("checkpoint:\n  idle_s: -1\n")
    assert daemon.reload() == ["api.listen"]  # still pending from the last good file
    assert daemon.config is before and daemon.coordinator.config.checkpoint.idle_s == 30
    assert any("kv.config.reload_failed" in r.getMessage() for r in caplog.records)


async def test_sighup_reads_the_file_off_the_loop_and_refuses_a_huge_one(
    daemon: Daemon, tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The SIGHUP handler parses on a thread (a large file must not stall the hooks); a file over 1 MiB is
    refused before it is parsed, and changes nothing."""
    threads: list[int] = []

    def recording(path: Path | str | None = None, **kwargs: Any) -> Config:
        threads.append(threading.get_ident())
        return load_config(path, **kwargs)

    monkeypatch.setattr(service, "load_config", recording)
    edit(daemon, tmp_path, checkpoint={"idle_s": 5})
    daemon._on_sighup()
    assert daemon._reload_task is not None
    await daemon._reload_task
    assert threads and threading.get_ident() not in threads
    assert daemon.coordinator.config.checkpoint.idle_s == 5
    assert daemon.config_path is not None
    daemon.config_path.write_text("# padding\n" * 120_000 + "checkpoint: {idle_s: 7}\n")
    daemon._on_sighup()
    await daemon._reload_task
    assert daemon.coordinator.config.checkpoint.idle_s == 5
    [failed] = [r.getMessage() for r in caplog.records if "kv.config.reload_failed" in r.getMessage()]
    assert "1 MiB" in failed


async def test_removed_keys_are_ignored_with_a_warning_and_the_rest_applies(
    daemon: Daemon, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    edit(daemon, tmp_path, restore={"verify": True}, auxiliary_requests="isolate", checkpoint={"idle_s": 5})
    caplog.set_level(logging.WARNING, ROOT)
    assert daemon.reload() == []
    assert daemon.coordinator.config.checkpoint.idle_s == 5
    warned = [r.getMessage() for r in caplog.records if "kv.config.deprecated" in r.getMessage()]
    assert len(warned) == 2 and "key=restore.verify" in warned[0]


def test_changed_keys_names_leaves_and_whole_new_entries() -> None:
    old = {"a": {"x": 1, "y": {"z": 2}}, "s": {"one": {"u": 1}}}
    new = {"a": {"x": 1, "y": {"z": 3}}, "s": {"one": {"u": 1}, "two": {"u": 1, "v": 2}}}
    assert changed_keys(old, new) == ["a.y.z", "s.two"]
    assert changed_keys(new, new) == []


async def test_the_fleet_section_is_restart_only_for_the_coordinator_too(
    daemon: Daemon, tmp_path: Path
) -> None:
    """The coordinator's own list of restart-only keys had drifted from the daemon's (it lacked `fleet`): a
    reload handed it a new fleet section and it took it live. Both read `RESTART_ONLY` now."""
    running = daemon.coordinator.config
    fleet = running.fleet.model_copy(update={"key_prefix": "other"})
    assert daemon.coordinator.reconfigure(running.model_copy(update={"fleet": fleet})) == ["fleet"]
    assert daemon.coordinator.config.fleet == running.fleet
    edit(daemon, tmp_path, fleet={"key_prefix": "other"})
    assert daemon.reload() == ["fleet.key_prefix"]
    assert daemon.config.fleet.key_prefix == running.fleet.key_prefix


async def test_the_daemon_owns_its_scheduler(tmp_path: Path) -> None:
    """The retention timer runs on the daemon's scheduler: started by `start`, stopped by `aclose`."""
    path = write(tmp_path / "config.yaml", base(tmp_path))
    d = Daemon(
        load_config(path, env={}),
        backends={"local": FakeKvBackend(tmp_path / "snaps")},
        process_finder=None,
        watch=False,
    )
    assert not d.scheduler.running
    await d.start()
    try:
        assert d.scheduler.running and d.scheduler.get_job("retention") is not None
    finally:
        await d.aclose()
    assert not d.scheduler.running
