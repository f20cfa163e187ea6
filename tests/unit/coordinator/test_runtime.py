"""The runtime guard (kvsidecar/coordinator/runtime.py): the canary's slot goes back as an idle moment
when the probe loop measured it, and quietly inside another operation's bracket."""

from __future__ import annotations

from pathlib import Path

from kvsidecar.testing.poll import until
from tests.unit.coordinator_helpers import start_harness


async def test_a_canary_measured_by_the_probe_loop_gives_the_server_an_idle_moment(tmp_path: Path) -> None:
    """After a restart whose canary could not be measured, the probe loop's refresh measures it: that
    give-back is an idle moment (the checkpoint policy starts the background save that is due), unlike the
    canary inside a save's or a restore's runtime check."""
    h = await start_harness(
        tmp_path,
        total_slots=2,
        servers={"local": {"mode": "managed-slots", "reserve_aux_slot": False}},
        checkpoint={"max_unsaved_turns": 1, "idle_s": None},
    )
    c = h.coordinator
    srv = c.servers["local"]
    h.fake.restart()
    h.fake.fail_next_save(100)  # the canary after the restart fails: it stays pending, no fingerprint
    await c.guard.refresh(srv)
    assert srv.fingerprint is None
    h.fake.fail_next_save(1)
    h.fake.fail_next_save(1)
    await h.turn("B")
    await h.turn("A")
    h.fake.fail_next_save(1)
    await h.turn("B")
    assert srv.fingerprint is None
    rt = c.sessions.get(srv.slots[1].owner)
    assert rt is not None and rt.dirty  # nothing could be saved without a fingerprint
    h.fake.knobs.fail_saves = 0
    await c.guard.refresh(srv)  # what the probe loop does: the canary is measured now
    assert srv.fingerprint is not None
    try:
        await until(lambda: not rt.dirty, timeout_s=5.0, what="the background save after the canary")
    finally:
        await c.aclose()
