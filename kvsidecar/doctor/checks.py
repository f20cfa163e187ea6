"""`doctor` (spec §34, §48, §61): is this llama-server set up so that kvsidecar can help, and does a restore
really get reused? Each check says OK / WARN / FAIL / SKIP with a one-line fix; the result is READY,
DEGRADED (works, but something costs speed or safety) or NOT READY.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import psutil

from kvsidecar.backend.base import BackendCapabilities, BackendSlot, KvBackend
from kvsidecar.buildcheck import cpu_info, isa_flags
from kvsidecar.config import Config, Mode, ServerConfig
from kvsidecar.errors import DirMoved, KvError
from kvsidecar.fingerprint.gguf_meta import GgufError, read_metadata, sliding_window
from kvsidecar.fingerprint.llama_exit import crash_hint, recent_crashes, unit_of
from kvsidecar.fingerprint.runtime import ProcessInfo, find_llama_process, model_proof
from kvsidecar.fingerprint.savepath import llama_save_dir
from kvsidecar.retention.job import free_floor_bytes
from kvsidecar.store.atomic import atomic_write_bytes
from kvsidecar.store.confined import DIR_MOVED, DirAnchor, lstat_at
from kvsidecar.store.integrity import header_from_fd
from kvsidecar.store.state_format import KNOWN_VERSIONS as STATE_VERSIONS

Status = Literal["OK", "WARN", "FAIL", "SKIP"]
# Runs `fn(slot_id)` while the slot is held exclusively (in the daemon: an auxiliary lease).
SlotHolder = Callable[[Callable[[int], Awaitable[Any]]], Awaitable[Any]]


@dataclass(kw_only=True)
class Check:
    name: str
    status: Status
    detail: str
    fix: str = ""


@dataclass(kw_only=True)
class DoctorReport:
    server: str
    endpoint: str
    checks: list[Check] = field(default_factory=list)

    @property
    def result(self) -> str:
        statuses = {c.status for c in self.checks}
        return "NOT READY" if "FAIL" in statuses else "DEGRADED" if "WARN" in statuses else "READY"

    def add(self, name: str, status: Status, detail: str, fix: str = "") -> None:
        self.checks.append(Check(name=name, status=status, detail=detail, fix=fix))

    def to_dict(self) -> dict[str, Any]:
        return {
            "server": self.server,
            "endpoint": self.endpoint,
            "result": self.result,
            "checks": [asdict(c) for c in self.checks],
        }


def _same_dir(a: str | Path, b: str | Path) -> bool:
    return os.path.realpath(os.path.expanduser(str(a))) == os.path.realpath(os.path.expanduser(str(b)))


class Doctor:
    def __init__(
        self,
        *,
        config: Config,
        server: str,
        backend: KvBackend,
        process_finder: Callable[[str], ProcessInfo | None] = find_llama_process,
        hold_slot: SlotHolder | None = None,
        crash_reader: Callable[[str | None], tuple[list[str], str]] = recent_crashes,
        snapshot_anchor: DirAnchor | None = None,
    ) -> None:
        self.config = config
        self.name = server
        self.server: ServerConfig = config.servers[server]
        self.backend = backend
        self.process_finder = process_finder
        self.hold_slot = hold_slot
        self.crash_reader = crash_reader
        # The daemon's held snapshot directory (its path must still lead there); None (the CLI): the
        # configured directory, opened for each probe and checked before and after it.
        self.snapshot_anchor = snapshot_anchor
        self.daemon_anchor = snapshot_anchor is not None
        self._theirs: str | None = None  # llama-server's --slot-save-path as seen from here, when known

    async def run(self, *, deep: bool = False) -> DoctorReport:
        report = DoctorReport(server=self.name, endpoint=self.server.base_url)
        caps = await self._reachable(report)
        self._metadata(report)
        self._disk(report)
        if caps is None:
            self._exits(report, None)
            return report
        slots = await self._slots(report, caps)
        process = self.process_finder(self.server.base_url)
        self._theirs = llama_save_dir(process)
        self._exits(report, process)
        self._process(report, caps, process)
        await self._save_path(report, process, slots, deep=deep)
        if deep:
            await self._deep(report)
        return report

    async def _reachable(self, report: DoctorReport) -> BackendCapabilities | None:
        try:
            caps = await self.backend.probe()
        except KvError as exc:
            report.add(
                "server reachable",
                "FAIL",
                exc.message,
                f"start llama-server or fix servers.{self.name}.base_url",
            )
            return None
        report.add(
            "server reachable",
            "OK",
            f"{caps.kind}, model {Path(caps.model_path or '?').name}, "
            f"build {caps.build_info}, {caps.total_slots} slot(s), n_ctx {caps.n_ctx}",
        )
        return caps

    async def _slots(self, report: DoctorReport, caps: BackendCapabilities) -> list[BackendSlot]:
        if not caps.slots_endpoint:
            report.add("/slots endpoint", "FAIL", "GET /slots is disabled", "start llama-server with --slots")
            return []
        if caps.sleeping:  # GET /slots would wake it (its model loaded again): only --deep does that
            report.add(
                "/slots endpoint",
                "SKIP",
                "llama-server is in sleep mode (--sleep-idle-seconds): not woken to list its slots",
            )
            return []
        slots = await self.backend.inspect_slots()
        ids = [s.id for s in slots]
        if self.server.mode is Mode.SINGLE_SLOT:
            if self.server.slot_id not in ids:
                report.add(
                    "slot geometry",
                    "FAIL",
                    f"slot {self.server.slot_id} not in {ids}",
                    f"set servers.{self.name}.slot_id to one of {ids}",
                )
            elif len(ids) > 1:
                report.add(
                    "slot geometry",
                    "WARN",
                    f"single-slot mode uses slot {self.server.slot_id} of {len(ids)}",
                    "use mode: managed-slots, or run llama-server with --parallel 1",
                )
            else:
                report.add("slot geometry", "OK", "single slot, as configured")
        else:
            report.add(
                "slot geometry",
                "OK" if len(ids) > 1 else "WARN",
                f"managed-slots over {len(ids)} slot(s)",
                "" if len(ids) > 1 else "run llama-server with --parallel N (N > 1)",
            )
        return slots

    def _exits(self, report: DoctorReport, process: ProcessInfo | None) -> None:
        """Has llama-server been dying with SIGILL/SIGSEGV (a build this CPU cannot run, issue 25)? Read from
        the unit's journal (the running process's unit, else `llama-server.service`) or the kernel log."""
        unit = (unit_of(process.pid) if process is not None else None) or "llama-server.service"
        signals, source = self.crash_reader(unit)
        if not signals:
            return
        counts = ", ".join(f"{sig} x{signals.count(sig)}" for sig in dict.fromkeys(signals))
        model, flags = cpu_info()
        isa = " ".join(f for f in isa_flags(flags) if f.startswith(("avx512", "amx", "avx2", "avx_vnni")))
        report.add(
            "llama-server crashes",
            "FAIL" if len(signals) >= 2 or process is None else "WARN",
            f"llama-server was killed lately: {counts} [{source}]; CPU {model or '?'} ({isa or 'no AVX2'})",
            crash_hint(signals[-1])
            + "; check a binary with `python -m kvsidecar.buildcheck smoke BINARY MODEL`",
        )

    def _model_identity(
        self, report: DoctorReport, caps: BackendCapabilities, process: ProcessInfo | None
    ) -> None:
        """Can a snapshot saved now be restored after llama-server restarts (issue 26 A)?"""
        proof = model_proof(caps, process)
        if proof is not None:
            report.add("model identity", "WARN", f"{proof.code}: {proof.why}", proof.fix)
        elif process is not None:
            report.add("model identity", "OK", "the loaded model is proven by what llama-server maps")

    def _process(self, report: DoctorReport, caps: BackendCapabilities, process: ProcessInfo | None) -> None:
        if process is None:
            self._model_identity(report, caps, None)
            report.add(
                "llama-server process",
                "WARN",
                "not found on this host: its flags cannot be checked",
                f"if the server is remote, set servers.{self.name}.runtime_key and bump it on every change",
            )
            return
        flags = process.flags
        report.add(
            "llama-server process",
            "OK",
            f"pid {process.pid}; cache k/v {flags.get('cache_type_k', 'f16')}/"
            f"{flags.get('cache_type_v', 'f16')}, flash-attn {flags.get('flash_attn', 'auto')}, "
            f"kv-unified {flags.get('kv_unified', 'off')} (all part of the snapshot fingerprint)",
        )
        self._model_identity(report, caps, process)
        self._swa(report, caps, flags)
        if flags.get("kv_unified") == "on" and flags.get("no_cache_idle_slots") != "on":
            report.add(
                "idle slot cache",
                "WARN",
                "--kv-unified with idle-slot caching clears a just-restored slot when another task starts",
                "add --no-cache-idle-slots",
            )
        cache_ram = flags.get("cache_ram", "8192")
        report.add(
            "RAM prompt cache",
            "OK",
            f"--cache-ram {cache_ram} MiB: recent switches may be served from RAM; "
            "kvsidecar covers restarts, eviction and the disk quota"
            if cache_ram != "0"
            else "--cache-ram 0: every warm start comes from kvsidecar's snapshots",
        )

    def _swa(self, report: DoctorReport, caps: BackendCapabilities, flags: dict[str, str]) -> None:
        try:
            window = sliding_window(read_metadata(Path(caps.model_path or "")))
        except (OSError, GgufError) as exc:
            report.add("sliding-window attention", "SKIP", f"cannot read the model's metadata ({exc})")
            return
        if window is None:
            report.add("sliding-window attention", "OK", "the model has no sliding-window layers")
        elif flags.get("swa_full") == "on":
            report.add("sliding-window attention", "OK", f"SWA model (window {window}) with --swa-full")
        else:
            report.add(
                "sliding-window attention",
                "WARN",
                f"SWA model (window {window}) without --swa-full: a restore "
                "answers 200 and the engine then recomputes everything",
                "add --swa-full to llama-server",
            )

    def _probe_anchor(self) -> DirAnchor:
        """The snapshot directory a probe file is checked and removed in (never through its path)."""
        if self.snapshot_anchor is None:
            configured = self.server.snapshot_dir
            anchor = DirAnchor(Path(os.path.realpath(configured)), area="doctor", views=(str(configured),))
            anchor.hold()  # OSError: no such directory
            self.snapshot_anchor = anchor
        return self.snapshot_anchor

    def _dir_moved(self, report: DoctorReport, name: str, when: str) -> bool:
        """FAIL (and True) when the snapshot directory's path (or llama-server's) leads elsewhere than
        the directory held: a probe then writes nothing there, and deletes nothing through it."""
        try:
            why = self._probe_anchor().moved(self._theirs)
        except OSError as exc:
            why = f"{self.server.snapshot_dir}: cannot open as a directory ({exc.strerror})"
        if why is None:
            return False
        report.add(name, "FAIL", f"{DIR_MOVED} {when}: {why}", DirMoved.default_hint)
        return True

    async def _save_path(
        self, report: DoctorReport, process: ProcessInfo | None, slots: list[BackendSlot], *, deep: bool
    ) -> None:
        ours = self.server.snapshot_dir
        if self.daemon_anchor and (not process or _same_dir(self._theirs or ours, ours)):
            # the daemon's: is the directory it opened at start still where the paths lead?
            if self._dir_moved(report, "snapshot directory", "(nothing is saved or restored there)"):
                return
            report.add("snapshot directory", "OK", f"{ours} still leads to the directory opened at start")
        if process is not None:
            theirs = process.flags.get("slot_save_path")
            if not theirs:
                report.add(
                    "--slot-save-path",
                    "FAIL",
                    "llama-server runs without --slot-save-path",
                    f"add --slot-save-path {ours}",
                )
                return
            if not _same_dir(theirs, ours):
                report.add(
                    "--slot-save-path",
                    "FAIL",
                    f"llama-server saves into {theirs} but kvsidecar manages {ours}",
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
        await self._probe_save(report, slot.id)

    async def _probe_save(self, report: DoctorReport, slot_id: int) -> None:
        name = f"kvsidecar-doctor-{secrets.token_hex(6)}.bin"

        async def probe(sid: int) -> None:
            await self.backend.save_slot(sid, name)

        if self._dir_moved(report, "--slot-save-path", "before the save probe; not run"):
            return
        try:
            await (self.hold_slot(probe) if self.hold_slot else probe(slot_id))
        except KvError as exc:
            report.add("--slot-save-path", "FAIL", f"save probe failed: {exc.message}", exc.hint)
            return
        if self._dir_moved(report, "--slot-save-path", "during the save probe"):
            return
        version = _probe_version(self._probe_anchor(), name)
        if _remove_probe(self._probe_anchor(), name):
            report.add("--slot-save-path", "OK", f"a probe save appeared in {self.server.snapshot_dir}")
            self._upgrades(report, version)
        else:
            report.add(
                "--slot-save-path",
                "FAIL",
                f"the server saved {name} somewhere else than {self.server.snapshot_dir}",
                f"make servers.{self.name}.snapshot_dir and --slot-save-path the same directory",
            )

    def _upgrades(self, report: DoctorReport, version: int | None) -> None:
        """Will this server's snapshots survive a llama.cpp upgrade (issue 29)? Which state format it writes,
        and whether snapshots of another build are carried over when proven equivalent."""
        if not self.config.restore.carry_over_builds:
            report.add(
                "llama.cpp upgrades",
                "WARN",
                "restore.carry_over_builds is off: after an upgrade every snapshot costs a cold prefill",
                "set restore.carry_over_builds: true",
            )
        elif version is None or version not in STATE_VERSIONS:
            report.add(
                "llama.cpp upgrades",
                "WARN",
                f"this build writes state format {'unknown' if version is None else f'v{version}'}, which "
                "kvsidecar cannot parse: after an upgrade its snapshots are cold starts",
                "use a llama.cpp build whose state format kvsidecar knows (v3, v4)",
            )
        else:
            canary = self.server.runtime_canary
            carried = (
                "a snapshot of another build is carried over on its session's next acquire when only the "
                "build differs and the new build recomputes its first rows bit-identically"
            )
            report.add(
                "llama.cpp upgrades",
                "OK" if canary else "WARN",
                f"state format v{version}; "
                + (carried if canary else "with runtime_canary off no snapshot is carried over an upgrade"),
                "" if canary else f"set servers.{self.name}.runtime_canary: true",
            )

    def _metadata(self, report: DoctorReport) -> None:
        probe = self.config.state_dir / f".doctor.tmp-{secrets.token_hex(4)}"
        try:
            self.config.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
            atomic_write_bytes(probe, b"ok")
            probe.unlink()
            report.add("state directory", "OK", f"{self.config.state_dir} is writable")
        except OSError as exc:
            report.add(
                "state directory",
                "FAIL",
                f"{self.config.state_dir}: {exc.strerror}",
                "create it and give kvsidecar's user write access",
            )

    def _disk(self, report: DoctorReport) -> None:
        directory = self.server.snapshot_dir
        try:
            usage = psutil.disk_usage(str(directory if directory.exists() else directory.parent))
        except OSError as exc:
            report.add("disk", "WARN", f"cannot read disk usage of {directory}: {exc.strerror}")
            return
        r = self.config.retention
        floor = (
            free_floor_bytes(
                total_bytes=usage.total, min_free_bytes=r.min_free_bytes, min_free_percent=r.min_free_percent
            )
            or 0
        )
        detail = f"{usage.free / 2**30:.1f} GiB free of {usage.total / 2**30:.1f} GiB"
        if floor and usage.free < floor:
            report.add(
                "disk",
                "WARN",
                f"{detail}: under the free-space floor ({floor / 2**30:.1f} GiB)",
                "free space, or lower retention.min_free_*: retention will delete snapshots to get there",
            )
        elif r.max_total_bytes and r.max_total_bytes > usage.free:
            report.add(
                "disk",
                "WARN",
                f"{detail}: retention.max_total_bytes ({r.max_total_bytes / 2**30:.1f} GiB) "
                "is more than is free",
                "lower retention.max_total_bytes",
            )
        else:
            report.add("disk", "OK", detail)

    async def _deep(self, report: DoctorReport) -> None:
        """Spec §61: cold prompt, save, erase, restore, identical prompt, confirm reuse from cache_n.

        Every call goes through the backend, so it carries llama-server's API key when one is configured."""
        prompt = " ".join(f"doctor{i} probe" for i in range(150))

        async def run(slot_id: int) -> tuple[int, int, int]:
            name = f"kvsidecar-doctor-{secrets.token_hex(6)}.bin"
            anchor = self._probe_anchor()
            await self.backend.erase_slot(slot_id)
            await self.backend.run_prompt(slot_id, prompt, n_predict=1)
            anchor.ensure(self._theirs)  # the paths must lead to the held directory, before and after
            saved = await self.backend.save_slot(slot_id, name)
            try:
                anchor.ensure(self._theirs)
                await self.backend.erase_slot(slot_id)
                await self.backend.restore_slot(slot_id, name)
                again = await self.backend.run_prompt(slot_id, prompt, n_predict=1)
            finally:
                _remove_probe(anchor, name)
            return saved.tokens, again.reused, again.computed

        try:
            saved, reused, computed = await (
                self.hold_slot(run) if self.hold_slot else run(self.server.slot_id)
            )
        except (KvError, OSError) as exc:
            report.add("restore reuse (deep)", "FAIL", f"the round trip failed: {exc}")
            return
        if saved and reused >= 0.9 * (saved - 2):
            report.add(
                "restore reuse (deep)",
                "OK",
                f"saved {saved} tokens; after erase+restore the engine reused "
                f"{reused} and computed {computed}",
            )
        else:
            report.add(
                "restore reuse (deep)",
                "WARN",
                f"saved {saved} tokens but the engine reused only {reused} after "
                "a restore: snapshots are useless on this model/build",
                "SWA model? add --swa-full; hybrid/recurrent models may not support reuse after restore",
            )


def _probe_version(anchor: DirAnchor, name: str) -> int | None:
    """The state-format version in a probe file's header (read in the held directory), or None."""
    with contextlib.suppress(OSError, KvError, ValueError), anchor.fd() as dfd:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dfd)
        try:
            return header_from_fd(fd, name).version
        finally:
            os.close(fd)
    return None


def _remove_probe(anchor: DirAnchor, name: str) -> bool:
    """Remove a probe file through the held directory (never through its path, a link at the name is
    removed itself); whether one was there."""
    with contextlib.suppress(OSError, KvError), anchor.fd() as dfd:
        if lstat_at(name, dfd) is not None:
            os.unlink(name, dir_fd=dfd)
            return True
    return False
