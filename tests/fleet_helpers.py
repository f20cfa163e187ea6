"""A real redis-server per test (scripts/bootstrap installs Debian's redis-server), and a socket to serve on.

`RedisServer` runs `redis-server` on a free loopback port with no persistence (`--save '' --appendonly
no`): `stop()` then `start()` on the same port is a Redis that lost every key, as after a crash.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvsidecar.testing.llama import free_port
from kvsidecar.testing.poll import eventually, until

START_TIMEOUT_S = 20.0


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found is None:
        raise RuntimeError(
            "redis-server is not installed: run scripts/bootstrap (apt-get install redis-server)"
        )
    return found


def _answers_ping(port: int, password: str | None) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            if password is not None:
                s.sendall(f"AUTH {password}\r\n".encode())
                if not s.recv(64).startswith(b"+OK"):
                    return False
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


@dataclass
class RedisServer:
    workdir: Path
    password: str | None = None
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password is not None else ""
        return f"redis://{auth}127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.workdir.mkdir(parents=True, exist_ok=True)
        args = [redis_binary(), "--port", str(self.port), "--save", "", "--appendonly", "no"]
        args += ["--bind", "127.0.0.1", "--dir", str(self.workdir), "--daemonize", "no"]
        if self.password is not None:
            args += ["--requirepass", self.password]
        log = (self.workdir / "redis.log").open("ab")
        self.proc = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        eventually(self._answers, timeout_s=START_TIMEOUT_S, interval_s=0.02, what="redis-server to answer")
        return self

    def _answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise RuntimeError(f"redis-server exited with {self.proc.returncode}: see {self.workdir}")
        return _answers_ping(self.port, self.password)

    def stop(self) -> None:
        """Kill it (SIGKILL: no shutdown save, no goodbye to clients), as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None


class BoundSocket:
    """A loopback socket bound now, so its URL can be advertised by a host started before its hook API is
    served on it (`serving`); nothing answers on it until then."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    @contextlib.asynccontextmanager
    async def serving(self, app: Any, *, what: str) -> AsyncIterator[None]:
        """Serve `app` (a hook API) on the socket with uvicorn for the block; the socket is closed after."""
        import uvicorn

        server = uvicorn.Server(uvicorn.Config(app, lifespan="off", log_level="warning"))
        serving = asyncio.ensure_future(server.serve(sockets=[self.sock]))
        try:
            await until(lambda: server.started, what=what)
            yield
        finally:
            server.should_exit = True
            await serving
            self.sock.close()


async def stop(task: asyncio.Task[None]) -> None:
    """End one of a fleet agent's loops, as a host that dies would. One cancel is not enough: it can land
    while redis-py's `asyncio.wait_for` around a socket write is finishing, and Python 3.11's `wait_for`
    then returns the result instead of raising (the task carries on): cancel until it is done."""
    for _ in range(100):
        if task.done():
            return
        task.cancel()
        await asyncio.wait({task}, timeout=0.05)
    raise AssertionError(f"{task.get_name()} did not stop")
