"""Doctor's checks of the llama-server process and what it runs: recent crashes of the configured server's
own processes (a SIGILL at an AMX/AVX instruction: a build this CPU cannot run), the flags that decide
whether a restore is reused (`--kv-unified` with idle-slot caching, the RAM prompt cache), the model's
memory class and what kvsidecar restores for it (`--swa-full` for a sliding-window model, with its memory
figure), whether the loaded model can be proven across a restart, and whether snapshots survive a
llama.cpp upgrade."""

from __future__ import annotations

from collections.abc import Callable

from kvsidecar.backend.base import BackendCapabilities
from kvsidecar.buildcheck import cpu_info, isa_flags
from kvsidecar.config import Config
from kvsidecar.doctor.report import DoctorReport, Status
from kvsidecar.fingerprint.llama_crashes import CrashRecord, CrashScope
from kvsidecar.fingerprint.llama_exit import crash_hint
from kvsidecar.fingerprint.llama_process import ProcessInfo
from kvsidecar.fingerprint.memory_class import HYBRID, RECURRENT, SWA, UNKNOWN
from kvsidecar.fingerprint.model_files import model_proof
from kvsidecar.fingerprint.server_memory import SWA_FULL_FIX, ServerMemory
from kvsidecar.store.state_format import KNOWN_VERSIONS as STATE_VERSIONS

# Reads the configured server's recent crashes (its processes, its units) and what their records say.
CrashReader = Callable[[CrashScope], CrashRecord]
_SMOKE = "check a binary with `python -m kvsidecar.buildcheck smoke BINARY MODEL`"


def crash_check(report: DoctorReport, running: bool, record: CrashRecord) -> None:
    """Has the configured llama-server been dying lately (issue 25)? Only its own processes' crashes count
    (`CrashScope`); the cause is named only where the record names it: a SIGILL at an AMX/AVX instruction
    is a build this CPU cannot run; a SIGILL without one is an instruction the CPU refused; a segfault is a
    crash, with no claim about the CPU."""
    signals = record.signals
    if not signals:
        return
    counts = ", ".join(f"{sig} x{signals.count(sig)}" for sig in dict.fromkeys(signals))
    status: Status = "FAIL" if len(signals) >= 2 or not running else "WARN"
    where = f" [{record.source}]"
    evidence = record.isa_crash
    if evidence is not None:
        model, flags = cpu_info()
        isa = " ".join(f for f in isa_flags(flags) if f.startswith(("avx512", "amx", "avx2", "avx_vnni")))
        detail = (
            f"llama-server was killed lately: {counts}{where}; the SIGILL was at an {evidence.isa} "
            f"instruction (in {evidence.where or '?'}) this CPU does not execute; CPU {model or '?'} "
            f"({isa or 'no AVX2'})"
        )
        report.add("llama-server crashes", status, detail, f"{crash_hint('SIGILL')}; {_SMOKE}")
    elif "SIGILL" in signals:
        detail = f"llama-server was killed lately: {counts}{where}; the record does not show the instruction"
        report.add("llama-server crashes", status, detail, f"{crash_hint('SIGILL')}; {_SMOKE}")
    else:
        detail = f"llama-server crashed lately: {counts}{where}"
        report.add("llama-server crashes", status, detail, crash_hint(signals[-1]))


def _model_identity(report: DoctorReport, caps: BackendCapabilities, process: ProcessInfo | None) -> None:
    """Can a snapshot saved now be restored after llama-server restarts (issue 26 A)?"""
    proof = model_proof(caps, process)
    if proof is not None:
        report.add("model identity", "WARN", f"{proof.code}: {proof.why}", proof.fix)
    elif process is not None:
        report.add("model identity", "OK", "the loaded model is proven by what llama-server maps")


def process_checks(
    report: DoctorReport,
    caps: BackendCapabilities,
    process: ProcessInfo | None,
    server: str,
    memory: ServerMemory,
) -> None:
    """The llama-server process of `server` (its name in the config), the flags it runs with, and its
    model's memory class (`memory`, read from the model's files and those flags)."""
    if process is None:
        _model_identity(report, caps, None)
        report.add(
            "llama-server process",
            "WARN",
            "not found on this host: its flags cannot be checked",
            f"if the server is remote, set servers.{server}.runtime_key and bump it on every change",
        )
        return
    flags = process.flags
    report.add(
        "llama-server process",
        "OK",
        f"pid {process.pid} ({process.program}); cache k/v {flags.get('cache_type_k', 'f16')}/"
        f"{flags.get('cache_type_v', 'f16')}, flash-attn {flags.get('flash_attn', 'auto')}, "
        f"kv-unified {flags.get('kv_unified', 'off')} (all part of the snapshot fingerprint)",
    )
    _model_identity(report, caps, process)
    memory_check(report, memory)
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


def memory_check(report: DoctorReport, memory: ServerMemory) -> None:
    """The model's memory class (read from its files and the server's settings) and what kvsidecar will
    and will not restore for it; `doctor --deep` confirms it on the server (`doctor.restore_check`). Only a
    sliding-window model without `--swa-full` is a warning: no restore of it is ever reused, so kvsidecar
    saves nothing there, and the fix's memory figure is given."""
    m, what = memory.memory, memory.describe()
    if memory.snapshot is not None:
        what += f" ({memory.snapshot.text()})"
    if m.kind == UNKNOWN:
        report.add("model memory", "SKIP", f"cannot tell the model's memory class: {m.why}")
    elif memory.swa_without_full:
        report.add(
            "model memory",
            "WARN",
            f"{what}: the saved file keeps only the window's positions and llama-server reuses no restore, "
            "not even of an exact extension; kvsidecar saves nothing on this server and restores nothing",
            f"{SWA_FULL_FIX}: {memory.swa_full_cost()}",
        )
    elif m.kind == SWA and not m.swa_full:
        report.add(
            "model memory",
            "WARN",
            f"{what}: without --swa-full no restore is reused; kvsidecar saves as usual until it can tell",
            "pass --swa-full (or its absence) on llama-server's command line, or let kvsidecar read its "
            "environment",
        )
    elif m.kind == SWA:
        report.add(
            "model memory",
            "OK",
            f"{what}: the saved file keeps only the window's positions, so kvsidecar restores only for a "
            "prompt that extends the saved tokens within one token of their end",
        )
    elif m.kind in (HYBRID, RECURRENT):
        ckpt = m.checkpoints
        fallback = (
            f"; resident, llama-server falls back to its {ckpt.max_per_slot} context checkpoints per slot"
            if ckpt is not None and ckpt.made
            else ""
        )
        report.add(
            "model memory",
            "OK",
            f"{what}: a restore is reused only when the next prompt extends the saved tokens exactly; "
            f"kvsidecar restores only then{fallback}",
        )
    else:
        report.add("model memory", "OK", f"{what}: a restore is reused for any common prefix")


def upgrade_check(report: DoctorReport, config: Config, server: str, version: int | None) -> None:
    """Will this server's snapshots survive a llama.cpp upgrade (issue 29)? Which state format it writes
    (`version`, from the save probe's file), and whether snapshots of another build are carried over when
    proven equivalent."""
    if not config.restore.carry_over_builds:
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
        canary = config.servers[server].runtime_canary
        carried = (
            "a snapshot of another build is carried over on its session's next acquire when only the "
            "build differs and the new build recomputes its first rows bit-identically"
        )
        report.add(
            "llama.cpp upgrades",
            "OK" if canary else "WARN",
            f"state format v{version}; "
            + (carried if canary else "with runtime_canary off no snapshot is carried over an upgrade"),
            "" if canary else f"set servers.{server}.runtime_canary: true",
        )
