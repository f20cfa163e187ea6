"""Session ownership leases with fencing tokens, and the leader lease: each an atomic Lua script on Redis.

Ownership of session key K (the host allowed to hold K in a slot and to commit its snapshots):

- `take(K, H, ttl)`: if nobody holds K, H takes it with a **new fencing token**; if H holds it, the lease is
  renewed and the token is **unchanged**; if another host holds it, the answer names that host and its
  token and nothing changes. One script, so two hosts racing for K cannot both win.
- Tokens of a key only ever grow: every new take increments K's counter (INCR), and the counter is never
  set below Redis' own clock in milliseconds, so even a Redis that lost its data (restarted without
  persistence) hands out tokens above every earlier one, as long as fewer than 1000 takes of one key
  happen per second (the counter is a floor of the clock, the clock a floor of the counter).
- `is_current(K, H, T)`: True only while H holds K under token T. A holder that was paused (SIGSTOP, GC,
  a partition) past its lease keeps its old token; once anyone took K again (H itself included) the old
  token is no longer current, and every later take has a higher token.

What this guarantees, and what it does not: Redis tells a holder whether its token is still the current
one at the moment it asks. It cannot stop a paused holder that already checked from writing afterwards.
That is closed on the storage side (`kvsidecar.store.fence`): every manifest commit and delete carries the
token and the store refuses a token lower than the highest it has recorded for K (the classic fencing rule).

A holder whose host record has expired (the host stopped heartbeating: dead, paused or partitioned) loses
the key to the next take at once, without waiting for its lease to run out; `force` takes it from a live
holder that cannot be reached. Either way the old holder's token is below the new one, so the store
refuses whatever it writes afterwards.

The leader lease (fleet-wide retention): `campaign(H, ttl)` takes the leader key if it is free (SET NX PX)
or renews it if H holds it (compare-and-renew); `leader()` names the current leader, or None.
"""

from __future__ import annotations

from dataclasses import dataclass

import redis.asyncio as aioredis

from kvsidecar.fleet.keys import FleetKeys

# KEYS[1] owner key, KEYS[2] fence counter, KEYS[3] the holder's host record key prefix ("P:host:");
# ARGV[1] host id, ARGV[2] ttl in ms, ARGV[3] "1" to take over from a live holder (it cannot be reached).
# A holder whose host record has expired (a dead host) is taken over without asking.
# Returns {granted (0/1), token, holder, new (0/1)}.
_TAKE = """
local cur = redis.call('GET', KEYS[1])
local sep = cur and string.find(cur, '|', 1, true)
-- a value that is not "<host>|<digits>" holds nothing: it is taken over (fencing covers whoever wrote it)
if sep and string.match(string.sub(cur, sep + 1), '^%d+$') and #cur - sep <= 18 then
  local holder = string.sub(cur, 1, sep - 1)
  local token = string.sub(cur, sep + 1)
  if holder == ARGV[1] then
    redis.call('PEXPIRE', KEYS[1], ARGV[2])
    return {1, token, holder, 0}
  end
  if ARGV[3] ~= '1' and redis.call('EXISTS', KEYS[3] .. holder) == 1 then
    return {0, token, holder, 0}
  end
end
local t = redis.call('INCR', KEYS[2])
local now = redis.call('TIME')
local floor = tonumber(now[1]) * 1000 + math.floor(tonumber(now[2]) / 1000)
if t < floor then
  t = floor
  redis.call('SET', KEYS[2], string.format('%d', t))
end
local token = string.format('%d', t)
redis.call('SET', KEYS[1], ARGV[1] .. '|' .. token, 'PX', ARGV[2])
return {1, token, ARGV[1], 1}
"""

# KEYS[1] owner key; ARGV[1] "<host>|<token>". 1 if released.
_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""

# KEYS[1] leader key; ARGV[1] host id, ARGV[2] ttl in ms. 1 if ARGV[1] is the leader afterwards.
_CAMPAIGN = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  return 1
end
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""


@dataclass(frozen=True, kw_only=True)
class Ownership:
    """The answer of a take: granted or not, the current token of the key, who holds it."""

    granted: bool
    token: int
    holder: str
    new: bool  # a new take (a new token); False: a renewal, or refused


MAX_TOKEN_DIGITS = 18  # tokens are Redis' clock in ms (13 digits) and up; a fence file records < 2**63


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


class Leases:
    """The ownership and leader scripts over one Redis client, under the fleet's key prefix."""

    def __init__(self, client: aioredis.Redis, *, key_prefix: str) -> None:
        self.redis = client
        self.keys = FleetKeys(key_prefix)
        self._take = client.register_script(_TAKE)
        self._release = client.register_script(_RELEASE)
        self._campaign = client.register_script(_CAMPAIGN)

    def _keys(self, key: str) -> list[str]:
        return [self.keys.owner(key), self.keys.fence(key)]

    async def take(self, key: str, host_id: str, ttl_s: float, *, force: bool = False) -> Ownership:
        """Take or renew ownership of session key `key` for `host_id` (see the module's guarantee). A holder
        whose host is no longer live loses the key at once; `force`: take it from a live holder too (it
        cannot be reached; fencing keeps its later writes out)."""
        keys = [*self._keys(key), self.keys.host_prefix]
        args: list[str | int] = [host_id, _ms(ttl_s), "1" if force else "0"]
        granted, token, holder, new = await self._take(keys=keys, args=args)
        value = int(token) if str(token).isdigit() and len(str(token)) <= MAX_TOKEN_DIGITS else None
        if value is None:  # a counter someone set beyond what a fence file records: nobody gets the key
            return Ownership(granted=False, token=0, holder=str(holder), new=False)
        return Ownership(granted=bool(int(granted)), token=value, holder=str(holder), new=bool(int(new)))

    async def is_current(self, key: str, host_id: str, token: int) -> bool:
        """Whether `host_id` holds `key` under `token` now (advisory: see the module docstring)."""
        value = await self.redis.get(self._keys(key)[0])
        return bool(value == f"{host_id}|{token}")

    async def holder(self, key: str) -> Ownership | None:
        """The current holder, or None (also for a value that is not one of ours: it holds nothing)."""
        value = await self.redis.get(self._keys(key)[0])
        if value is None:
            return None
        holder, sep, token = str(value).rpartition("|")
        if not sep or not holder or not token.isdigit() or len(token) > MAX_TOKEN_DIGITS:
            return None
        return Ownership(granted=False, token=int(token), holder=holder, new=False)

    async def release(self, key: str, host_id: str, token: int) -> bool:
        """Give up `key` if `host_id` still holds it under `token` (a stale release changes nothing)."""
        done = await self._release(keys=self._keys(key)[:1], args=[f"{host_id}|{token}"])
        return bool(int(done))

    # the leader --------------------------------------------------------------------------------------
    async def campaign(self, host_id: str, ttl_s: float) -> bool:
        """Become the leader if there is none, or stay it; True if `host_id` leads now."""
        return bool(int(await self._campaign(keys=[self.keys.leader], args=[host_id, _ms(ttl_s)])))

    async def leader(self) -> str | None:
        value = await self.redis.get(self.keys.leader)
        return None if value is None else str(value)

    async def resign(self, host_id: str) -> bool:
        """Step down now (a clean stop) rather than at the lease's end."""
        return bool(int(await self._release(keys=[self.keys.leader], args=[host_id])))
