"""`Room`: what kvsidecar knows, per llama-server router, of who is using which of its models right now
(coordinator/swaps.py owns one per router and is its only writer).

- `users`: per model (its server entry's name), the acquires and leases of ours on it, from the moment an
  acquire is let in (`ModelSwaps.enter`) to its lease's release: a model with one is never unloaded by us.
- `leaving`: the models kvsidecar is saving and unloading now: an acquire for one waits until it is gone,
  then loads it again.
- `lock`: one load or unload of ours at a time on the router.
- `changed()` / `wait()`: a waiter takes the current change marker *before* it checks what it waits for
  (no await in between), so a change made after the check always wakes it; nothing polls.
"""

from __future__ import annotations

import asyncio
from collections import Counter as Tally

from kvsidecar.coordinator.caller import Caller


class Room:
    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.users: Tally[str] = Tally()
        self.leaving: set[str] = set()
        self.waiting = 0  # acquires now waiting for room or for an unload to end (status)
        self.max_loaded: int | None = None  # the router's --models-max as last read (0: no limit)
        self._changed = asyncio.Event()

    def marker(self) -> asyncio.Event:
        """The change marker to wait on: set by the next `changed()`."""
        return self._changed

    def changed(self) -> None:
        """A model's users went down, an unload ended, a slot was given back: every waiter looks again."""
        self._changed.set()
        self._changed = asyncio.Event()

    def enter(self, name: str) -> None:
        self.users[name] += 1

    def leave(self, name: str) -> None:
        if self.users[name] > 1:
            self.users[name] -= 1
            return
        self.users.pop(name, None)
        self.changed()

    def free(self, name: str) -> bool:
        """No acquire or lease of ours on the model, and no unload of ours under way."""
        return self.users[name] == 0 and name not in self.leaving

    async def wait(self, marker: asyncio.Event, deadline: float, caller: Caller | None) -> bool:
        """Wait for `marker` (a change since it was taken) until the loop-time `deadline`; False once the
        deadline has passed or the caller is gone."""
        loop = asyncio.get_running_loop()
        remaining = deadline - loop.time()
        if remaining <= 0 or (caller is not None and caller.gone()):
            return False
        waits: set[asyncio.Future[object]] = {asyncio.ensure_future(marker.wait())}
        if caller is not None:
            waits.add(asyncio.ensure_future(caller.wait()))
        self.waiting += 1
        try:
            await asyncio.wait(waits, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        finally:
            self.waiting -= 1
            for w in waits:
                w.cancel()
            await asyncio.gather(*waits, return_exceptions=True)
        return marker.is_set() and not (caller is not None and caller.gone())
