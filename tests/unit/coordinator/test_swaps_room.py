"""Requests for more models than the router keeps loaded, at the same moment (coordinator/rooms.py,
swaps.py `enter`/`leave`), against a fake router: a model with a request of ours in flight is never
unloaded (the request for another model waits for its release, bounded: KV_MODEL_BUSY); a request for the
model being unloaded waits for the unload to end, then loads it again; an unload waits for a save the
checkpoint loop holds a slot for. Every wait here is on an event the code under test sets."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from kvsidecar.coordinator.swaps import UNLOAD, ModelSwaps
from kvsidecar.errors import ModelBusy
from kvsidecar.testing.poll import until
from tests.unit.coordinator.test_swaps import Checkpoints, Router, runtime, swaps_of


class GatedCheckpoints(Checkpoints):
    """Each save before an unload waits for `gate` (an unload caught in the middle)."""

    def __init__(self, log: list[str]) -> None:
        super().__init__(log)
        self.gate = asyncio.Event()

    async def checkpoint_all(self, trigger: str, *, server: str | None = None) -> list[Any]:
        self.log.append(f"save:{server}:{trigger}")
        await self.gate.wait()
        return []


def waiting(swaps: ModelSwaps) -> int:
    return sum(room.waiting for room in swaps._rooms.values())


async def test_a_model_in_use_is_not_unloaded_the_other_request_waits_for_its_release() -> None:
    router = Router(["a", "b"], max_loaded=1)
    a, b = runtime("a", "a", router), runtime("b", "b", router)
    swaps, _ = swaps_of([a, b], router.log)
    await swaps.enter(a)  # a request of ours runs on a
    entering = asyncio.ensure_future(swaps.enter(b))
    await until(lambda: waiting(swaps) == 1, what="b's request waiting for room")
    assert router.log == ["load:a"]  # nothing unloaded under a's request, nothing loaded past the limit
    view = swaps.view()
    assert (view["a"]["in_use"], view["b"]["in_use"], view["b"]["waiting"]) == (1, 0, 1), view
    swaps.leave(a)  # a's lease released
    await entering
    assert router.log == ["load:a", f"save:a:{UNLOAD}", "unload:a", "load:b"]
    assert swaps.view()["a"]["unloads"] == {"kvsidecar": 1}


async def test_the_wait_for_room_is_bounded_with_a_stable_code() -> None:
    router = Router(["a", "b"], max_loaded=1)
    a, b = runtime("a", "a", router), runtime("b", "b", router, model_wait_s=0.05)
    swaps, _ = swaps_of([a, b], router.log)
    await swaps.enter(a)
    with pytest.raises(ModelBusy) as caught:
        await swaps.enter(b)
    assert caught.value.code == "KV_MODEL_BUSY"
    assert router.log == ["load:a"]
    swaps.leave(a)
    await swaps.enter(b)  # once a is free, the next request makes room
    assert router.log[-2:] == ["unload:a", "load:b"]


async def test_a_request_for_the_model_being_unloaded_waits_then_loads_it_again() -> None:
    router = Router(["a", "b"], max_loaded=1)
    a, b = runtime("a", "a", router), runtime("b", "b", router)
    checkpoints = GatedCheckpoints(router.log)
    swaps = ModelSwaps(servers={"a": a, "b": b}, checkpoints=checkpoints, metrics=swaps_of([], [])[1])  # type: ignore[arg-type]
    await swaps.enter(a)
    swaps.leave(a)  # a loaded, idle
    for_b = asyncio.ensure_future(swaps.enter(b))
    await until(lambda: f"save:a:{UNLOAD}" in router.log, what="a being saved before its unload")
    for_a = asyncio.ensure_future(swaps.enter(a))  # a request for a, while a is being unloaded
    await until(lambda: waiting(swaps) == 1, what="a's request waiting for the unload")
    checkpoints.gate.set()
    await for_b  # b loaded for its request, which is in flight now
    await until(lambda: waiting(swaps) == 1 and "load:b" in router.log, what="a's request waiting for b")
    assert not for_a.done() and router.log[-1] == "load:b"
    swaps.leave(b)
    await for_a
    assert router.log == [
        "load:a",
        f"save:a:{UNLOAD}",
        "unload:a",
        "load:b",
        f"save:b:{UNLOAD}",  # b saved before the unload that makes room for a again
        "unload:b",
        "load:a",
    ]


async def test_an_unload_waits_for_a_save_the_checkpoint_loop_holds_a_slot_for() -> None:
    """A background save that a give-back started while the model's saves ran holds a slot: the unload
    waits until that save gives it back, and no save starts on the model after it (its slots are held)."""
    router = Router(["a", "b"], max_loaded=1)
    a, b = runtime("a", "a", router), runtime("b", "b", router)
    swaps, _ = swaps_of([a, b], router.log)
    pool = swaps.checkpoints.pool
    pool.on_given_back = swaps.given_back

    async def saved_and_a_save_started(trigger: str, *, server: str | None = None) -> list[Any]:
        router.log.append(f"save:{server}:{trigger}")
        assert pool.try_take(a, a.slots[0], "protect")  # the checkpoint loop's save, at a give-back
        return []

    swaps.checkpoints.checkpoint_all = saved_and_a_save_started  # type: ignore[method-assign]
    await swaps.enter(a)
    swaps.leave(a)
    for_b = asyncio.ensure_future(swaps.enter(b))
    await until(lambda: waiting(swaps) == 1, what="the unload waiting for the save's slot")
    router.log.append("protect save done")
    pool.give_back(a, a.slots[0])
    await for_b
    assert router.log == ["load:a", f"save:a:{UNLOAD}", "protect save done", "unload:a", "load:b"]
    assert a.slots[0].free  # given back after the unload


@pytest.mark.parametrize(("max_loaded", "crowded"), [(1, True), (2, False), (0, False)])
async def test_models_the_router_cannot_keep_loaded_together_are_crowded(
    max_loaded: int, crowded: bool
) -> None:
    """Fewer models loaded at once than ours on the router: each will be unloaded in turn, so its sessions
    take the save points of sessions that outnumber their slots (Restorer.oversubscribed)."""
    router = Router(["a", "b"], max_loaded=max_loaded)
    a, b = runtime("a", "a", router), runtime("b", "b", router)
    swaps, _ = swaps_of([a, b], router.log)
    await swaps.enter(a)
    assert [s.backend.crowded for s in (a, b)] == [crowded, crowded]  # type: ignore[attr-defined]


async def test_a_model_being_unloaded_is_not_woken_by_its_own_saves() -> None:
    """A save before the unload that finds the model gone (the router unloaded it meanwhile) would wake it:
    the wake hook refuses at once instead of waiting for the router's lock that unload holds."""
    router = Router(["a", "b"], max_loaded=1)
    a, b = runtime("a", "a", router), runtime("b", "b", router)
    swaps, _ = swaps_of([a, b], router.log)
    swaps._room(a).leaving.add("a")
    with pytest.raises(ModelBusy):
        await swaps.load(a)
    assert router.log == []
