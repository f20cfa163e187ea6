"""`doctor` (spec §34, §48, §61): is this llama-server set up so that kvsidecar can help, and does a restore
really get reused? `Doctor.run` runs every check of one server in order and returns a `DoctorReport`
(`doctor.report`); this module owns the order and the checks of the server's API (reachable, /slots, the
slot geometry the mode needs). The process and model checks are in `doctor.llama`, the host's directories
and disk in `doctor.host`, the probes in the snapshot directory in `doctor.probe`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Sequence
from pathlib import Path
from urllib.parse import urlsplit

from kvsidecar.backend.base import BackendCapabilities, BackendSlot, KvBackend
from kvsidecar.config import Config, Mode, ServerConfig
from kvsidecar.doctor.host import disk_check, state_dir_check
from kvsidecar.doctor.llama import CrashReader, crash_check, process_checks
from kvsidecar.doctor.probe import SlotHolder, SnapshotProbe
from kvsidecar.doctor.report import DoctorReport
from kvsidecar.errors import KvError
from kvsidecar.files.confined import DirAnchor
from kvsidecar.fingerprint.llama_crashes import CrashScope, ServedBy, recent_crashes, served_by
from kvsidecar.fingerprint.llama_process import ProcessInfo, find_llama_process
from kvsidecar.fingerprint.savepath import llama_save_dir
from kvsidecar.fingerprint.server_memory import read_server_memory


class Doctor:
    def __init__(
        self,
        *,
        config: Config,
        server: str,
        backend: KvBackend,
        process_finder: Callable[[str], ProcessInfo | None] = find_llama_process,
        hold_slot: SlotHolder | None = None,
        crash_reader: CrashReader = recent_crashes,
        snapshot_anchor: DirAnchor | None = None,
        served: Sequence[ServedBy] = (),
    ) -> None:
        """`served`: the processes the daemon has seen serve this server (`ExitWatch.served`): their
        crashes count, with the running one's; nobody else's."""
        self.config = config
        self.name = server
        self.server: ServerConfig = config.servers[server]
        self.backend = backend
        self.process_finder = process_finder
        self.crash_reader = crash_reader
        self.served = tuple(served)
        # snapshot_anchor: the daemon's held snapshot directory; None (the CLI): the configured one
        self.probe = SnapshotProbe(
            config=config, server=server, backend=backend, hold_slot=hold_slot, anchor=snapshot_anchor
        )

    async def run(self, *, deep: bool = False) -> DoctorReport:
        report = DoctorReport(server=self.name, endpoint=self.server.base_url)
        caps = await self._reachable(report)
        state_dir_check(report, self.config)
        disk_check(report, self.config.retention, self.server.snapshot_dir)
        if caps is None:
            await self._crashes(report, None)
            return report
        slots = await self._slots(report, caps)
        # a router's model runs in a child of its own: its process (its class) as the coordinator reads it
        process = self.process_finder(caps.process_url or self.server.base_url)
        theirs = llama_save_dir(process)  # llama-server's --slot-save-path as seen from here, when known
        await self._crashes(report, process)
        memory = await asyncio.to_thread(read_server_memory, caps, process)  # its model files, its flags
        process_checks(report, caps, process, self.name, memory)
        await self.probe.save_path(report, process, slots, theirs=theirs, deep=deep)
        if deep:
            await self.probe.restore_check(report, theirs, memory, caps.n_ctx)
        return report

    async def _crashes(self, report: DoctorReport, process: ProcessInfo | None) -> None:
        """The configured server's crashes: the process serving its port now and those seen serving it."""
        parts = urlsplit(self.server.base_url)
        port = str(parts.port or (443 if parts.scheme == "https" else 80))
        now = (served_by(process),) if process is not None else ()
        scope = CrashScope(port=port, processes=(*self.served, *now))
        record = await asyncio.to_thread(self.crash_reader, scope)  # the kernel log, journalctl, systemctl
        crash_check(report, process is not None, record)

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
