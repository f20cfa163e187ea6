"""Saving a slot into its session's next snapshot generation (spec §26-28, §41).

`Saver.save()` runs while the caller holds the slot, as one guarded persistence operation (guard.py: the
breaker's gate and trial, the call's bound, the verdict). It is bracketed like a restore (issue 16 A): the
server must provably be the instance its fingerprint was made for before the save and again before the
manifest commit, else the file is discarded and nothing is recorded; an empty save (a slot emptied by a
restart) is never recorded. A save never targets the newest generation that still verifies (the store
picks the target), so a failed save can never cost the last good snapshot.

Coalescing (spec §27): a session whose saved revision equals its dirty one is not saved again.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import dataclass
from functools import partial
from typing import Any

from kvsidecar.backend.base import SaveResult
from kvsidecar.config import Config
from kvsidecar.coordinator.costs import CostModel
from kvsidecar.coordinator.guard import PersistGuard, Persisting
from kvsidecar.coordinator.ownership import KeyOwnership
from kvsidecar.coordinator.runtime import RuntimeGuard
from kvsidecar.coordinator.server import ServerRuntime
from kvsidecar.coordinator.sessions import SessionEvent, SessionTable
from kvsidecar.coordinator.state import SessionRuntime, Slot
from kvsidecar.coordinator.telemetry import Telemetry
from kvsidecar.errors import Fenced, KvError, SaveFailed
from kvsidecar.fingerprint.runtime import RuntimeFingerprint
from kvsidecar.fingerprint.savepath import llama_save_dir
from kvsidecar.store.snapshots import SavePlan, SnapshotStore


@dataclass(frozen=True)
class _Written:
    """A save llama-server has written and the runtime bracket has vouched for: what the commit needs."""

    op: Persisting
    plan: SavePlan
    saved: SaveResult
    fingerprint: RuntimeFingerprint
    revision: int
    trigger: str
    started: float
    resident: bool


class Saver:
    def __init__(
        self,
        *,
        config: Config,
        store: SnapshotStore,
        sessions: SessionTable,
        guard: RuntimeGuard,
        persist: PersistGuard,
        telemetry: Telemetry,
        costs: CostModel,
        monotonic: Callable[[], float] = time.monotonic,
        ownership: KeyOwnership | None = None,
        after_save: Callable[[], None] | None = None,
    ) -> None:
        self.costs = costs
        self.ownership = ownership
        self.config = config
        self.store = store
        self.sessions = sessions
        self.guard = guard
        self.persist = persist
        self.telemetry = telemetry
        self.monotonic = monotonic
        # Called (on the loop) after every save attempt that wrote or failed to write: the daemon checks
        # its retention limits then (a full disk is a reason to run retention now).
        self.after_save = after_save

    def reconfigure(self, config: Config) -> None:
        """SIGHUP: the live configuration."""
        self.config = config

    async def save(
        self,
        srv: ServerRuntime,
        slot: Slot,
        rt: SessionRuntime,
        *,
        trigger: str,
        actions: list[str] | None = None,
        overlap: bool = False,
    ) -> bool:
        """Checkpoint the slot into the session's next generation. True if saved (or nothing to save).

        `overlap` (a switch's save): once llama-server has written the file and the closing bracket held,
        return, and let the commit (checksum, manifest) finish in `rt.pending_commit` while the caller
        restores the slot's next session; True then means "written, being committed". The session stays
        busy until the commit ends, and its own next acquire waits for it (`wait_commit`). Not in strict
        mode (its caller must see the failure) nor for a half-open breaker's trial."""
        if not rt.dirty:
            return True
        if self.ownership is not None:  # fleet: only the key's owner writes; a stale copy is given up
            claim = await self.ownership.claim(rt.key, keep=True)
            if not claim.write or claim.stale:
                self.telemetry.save_not_owner(srv.name, rt, trigger, claim.holder)
                return False  # nothing written (a stale copy is given up: nothing of it is worth saving)
        ready = srv.fingerprint is not None and srv.available
        async with contextlib.AsyncExitStack() as held:
            op = await held.enter_async_context(self.persist.persisting(srv, "save", slot=slot, ready=ready))
            if not op.allowed:
                self.telemetry.save_refused(srv.name, "KV_BACKEND_UNAVAILABLE")
                return False
            overlap = overlap and not op.trial and not self.config.failure.strict
            held.enter_context(self.sessions.busy_with(rt.key))
            # a switch's save: the slot is no longer the session's, so its own next acquire may take another
            # slot at once; it waits for this save from now on, the write included, not only the commit
            held.enter_context(self._in_flight(rt))
            commit = await self._write(op, srv, slot, rt, trigger=trigger)
            if commit is None:
                return False
            if overlap:  # the commit carries the operation and the busy mark on; written counts as saved
                rt.pending_commit = asyncio.get_running_loop().create_task(
                    self._commit_later(held.pop_all(), commit)
                )
                saved = True
            else:
                saved = await commit
            if saved and actions is not None:
                actions.append(f"save {rt.identity.short}")
            return saved

    @staticmethod
    @contextlib.contextmanager
    def _in_flight(rt: SessionRuntime) -> Iterator[None]:
        """While the save runs: `rt.pending_commit` is a future that ends with it, so `wait_commit` waits for
        the write too. An overlapped commit takes `pending_commit` over once the file is written, and this
        context with it (`held.pop_all()`): the future then ends with the commit."""
        ended: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        rt.pending_commit = ended
        try:
            yield
        finally:
            if rt.pending_commit is ended:
                rt.pending_commit = None
            ended.set_result(True)

    async def _commit_later(self, held: contextlib.AsyncExitStack, commit: Coroutine[Any, Any, bool]) -> bool:
        async with held:
            return await commit

    @staticmethod
    async def wait_commit(rt: SessionRuntime) -> None:
        """The session's overlapped commit, if one is running: wait for it (never cancelling it)."""
        task = rt.pending_commit
        if task is not None and not task.done():
            await asyncio.wait([task])

    async def _write(
        self, op: Persisting, srv: ServerRuntime, slot: Slot, rt: SessionRuntime, *, trigger: str
    ) -> Coroutine[Any, Any, bool] | None:
        """Have llama-server write the slot into the session's next generation, bracketed by the runtime
        check; returns the commit still to run, or None if nothing was written (already handled)."""
        mark, revision = self.guard.mark(srv), rt.dirty_revision
        fingerprint = mark.fingerprint
        resident = slot.owner == rt.key
        if not await self.guard.still(srv, mark):
            # The server restarted since this slot was filled: its content is gone, nothing to save.
            self.telemetry.save_refused(srv.name, "KV_SERVER_RESTARTED")
            op.void()
            return None
        assert fingerprint is not None
        self.sessions.apply(rt, SessionEvent.SAVE_BEGIN)
        self.telemetry.save_start(rt, trigger, slot.id)
        started = self.monotonic()
        plan: SavePlan | None = None
        try:
            plan = await self._begin(rt, fingerprint)
            if plan.retired is not None:  # its blocks are freed while the server writes (the commit or
                # abort deletes it too, if this has not yet: never on the path, never left behind)
                asyncio.get_running_loop().run_in_executor(None, self.store.drop_retired, plan)
            # llama-server writes <its --slot-save-path>/<name> by path: right before, that path (and the
            # configured one) must still lead to the directory the store holds, the name hold nothing
            # planted; right after, the same (else the server may have written elsewhere: not trusted).
            theirs = llama_save_dir(srv.process)
            self.store.check_save_target(plan, theirs)
            saved = await op.call(srv.backend.save_slot(slot.id, plan.filename))
            self.store.check_snapshot_dir(srv.name, theirs)
            if saved.tokens <= 0:
                raise SaveFailed("llama-server saved an empty slot (it lost the session's KV); not recorded")
            # The closing bracket: a file written by another instance is not this session's KV.
            if not await self.guard.still(srv, mark):
                raise SaveFailed("llama-server restarted during the save; the file is discarded")
        except BaseException as exc:
            await self._aborted(op, srv, slot, rt, plan, exc, trigger, resident=resident)
            return None
        step = _Written(op, plan, saved, fingerprint, revision, trigger, started, resident)
        return self._commit(srv, slot, rt, step)

    async def _begin(self, rt: SessionRuntime, fingerprint: RuntimeFingerprint) -> SavePlan:
        """The store's save plan, made in a thread. If this task is cancelled meanwhile, the thread still
        makes it (it claims names, and may move the old file aside): it is ended as soon as it comes."""
        loop = asyncio.get_running_loop()
        made = loop.run_in_executor(
            None, partial(self.store.begin_save, rt.identity, fingerprint=fingerprint)
        )
        try:
            return await asyncio.shield(made)
        except asyncio.CancelledError:
            made.add_done_callback(self._end_unused_plan)
            raise

    def _end_unused_plan(self, made: asyncio.Future[SavePlan]) -> None:
        if made.cancelled() or made.exception() is not None:
            return
        # Nothing was asked to write to it: the abort unclaims its names and deletes the old file it moved
        # aside, and deletes nothing else (a later save of the session may be writing the same name by now).
        asyncio.get_running_loop().run_in_executor(None, self.store.abort_save, made.result())

    async def _commit(self, srv: ServerRuntime, slot: Slot, rt: SessionRuntime, step: _Written) -> bool:
        """Check, hash and record the written file; only then does the manifest point at it. A cancel
        while the commit thread runs does not discard the file under it: the thread may be recording it
        in the manifest that moment. The file is discarded only if that commit then fails."""
        committing = asyncio.get_running_loop().run_in_executor(
            None,
            partial(
                self.store.commit_save,
                step.plan,
                step.saved,
                fingerprint=step.fingerprint,
                revision=step.revision,
                session_seq=rt.seq,
            ),
        )
        try:
            await asyncio.shield(committing)
        except asyncio.CancelledError as exc:
            committing.add_done_callback(partial(self._discard_if_failed, step.plan))
            await self._aborted(step.op, srv, slot, rt, None, exc, step.trigger, resident=step.resident)
            return False  # not reached: _aborted re-raises the cancel
        except BaseException as exc:
            await self._aborted(step.op, srv, slot, rt, step.plan, exc, step.trigger, resident=step.resident)
            return False
        finally:
            if rt.pending_commit is asyncio.current_task():  # the overlapped commit ends
                rt.pending_commit = None
        self._saved(srv, slot, rt, step)
        return True

    def _discard_if_failed(self, plan: SavePlan, committing: asyncio.Future[Any]) -> None:
        if committing.cancelled() or committing.exception() is not None:
            asyncio.get_running_loop().run_in_executor(
                None, partial(self.store.abort_save, plan, discard=True)
            )

    async def _aborted(
        self,
        op: Persisting,
        srv: ServerRuntime,
        slot: Slot,
        rt: SessionRuntime,
        plan: SavePlan | None,
        exc: BaseException,
        trigger: str,
        *,
        resident: bool,
    ) -> None:
        """A failed save (KvError: recorded, and re-raised in strict mode) or a cancelled one (re-raised):
        no half-written file left behind, no session stuck in SAVING."""
        if isinstance(exc, KvError):
            await self._failed(op, srv, slot, rt, plan, exc, trigger)
            return
        if plan is not None:  # a cancelled task cannot wait for a thread: the deletion runs on its own
            asyncio.get_running_loop().run_in_executor(
                None, partial(self.store.abort_save, plan, discard=True)
            )
        self._after_save()
        self.sessions.apply(rt, SessionEvent.SAVE_FAILED, resident=resident)
        raise exc

    async def _failed(
        self,
        op: Persisting,
        srv: ServerRuntime,
        slot: Slot,
        rt: SessionRuntime,
        plan: SavePlan | None,
        exc: KvError,
        trigger: str,
    ) -> None:
        if plan is not None:  # off the loop: it deletes the partial file
            await asyncio.to_thread(self.store.abort_save, plan, discard=True)
        if isinstance(exc, Fenced) and self.ownership is not None:  # another host took the key over
            await self.ownership.forget(rt.key)
        self._after_save()  # a full disk is a reason to run retention now
        op.failed(exc)
        self.telemetry.save_failed(srv.name, rt, trigger, exc)
        self.sessions.apply(rt, SessionEvent.SAVE_FAILED, resident=slot.owner == rt.key, error=exc.code)
        if self.config.failure.strict:
            raise exc

    def _saved(self, srv: ServerRuntime, slot: Slot, rt: SessionRuntime, step: _Written) -> None:
        step.op.succeeded()
        saved = step.saved
        resident = slot.owner == rt.key
        generation = step.plan.generation
        self.sessions.saved(
            rt, revision=step.revision, tokens=saved.tokens, generation=generation, resident=resident
        )
        self.costs.observe_transfer(
            srv.name,
            kind="save",
            nbytes=saved.bytes_written,
            tokens=saved.tokens,
            server_ms=saved.server_ms,
            measured_ms=saved.measured_ms,
        )
        elapsed_ms = (self.monotonic() - step.started) * 1000
        self.telemetry.saved(
            srv.name,
            rt,
            step.trigger,
            saved.tokens,
            saved.bytes_written,
            elapsed_ms,
            slot_ms=saved.measured_ms,
            server_ms=saved.server_ms,
        )
        self._after_save()

    def _after_save(self) -> None:
        if self.after_save is not None:
            self.after_save()
