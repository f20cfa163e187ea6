"""`FleetPlane`: the Redis side of fleet mode: one connection, the host registry and the residency map.
Ownership leases and the leader are in ownership.py, on the same connection; the key names are keys.py's;
every call is bounded and its failure handled by the caller's guard (redis_guard.py). Values read back
from Redis are hostile input, read by the one document reader (`kvsidecar.files.documents`).
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import json
import logging
import re
import socket
import time
from collections.abc import Awaitable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar, cast
from urllib.parse import urlsplit

import redis.asyncio as aioredis
import xxhash
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError

from kvsidecar.config import HOST_ID, http_origin
from kvsidecar.files.documents import HOST_RECORD, RESIDENCY
from kvsidecar.fleet.keys import FleetKeys
from kvsidecar.logs import event

RECORD_VERSION = 1
RECORD_REFUSED = "KV_FLEET_RECORD_REFUSED"  # logged when a host record in Redis is not one we write
log = logging.getLogger("kvsidecar.fleet")
T = TypeVar("T")


def awaited(call: Awaitable[T] | T) -> Awaitable[T]:
    """redis-py types a command as `Awaitable[T] | T` (one signature for both clients); on redis.asyncio
    it is always the awaitable."""
    return cast("Awaitable[T]", call)


@dataclass(frozen=True, kw_only=True)
class ServerRecord:
    """One llama-server of a host as the fleet sees it."""

    name: str
    base_url: str
    fingerprint: str | None  # the runtime fingerprint's digest (None until it is complete)
    slots_total: int
    slots_free: int  # held by nobody and holding nothing
    slots_clean: int  # held by nobody, holding a session whose snapshot is current (evictable for free)


@dataclass(frozen=True, kw_only=True)
class HostRecord:
    host_id: str
    advertise_url: str
    version: str
    time: float  # wall clock of the writer at its heartbeat (seconds since the epoch)
    servers: tuple[ServerRecord, ...] = ()
    proxy_url: str | None = None  # its proxy listener, when it runs one

    def to_json(self) -> str:
        return json.dumps(
            {
                "v": RECORD_VERSION,
                "host_id": self.host_id,
                "advertise_url": self.advertise_url,
                "version": self.version,
                "time": self.time,
                "servers": [s.__dict__ for s in self.servers],
                "proxy_url": self.proxy_url,
            },
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str) -> HostRecord | None:
        """None for anything that is not a record we wrote (a peer's newer format, garbage)."""
        try:
            data = HOST_RECORD.read(text)
            if data.get("v") != RECORD_VERSION:
                return None
            servers = tuple(_server(s) for s in data["servers"])
            # What this host will send its token to: a host id of ours, and origins only (scheme, host,
            # port): every URL sent to is one of them plus a path of ours (kvsidecar.config.http_origin).
            # A proxy_url that is there and is not one refuses the whole record, as a bad advertise_url.
            advertise = http_origin(data["advertise_url"])
            raw_proxy = data.get("proxy_url")
            proxy_url = http_origin(raw_proxy) if raw_proxy is not None else None
            if not isinstance(data["host_id"], str) or not HOST_ID.match(data["host_id"]):
                return None
            if advertise is None or (raw_proxy is not None and proxy_url is None):
                return None
            return cls(
                host_id=data["host_id"],
                advertise_url=advertise,
                version=str(data["version"]),
                time=float(data["time"]),
                servers=servers,
                proxy_url=proxy_url,
            )
        except PARSE_ERRORS:
            return None


def _server(data: Any) -> ServerRecord:
    """One server of a host record, every field of its type (a bad one refuses the whole record)."""
    if not isinstance(data, dict):
        raise TypeError("not an object")
    counts = [data["slots_total"], data["slots_free"], data["slots_clean"]]
    if not all(type(c) is int and 0 <= c < 1 << 20 for c in counts):
        raise TypeError("slot counts must be small integers")
    name, base_url, fingerprint = data["name"], data["base_url"], data["fingerprint"]
    if not isinstance(name, str) or not isinstance(base_url, str):
        raise TypeError("name and base_url must be strings")
    if fingerprint is not None and not isinstance(fingerprint, str):
        raise TypeError("fingerprint must be a string")
    return ServerRecord(
        name=name,
        base_url=base_url,
        fingerprint=fingerprint,
        slots_total=counts[0],
        slots_free=counts[1],
        slots_clean=counts[2],
    )


@dataclass(frozen=True, kw_only=True)
class Residency:
    """Where a session key is resident: a slot of a server of a live host."""

    host_id: str
    server: str
    slot: int
    since: float
    sid: str = ""  # session_hash of the session id ("" if unknown): which hosts hold a session's keys


SID = re.compile(r"\A[0-9a-f]{16}\Z")


def session_hash(session_id: str) -> str:
    """What Redis holds of a session id (never the id itself): enough to find the hosts holding it."""
    return xxhash.xxh3_64_hexdigest(b"kvsidecar-session\0" + session_id.encode())


def connect(url: str, *, timeout_s: float, **extra: Any) -> aioredis.Redis:
    """A client that never waits long: one retry (a pooled connection a restarted Redis closed is found
    dead only when used), then the error goes to the caller, whose loop tries again later."""
    client: aioredis.Redis = aioredis.Redis.from_url(
        url,
        decode_responses=True,
        encoding_errors="replace",  # a value that is not UTF-8 is refused by our parsing, never raises
        socket_timeout=timeout_s,
        socket_connect_timeout=timeout_s,
        retry=Retry(NoBackoff(), 1),
        retry_on_error=[RedisConnectionError],  # not a timeout: a hung Redis is not waited for twice
        **extra,
    )
    return client


class FleetPlane:
    """The host registry and the residency map, over one Redis client (the caller owns its lifetime)."""

    def __init__(
        self,
        client: aioredis.Redis,
        *,
        key_prefix: str,
        host_ttl_s: float,
        own_host: str | None = None,
        local_origins: frozenset[str] = frozenset(),
    ) -> None:
        self.redis = client
        self.keys = FleetKeys(key_prefix)
        self.host_ttl_ms = max(1, int(host_ttl_s * 1000))
        self.refused_records = 0  # host records read and refused (not a record we write: forged, garbage)
        self.refused_hosts: set[str] = set()  # refused at the last read (each logged once)
        # The agent's: this host's id and the origins a peer's URLs must never name (its llama-servers): a
        # record that would send this host's calls there is refused. `fleet status` reads with neither.
        self.own_host = own_host
        self.local_origins = local_origins

    async def ping_ms(self) -> float:
        start = time.perf_counter()
        await self.redis.ping()
        return (time.perf_counter() - start) * 1000

    # the host registry -------------------------------------------------------------------------------
    async def register(self, record: HostRecord) -> None:
        """Write this host's record with the host TTL (every heartbeat), and keep its residency alive."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(self.keys.host(record.host_id), record.to_json(), px=self.host_ttl_ms)
            pipe.sadd(self.keys.hosts, record.host_id)
            pipe.pexpire(self.keys.residency(record.host_id), self.host_ttl_ms)
            await pipe.execute()

    async def deregister(self, host_id: str) -> None:
        """A clean stop: this host's record and residency are gone now rather than at their TTL."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(self.keys.host(host_id), self.keys.residency(host_id))
            pipe.srem(self.keys.hosts, host_id)
            await pipe.execute()

    async def live_hosts(self) -> dict[str, HostRecord]:
        """Every host whose record has not expired, by id; ids whose record is gone are pruned."""
        members = await awaited(self.redis.smembers(self.keys.hosts))
        ids = sorted(m for m in members if isinstance(m, str) and HOST_ID.match(m))
        bad = [m for m in members if not isinstance(m, str) or not HOST_ID.match(m)]
        if bad:  # not a host id of ours (written by something else): dropped, never read as a key
            await awaited(self.redis.srem(self.keys.hosts, *bad))
        if not ids:
            return {}
        texts = await self.redis.mget([self.keys.host(h) for h in ids])
        out: dict[str, HostRecord] = {}
        dead = []
        refused: set[str] = set()
        for host_id, text in zip(ids, texts, strict=True):
            record = HostRecord.from_json(text) if isinstance(text, str) else None
            if record is None or record.host_id != host_id:
                dead.append(host_id)
                if text is not None:  # there, and not a record of ours: refused, not merely expired
                    refused.add(host_id)
            else:
                out[host_id] = record
        inward = _inward(out, self.own_host, self.local_origins)
        for host_id in inward:
            del out[host_id]
        self._refused(refused | inward)
        if dead:  # a host that comes back re-adds itself at its next heartbeat
            await awaited(self.redis.srem(self.keys.hosts, *dead))
        return out

    def _refused(self, host_ids: set[str]) -> None:
        """Count refused records; log a host id when its record starts being refused (not every read)."""
        self.refused_records += len(host_ids)
        for host_id in sorted(host_ids - self.refused_hosts):
            event(log, logging.WARNING, "kv.fleet.host_record_refused", host=host_id, code=RECORD_REFUSED)
        self.refused_hosts = host_ids

    # the residency map -------------------------------------------------------------------------------
    @staticmethod
    def _entry(server: str, slot: int, sid: str = "") -> str:
        entry = {"server": server, "slot": slot, "t": time.time(), "sid": sid}
        return json.dumps(entry, separators=(",", ":"))

    async def set_resident(self, host_id: str, key: str, server: str, slot: int, sid: str = "") -> None:
        name = self.keys.residency(host_id)
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(name, key, self._entry(server, slot, sid))
            pipe.pexpire(name, self.host_ttl_ms)
            await pipe.execute()

    async def drop_resident(self, host_id: str, keys: Iterable[str]) -> None:
        gone = list(keys)
        if gone:
            await awaited(self.redis.hdel(self.keys.residency(host_id), *gone))

    async def replace_residency(
        self,
        host_id: str,
        resident: Mapping[str, tuple[str, int]],
        sids: Mapping[str, str] | None = None,
    ) -> None:
        """The whole truth of this host (every heartbeat): repairs any event that was dropped or failed."""
        name = self.keys.residency(host_id)
        sids = sids or {}
        entries = {k: self._entry(s, slot, sids.get(k, "")) for k, (s, slot) in resident.items()}
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(name)
            if resident:
                pipe.hset(name, mapping=entries)
                pipe.pexpire(name, self.host_ttl_ms)
            await pipe.execute()

    async def where(self, key: str, live: Iterable[str] | None = None) -> list[Residency]:
        """The live hosts that hold session key `key` resident (normally one; two for a moment while a
        session moves). Entries of hosts that are not live are ignored."""
        hosts = sorted(live) if live is not None else sorted(await self.live_hosts())
        if not hosts:
            return []
        async with self.redis.pipeline(transaction=False) as pipe:
            for host_id in hosts:
                pipe.hget(self.keys.residency(host_id), key)
            found = await pipe.execute()
        out = []
        for host_id, text in zip(hosts, found, strict=True):
            if text is not None and (entry := _residency(host_id, text)) is not None:
                out.append(entry)
        return out

    async def residency(self, host_id: str) -> dict[str, Residency]:
        """Everything one host holds resident (empty when its map expired with it)."""
        raw = await awaited(self.redis.hgetall(self.keys.residency(host_id)))
        return {k: e for k, v in raw.items() if (e := _residency(host_id, v)) is not None}

    async def holding_session(self, sid: str, live: Iterable[str]) -> set[str]:
        """The live hosts holding any key of the session whose `session_hash` is `sid` in a slot."""
        hosts = sorted(live)
        if not hosts:
            return set()
        async with self.redis.pipeline(transaction=False) as pipe:
            for host_id in hosts:
                pipe.hvals(self.keys.residency(host_id))
            found = await pipe.execute()
        return {
            host_id
            for host_id, values in zip(hosts, found, strict=True)
            if any((e := _residency(host_id, v)) is not None and e.sid == sid for v in values or [])
        }

    async def sessions_per_host(self, hosts: Iterable[str]) -> dict[str, int]:
        ids = sorted(hosts)
        async with self.redis.pipeline(transaction=False) as pipe:
            for host_id in ids:
                pipe.hlen(self.keys.residency(host_id))
            counts = await pipe.execute()
        return {h: int(n) for h, n in zip(ids, counts, strict=True)}


# What reading a value from Redis may raise: the document reader's refusal (a ValueError), and a field of
# the wrong type or missing (it is input: never past here).
PARSE_ERRORS = (ValueError, TypeError, KeyError, OverflowError, AttributeError)


def origin_of(url: str) -> str | None:
    """`scheme://host:port` of any http(s) URL (a server's base_url may have a path), default ports filled."""
    try:
        parts = urlsplit(url)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
        host = parts.hostname
    except ValueError:
        return None
    if port is None or not host:
        return None
    return f"{parts.scheme}://{'[' + host + ']' if ':' in host else host}:{port}"


def same_endpoint(a: str, b: str) -> bool:
    """Two origins naming the same host and port (every loopback spelling alike; the scheme aside)."""
    return _endpoint(a) == _endpoint(b)


def _endpoint(origin: str) -> tuple[str, int]:
    """(host, port) of an origin, every spelling of this machine's own loopback spelled one way
    ("loopback"): a loopback address (IPv4-mapped too), the unspecified address (a connection to 0.0.0.0
    or [::] reaches this machine), and the names this machine resolves to loopback without DNS."""
    host, _, port = origin.partition("://")[2].rpartition(":")
    bare = host.strip("[]").lower()
    try:
        ip = ipaddress.ip_address(bare)
    except ValueError:
        bare = bare.rstrip(".")  # a fully qualified spelling ("localhost.") is the same name
        loop = bare in _loopback_names() or bare.endswith(".localhost")  # RFC 6761 §6.3
    else:
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped  # [::ffff:127.0.0.1] is 127.0.0.1 (Python 3.11 does not say loopback)
        loop = ip.is_loopback or ip.is_unspecified
    return ("loopback" if loop else bare, int(port))


@functools.cache
def _loopback_names() -> frozenset[str]:
    """Host names that reach this machine's loopback: the usual ones, this machine's own name, and those
    /etc/hosts maps to a loopback address (read once)."""
    names = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback", socket.gethostname()}
    with contextlib.suppress(OSError, UnicodeDecodeError):
        for line in Path("/etc/hosts").read_text(encoding="utf-8").splitlines()[:10_000]:
            fields = line.partition("#")[0].split()
            try:
                loop = len(fields) > 1 and ipaddress.ip_address(fields[0].partition("%")[0]).is_loopback
            except ValueError:
                continue
            if loop:
                names.update(fields[1:])
    return frozenset(n.lower().rstrip(".") for n in names if n)


def _inward(records: Mapping[str, HostRecord], own: str | None, local: Iterable[str]) -> set[str]:
    """The hosts (other than this one) whose advertise_url or proxy_url names a llama-server: one of any
    live record, or one of this host's (`local`), any loopback spelling alike: forwarding there would send
    a hook call or an unpinned request where only kvsidecar may speak to a slot."""
    banned = {_endpoint(o) for o in local}
    for record in records.values():
        banned |= {_endpoint(o) for s in record.servers if (o := origin_of(s.base_url)) is not None}
    return {
        host_id
        for host_id, record in records.items()
        if host_id != own
        and any(_endpoint(u) in banned for u in (record.advertise_url, record.proxy_url) if u is not None)
    }


def _residency(host_id: str, text: str) -> Residency | None:
    try:
        if not isinstance(text, str):
            return None
        data = RESIDENCY.read(text)
        slot, since, sid = data["slot"], data["t"], data.get("sid", "")
        if type(slot) is not int or not 0 <= slot < 1 << 20 or not isinstance(since, int | float):
            return None
        sid = sid if isinstance(sid, str) and SID.match(sid) else ""
        return Residency(host_id=host_id, server=str(data["server"]), slot=slot, since=float(since), sid=sid)
    except PARSE_ERRORS:
        return None
