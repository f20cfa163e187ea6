"""The state directory's lock: one holder, named when a start is refused; stale locks taken over on this
host only; hostile lock files never followed, never crash, never written through."""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import stat
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import uvicorn

from kvsidecar import __version__
from kvsidecar.backend.fake import FakeKvBackend
from kvsidecar.cli import EXIT_USAGE, main
from kvsidecar.daemon.lifecycle import Stopper
from kvsidecar.daemon.service import Daemon
from kvsidecar.daemon.statelock import LOCK_NAME, Holder, StateLock, this_host
from kvsidecar.errors import MetadataIO, StateLocked
from kvsidecar.testing.llama import free_port
from tests.unit.coordinator_helpers import make_config

HOLD = (
    "import sys; from kvsidecar.daemon.statelock import StateLock; "
    "lock = StateLock.acquire(sys.argv[1]); print('locked', flush=True); sys.stdin.read()"
)


@pytest.fixture
def state(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def holder_process(state: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process holding the lock (until its stdin closes or it is killed)."""
    with subprocess.Popen(
        [sys.executable, "-c", HOLD, str(state)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    ) as proc:
        assert proc.stdout is not None and proc.stdout.readline() == "locked\n"
        yield proc
        proc.kill()


@pytest.fixture
def sleeper() -> Iterator[psutil.Process]:
    """A live process of ours that holds no lock."""
    with subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE
    ) as proc:
        yield psutil.Process(proc.pid)
        proc.kill()


def record(**overrides: Any) -> bytes:
    data: dict[str, Any] = {
        "format": 1,
        "host": this_host(),
        "pid": 4_000_000,
        "create_time": 1_700_000_000.0,
        "version": "0.0.9",
        "since": 1_700_000_100.0,
    }
    return json.dumps({**data, **overrides}).encode()


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(timeout=30)
    return proc.pid


def plant(state: Path, raw: bytes) -> Path:
    state.mkdir(parents=True, exist_ok=True)
    path = state / LOCK_NAME
    path.write_bytes(raw)
    return path


def taken_over(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "kv.state.lock_taken_over" in r.getMessage()]


# one holder ---------------------------------------------------------------------------------------------


def test_lock_records_its_holder_and_release_removes_it(state: Path) -> None:
    with StateLock.acquire(state) as lock:
        assert stat.S_IMODE(state.stat().st_mode) == 0o700
        held = Holder.model_validate_json((state / LOCK_NAME).read_bytes())
        assert held == lock.holder
        assert (held.host, held.pid) == (this_host(), os.getpid())
        assert held.create_time == psutil.Process().create_time()
        assert stat.S_IMODE((state / LOCK_NAME).stat().st_mode) == 0o600
    assert not lock.held and not (state / LOCK_NAME).exists()
    StateLock.acquire(state).release()  # free again


def test_second_holder_in_the_same_process_is_refused(state: Path) -> None:
    """flock, unlike POSIX fcntl locks, excludes a second daemon even inside one process."""
    with StateLock.acquire(state) as first:
        with pytest.raises(StateLocked) as info:
            StateLock.acquire(state)
        assert f"pid {os.getpid()} on host {this_host()}" in info.value.message
        assert first.held and (state / LOCK_NAME).exists()


def test_holder_in_another_process_is_named(state: Path, holder_process: subprocess.Popen[str]) -> None:
    with pytest.raises(StateLocked) as info:
        StateLock.acquire(state)
    assert info.value.code == "KV_STATE_LOCKED"
    assert f"in use by kvsidecar {__version__} (pid" in info.value.message
    assert f"pid {holder_process.pid} on host {this_host()}, since 20" in info.value.message


def test_kill_9_of_the_holder_leaves_a_stale_lock_that_is_taken_over(
    state: Path, holder_process: subprocess.Popen[str], caplog: pytest.LogCaptureFixture
) -> None:
    holder_process.kill()
    holder_process.wait(timeout=10)
    assert (state / LOCK_NAME).exists()  # what a crash leaves behind
    caplog.set_level(logging.INFO, "kvsidecar")
    with StateLock.acquire(state) as lock:
        assert lock.holder.pid == os.getpid()
    [line] = taken_over(caplog)
    assert f"holder_pid={holder_process.pid}" in line and 'reason="holder gone"' in line


def test_clean_exit_of_the_holder_releases(state: Path, holder_process: subprocess.Popen[str]) -> None:
    assert holder_process.stdin is not None
    holder_process.stdin.close()  # its script ends: the interpreter closes the descriptor
    holder_process.wait(timeout=10)
    StateLock.acquire(state).release()


# a free flock, and what the record says --------------------------------------------------------------


def test_record_of_a_dead_process_on_this_host_is_stale(
    state: Path, caplog: pytest.LogCaptureFixture
) -> None:
    pid = dead_pid()
    plant(state, record(pid=pid))
    caplog.set_level(logging.WARNING, "kvsidecar")
    StateLock.acquire(state).release()
    [line] = taken_over(caplog)
    assert f"holder_pid={pid}" in line and "holder gone" in line


def test_reused_pid_is_stale(state: Path, sleeper: psutil.Process, caplog: pytest.LogCaptureFixture) -> None:
    """The pid is alive, but it is another process than the one that wrote the record."""
    plant(state, record(pid=sleeper.pid, create_time=sleeper.create_time() - 3600))
    caplog.set_level(logging.WARNING, "kvsidecar")
    StateLock.acquire(state).release()
    [line] = taken_over(caplog)
    assert "pid reused" in line


def test_live_holder_without_the_flock_is_refused(state: Path, sleeper: psutil.Process) -> None:
    """Its process is running and was started when the record says: a filesystem without flock."""
    path = plant(state, raw := record(pid=sleeper.pid, create_time=sleeper.create_time()))
    with pytest.raises(StateLocked, match=f"pid {sleeper.pid} .* still running"):
        StateLock.acquire(state)
    assert path.read_bytes() == raw


def test_lock_of_another_host_is_never_assumed_stale(state: Path) -> None:
    path = plant(state, raw := record(host="build-box-7", pid=dead_pid()))
    with pytest.raises(StateLocked) as info:
        StateLock.acquire(state)
    assert "host build-box-7" in info.value.message and "never taken over" in info.value.message
    assert info.value.hint.endswith(f"rm {path}")
    assert path.read_bytes() == raw  # left exactly as found
    path.unlink()  # what the hint says
    StateLock.acquire(state).release()


# hostile lock files -------------------------------------------------------------------------------------

HOSTILE = {
    "garbage": b"\x00\xff garbage \x1b[31m",
    "huge": b"{" + b" " * (8 << 20),
    "deep": b"[" * 3000 + b"]" * 3000,
    "deep object": b'{"a":' * 1000 + b"1" + b"}" * 1000,
    "not utf-8": b'{"host": "\xff\xfe"}',
    "nan": record(create_time=float("nan")),
    "huge since": record(since=1e300),
    "pid as bool": record(pid=True),
    "pid as string": record(pid="123"),
    "negative pid": record(pid=-1),
    "extra key": record(extra="x"),
    "host with newline": record(host="a\nkv.state.locked forged=1"),
    "host with escape": record(host="\x1b]0;owned\x07"),
    "list": b"[1, 2, 3]",
    "empty object": b"{}",
    "whitespace": b" \n\t ",
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_unreadable_record_with_a_free_flock_is_taken_over(
    state: Path, name: str, caplog: pytest.LogCaptureFixture
) -> None:
    plant(state, HOSTILE[name])
    caplog.set_level(logging.WARNING, "kvsidecar")
    with StateLock.acquire(state) as lock:
        assert Holder.model_validate_json((state / LOCK_NAME).read_bytes()) == lock.holder
    lines = taken_over(caplog)
    assert len(lines) == (0 if name == "whitespace" else 1)  # blank is simply free
    assert all("\n" not in line and "\x1b" not in line for line in lines)


@pytest.mark.parametrize("name", ["garbage", "huge", "deep", "host with escape", "whitespace"])
def test_unreadable_record_with_a_held_flock_is_a_holder_that_cannot_be_named(state: Path, name: str) -> None:
    with StateLock.acquire(state) as lock:
        path = state / LOCK_NAME
        with path.open("r+b") as f:  # the holder's file is overwritten (ours: same inode, lock held)
            f.truncate(0)
            f.write(HOSTILE[name])
        with pytest.raises(StateLocked, match="cannot be named") as info:
            StateLock.acquire(state)
        assert "\x1b" not in info.value.message and "fuser -v" in info.value.hint
        assert lock.held


def test_symlink_is_refused_and_never_followed(state: Path, tmp_path: Path) -> None:
    target = tmp_path / "precious"
    target.write_bytes(b"keep me")
    state.mkdir()
    (state / LOCK_NAME).symlink_to(target)
    with pytest.raises(StateLocked, match="is a symlink"):
        StateLock.acquire(state)
    assert target.read_bytes() == b"keep me" and (state / LOCK_NAME).is_symlink()


def test_dangling_symlink_is_refused_and_its_target_not_created(state: Path, tmp_path: Path) -> None:
    state.mkdir()
    (state / LOCK_NAME).symlink_to(tmp_path / "created-through-link")
    with pytest.raises(StateLocked, match="is a symlink"):
        StateLock.acquire(state)
    assert not (tmp_path / "created-through-link").exists()


def test_hard_link_is_refused_and_never_written(state: Path, tmp_path: Path) -> None:
    other = tmp_path / "someone-elses-file"
    other.write_bytes(b"keep me")
    state.mkdir()
    os.link(other, state / LOCK_NAME)
    with pytest.raises(StateLocked, match="2 links"):
        StateLock.acquire(state)
    assert other.read_bytes() == b"keep me"


@pytest.mark.parametrize("kind", ["directory", "fifo"])
def test_directory_or_fifo_is_refused_without_hanging(state: Path, kind: str) -> None:
    state.mkdir()
    path = state / LOCK_NAME
    path.mkdir() if kind == "directory" else os.mkfifo(path)
    with pytest.raises(StateLocked, match=f"is a {kind}"):
        StateLock.acquire(state)


def test_state_dir_that_cannot_be_created_is_a_metadata_error(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("x")
    with pytest.raises(MetadataIO, match=r"state_dir .* cannot open it"):
        StateLock.acquire(tmp_path / "file" / "state")


# release racing a start ---------------------------------------------------------------------------------


def test_a_lock_released_between_open_and_flock_is_not_taken_on_the_dead_file(
    state: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The holder unlinks its file, then unlocks. A starter that opened the old file gets its flock and
    must notice that the path names another file (or none), and start over on the path."""
    first = StateLock.acquire(state)
    real_flock = fcntl.flock
    calls: list[int] = []

    def flock_after_release(fd: int, op: int) -> None:
        if not calls:
            first.release()  # between our open and our flock
        calls.append(fd)
        real_flock(fd, op)

    monkeypatch.setattr(fcntl, "flock", flock_after_release)
    with StateLock.acquire(state) as second:
        assert len(calls) == 2  # the first flock was on the unlinked file
        on_disk = os.stat(state / LOCK_NAME)
        assert Holder.model_validate_json((state / LOCK_NAME).read_bytes()) == second.holder
        assert on_disk.st_nlink == 1
        monkeypatch.setattr(fcntl, "flock", real_flock)
        with pytest.raises(StateLocked):  # and the new file is really locked
            StateLock.acquire(state)


# the daemon and the CLI ---------------------------------------------------------------------------------


def make_daemon(tmp_path: Path) -> Daemon:
    config = make_config(tmp_path)
    return Daemon(
        config, backends={"local": FakeKvBackend(tmp_path / "snaps")}, process_finder=None, watch=False
    )


async def test_a_second_daemon_on_the_same_state_dir_refuses_to_start(tmp_path: Path) -> None:
    first, second = make_daemon(tmp_path), make_daemon(tmp_path)
    await first.start()
    try:
        with pytest.raises(StateLocked, match=f"pid {os.getpid()}"):
            await second.start()
        assert first.state_lock is not None and first.state_lock.held
    finally:
        await first.aclose()
    assert not (tmp_path / "state" / LOCK_NAME).exists()  # released on a clean shutdown
    await second.start()
    await second.aclose()


async def test_a_failed_start_releases_the_lock(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    d = make_daemon(tmp_path)

    def broken() -> None:
        raise MetadataIO("disk on fire")

    monkeypatch.setattr(d.store, "open", broken)
    with pytest.raises(MetadataIO):
        await d.start()
    StateLock.acquire(tmp_path / "state").release()


@pytest.fixture
def cli_logging() -> Iterator[None]:
    """`serve` configures kvsidecar's logger; put it back."""
    root = logging.getLogger("kvsidecar")
    saved = (list(root.handlers), root.level, root.propagate)
    yield
    root.handlers[:] = saved[0]
    root.setLevel(saved[1])
    root.propagate = saved[2]


def test_serve_exits_2_naming_the_holder(
    tmp_path: Path, cli_logging: None, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "config.yaml"
    path.write_text(f"state_dir: {tmp_path / 'state'}\napi:\n  listen: 127.0.0.1:{free_port()}\n")
    with StateLock.acquire(tmp_path / "state"):
        assert main(["-c", str(path), "serve"]) == EXIT_USAGE == 2
    err = capsys.readouterr().err
    assert f"kvsidecar: KV_STATE_LOCKED: state_dir {tmp_path / 'state'} is in use by kvsidecar" in err
    assert f"pid {os.getpid()} on host {this_host()}" in err and "hint: Stop that daemon" in err


def test_a_stop_signal_before_the_servers_run_still_stops_them() -> None:
    """uvicorn re-raises SIGTERM once stopped; serve() takes it (so it can release the lock), and one that
    arrives while it builds the servers is not lost."""
    stopper = Stopper()
    stopper.stop(signal.SIGTERM, None)
    server = uvicorn.Server(uvicorn.Config(app=lambda: None))
    assert not server.should_exit
    stopper.add(server)
    assert server.should_exit
