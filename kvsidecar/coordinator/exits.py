"""Why each server's local llama-server process went away, and whether it keeps dying (issue 25).

`ExitWatch.note()` runs after every probe. When the process the last probe found is gone (another process
serves now, or nothing answers and it is not running), it asks the host how it ended
(`fingerprint/llama_exit.py`, in a thread: the kernel log and the unit's journal) and tells telemetry once per
process: a warning with the signal, and an error with what to do when the same crash signal (SIGILL,
SIGSEGV, ...) ended it twice within ten minutes, which is what a build this CPU cannot run looks like.

It also remembers, per server, the processes it has seen serve it (`served`: pid, start time, the kernel's
name for it, binary, libraries, unit; the last `SERVED_KEPT`): `doctor` counts only their crashes.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque

from kvsidecar.coordinator.server import ServerRuntime, process_alive
from kvsidecar.coordinator.telemetry import Telemetry
from kvsidecar.fingerprint.llama_crashes import ServedBy, served_by
from kvsidecar.fingerprint.llama_exit import ExitEvidence, ExitHistory, exit_evidence
from kvsidecar.fingerprint.llama_process import ProcessInfo

SERVED_KEPT = 64


class ExitWatch:
    def __init__(self, *, telemetry: Telemetry) -> None:
        self.telemetry = telemetry
        self.history: dict[str, ExitHistory] = {}
        self._units: dict[tuple[int, float], str | None] = {}  # unit of each process seen alive
        self._served: dict[str, deque[ServedBy]] = {}  # per server, the processes seen serving it
        self._reported: set[tuple[int, float]] = set()
        self._tasks: set[asyncio.Task[None]] = set()

    def served(self, server: str) -> tuple[ServedBy, ...]:
        """The processes seen serving `server`, oldest first."""
        return tuple(self._served.get(server, ()))

    def last(self, server: str) -> ExitEvidence | None:
        history = self.history.get(server)
        return history.last() if history is not None else None

    def note(self, srv: ServerRuntime, before: ProcessInfo | None) -> bool:
        """After a probe of `srv`: `before` is the process the previous probe had found. True when it is
        seen gone now, for the first time (the caller tells the server's identity)."""
        now = srv.process if srv.available else None
        if now is not None and now.identity not in self._units:
            seen = served_by(now)  # read while it lives: its cgroup and comm go with it
            self._units[now.identity] = seen.unit
            self._served.setdefault(srv.name, deque(maxlen=SERVED_KEPT)).append(seen)
        if before is None or (now is not None and now.identity == before.identity):
            return False
        if before.identity in self._reported or process_alive(before):
            return False
        self._reported.add(before.identity)
        unit = self._units.pop(before.identity, None)
        task = asyncio.get_running_loop().create_task(self._explain(srv.name, before.pid, unit))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return True

    async def _explain(self, server: str, pid: int, unit: str | None) -> None:
        evidence = await asyncio.to_thread(exit_evidence, pid, unit)
        history = self.history.setdefault(server, ExitHistory())
        history.record(evidence)
        self.telemetry.server_exited(server, evidence, history.crash_loop())

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
