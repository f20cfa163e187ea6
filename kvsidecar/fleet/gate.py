"""`FleetGate`: the right to write a session key's files, in fleet mode (see kvsidecar.coordinator.ownership).

A claim takes (or renews) the key's ownership lease on Redis and then records the lease's fencing token in
the shared store's fence file for the key (`FenceFiles.advance`). The value that file held before tells
whether this host's copy of the key is current: it is when the recorded token is the one this host last
held (nobody else owned the key in between); otherwise another host did, and the copy is stale.

From then on the store checks every write and delete of the key against the token this host holds
(`token_for`): a host paused past its lease, whose key was taken over meanwhile, finds a higher token
recorded and writes nothing.

Without Redis (down, or not answered yet) a host keeps writing only the keys whose recorded token is still
its own; it takes no new key, so two hosts never both write one (a session then costs a cold prefill or a
restore, never a wrong answer).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from kvsidecar.config import FleetConfig
from kvsidecar.coordinator.ownership import Claim, KeyOwnership
from kvsidecar.errors import KvError
from kvsidecar.fleet.ownership import Leases
from kvsidecar.fleet.plane import FleetPlane
from kvsidecar.fleet.redis_guard import RedisDown, RedisGuard
from kvsidecar.logs import event
from kvsidecar.store.fence import FenceFiles

log = logging.getLogger("kvsidecar.fleet")


class RedisLink(Protocol):
    """What the gate and the leader's retention need of the agent (`FleetAgent`, which builds the gate and
    shows its counters): this host's id, whether Redis answers, the calls to it and the one guard every
    call runs in (`redis`). Typed here so that the gate never imports the agent."""

    host_id: str
    settings: FleetConfig
    redis: RedisGuard
    redis_up: bool
    is_leader: bool
    leases: Leases
    plane: FleetPlane


class FleetGate:
    def __init__(self, agent: RedisLink, fence_for: FenceFactory) -> None:
        self.agent = agent
        self.tokens: dict[str, int] = {}  # key -> the token this host holds (its writes carry it)
        self.fence = fence_for(self.token_for)
        self.taken_over = 0  # claims that found another host had owned the key since (stale copies)
        self._claiming: dict[str, asyncio.Lock] = {}

    def token_for(self, key: str) -> int | None:
        return self.tokens.get(key)

    async def claim(self, key: str, *, force: bool = False, keep: bool = False) -> Claim:
        """One claim of `key` at a time on this host (a save's and an acquire's must not interleave: one
        could erase the token the other just took, or miss that the copy is stale)."""
        async with self._claiming.setdefault(key, asyncio.Lock()):  # one small lock per key ever claimed
            return await self._claim(key, force=force, keep=keep)

    async def _claim(self, key: str, *, force: bool, keep: bool) -> Claim:
        agent = self.agent
        if not agent.redis_up:
            return await self._without_redis(key)
        if keep and not await self._still_mine(key):
            return Claim(write=False, stale=True)
        try:
            async with agent.redis.guarded(2):
                own = await agent.leases.take(
                    key, agent.host_id, agent.settings.owner_lease_ttl_s, force=force
                )
        except RedisDown:  # Redis went away mid-call
            return await self._without_redis(key)
        if not own.granted:
            self.tokens.pop(key, None)
            return Claim(write=False, stale=True, holder=own.holder)
        try:
            before = await asyncio.to_thread(self.fence.advance, key, own.token)
        except KvError as exc:
            event(log, logging.WARNING, "kv.fleet.fence_unusable", snapshot=key[:8], error=exc.code)
            self.tokens.pop(key, None)
            return Claim(write=False, stale=True)
        if before > own.token:  # the store saw a newer token than Redis hands out (Redis lost its data
            self.tokens.pop(key, None)  # and its clock went back): fail closed, write nothing
            return Claim(write=False, stale=True)
        # stale: another host recorded a token since this host's (nothing is newer than this host's copy
        # when no host ever recorded one)
        stale = before != 0 and before != self.tokens.get(key)
        self.tokens[key] = own.token
        if stale:
            self.taken_over += before != 0
        return Claim(write=True, stale=stale)

    async def let_go(self, key: str, token: int | None, *, unless: Callable[[], bool]) -> None:
        """Give a key's ownership back (the leader, after retention deleted it), if this host still holds
        it under `token` and `unless()` is false (it did not start serving the key meanwhile); best effort.
        Under the key's claim lock: never between another claim's steps."""
        async with self._claiming.setdefault(key, asyncio.Lock()):
            if token is None or self.tokens.get(key) != token or unless():
                return
            del self.tokens[key]
            if not self.agent.redis_up:
                return
            with contextlib.suppress(RedisDown):  # the lease ends at its TTL
                async with self.agent.redis.guarded(2):
                    await self.agent.leases.release(key, self.agent.host_id, token)

    async def _still_mine(self, key: str) -> bool:
        """This host holds a token for `key` and it is still the one recorded (nobody took the key since)."""
        mine = self.tokens.get(key)
        try:
            if mine is not None and await asyncio.to_thread(self.fence.recorded, key) == mine:
                return True
        except KvError:
            pass
        self.tokens.pop(key, None)
        return False

    async def _without_redis(self, key: str) -> Claim:
        mine = self.tokens.get(key)
        try:
            recorded = await asyncio.to_thread(self.fence.recorded, key)
        except KvError:
            return Claim(write=False, stale=True)
        if mine is not None and mine == recorded:
            return Claim(write=True)
        self.tokens.pop(key, None)
        return Claim(write=False, stale=True)


if TYPE_CHECKING:
    FenceFactory = Callable[[Callable[[str], int | None]], FenceFiles]


class LeaderRetention:
    """Retention in fleet mode (kvsidecar.retention.FleetRetention): the leader alone runs it, over the whole
    shared directory, against the configured limits (the fleet-wide quota); every deletion is fenced."""

    def __init__(
        self,
        agent: RedisLink,
        gate: FleetGate,
        reload_all: Callable[[], object],
        *,
        ownership: KeyOwnership,
    ) -> None:
        self.agent = agent
        self.gate = gate
        self.reload_all = reload_all
        self.ownership = ownership  # the coordinator's: what this host holds, and its claims
        self._taken: dict[str, int | None] = {}  # key -> the token retention's claim held

    async def prepare(self) -> set[str] | None:
        agent = self.agent
        if not agent.redis_up or not agent.is_leader:
            return None
        try:
            async with agent.redis.guarded(4):
                live = await agent.plane.live_hosts()
                held: set[str] = set()
                for host_id in live:
                    held |= set(await agent.plane.residency(host_id))
        except RedisDown:
            return None
        await asyncio.to_thread(self.reload_all)  # what every host committed, as it is on disk now
        return held

    async def claim(self, key: str) -> bool:
        ownership = self.ownership
        if ownership.held_here(key):
            return False  # resident or busy on this host (the leader serves sessions too)
        if not (await ownership.claim(key)).write:
            return False
        self._taken[key] = self.gate.tokens.get(key)
        return True

    async def done(self, key: str) -> None:
        ownership = self.ownership
        token = self._taken.pop(key, None)
        await self.gate.let_go(key, token, unless=lambda: ownership.held_here(key))

    def leads(self) -> bool:
        return self.agent.redis_up and self.agent.is_leader
