"""`ServerRuntime`: one llama-server as the coordinator sees it: its backend, breaker, slots, fingerprint.

Different servers never share a lock (spec §38). `refresh()` probes the server and rebuilds its runtime
fingerprint; when the server restarted (local process identity changed, its per-start nonce changed, or it
was unreachable) the coordinator is told to drop its belief that any session is resident, so the next
request restores instead of trusting an empty slot. What other parts keep about a server lives with them:
the queue of requests waiting for its slots (pool.py), its recent demand (checkpoint.py) and the count of
its restarts seen (runtime.py).

A fingerprint is bound to the server instance it was built for (`instance`: the local process' pid and
create time, and the nonce llama-server makes at each start). `same_instance()` re-checks that binding
cheaply; the coordinator brackets every restore and every save commit with it, so a restart between two
probes can never lend one runtime's fingerprint to another runtime's KV.

A model loaded again inside the same process is a new runtime too (issue 26 A): llama-server's sleep mode
frees the model and every slot, and on wake reads whatever file is at the model's path then. The probe
reads only `/props` (which neither wakes a sleeping server nor resets its idle timer) and sees
`is_sleeping`; a sleep seen, a wake seen, or a change in the files the process maps as its model (device,
inode, address ranges: `model_mappings`) forgets every slot's residency and rebuilds the fingerprint, and
`same_instance()` checks both, so a reload between two probes voids the restore it brackets. While the
server sleeps there is no fingerprint: an acquire wakes it first (`refresh(wake=True)`), then fingerprints
what it loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import select
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import psutil

from kvsidecar.backend.base import BackendCapabilities, KvBackend
from kvsidecar.config import Config, Mode, ServerConfig
from kvsidecar.coordinator.breaker import CircuitBreaker
from kvsidecar.coordinator.decisions import ModelFacts, save_useless
from kvsidecar.coordinator.state import Slot
from kvsidecar.errors import KvError
from kvsidecar.fingerprint.file_digests import FileDigestCache
from kvsidecar.fingerprint.llama_process import ProcessInfo, load_identity, model_mappings
from kvsidecar.fingerprint.memory_class import UNKNOWN
from kvsidecar.fingerprint.model_files import ModelProof, model_proof
from kvsidecar.fingerprint.runtime import RuntimeFingerprint, build_fingerprint
from kvsidecar.fingerprint.server_memory import SWA_FULL_FIX, ServerMemory, read_server_memory
from kvsidecar.logs import event

log = logging.getLogger("kvsidecar.server")

ProcessFinder = Callable[[str], ProcessInfo | None]
MemoryReader = Callable[[BackendCapabilities, ProcessInfo | None], ServerMemory]


# The restart reasons that prove a new llama-server process (not a server that only looked gone for a while).
NEW_PROCESS = frozenset({"process changed", "instance nonce changed"})


@dataclass(frozen=True, kw_only=True)
class RefreshResult:
    available: bool
    restarted: bool
    reason: str | None = None

    @property
    def new_process(self) -> bool:
        return self.restarted and self.reason in NEW_PROCESS


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
        memory_reader: MemoryReader = read_server_memory,
    ) -> None:
        self.name = name
        self.config = config
        self.backend = backend
        self.breaker = breaker
        self.process_finder = process_finder
        self._watch: _ProcessWatch | None = None
        self.process_check = process_check or self._process_alive
        self.mappings = mappings or model_mappings  # pid -> the files it maps as its model now
        self.digests = digests
        self.caps: BackendCapabilities | None = None
        # The complete fingerprint (None until every part, the KV canary included, is known).
        self.fingerprint: RuntimeFingerprint | None = None
        self.canary: str | None = None  # digest of the runtime canary's KV, made on this instance
        self.canary_failures = 0
        self.process: ProcessInfo | None = None
        # The model's memory class on this instance (its files and settings), read again at each new one
        self.memory: ServerMemory | None = None
        self.memory_reader = memory_reader
        # Held while the server is re-probed and re-fingerprinted: an acquire that needs a fingerprint
        # waits for the one being built instead of starting a second build (a whole-file model hash).
        self.refresh_lock = asyncio.Lock()
        self.available = False
        self.last_error: str | None = None
        first = config.slot_id if config.mode is Mode.SINGLE_SLOT else 0
        self.slots: dict[int, Slot] = {first: Slot(id=first)}
        self._base: RuntimeFingerprint | None = None  # the fingerprint without the canary

    @property
    def slot_n_ctx(self) -> int | None:
        if self.caps is None or self.caps.n_ctx is None:
            return None
        return self.caps.n_ctx

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
        return None if self.caps is None else model_proof(self.caps, self.process)

    @property
    def sleeping(self) -> bool:
        return self.caps is not None and self.caps.sleeping

    @property
    def needs_canary(self) -> bool:
        return self.config.runtime_canary and self.available and self.canary is None and not self.sleeping

    async def refresh(self, *, force: bool = False, wake: bool = False) -> RefreshResult:
        """Probe the server; say whether it is up and whether it restarted since the last look.

        `force` rebuilds the fingerprint (and asks for a new canary) even when nothing looks changed:
        the caller could not prove the server is the instance the fingerprint was made for.
        `wake`: a server in sleep mode is woken (the caller needs it now) and fingerprinted after; without
        it a sleeping server is left asleep, and has no fingerprint.
        """
        was_available, old_process, old_caps = self.available, self.process, self.caps
        try:
            caps = await self.backend.probe()
            if caps.sleeping and wake:
                # the sleep is seen here (the restart reason below compares with the last probe)
                self.caps = caps
                old_caps = caps
                await self.backend.wake()
                caps = await self.backend.probe()
        except KvError as exc:
            self.available = False
            self.last_error = exc.message
            return RefreshResult(available=False, restarted=was_available, reason="unreachable")
        process = (
            await asyncio.to_thread(self.process_finder, self.config.base_url)
            if self.process_finder
            else None
        )
        restarted, reason = _restart_reason(was_available, old_caps, caps, old_process, process)
        self.caps, self.process, self.available, self.last_error = caps, process, True, None
        if process is not None and (self._watch is None or self._watch.identity != process.identity):
            if self._watch is not None:
                self._watch.close()
            self._watch = _ProcessWatch(process)
        rebuild = force or restarted or self._base is None or (process is not None and old_process is None)
        if caps.sleeping:  # no model loaded: the next one is read from the path at wake, unknown now
            self._base, self.canary, self.fingerprint = None, None, None
        elif rebuild:
            await self._rebuild(caps, process)
        self._sync_slots(caps.total_slots)
        if not was_available:
            event(
                log,
                logging.INFO,
                "kv.backend.ready",
                server=self.name,
                slots=caps.total_slots,
                n_ctx=caps.n_ctx,
                fingerprint=self.fingerprint.digest[:12] if self.fingerprint else None,
                local_process=process.pid if process else None,
            )
        return RefreshResult(available=True, restarted=restarted, reason=reason)

    async def _rebuild(self, caps: BackendCapabilities, process: ProcessInfo | None) -> None:
        """A new fingerprint (the canary asked again) and the model's memory class, for the instance seen."""
        self._base = await asyncio.to_thread(
            build_fingerprint,
            caps=caps,
            process=process,
            runtime_key=self.config.runtime_key,
            digests=self.digests,
        )
        self.canary = None
        self._compose()
        memory = await asyncio.to_thread(self.memory_reader, caps, process)
        if self._still(caps, process):  # not a look at an instance that another look has replaced
            self._learned(memory)

    def _still(self, caps: BackendCapabilities, process: ProcessInfo | None) -> bool:
        """Is the instance a look read (its process, its model) still the one seen last?"""
        now = self.process.identity if self.process is not None else None
        seen = process.identity if process is not None else None
        return now == seen and self.caps is not None and self.caps.model_path == caps.model_path

    def _learned(self, memory: ServerMemory) -> None:
        """The model's memory class on this instance: said once (again only when it changes, e.g. a
        restart with other settings), with what kvsidecar saves for it and, where saves are useless, the
        fix and its memory figure."""
        old, self.memory = self.memory, memory
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
        self.canary, self.canary_failures = digest, 0
        self._compose()

    def _compose(self) -> None:
        """The full fingerprint: what the server and its process say, plus the canary's KV digest."""
        base = self._base
        if base is None or (self.config.runtime_canary and self.canary is None):
            self.fingerprint = None
            return
        if not self.config.runtime_canary:
            self.fingerprint = base
            return
        self.fingerprint = RuntimeFingerprint(
            components={**base.components, "canary_kv": self.canary or ""}, info=dict(base.info)
        )

    def close(self) -> None:
        if self._watch is not None:
            self._watch.close()
            self._watch = None

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
        kinds = [
            name
            for name, known in (
                ("process", self.process is not None),
                ("nonce", self.caps is not None and self.caps.instance_id is not None),
            )
            if known
        ]
        return "+".join(kinds) or "none"

    async def same_instance(self) -> bool | None:
        """Is the server still the instance the fingerprint was built for?

        True: proven (local process alive with the same pid and create time, and/or the same per-start
        nonce from /props). False: it is not, or the check failed. None: nothing can tell instances
        apart (a remote server that exposes no nonce); the caller decides how to fail closed.
        """
        if self.caps is None or not self.available or self.caps.sleeping:
            return False
        proven = False
        if self.process is not None:
            if not self.process_check(self.process):
                return False
            if self.process.mapped_models is not None:
                # the model mapped anew (a wake from sleep mode) is a new runtime, even in this process
                now = await asyncio.to_thread(self.mappings, self.process.pid)
                if load_identity(now) != self.process.load_identity:
                    return False
            proven = True
        if self.caps.instance_id is not None or "is_sleeping" in self.caps.props:
            try:
                state = await self.backend.instance_state()
            except KvError:
                return False
            if state.sleeping or state.nonce != self.caps.instance_id:
                return False
            proven = proven or state.nonce is not None
        return True if proven else None


class _ProcessWatch:
    """A pidfd on the local llama-server: "is it still running?" is one poll (about 2 µs, where psutil
    takes about 35 µs), and a pidfd can never refer to another process that reused the pid."""

    def __init__(self, process: ProcessInfo) -> None:
        self.identity = process.identity
        self.fd: int | None = None
        with contextlib.suppress(OSError, AttributeError):
            fd = os.pidfd_open(process.pid)
            if process_alive(process):  # the pid still names the process we found (not a reuse)
                self.fd = fd
            else:
                os.close(fd)

    def alive(self) -> bool | None:
        if self.fd is None:
            return None
        readable, _, _ = select.select([self.fd], [], [], 0)  # readable once the process has exited
        return not readable

    def close(self) -> None:
        if self.fd is not None:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = None


def process_alive(process: ProcessInfo) -> bool:
    """The same local process is still running (a pid reused by another process has another start time)."""
    try:
        return abs(psutil.Process(process.pid).create_time() - process.create_time) < 1e-3
    except (psutil.Error, OSError):
        return False


def _restart_reason(
    was_available: bool,
    old_caps: BackendCapabilities | None,
    caps: BackendCapabilities,
    old_process: ProcessInfo | None,
    process: ProcessInfo | None,
) -> tuple[bool, str | None]:
    """Did the server restart since the last probe, and what shows it. Identity evidence (process, nonce)
    decides when there is some: a slow answer that made the server look unreachable is not a restart."""
    if old_caps is None:
        return False, None
    same_evidence = False
    if old_process is not None and process is not None:
        if old_process.identity != process.identity:
            return True, "process changed"
        same_evidence = True
    if caps.sleeping and not old_caps.sleeping:
        return True, "entered sleep mode"  # the model and every slot's KV are freed
    if old_caps.sleeping and not caps.sleeping:
        return True, "woke from sleep mode"  # the model was loaded again from its path
    if (
        old_process is not None
        and process is not None
        and old_process.mapped_models is not None
        and old_process.load_identity != process.load_identity
    ):
        return True, "model mapped again"
    if old_caps.instance_id is not None or caps.instance_id is not None:
        if old_caps.instance_id != caps.instance_id:
            return True, "instance nonce changed"
        same_evidence = True
    if caps.model_path != old_caps.model_path:
        return True, "model changed"
    if old_process is not None and process is None:
        return True, "local process gone"
    if not was_available and not same_evidence:
        return True, "was unreachable"
    return False, None


def build_servers(
    config: Config,
    backends: dict[str, KvBackend],
    process_finder: ProcessFinder | None,
    process_check: Callable[[ProcessInfo], bool] | None,
    digests: FileDigestCache | None,
    monotonic: Callable[[], float],
) -> dict[str, ServerRuntime]:
    """One runtime per configured server, each with its own breaker (different servers share nothing)."""
    return {
        name: ServerRuntime(
            name=name,
            config=cfg,
            backend=backends[name],
            breaker=CircuitBreaker(
                max_consecutive_failures=config.failure.max_consecutive_failures,
                cooldown_s=config.failure.cooldown_s,
                clock=monotonic,
            ),
            process_finder=process_finder,
            process_check=process_check,
            digests=digests,
        )
        for name, cfg in config.servers.items()
    }
