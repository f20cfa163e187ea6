"""coordinator/scope.py: the one rule of whose KV a request may run on, its ledger of the scopes each
llama-server instance ran, and the gate every path goes through (the fake backend; the real llama-server's
side of it: tests/integration/test_scope_real.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvsidecar.coordinator.scope import (
    PARK_PROMPT,
    Incoming,
    SlotKv,
    Verdict,
    keeps_half,
    park_prompt,
    ram_lookups,
    verdict,
)
from kvsidecar.coordinator.state import HOOK_SCOPE, Outcome
from kvsidecar.errors import BackendUnavailable
from kvsidecar.fingerprint.llama_process import ProcessInfo
from tests.unit.coordinator_helpers import Harness, start_harness

RUN, OTHER, UNKNOWN, RAM = Verdict.RUN, Verdict.OTHER_SCOPE, Verdict.UNKNOWN_SCOPE, Verdict.RAM_CACHE
BOB = Incoming(scope="kbob", session="B")
BOB_EXTENDS = Incoming(scope="kbob", session="B", extends=True)
BOB_AUX = Incoming(scope="kbob")
HOOK = Incoming(scope=HOOK_SCOPE, session="H")


@pytest.mark.parametrize(
    ("slot", "incoming", "shared", "expected"),
    [
        # 1. an empty slot: nothing to reuse, and llama-server does not look in its RAM cache
        (SlotKv(scope="kalice", empty=True), BOB_AUX, True, RUN),
        (SlotKv(scope=None, empty=True), BOB, True, RUN),
        # 2. another scope's KV, or KV of unknown scope: erased, whatever else holds
        (SlotKv(scope="kalice", empty=False), BOB_AUX, False, OTHER),
        (SlotKv(scope="kalice", empty=False, session="B"), BOB_EXTENDS, False, OTHER),
        (SlotKv(scope=HOOK_SCOPE, empty=False), BOB, False, OTHER),  # out of the operator's: a leak
        (SlotKv(scope="kbob", empty=False), HOOK, False, OTHER),
        (SlotKv(scope=None, empty=False), BOB_AUX, False, UNKNOWN),
        (SlotKv(scope=None, empty=False), HOOK, False, UNKNOWN),
        # 3. the RAM cache may hold another scope's KV: only the session's own KV, known to be extended
        (SlotKv(scope="kbob", empty=False, session="B"), BOB_EXTENDS, True, RUN),
        (SlotKv(scope="kbob", empty=False, session="B"), BOB, True, RAM),  # diverged, new, no messages
        (SlotKv(scope="kbob", empty=False), BOB_EXTENDS, True, RAM),  # another session's (kept, donor)
        (SlotKv(scope="kbob", empty=False, session="C"), BOB_EXTENDS, True, RAM),
        (SlotKv(scope="kbob", empty=False), BOB_AUX, True, RAM),  # a title, a pass-through route
        (SlotKv(scope=HOOK_SCOPE, empty=False), Incoming(scope=HOOK_SCOPE), True, RUN),  # trusted
        # 4. within one scope, nothing shared: run on what is there
        (SlotKv(scope="kbob", empty=False), BOB_AUX, False, RUN),
        (SlotKv(scope="kbob", empty=False, session="B"), BOB, False, RUN),
    ],
)
def test_the_rule(slot: SlotKv, incoming: Incoming, shared: bool, expected: Verdict) -> None:
    assert verdict(slot, incoming, ram_shared=shared) is expected


def test_only_the_sessions_own_kv_known_to_be_extended_keeps_half_without_tokens() -> None:
    own = SlotKv(scope="kbob", empty=False, session="B")
    assert keeps_half(own, BOB_EXTENDS)
    assert not keeps_half(own, BOB) and not keeps_half(own, BOB_AUX)
    assert not keeps_half(SlotKv(scope="kbob", empty=False), BOB_EXTENDS)


def process(*argv: str, environ: dict[str, str] | None = None) -> ProcessInfo:
    return ProcessInfo(
        pid=10, create_time=1.0, exe=None, cmdline=("llama-server", *argv), flags={}, environ=environ
    )


@pytest.mark.parametrize(
    ("info", "lookups"),
    [
        (process(), True),  # llama-server's default: --cache-ram 8192, --slot-prompt-similarity 0.1
        (process("--cache-ram", "0"), False),
        (process("-cram", "0"), False),
        (process("--cache-ram=0"), False),
        (process("--cache-ram", "-1"), True),  # no limit
        (process("--cache-ram", "lots"), True),  # a value llama.cpp would refuse: assumed on
        (process(environ={"LLAMA_ARG_CACHE_RAM": "0"}), False),
        (process("--cache-ram", "4096", environ={"LLAMA_ARG_CACHE_RAM": "0"}), True),  # the command line last
        (process("--slot-prompt-similarity", "0"), False),  # a pinned request never looks then
        (process("-sps", "0.0"), False),
        (process("-sps", "0.5"), True),
    ],
)
def test_whether_llama_servers_ram_cache_can_give_a_pinned_request_anything(
    info: ProcessInfo, lookups: bool
) -> None:
    assert ram_lookups(info) is lookups


def test_a_server_whose_settings_are_not_seen_is_assumed_to_look_in_its_ram_cache() -> None:
    assert ram_lookups(None) is True  # the rule fails closed
    assert ram_lookups(None, remote=False) is False  # what only saves work does not run on a guess


async def held(h: Harness, session: str | None, scope: str, *, extends: bool = False) -> Outcome:
    """One turn of `session` (None: an auxiliary request) in `scope`: what it ran on, and it ran."""
    r = await h.coordinator.acquire(
        session,
        provider="local",
        model="m",
        purpose=None if session else "title",
        scope=scope,
        extends=extends,
    )
    assert r.lease_id is not None and r.slot_id is not None
    prompt = [hash((scope, session, i)) % 30000 for i in range(8)]
    prompt_n, cache_n = h.fake.infer(r.slot_id, prompt)
    await h.coordinator.release(r.lease_id, status="ok", prompt_tokens=prompt_n, cached_tokens=cache_n)
    return r.outcome


def scopes(h: Harness) -> frozenset[str] | None:
    return h.coordinator.scopes.ledger.seen(h.coordinator.servers["local"])


async def test_no_path_runs_a_request_on_another_scopes_kv(tmp_path: Path) -> None:
    """A session, an auxiliary request, the same session id under another credential, the operator's own
    probe: each finds the slot emptied of the other scope's KV before it runs."""
    h = await start_harness(tmp_path)
    try:
        assert scopes(h) == frozenset()  # a fresh instance: no slot ever ran a task
        await held(h, "A", "kalice")
        for session, scope in ((None, "kbob"), ("A", "kbob"), (None, HOOK_SCOPE), ("A", "kalice")):
            before = h.fake.slot_tokens(0)
            r = await h.coordinator.acquire(
                session,
                provider="local",
                model="m",
                purpose=None if session else "title",
                scope=scope,
            )
            assert "erase" in r.actions and h.fake.slot_tokens(0) == [], (session, scope, before)
            assert r.outcome is not Outcome.RESTORED, "another credential's id is another session"
            prompt_n, cache_n = h.fake.infer(0, [hash((scope, i)) % 30000 for i in range(8)])
            assert cache_n == 0
            await h.coordinator.release(
                r.lease_id or "", status="ok", prompt_tokens=prompt_n, cached_tokens=0
            )
        keys = {rt.key for rt in h.coordinator.sessions.known("A")}
        assert len(keys) == 2  # one session id, two credentials: two sessions
    finally:
        await h.coordinator.aclose()


async def test_a_resident_session_runs_on_its_kv_only_when_its_prompt_is_known_to_extend_it(
    tmp_path: Path,
) -> None:
    """With two scopes seen, llama-server's RAM cache may hold either's KV: a turn that is not known to
    extend its session (a divergence, a route without messages) starts cold on an erased slot; a turn
    known to extend it stays resident; the operator's sessions are trusted with the cache."""
    h = await start_harness(tmp_path)
    try:
        await held(h, "B", "kbob")
        assert await held(h, "B", "kbob") is Outcome.RESIDENT  # only bob so far: nothing to fear
        await held(h, None, "kalice")
        assert scopes(h) == frozenset({"kbob", "kalice"})
        await held(h, "B", "kbob")  # restored (alice's aux took the slot)
        h.fake.calls.clear()
        assert await held(h, "B", "kbob", extends=True) is Outcome.RESIDENT
        assert [c[0] for c in h.fake.calls] == []  # Invariant 6: no management call
        r = await h.coordinator.acquire("B", provider="local", model="m", scope="kbob")
        assert (r.outcome, r.reason, r.actions) == (Outcome.COLD, "isolated", ["erase"])
        assert h.fake.slot_tokens(0) == []
        await h.coordinator.release(r.lease_id or "", status="aborted")
        await held(h, "H", HOOK_SCOPE)
        assert await held(h, "H", HOOK_SCOPE) is Outcome.RESIDENT  # trusted: KV flowing in is no leak
    finally:
        await h.coordinator.aclose()


async def test_a_snapshot_is_not_restored_for_a_turn_that_could_not_run_on_it(tmp_path: Path) -> None:
    """The gate is asked before anything is loaded: a session whose turn may not run on its own KV is not
    restored (only to be erased), and says why (X-KV-Reason ISOLATED)."""
    h = await start_harness(tmp_path)
    try:
        await held(h, "B", "kbob")
        await held(h, None, "kalice")  # bob's session is saved and evicted; two scopes now
        h.fake.calls.clear()
        r = await h.coordinator.acquire("B", provider="local", model="m", scope="kbob")
        assert (r.outcome, r.reason) == (Outcome.COLD, "isolated")
        assert "restore" not in [c[0] for c in h.fake.calls] and h.fake.slot_tokens(0) == []
        await h.coordinator.release(r.lease_id or "", status="aborted")
        r = await h.coordinator.acquire("B", provider="local", model="m", scope="kbob", extends=True)
        assert r.outcome is Outcome.RESTORED
        await h.coordinator.release(r.lease_id or "", status="aborted")
    finally:
        await h.coordinator.aclose()


async def test_a_request_is_refused_rather_than_run_on_kv_it_could_not_be_erased_of(tmp_path: Path) -> None:
    h = await start_harness(tmp_path)
    try:
        await held(h, "A", "kalice")
        h.fake.fail_next_erase(2)  # a cold start's own erase, then the gate's
        with pytest.raises(BackendUnavailable, match="erasing it failed"):
            await h.coordinator.acquire("B", provider="local", model="m", scope="kbob")
        h.fake.fail_next_erase()
        with pytest.raises(BackendUnavailable):
            await h.coordinator.acquire(None, provider="local", model="m", purpose="t", scope="kbob")
        assert h.coordinator.servers["local"].slots[0].free and len(h.coordinator.leases) == 0
        r = await h.coordinator.acquire(None, provider="local", model="m", purpose="t", scope="kbob")
        assert "erase" in r.actions and h.fake.slot_tokens(0) == []
        await h.coordinator.release(r.lease_id or "", status="aborted")
    finally:
        await h.coordinator.aclose()


async def test_an_instance_first_seen_after_it_ran_a_task_may_hold_anyones_kv(tmp_path: Path) -> None:
    """kvsidecar restarted while llama-server kept running: which scopes its RAM cache holds is unknown
    (assumed several); a new process whose slots never ran a task is known empty, its slots erased first
    (one may hold KV a restore put there); KV of unknown scope in a slot is erased before any request."""
    h = await start_harness(tmp_path)
    srv = h.coordinator.servers["local"]
    try:
        await held(h, "A", "kalice")
        h.fake.restart()  # a new process ...
        h.fake.infer(0, [1, 2, 3])  # ... that ran a task before kvsidecar looked
        await h.coordinator.guard.refresh(srv)
        assert scopes(h) is None
        assert h.coordinator.scopes.ram_shared(srv, "kalice")
        h.fake.restart()
        h.fake.slots[0].tokens = [7, 8, 9]  # a restore, no task
        await h.coordinator.guard.refresh(srv)
        assert scopes(h) == frozenset() and h.fake.slot_tokens(0) == []
    finally:
        await h.coordinator.aclose()


async def test_within_one_scope_the_ram_cache_keeps_working(tmp_path: Path) -> None:
    """A local llama-server with its RAM cache on, one scope: KV no session owns (a title's) is handed to
    that cache before a restore replaces it (kvsidecar's few tokens on the slot), as llama-server itself
    would before it reused the slot."""
    h = await start_harness(tmp_path, total_slots=1)
    try:
        h.process[0] = process()  # seen: its settings say the RAM cache is on
        await h.coordinator.guard.refresh(h.coordinator.servers["local"], force=True)
        await held(h, "A", "kbob")
        await held(h, None, "kbob")  # a title: A is saved and evicted, the slot holds the title's KV
        h.fake.calls.clear()
        await held(h, "A", "kbob")  # restored over the title's KV: parked first
        calls = [c[0] for c in h.fake.calls]
        assert calls.index("prompt") < calls.index("restore")
        assert h.fake.slot_tokens(0) != []
        h.fake.calls.clear()
        r = await h.coordinator.acquire(None, provider="local", model="m", purpose="t", scope="kbob")
        # A's KV, saved: lent as it is (no erase, no park: the title keeps its common prefix with it)
        assert [c[0] for c in h.fake.calls] == ["save"]
        await h.coordinator.release(r.lease_id or "", status="aborted")
        h.process[0] = process("--cache-ram", "0")
        await h.coordinator.guard.refresh(h.coordinator.servers["local"], force=True)
        h.fake.calls.clear()
        await held(h, "A", "kbob")
        assert "prompt" not in [c[0] for c in h.fake.calls]  # no RAM cache: nothing to hand it to
    finally:
        await h.coordinator.aclose()


async def test_an_empty_slot_is_primed_only_where_the_ram_cache_may_help(tmp_path: Path) -> None:
    h = await start_harness(tmp_path, total_slots=1)
    try:
        h.process[0] = process()
        await h.coordinator.guard.refresh(h.coordinator.servers["local"], force=True)
        h.fake.calls.clear()
        r = await h.coordinator.acquire(None, provider="local", model="m", purpose="t", scope="kbob")
        # a fresh instance: nothing ran on it, its RAM cache is empty, a prime would compute for nothing
        assert "prompt" not in [c[0] for c in h.fake.calls]
        await h.coordinator.release(r.lease_id or "", status="aborted")
        await h.coordinator.guard.refresh(h.coordinator.servers["local"], force=True)  # a canary again
        h.fake.calls.clear()
        r = await h.coordinator.acquire(None, provider="local", model="m", purpose="t", scope="kbob")
        assert ("prompt", 0, None) in h.fake.calls  # the canary left it empty, kbob ran before: primed
        assert len(h.fake.slot_tokens(0)) == 1  # one token of kvsidecar's (PARK_PROMPT's first, no BOS)
        await h.coordinator.release(r.lease_id or "", status="aborted")
        await held(h, None, "kalice")  # a second scope: from now on the empty slot is the protection
        h.fake.calls.clear()
        r = await h.coordinator.acquire(None, provider="local", model="m", purpose="t", scope="kbob")
        assert [c[0] for c in h.fake.calls] == ["erase"] and h.fake.slot_tokens(0) == []
        await h.coordinator.release(r.lease_id or "", status="aborted")
    finally:
        await h.coordinator.aclose()


async def test_a_park_is_one_token_that_no_request_starts_with(tmp_path: Path) -> None:
    """The park's prompt: the first token of PARK_PROMPT without the BOS (a text prompt would get the BOS,
    which every request shares, and cost a second token); the text when the server cannot tokenize."""
    h = await start_harness(tmp_path, total_slots=1)
    try:
        srv = h.coordinator.servers["local"]
        bare = await h.fake.tokenize(PARK_PROMPT, add_special=False, parse_special=False)
        with_bos = await h.fake.tokenize(PARK_PROMPT, add_special=True, parse_special=False)
        assert await park_prompt(srv) == bare[:1] and bare[:1] != with_bos[:1]
        h.fake.knobs.unavailable = True
        assert await park_prompt(srv) == PARK_PROMPT
    finally:
        h.fake.knobs.unavailable = False
        await h.coordinator.aclose()
