"""`ServerRuntime`: one llama-server as the coordinator sees it: its backend, breaker, slots, and the I/O that
tells what it is. What is known of it lives in its identity (`fingerprint/identity.py`, the one writer).

Different servers never share a lock (spec §38). `refresh()` probes the server, looks up its local process,
feeds what it found to the identity (which says whether it restarted: the local process identity changed,
its per-start nonce changed, or it was unreachable) and, when the identity asks for it, builds the runtime
fingerprint and reads the model's memory class; the coordinator is then told to drop its belief that any
session is resident, so the next request restores instead of trusting an empty slot. What other parts keep
about a server lives with them: the queue of requests waiting for its slots (pool.py), its recent demand
(checkpoint.py), the credential scopes its instance ran (scope.py), how its processes ended (exits.py).

A fingerprint is bound to the server instance it was built for (the local process' pid and create time,
and the nonce llama-server makes at each start). `same_instance()` re-checks that binding cheaply; the
coordinator brackets every restore and every save commit with it, so a restart between two probes can
never lend one runtime's fingerprint to another runtime's KV. A check that fails is told to the identity
(`doubted`, `exited`), which stops showing the fingerprint until the next probe decides.

A model loaded again inside the same process is a new runtime too (issue 26 A): llama-server's sleep mode
frees the model and every slot, and on wake reads whatever file is at the model's path then. The probe
reads only `/props` (which neither wakes a sleeping server nor resets its idle timer) and sees
`is_sleeping`; a sleep seen, a wake seen, or a change in the files the process maps as its model (device,
inode, address ranges: `model_mappings`) forgets every slot's residency and rebuilds the fingerprint, and
`same_instance()` checks both, so a reload between two probes voids the restore it brackets. While the
server sleeps there is no fingerprint: an acquire wakes it first (`refresh(wake=True)`), then fingerprints
what it loaded.

Router mode: each model of a router is a runtime of its own (`RuntimeKey(server, model)`), with its own
identity, process and slots; a discovered model's is made by `server_maker`'s (router_models.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from kvsidecar.backend.base import BackendCapabilities, KvBackend
from kvsidecar.config import Config, Mode, ServerConfig
from kvsidecar.coordinator.breaker import CircuitBreaker
from kvsidecar.coordinator.decisions import ModelFacts, save_useless
from kvsidecar.coordinator.process_watch import _ProcessWatch, process_alive
from kvsidecar.coordinator.state import Slot
from kvsidecar.errors import KvError
from kvsidecar.fingerprint.file_digests import FileDigestCache
from kvsidecar.fingerprint.identity import (
    NEW_PROCESS,
    IdentityState,
    RefreshResult,
    RuntimeIdentity,
    RuntimeKey,
)
from kvsidecar.fingerprint.llama_process import ProcessInfo, load_identity, model_mappings
from kvsidecar.fingerprint.memory_class import UNKNOWN, MemoryClass
from kvsidecar.fingerprint.model_files import ModelProof, model_proof
from kvsidecar.fingerprint.runtime import RuntimeFingerprint, build_fingerprint
from kvsidecar.fingerprint.server_memory import SWA_FULL_FIX, ServerMemory, read_server_memory
from kvsidecar.logs import event

log = logging.getLogger("kvsidecar.server")

ProcessFinder = Callable[[str], ProcessInfo | None]
MemoryReader = Callable[[BackendCapabilities, ProcessInfo | None], ServerMemory]

__all__ = ["NEW_PROCESS", "ProcessFinder", "RefreshResult", "ServerRuntime", "build_servers", "server_maker"]
__all__ += ["process_alive"]


class ServerRuntime:
    def __init__(
        self,
        *,
        name: str,
        config: ServerConfig,
        backend: KvBackend,
        breaker: CircuitBreaker,
        process_finder: ProcessFinder | None,
        digests: FileDigestCache | None,
        process_check: Callable[[ProcessInfo], bool] | None = None,
        mappings: Callable[[int], Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        model: str | None = None,
        memory_reader: MemoryReader = read_server_memory,
        before_wake: Callable[[ServerRuntime], Awaitable[None]] | None = None,
    ) -> None:
        self.name = name
        # what wakes a model a router unloaded: room made on the router first (coordinator/swaps.py)
        self.before_wake = before_wake
        self.config = config
        self.backend = backend
        self.breaker = breaker
        self.process_finder = process_finder
        self._watch: _ProcessWatch | None = None
        self._alive = process_check or self._process_alive
        self.mappings = mappings or model_mappings  # pid -> the files it maps as its model now
        self.digests = digests
        # every fact about the runtime: its one writer (the events below feed it, everything else reads it)
        self.identity = RuntimeIdentity(
            key=RuntimeKey(name, model), canary=lambda: self.config.runtime_canary, clock=clock
        )
        # The model's memory class on this instance, with its settings and costs (doctor's and status' figure;
        # written by `_learned` alone, read again at each new instance)
        self._memory: ServerMemory | None = None
        self.memory_reader = memory_reader
        # Held while the server is re-probed and re-fingerprinted: an acquire that needs a fingerprint
        # waits for the one being built instead of starting a second build (a whole-file model hash).
        self.refresh_lock = asyncio.Lock()
        first = config.slot_id if config.mode is Mode.SINGLE_SLOT else 0
        self.slots: dict[int, Slot] = {first: Slot(id=first)}

    # what is known of it, read from its identity ----------------------------------------------------------
    @property
    def key(self) -> RuntimeKey:
        """Which runtime this is (the server's name, and a router child's model)."""
        return self.identity.key

    @property
    def state(self) -> IdentityState:
        return self.identity.now.state

    @property
    def caps(self) -> BackendCapabilities | None:
        return self.identity.now.caps

    @property
    def process(self) -> ProcessInfo | None:
        return self.identity.now.process

    @property
    def available(self) -> bool:
        return self.identity.now.available

    @property
    def last_error(self) -> str | None:
        return self.identity.now.last_error

    @property
    def fingerprint(self) -> RuntimeFingerprint | None:
        """The complete fingerprint of the instance proven (None until every part, the KV canary included,
        is known, and while a check says the server may not be that instance any more)."""
        return self.identity.now.shown

    @property
    def memory(self) -> ServerMemory | None:
        """The model's memory class on the instance running now, its settings and what a snapshot costs
        (None while that instance's class is not read: never the class of one that is gone, which status
        and the checkpoint policy would otherwise show while the planner reads unknown)."""
        if self.identity.now.memory is None and self.process is not None:
            return None
        return self._memory

    @property
    def canary(self) -> str | None:
        return self.identity.now.canary  # digest of the runtime canary's KV, made on this instance

    @property
    def canary_failures(self) -> int:
        return self.identity.now.canary_failures

    @property
    def memory_class(self) -> MemoryClass | None:
        """The loaded model's memory class (None: not read yet, or the process is not seen here)."""
        return self.identity.now.memory

    @property
    def slot_n_ctx(self) -> int | None:
        caps = self.caps
        if caps is None or caps.n_ctx is None:
            return None
        return caps.n_ctx

    def _sync_slots(self, total: int) -> None:
        if self.config.mode is Mode.SINGLE_SLOT:
            return
        for i in range(total):
            self.slots.setdefault(i, Slot(id=i))
        for i in [i for i, s in self.slots.items() if i >= total and s.free]:
            del self.slots[i]

    @property
    def canary_slot_id(self) -> int:
        """The slot the canary is always measured on (a state file differs with its slot)."""
        return min(self.slots)

    @property
    def model_proof(self) -> ModelProof | None:
        """Why the loaded model cannot be proven across a restart of llama-server (status says it)."""
        caps = self.caps
        return None if caps is None else model_proof(caps, self.process)

    @property
    def sleeping(self) -> bool:
        return self.identity.now.sleeping

    @property
    def needs_canary(self) -> bool:
        return self.config.runtime_canary and self.available and self.canary is None and not self.sleeping

    # the probe ----------------------------------------------------------------------------------------------
    async def refresh(self, *, force: bool = False, wake: bool = False) -> RefreshResult:
        """Probe the server; say whether it is up and whether it restarted since the last look.

        `force` rebuilds the fingerprint (and asks for a new canary) even when nothing looks changed:
        the caller could not prove the server is the instance the fingerprint was made for.
        `wake`: a server in sleep mode is woken (the caller needs it now) and fingerprinted after; without
        it a sleeping server is left asleep, and has no fingerprint.
        """
        was_available, slept = self.available, None
        try:
            caps = await self.backend.probe()
            if caps.sleeping and wake:
                slept = caps  # the sleep is seen here: the answer after the wake is compared with it
                if self.before_wake is not None:
                    await self.before_wake(self)
                await self.backend.wake()
                caps = await self.backend.probe()
        except KvError as exc:
            return self.identity.probe_failed(exc.message, slept=slept)
        process = (
            await asyncio.to_thread(self.process_finder, caps.process_url or self.config.base_url)
            if self.process_finder
            else None
        )
        result = self.identity.probed(caps, process, force=force, slept=slept)
        if process is not None and (self._watch is None or self._watch.identity != process.identity):
            if self._watch is not None:
                self._watch.close()
            self._watch = _ProcessWatch(process)
        if result.rebuild:
            base, read = await asyncio.to_thread(
                _build, caps, process, self.config.runtime_key, self.digests, self.memory_reader
            )
            if self._still(caps, process):  # not a look at an instance another look has replaced
                # the class is read once: the identity, the planner, status and doctor all take this read
                self.identity.fingerprinted(base, read.memory if process is not None else None)
                self._learned(read)
        self._sync_slots(caps.total_slots)
        if not was_available:
            fingerprint = self.fingerprint
            event(
                log,
                logging.INFO,
                "kv.backend.ready",
                server=self.name,
                slots=caps.total_slots,
                n_ctx=caps.n_ctx,
                fingerprint=fingerprint.digest[:12] if fingerprint else None,
                local_process=process.pid if process else None,
            )
        return result

    def _still(self, caps: BackendCapabilities, process: ProcessInfo | None) -> bool:
        """Is the instance a look read (its process, its model) still the one seen last?"""
        now = self.process.identity if self.process is not None else None
        seen = process.identity if process is not None else None
        return now == seen and self.caps is not None and self.caps.model_path == caps.model_path

    def _learned(self, memory: ServerMemory) -> None:
        """The model's memory class on this instance: said once (again only when it changes, e.g. a
        restart with other settings), with what kvsidecar saves for it and, where saves are useless, the
        fix and its memory figure."""
        old, self._memory = self._memory, memory
        if old is not None and old.key == memory.key:
            return
        useless = save_useless(ModelFacts.of(memory))
        m = memory.memory
        fields: dict[str, Any] = {
            "server": self.name,
            "memory": m.kind,
            "arch": m.arch or None,
            "restore_keeps": m.restore_keeps if m.kind != UNKNOWN else None,
            "saves": "off" if useless else "on",
        }
        if useless:
            fields |= {
                "reason": useless,
                "n_swa": m.n_swa,
                "fix": SWA_FULL_FIX,
                "cost": memory.swa_full_cost(),
            }
        elif m.why:
            fields["why"] = m.why
        event(log, logging.WARNING if useless else logging.INFO, "kv.backend.memory", **fields)

    def set_canary(self, digest: str) -> None:
        """The canary measured on this instance (the identity keeps it while the instance is being proven)."""
        self.identity.canary_measured(digest)

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None

    # the checks between probes --------------------------------------------------------------------------
    def process_check(self, process: ProcessInfo) -> bool:
        """Is `process` still running (a pidfd poll, else /proc)? One that ended is told to the identity."""
        alive = self._alive(process)
        if not alive:
            self.identity.exited(process)
        return alive

    def _process_alive(self, process: ProcessInfo) -> bool:
        watch = self._watch
        if watch is not None and watch.identity == process.identity:
            alive = watch.alive()
            if alive is not None:
                return alive
        return process_alive(process)

    @property
    def identity_kind(self) -> str:
        """How a restart of this server is noticed between probes: what `same_instance` can check."""
        caps = self.caps
        kinds = [
            name
            for name, known in (
                ("process", self.process is not None),
                ("nonce", caps is not None and caps.instance_id is not None),
            )
            if known
        ]
        return "+".join(kinds) or "none"

    async def same_instance(self) -> bool | None:
        """Is the server still the instance the fingerprint was built for?

        True: proven (local process alive with the same pid and create time, and/or the same per-start
        nonce from /props). False: it is not, or the check failed (told to the identity: it shows no
        fingerprint until the next probe). None: nothing can tell instances apart (a remote server that
        exposes no nonce); the caller decides how to fail closed.
        """
        facts = self.identity.now
        caps, process = facts.caps, facts.process
        if caps is None or not facts.available or caps.sleeping:
            return False
        proven = False
        if process is not None:
            if not self.process_check(process):
                return False
            if process.mapped_models is not None:
                # the model mapped anew (a wake from sleep mode) is a new runtime, even in this process
                now = await asyncio.to_thread(self.mappings, process.pid)
                if load_identity(now) != process.load_identity:
                    return self._doubted()
            proven = True
        if caps.instance_id is not None or "is_sleeping" in caps.props:
            try:
                state = await self.backend.instance_state()
            except KvError:
                return self._doubted()
            if state.sleeping or state.nonce != caps.instance_id:
                return self._doubted()
            proven = proven or state.nonce is not None
        return True if proven else None

    def _doubted(self) -> bool:
        self.identity.doubted()
        return False


def _build(
    caps: BackendCapabilities,
    process: ProcessInfo | None,
    runtime_key: str | None,
    digests: FileDigestCache | None,
    memory_reader: MemoryReader,
) -> tuple[RuntimeFingerprint, ServerMemory]:
    """The fingerprint of what a probe found (without the canary) and its model's memory (class, settings,
    costs): reads whole files the first time they are seen (call off the loop)."""
    base = build_fingerprint(caps=caps, process=process, runtime_key=runtime_key, digests=digests)
    return base, memory_reader(caps, process)


def build_servers(
    config: Config,
    backends: dict[str, KvBackend],
    make: Callable[[str, ServerConfig, KvBackend], ServerRuntime],
) -> dict[str, ServerRuntime]:
    """One runtime per configured server (`server_maker`); a router's entry that discovers its models has no
    backend and is none (router_models.py adds a runtime per model it finds)."""
    found = [(name, cfg) for name, cfg in config.servers.items() if not cfg.discover_models]
    return {name: make(name, cfg, backends[name]) for name, cfg in found}


def server_maker(
    config: Config,
    process_finder: ProcessFinder | None,
    process_check: Callable[[ProcessInfo], bool] | None,
    digests: FileDigestCache | None,
    monotonic: Callable[[], float],
    before_wake: Callable[[ServerRuntime], Awaitable[None]] | None = None,
) -> Callable[[str, ServerConfig, KvBackend], ServerRuntime]:
    """What makes the runtime of one server entry (configured, or a router's model discovered)."""

    def make(name: str, cfg: ServerConfig, backend: KvBackend) -> ServerRuntime:
        return ServerRuntime(
            name=name,
            config=cfg,
            backend=backend,
            breaker=CircuitBreaker(
                max_consecutive_failures=config.failure.max_consecutive_failures,
                cooldown_s=config.failure.cooldown_s,
                clock=monotonic,
            ),
            process_finder=process_finder,
            process_check=process_check,
            digests=digests,
            clock=monotonic,
            model=cfg.model,
            before_wake=before_wake,
        )

    return make
