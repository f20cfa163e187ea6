"""Hostile and racing cases of fleet mode (issue 18), from its second and third adversarial reviews.

The second: a proxied request to a stopped peer, a purge that deletes nothing, the leader's retention
letting go of a session it serves, an auxiliary lease released through another host, Redis values the
parsers must survive, a fan-out that must not wait for a host holding nothing, a shared directory that is
the snapshot directory behind a link, an owner token too long to record. The third: the staging-name
commit (a file swapped in after its check is never published), the session-scoped fan-out (a purge reaches
the live host that owns a session no slot holds), the proxy's wait on a peer (a Redis blip does not give up
a healthy peer). Each failed on the tree it was written against."""

from __future__ import annotations

import asyncio
import os
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
from starlette.types import Receive, Scope, Send

from kvsidecar.api.routes import create_app
from kvsidecar.config import config_from_mapping
from kvsidecar.config.errors import ConfigInvalid
from kvsidecar.errors import MetadataIO, NotFound
from kvsidecar.fleet.gate import LeaderRetention
from kvsidecar.fleet.plane import HostRecord, awaited
from kvsidecar.fleet.routing import FleetRouter
from kvsidecar.metrics import Metrics
from kvsidecar.proxy.app import Proxy
from kvsidecar.proxy.conversations import ANONYMOUS
from kvsidecar.proxy.peers import PeerProxies
from kvsidecar.retention.job import RetentionJob
from kvsidecar.retention.plan import Deletion
from kvsidecar.store.saving import SavePlan
from kvsidecar.store.snapshots import SnapshotStore
from kvsidecar.testing.poll import until
from tests.fleet_helpers import BoundSocket
from tests.unit.fleet.test_gate import Host, key_of, manifest_bytes, start_host

__all__ = ["start_host"]  # the fixture, shared with fleet/test_gate.py


async def purge_everywhere(router: FleetRouter, host: Host, *, every_host: bool = False) -> dict[str, Any]:
    """DELETE /v1/sessions/A through `router`'s fan-out, served on `host` (every_host: as the route asks)."""
    return await router.everywhere(
        "A",
        "DELETE",
        "/v1/sessions/A",
        None,
        0,
        lambda: host.coordinator.purge("A"),
        ("purged", "bytes_freed"),
        every_host=every_host,
    )


@contextmanager
def silent_listener() -> Iterator[str]:
    """A URL whose kernel completes the TCP handshake and then nothing ever answers: a SIGSTOPped host."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen(16)  # never accepted
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        sock.close()


async def fake_peer(host: Host, host_id: str, url: str, *, ttl_ms: int, proxy: bool = False) -> None:
    """A host record for `host_id` (advertise URL, or proxy URL, `url`) that lives `ttl_ms`."""
    record = HostRecord(
        host_id=host_id,
        advertise_url=url,
        version="x",
        time=time.time(),
        proxy_url=url if proxy else None,
    )
    await host.agent.client.set(f"t:host:{host_id}", record.to_json(), px=ttl_ms)
    await awaited(host.agent.client.sadd("t:hosts", host_id))
    await until(lambda: host_id in host.agent.hosts, what=f"{host.name} to see {host_id} live")


# HIGH ------------------------------------------------------------------------------------------------
async def test_a_proxied_request_for_a_host_that_stopped_is_served_here_once_it_is_no_longer_live(
    start_host: Callable[..., Awaitable[Host]],
) -> None:
    """563e529 made the hook API race a forward against the peer's liveness (`_while_live`), but not the
    proxy: `_to_peer` sends the client's request to the owner's proxy and waits `proxy.upstream_timeout_s`
    (600 s by default) of silence before it even asks `_peer_working`; then it answers 504 (an
    UpstreamTimeout is never "unreachable"), and the session is not taken over. A SIGSTOPped peer's kernel
    completes the handshake, so the client hangs 10 minutes and then gets an error, where the hook API
    serves the same session here after `host_ttl_s`."""
    h1 = await start_host("h1")
    k = key_of("A", ANONYMOUS)  # a proxy client without a credential: its session's key is in that scope
    router = FleetRouter(h1.agent, h1.coordinator, token=None)
    proxy = Proxy(h1.coordinator, h1.coordinator.config, token=None, check_host=False, fleet=lambda: router)
    served_here: list[str] = []

    class LocalLlama:  # stands in for this host's llama-server: what is served here answers at once
        async def forward(
            self, scope: Scope, out: Any, receive: Receive, send: Send, **_: Any
        ) -> tuple[str, None]:
            served_here.append(out.path)
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}", "more_body": False})
            return "ok", None

    proxy.forwarder = LocalLlama()  # type: ignore[assignment]
    with silent_listener() as url:
        await fake_peer(h1, "h9", url, ttl_ms=1500, proxy=True)  # h9 stops heartbeating now
        await h1.agent.client.set(f"t:owner:{k}", "h9|5", px=60_000)
        transport = httpx.ASGITransport(app=proxy)
        try:
            async with httpx.AsyncClient(transport=transport, base_url="http://127.0.0.1") as client:
                post = client.post(
                    "/completion",
                    json={"model": "m", "prompt": "hi"},
                    headers={"X-Session-Id": "A"},
                    timeout=None,
                )
                answer = await asyncio.wait_for(post, timeout=15)  # TimeoutError today (600 s)
        finally:
            await proxy.aclose()
            await router.aclose()
    assert answer.status_code == 200 and served_here == ["/completion"]
    holder = await h1.agent.leases.holder(k)
    assert holder is not None and holder.holder == "h1"  # taken over, as the hook API does


async def test_a_purge_deletes_a_session_that_only_the_shared_directory_still_knows(
    start_host: Callable[..., Awaitable[Host]], tmp_path: Path
) -> None:
    """`Coordinator.purge` looks for the session in this host's memory (`sessions.known`: its runtimes and
    the manifests it loaded). A host that started before another host committed the session never loaded
    that manifest: once the committing host is gone, `DELETE /v1/sessions/A` answers 404 on every host, the
    snapshot stays in the shared directory, and the next acquire restores the conversation the client
    asked to delete (the claim re-reads the shared manifest)."""
    h1, h2 = await start_host("h1"), await start_host("h2")
    k = key_of("A")
    await h2.h.turn("A")
    assert (await h2.coordinator.save("A"))["saved"] == 1
    await h2.agent.aclose()  # h2 leaves the fleet for good (its lease's holder is no longer live)
    await until(lambda: "h2" not in h1.agent.hosts, what="h2 gone from h1's view")
    router = FleetRouter(h1.agent, h1.coordinator, token=None)
    try:
        answer: dict[str, Any] | str = await purge_everywhere(router, h1)
    except NotFound as exc:
        answer = f"404 {exc.message}"
    finally:
        await router.aclose()
    assert manifest_bytes(tmp_path, k) is None, f"purge answered {answer!r}; the manifest is still shared"
    result, *_ = await h1.h.turn("A")
    assert result.outcome.value != "restored", "the purged conversation was restored"


async def test_a_purge_that_deleted_nothing_does_not_report_the_session_purged(
    start_host: Callable[..., Awaitable[Host]], tmp_path: Path
) -> None:
    """Each host purges only under a claim; when the lease is held by a host that is live but stopped
    (SIGSTOP: live until `host_ttl_s`), every claim is refused, the stopped host's forward is given up
    once it drops out, and the answer is still `{"purged": 1, "bytes_freed": 0}` with the manifest and
    the files left in place: restored by the next acquire after the lease expires."""
    h1 = await start_host("h1")
    k = key_of("A")
    await h1.h.turn("A")
    assert (await h1.coordinator.save("A"))["saved"] == 1
    router = FleetRouter(h1.agent, h1.coordinator, token=None)
    with silent_listener() as url:
        await fake_peer(h1, "h9", url, ttl_ms=1500)  # h9 stops heartbeating now
        await h1.agent.client.set(f"t:owner:{k}", f"h9|{10**15}", px=60_000)  # h9 took A, then stopped
        try:
            answer = await asyncio.wait_for(purge_everywhere(router, h1), timeout=15)
        finally:
            await router.aclose()
    kept = manifest_bytes(tmp_path, k) is not None
    assert not (kept and answer["purged"]), f"answered {answer} while the session's files were kept"


async def test_the_leaders_retention_does_not_let_go_of_a_session_it_serves_meanwhile(
    start_host: Callable[..., Awaitable[Host]],
) -> None:
    """`LeaderRetention.done` → `FleetGate.let_go` pops `tokens[key]` and releases the Redis lease without
    the gate's per-key claim lock and without looking at what happened since the retention claim. An
    acquire of that session on the leader while the deletion runs (its claim is a renewal of the same
    token) loses its token: the leader serves the session with no right to write it (every save is
    skipped as `not_owner`, its turns are lost) while Redis says nobody owns it."""
    h1, h2 = await start_host("h1"), await start_host("h2")
    await until(lambda: h1.agent.is_leader or h2.agent.is_leader, what="a leader")
    leader, other = (h1, h2) if h1.agent.is_leader else (h2, h1)
    k = key_of("B")
    await other.h.turn("B")
    assert (await other.coordinator.save("B"))["saved"] == 1
    await other.h.turn("C")  # evicts B (one slot): B is resident nowhere
    assert await other.agent.leases.release(k, other.name, other.gate.tokens[k])
    config = leader.coordinator.config.retention.model_copy(update={"max_age_days": None})
    job = RetentionJob(
        store=leader.store,
        config=config,
        metrics=Metrics(),
        protected_keys=leader.coordinator.protected_keys,
        fleet=LeaderRetention(
            leader.agent, leader.gate, leader.store.reload_all, ownership=leader.coordinator.ownership
        ),
    )
    job.policy = type(job.policy)(max_total_bytes=1)
    entered, go = threading.Event(), threading.Event()
    delete = job._delete

    def slow_delete(d: Deletion) -> bool:
        if d.file.key == k:
            entered.set()
            go.wait(10)
        return delete(d)

    job._delete = slow_delete  # type: ignore[method-assign]
    run = asyncio.create_task(job.run())
    await until(entered.is_set, what="retention to be deleting B")
    await leader.h.turn("B")  # a turn of B lands on the leader meanwhile (the routing sends it there)
    go.set()
    await run
    holder = await leader.agent.leases.holder(k)
    assert leader.gate.tokens.get(k) is not None, "the leader serves B and holds no token for it"
    assert holder is not None and holder.holder == leader.name
    assert (await leader.coordinator.save("B"))["saved"] == 1


async def test_an_auxiliary_lease_can_be_released_through_any_host(
    start_host: Callable[..., Awaitable[Host]],
) -> None:
    """FLEET.md: a release "may be sent to any host: it follows the lease". `POST /v1/acquire` (titles,
    compaction) is not wrapped by the router: its lease id is not `<host>~<id>`, so a release that reaches
    another host answers 404 there, and the auxiliary lease (the reserved aux slot, or a session's slot
    whose owner was saved for it) stays held on the first host until `api.lease_ttl_s`."""
    api = BoundSocket()
    url = api.url
    h1 = await start_host("h1", advertise_url=url)
    h2 = await start_host("h2")
    await until(lambda: "h1" in h2.agent.hosts, what="h2 to see h1")
    r1 = FleetRouter(h1.agent, h1.coordinator, token=None)
    r2 = FleetRouter(h2.agent, h2.coordinator, token=None)
    app1 = create_app(h1.coordinator, check_host=False, fleet=lambda: r1)
    app2 = create_app(h2.coordinator, check_host=False, fleet=lambda: r2)
    try:
        async with api.serving(app1, what="h1's hook API"):
            body = {"provider": "local", "model": "m", "purpose": "title"}
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app1), base_url=url) as c1:
                lease = (await c1.post("/v1/acquire", json=body)).json()
            assert lease["lease_id"]
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app2), base_url=url) as c2:
                done = await c2.post(f"/v1/leases/{lease['lease_id']}/release", json={"status": "ok"})
            assert done.status_code == 200, done.text
            assert h1.coordinator.status()["leases"] == 0
    finally:
        await r1.aclose()
        await r2.aclose()


# MEDIUM ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "entry",
    [
        b'{"server":"local","slot":1e400,"t":0}',  # int(inf): OverflowError
        b"[" * 100_000,  # json.loads: RecursionError
        b'{"server":"loc\xffal","slot":0,"t":0}',  # redis-py decode_responses: UnicodeDecodeError
    ],
    ids=["overflow", "deep", "not-utf8"],
)
async def test_a_malformed_residency_entry_neither_breaks_routing_nor_the_leaders_retention(
    start_host: Callable[..., Awaitable[Host]], entry: bytes
) -> None:
    """`_residency` catches ValueError/TypeError/KeyError only; and redis-py decodes every reply as UTF-8,
    raising UnicodeDecodeError (a ValueError, but outside the parser's try). Either escapes `owner_of`
    (not in DOWN): every acquire of that session answers 500 on every host; and the leader's
    `prepare` (every host's residency) raises, so retention never runs."""
    h1 = await start_host("h1")
    k = key_of("A")
    with silent_listener() as url:
        await fake_peer(h1, "h9", url, ttl_ms=60_000)
        await awaited(h1.agent.client.hset("t:res:h9", k, entry))  # type: ignore[arg-type]
        router = FleetRouter(h1.agent, h1.coordinator, token=None)
        try:
            await router.owner_of(k)
            await h1.agent.plane.residency("h9")
        finally:
            await router.aclose()


async def test_an_owner_value_that_is_not_utf8_does_not_fail_the_acquire(
    start_host: Callable[..., Awaitable[Host]],
) -> None:
    """563e529 parses owner values defensively after the GET, but the GET itself raises
    UnicodeDecodeError on bytes that are not UTF-8 (decode_responses=True): `owner_of` raises, and every
    acquire of that session answers 500 on every host."""
    h1 = await start_host("h1")
    k = key_of("A")
    await h1.agent.client.set(f"t:owner:{k}", b"h9\xff|5")
    router = FleetRouter(h1.agent, h1.coordinator, token=None)
    try:
        await router.owner_of(k)
    finally:
        await router.aclose()


@pytest.mark.parametrize("poison", ["member-not-utf8", "record-too-deep"])
async def test_one_bad_host_entry_does_not_freeze_every_hosts_view_of_the_fleet(
    start_host: Callable[..., Awaitable[Host]], poison: str
) -> None:
    """`live_hosts` reads the host set and every record: a member that is not UTF-8 (UnicodeDecodeError
    from redis-py) or a record nested too deep (RecursionError: `from_json` catches ValueError, TypeError
    and KeyError) raises out of the heartbeat after the register and before `self.hosts` is updated. The
    heartbeat logs `heartbeat_failed` and stays "up": every host's live view is frozen for good, so a host
    that stops stays live (forwards to it wait `forward_timeout_s`, `_while_live` never sees it go), and a
    new one is never seen."""
    h1, h2 = await start_host("h1"), await start_host("h2")
    await until(lambda: "h2" in h1.agent.hosts, what="h1 to see h2")
    if poison == "member-not-utf8":
        await awaited(h1.agent.client.sadd("t:hosts", b"\xff"))
    else:
        await h1.agent.client.set("t:host:h8", "[" * 100_000)
        await awaited(h1.agent.client.sadd("t:hosts", "h8"))
    beats = h1.agent.heartbeats
    await h2.agent.aclose()  # h2 stops cleanly: deregistered at once
    await until(lambda: "h2" not in h1.agent.hosts, timeout_s=5, what="h1 to see h2 gone")
    assert h1.agent.heartbeats > beats


async def test_a_fan_out_does_not_wait_for_a_host_that_holds_nothing_of_the_session(
    start_host: Callable[..., Awaitable[Host]],
) -> None:
    """`everywhere` (events, save, invalidate, purge) calls every live host and waits for all of them:
    563e529 bounds a peer by its liveness, but a live host whose API does not answer (its listener
    saturated, a hung handler; its heartbeat, on Redis, goes on) delays every session's flush on every host
    by `forward_timeout_s` (600 s), although it holds neither the session's lease nor its slot."""
    h1 = await start_host("h1", forward_timeout_s=120)
    with silent_listener() as url:
        await fake_peer(h1, "h9", url, ttl_ms=60_000)  # live, holds nothing, never answers
        router = FleetRouter(h1.agent, h1.coordinator, token=None)

        async def serve() -> dict[str, Any]:
            return {"saved": 0}

        try:
            answer = await asyncio.wait_for(
                router.everywhere(
                    "A", "POST", "/v1/sessions/A/events", {"type": "flush"}, 0, serve, ("saved",)
                ),
                timeout=15,
            )  # TimeoutError today: 120 s here, 600 s by default
        finally:
            await router.aclose()
    assert answer == {"saved": 0}


def _linked_shared_dir(tmp_path: Path) -> tuple[Path, Path]:
    snaps = tmp_path / "snaps"
    snaps.mkdir()
    os.chmod(snaps, 0o2770)  # what install-systemd sets up: llama-server writes through the group
    link = tmp_path / "meta-link"
    link.symlink_to(snaps)
    return snaps, link


def test_a_shared_dir_that_is_the_snapshot_dir_behind_a_link_is_refused(tmp_path: Path) -> None:
    """`_nested` compares `os.path.abspath`s; install-systemd's `nested_problems` also looks where links
    lead (realpath), the config check does not: a `fleet.shared_dir` that is a link to the snapshot
    directory (or to state_dir) passes."""
    snaps, link = _linked_shared_dir(tmp_path)
    data = {
        "state_dir": str(tmp_path / "state"),
        "servers": {"local": {"snapshot_dir": str(snaps)}},
        "fleet": {"enabled": True, "host_id": "h1", "shared_dir": str(link)},
    }
    with pytest.raises(ConfigInvalid) as caught:
        config_from_mapping(data)
    assert any(p.startswith("fleet.shared_dir") for p in caught.value.problems)


def test_a_store_whose_shared_dir_resolves_to_the_snapshot_dir_keeps_the_llama_servers_access(
    tmp_path: Path,
) -> None:
    """What such a config does at start: `StoreLayout.open` tightens the metadata directory as private
    (0700) before it looks at the snapshot directories, so the snapshot directory loses the group access
    llama-server writes through (2770 -> 0700): every save fails from then on."""
    snaps, link = _linked_shared_dir(tmp_path)
    store = SnapshotStore(state_dir=tmp_path / "state", snapshot_dirs={"local": snaps}, shared_dir=link)
    with pytest.raises(MetadataIO, match=r"fleet\.shared_dir"):  # refused at start, before any chmod
        store.open()
    assert (snaps.stat().st_mode & 0o7777) == 0o2770


# LOW -------------------------------------------------------------------------------------------------
async def test_an_owner_token_too_long_to_record_does_not_lock_the_session_for_good(
    start_host: Callable[..., Awaitable[Host]],
) -> None:
    """`holder()` caps a token at 20 digits, the take script does not: `<me>|<40 digits>` is renewed as
    this host's, `advance` records the 40 digits, and the fence file is then over `_MAX_BYTES`: it reads
    as UNREADABLE, and no host ever writes that session again until an operator edits the fence file."""
    h1 = await start_host("h1")
    k = key_of("A")
    await h1.agent.client.set(f"t:owner:{k}", "h1|" + "9" * 40, px=60_000)
    await h1.gate.claim(k)
    await h1.agent.client.delete(f"t:owner:{k}")  # the bad value is gone: a fresh take follows
    assert (await h1.gate.claim(k)).write, "the session can no longer be written by any host"


async def test_a_commit_does_not_publish_a_file_swapped_in_after_it_was_checked(
    tmp_path: Path, start_host: Callable[..., Awaitable[Host]]
) -> None:
    """`_publish` promises "the name now holds that very file (nothing swapped in between the check and the
    rename)", but it compares the staging name's inode just before the rename with the final name's just
    after it, never with the inode `_check_written` read, hashed and chmod-ed. A file put at the staging name
    after the check (anyone who may write the snapshot directory: llama-server's group) is renamed to the
    generation's name and recorded with the checked file's size, header and checksum."""
    h1 = await start_host("h1")
    k = key_of("A")
    await h1.h.turn("A")
    planner = h1.store.saves
    check = planner._check_written
    checked: list[bytes] = []

    def check_then_swap(plan: SavePlan, *, checksum: bool) -> Any:
        out = check(plan, checksum=checksum)
        checked.append(plan.path.read_bytes())
        swapped = plan.path.with_name(plan.path.name + ".x")
        swapped.write_bytes(checked[0][:-1] + bytes([checked[0][-1] ^ 0xFF]))  # same size, other bytes
        os.rename(swapped, plan.path)  # a new inode at the staging name, after the check
        return out

    planner._check_written = check_then_swap  # type: ignore[method-assign]
    saved = (await h1.coordinator.save("A"))["saved"]
    manifest = h1.store.reload(k)
    assert checked, "the save never reached its check"
    if saved and manifest is not None and manifest.current is not None:
        final = tmp_path / "shared" / "snaps" / manifest.generations[manifest.current].filename
        assert final.read_bytes() == checked[0], "the committed name holds a file nobody checked"


async def test_a_redis_blip_does_not_abort_a_healthy_peers_proxied_answer(
    start_host: Callable[..., Awaitable[Host]],
) -> None:
    """a97a2af made `is_live` answer False for every host while Redis is down, and `_until_gone` polls it
    every heartbeat while a proxied request waits for the peer's first byte (a long prefill). One failed
    Redis call anywhere on this host (`went_down`) is enough: the forward to a peer whose record is still
    live is cancelled, the peer's prefill is thrown away, and the request is redone here from cold or a
    restore, though nothing says the peer stopped."""
    h1 = await start_host("h1", heartbeat_s=0.05, host_ttl_s=30.0, owner_lease_ttl_s=60.0)
    router = FleetRouter(h1.agent, h1.coordinator, token=None)
    with silent_listener() as url:
        await fake_peer(h1, "h9", url, ttl_ms=30_000, proxy=True)  # h9 is live and will answer

        async def redis_down() -> None:  # Redis stops answering this host for a while
            raise OSError("connection refused")

        h1.agent.heartbeat = redis_down  # type: ignore[method-assign]
        h1.agent.went_down(OSError("a call timed out"))
        asked: list[bool] = []
        answer: asyncio.Future[tuple[str | None, Any]] = asyncio.get_running_loop().create_future()
        is_live = router.is_live

        def counting(host_id: str) -> bool:
            live = is_live(host_id)
            asked.append(live)
            if len(asked) == 3 and not answer.done():
                answer.set_result(("ok", None))  # the peer's answer begins after a few heartbeats
            return live

        router.is_live = counting  # type: ignore[method-assign]
        try:
            result = await PeerProxies._until_gone(answer, router, "h9", [])
        finally:
            await router.aclose()
    assert result == "ok", f"the forward was given up after {len(asked)} look(s) at h9 (live: {asked})"


async def test_a_purge_reaches_the_live_host_that_owns_a_session_no_slot_holds(
    tmp_path: Path, start_host: Callable[..., Awaitable[Host]]
) -> None:
    """a97a2af sends a session-scoped call only to hosts whose residency map holds the session in a slot.
    A session h2 served, saved and then evicted from its slot (another session took the only slot) is held
    nowhere, but h2 still holds its ownership lease: the purge sent to h1 claims the key, is refused
    (h2 owns it), never asks h2, and answers 200 `{"purged": 0}`; the conversation the client asked to
    delete stays in the shared directory and h2 restores it on the next acquire."""
    api = BoundSocket()
    h1 = await start_host("h1", owner_lease_ttl_s=60.0)
    h2 = await start_host("h2", owner_lease_ttl_s=60.0, advertise_url=api.url)
    await until(lambda: "h2" in h1.agent.hosts, what="h1 to see h2")
    k = key_of("A")
    await h2.h.turn("A")
    assert (await h2.coordinator.save("A"))["saved"] == 1
    await h2.h.turn("B")  # A is checkpointed out of h2's only slot; h2 keeps A's lease
    holder = await h2.agent.leases.holder(k)
    assert holder is not None and holder.holder == "h2"
    await h2.agent.heartbeat()  # the residency map says: B on h2, A nowhere
    r1 = FleetRouter(h1.agent, h1.coordinator, token=None)
    r2 = FleetRouter(h2.agent, h2.coordinator, token=None)
    app2 = create_app(h2.coordinator, check_host=False, fleet=lambda: r2)
    answer: dict[str, Any] | str
    try:
        async with api.serving(app2, what="h2's hook API"):
            # every_host: what the hook API's DELETE (and invalidate) route asks for
            answer = await purge_everywhere(r1, h1, every_host=True)
    except NotFound as exc:
        answer = f"404 {exc.message}"
    finally:
        await r1.aclose()
        await r2.aclose()
    assert manifest_bytes(tmp_path, k) is None, f"purge answered {answer!r}; the session's files are kept"
