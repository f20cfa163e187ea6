"""Hostile and racing cases of fleet mode (issue 18), from its third adversarial review: the staging-name
commit (a file swapped in after its check is never published), the session-scoped fan-out (a purge reaches
the live host that owns a session no slot holds), the proxy's wait on a peer (a Redis blip does not give up
a healthy peer). Each failed on the tree it was written against."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from kvsidecar.api.routes import create_app
from kvsidecar.errors import NotFound
from kvsidecar.fleet.routing import FleetRouter
from kvsidecar.proxy.peers import PeerProxies
from kvsidecar.store.saving import SavePlan
from tests.fleet_helpers import BoundSocket, eventually
from tests.unit.test_fleet_fencing import Host, key_of, manifest_bytes, start_host
from tests.unit.test_fleet_hostile2 import fake_peer, purge_everywhere, silent_listener

__all__ = ["start_host"]  # the fixture, shared with test_fleet_fencing


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
    await eventually(lambda: "h2" in h1.agent.hosts, what="h1 to see h2")
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
