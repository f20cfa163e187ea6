"""Doctor's checks in the snapshot directory itself: does llama-server save where kvsidecar manages
(`--slot-save-path`, proven by a probe save that must appear there), is the directory the daemon opened
still where the paths lead, and, with `--deep` (spec §61), does a restore really get reused (save, erase,
restore, the same prompt plus a few tokens, the engine's reuse read from cache_n: `doctor.restore_check`).
Every probe file is checked and removed through the held directory, never through its path."""

from __future__ import annotations

import contextlib
import os
import secrets
import stat
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from kvsidecar.backend.base import BackendSlot, KvBackend
from kvsidecar.config import Config, ServerConfig
from kvsidecar.doctor.llama import upgrade_check
from kvsidecar.doctor.report import DoctorReport
from kvsidecar.doctor.restore_check import Evidence, measure, probe_length, probe_prompts, verdict
from kvsidecar.errors import DirMoved, KvError
from kvsidecar.files.confined import DIR_MOVED, DirAnchor, lstat_at
from kvsidecar.fingerprint.llama_process import ProcessInfo
from kvsidecar.fingerprint.memory_class import SWA
from kvsidecar.fingerprint.server_memory import ServerMemory
from kvsidecar.store.integrity import header_from_fd
from kvsidecar.store.state_format import StateFormatError, parse
from kvsidecar.store.state_sections import MemoryLayout, layout_for

CHECK = "restore compatibility (deep)"
# Runs `fn(slot_id)` while the slot is held exclusively (in the daemon: an auxiliary lease).
SlotHolder = Callable[[Callable[[int], Awaitable[Any]]], Awaitable[Any]]


def _same_dir(a: str | Path, b: str | Path) -> bool:
    return os.path.realpath(os.path.expanduser(str(a))) == os.path.realpath(os.path.expanduser(str(b)))


class SnapshotProbe:
    """The probes of one server's snapshot directory. `theirs`, in each call: llama-server's
    --slot-save-path as seen from here, when known."""

    def __init__(
        self,
        *,
        config: Config,
        server: str,
        backend: KvBackend,
        hold_slot: SlotHolder | None,
        anchor: DirAnchor | None,
    ) -> None:
        self.config = config
        self.name = server
        self.server: ServerConfig = config.servers[server]
        self.backend = backend
        self.hold_slot = hold_slot
        # The daemon's held snapshot directory (its path must still lead there); None (the CLI): the
        # configured directory, opened for the first probe and checked before and after each.
        self.anchor = anchor
        self.daemon_anchor = anchor is not None

    def _held(self) -> DirAnchor:
        """The snapshot directory a probe file is checked and removed in (never through its path)."""
        if self.anchor is None:
            configured = self.server.snapshot_dir
            anchor = DirAnchor(Path(os.path.realpath(configured)), area="doctor", views=(str(configured),))
            anchor.hold()  # OSError: no such directory
            self.anchor = anchor
        return self.anchor

    def _dir_moved(self, report: DoctorReport, name: str, when: str, theirs: str | None) -> bool:
        """FAIL (and True) when the snapshot directory's path (or llama-server's) leads elsewhere than
        the directory held: a probe then writes nothing there, and deletes nothing through it."""
        try:
            why = self._held().moved(theirs)
        except OSError as exc:
            why = f"{self.server.snapshot_dir}: cannot open as a directory ({exc.strerror})"
        if why is None:
            return False
        report.add(name, "FAIL", f"{DIR_MOVED} {when}: {why}", DirMoved.default_hint)
        return True

    async def save_path(
        self,
        report: DoctorReport,
        process: ProcessInfo | None,
        slots: list[BackendSlot],
        *,
        theirs: str | None,
        deep: bool,
    ) -> None:
        ours = self.server.snapshot_dir
        if self.daemon_anchor and (not process or _same_dir(theirs or ours, ours)):
            # the daemon's: is the directory it opened at start still where the paths lead?
            if self._dir_moved(report, "snapshot directory", "(nothing is saved or restored there)", theirs):
                return
            report.add("snapshot directory", "OK", f"{ours} still leads to the directory opened at start")
        if process is not None:
            given = process.flags.get("slot_save_path")
            if not given:
                report.add(
                    "--slot-save-path",
                    "FAIL",
                    "llama-server runs without --slot-save-path",
                    f"add --slot-save-path {ours}",
                )
                return
            if not _same_dir(given, ours):
                report.add(
                    "--slot-save-path",
                    "FAIL",
                    f"llama-server saves into {given} but kvsidecar manages {ours}",
                    f"make servers.{self.name}.snapshot_dir and --slot-save-path the same directory",
                )
                return
        slot = next((s for s in slots if s.id == self.server.slot_id), slots[0] if slots else None)
        idle = slot is not None and not slot.is_processing and not slot.n_tokens
        if slot is None or not (idle or deep or self.hold_slot is not None):
            report.add(
                "--slot-save-path",
                "OK" if process else "SKIP",
                "same directory (from the command line)"
                if process
                else "slot in use: the save probe needs an idle slot or --deep",
            )
            return
        await self._probe_save(report, slot.id, theirs)

    async def _probe_save(self, report: DoctorReport, slot_id: int, theirs: str | None) -> None:
        name = f"kvsidecar-doctor-{secrets.token_hex(6)}.bin"

        async def probe(sid: int) -> None:
            await self.backend.save_slot(sid, name)

        if self._dir_moved(report, "--slot-save-path", "before the save probe; not run", theirs):
            return
        try:
            await (self.hold_slot(probe) if self.hold_slot else probe(slot_id))
        except KvError as exc:
            report.add("--slot-save-path", "FAIL", f"save probe failed: {exc.message}", exc.hint)
            return
        if self._dir_moved(report, "--slot-save-path", "during the save probe", theirs):
            return
        version = _probe_version(self._held(), name)
        if _remove_probe(self._held(), name):
            report.add("--slot-save-path", "OK", f"a probe save appeared in {self.server.snapshot_dir}")
            upgrade_check(report, self.config, self.name, version)
        else:
            report.add(
                "--slot-save-path",
                "FAIL",
                f"the server saved {name} somewhere else than {self.server.snapshot_dir}",
                f"make servers.{self.name}.snapshot_dir and --slot-save-path the same directory",
            )

    async def restore_check(
        self, report: DoctorReport, theirs: str | None, memory: ServerMemory, n_ctx: int | None
    ) -> None:
        """Spec §61 (`doctor.restore_check`): cold prompt, save, erase, restore, the same prompt plus a few
        tokens, reuse read from llama-server's cache_n, and the verdict for the server's memory class. On
        a held slot (the daemon's auxiliary lease: the slot's owner is checkpointed first and restores on
        its next request); the probe file is removed and the slot erased, whatever happens.

        Every call goes through the backend, so it carries llama-server's API key when one is configured."""
        stem = f"kvsidecar-doctor-{secrets.token_hex(6)}"
        name, second = f"{stem}.bin", f"{stem}-2.bin"
        layout = layout_for(memory.memory) if memory.kind == SWA else None

        async def run(slot_id: int) -> Evidence:
            anchor = self._held()
            try:
                prompts = await probe_prompts(self.backend, probe_length(memory, n_ctx))
                return await measure(
                    self.backend,
                    slot_id,
                    prompts,
                    names=(name, second),
                    ensure=lambda: anchor.ensure(theirs),  # the paths must lead to the held directory
                    window=lambda: _probe_window(anchor, name, layout),
                    size=lambda n: _probe_size(anchor, n),
                )
            finally:
                _remove_probe(anchor, name)
                _remove_probe(anchor, second)
                with contextlib.suppress(KvError):
                    await self.backend.erase_slot(slot_id)  # nothing of the probe stays in the slot

        try:
            evidence = await (self.hold_slot(run) if self.hold_slot else run(self.server.slot_id))
        except (KvError, OSError) as exc:
            report.add(CHECK, "FAIL", f"the check failed: {exc}")
            return
        found = verdict(memory, evidence)
        report.add(CHECK, found.status, f"{found.compatibility}: {found.detail}", found.fix)
        report.compatibility = {
            "verdict": found.compatibility,
            "memory": memory.to_dict(),
            "evidence": evidence.to_dict(),
        }


def _probe_version(anchor: DirAnchor, name: str) -> int | None:
    """The state-format version in a probe file's header (read in the held directory), or None."""
    with contextlib.suppress(OSError, KvError, ValueError), anchor.fd() as dfd:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
        try:
            return header_from_fd(fd, name).version
        finally:
            os.close(fd)
    return None


def _probe_window(anchor: DirAnchor, name: str, layout: MemoryLayout | None) -> tuple[int, int] | None:
    """The positions the SWA layers of a sliding-window model's probe file hold (read in the held
    directory, under the model's layout), or None."""
    if layout is None:
        return None
    with contextlib.suppress(OSError, KvError, ValueError, StateFormatError), anchor.fd() as dfd:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
        with os.fdopen(fd, "rb") as f:
            parts = parse(f, memory=layout).kv_parts
        positions = [p for s in (parts[1] if len(parts) > 1 else ()) for p in s.positions]
        return (min(positions), max(positions)) if positions else None
    return None


def _probe_size(anchor: DirAnchor, name: str) -> int | None:
    """A probe file's bytes (a regular file in the held directory, never followed through a link)."""
    with contextlib.suppress(OSError, KvError), anchor.fd() as dfd:
        st = lstat_at(name, dfd)
        return st.st_size if st is not None and stat.S_ISREG(st.st_mode) else None
    return None


def _remove_probe(anchor: DirAnchor, name: str) -> bool:
    """Remove a probe file through the held directory (never through its path, a link at the name is
    removed itself); whether one was there."""
    with contextlib.suppress(OSError, KvError), anchor.fd() as dfd:
        if lstat_at(name, dfd) is not None:
            os.unlink(name, dir_fd=dfd)
            return True
    return False
