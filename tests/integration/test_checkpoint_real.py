"""A planned stop of llama-server loses no turn (`kvsidecar checkpoint`), on a real llama-server and the
real daemon (`kvsidecar serve`, kvsidecar/testing/daemon.py).

Two sessions on a `--parallel 2` pool each have an unsaved turn (no idle save, no background save: they
would come `idle_s` after the turn, or later). The rendered `llama-server.service`'s `ExecStop=` runs, its
exact argv as systemd would run it (systemd is not PID 1 here: the unit itself cannot be started); then
llama-server is stopped and started again, and each session's next turn is restored warm: llama-server's
`cache_n` shows the reuse. The same stop without the checkpoint loses each session's last turn (restored
from the checkpoint's older generation, it computes that turn again): the window the checkpoint closes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx

from kvsidecar.cli import main
from kvsidecar.client import KvSidecar, Lease
from kvsidecar.testing.daemon import DaemonProcess
from kvsidecar.testing.llama import LlamaServer, complete, words
from tests.conftest import StartServer

REPO = Path(__file__).resolve().parents[2]
TURN_TOKENS = 600


def exec_stop(units: Path) -> list[str]:
    """The argv of llama-server.service's `ExecStop=` as systemd runs it: the `-` (ignore failure) and `+`
    (full privileges) prefixes dropped, split on whitespace (install-systemd refuses quotes, `$`, `%` and
    spaces in what it renders, so systemd's own unquoting splits it the same way)."""
    (line,) = [
        x for x in (units / "llama-server.service").read_text().splitlines() if x.startswith("ExecStop=")
    ]
    command = line.removeprefix("ExecStop=")
    assert command.startswith("-+"), command
    return command[2:].split()


def run_as_systemd(argv: list[str]) -> subprocess.CompletedProcess[str]:
    """systemd's environment for a unit's command: no HOME or XDG, a plain PATH (and, for this checkout,
    the PYTHONPATH under test)."""
    env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
    env["PYTHONPATH"] = os.environ.get("PYTHONPATH", str(REPO))
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=180, cwd="/")


class Turns:
    """A harness over the hook API: each session's prompt grows by TURN_TOKENS a turn."""

    def __init__(self, daemon: DaemonProcess, server: LlamaServer) -> None:
        self.daemon, self.server, self.n = daemon, server, {"A": 0, "B": 0}

    def turn(self, session: str) -> tuple[Lease, int, int]:
        self.n[session] += 1
        prompt = words(session, TURN_TOKENS * self.n[session])
        with (
            KvSidecar(self.daemon.url, token=self.daemon.token) as kv,
            kv.acquire(session, provider="local", model="m") as lease,
        ):
            t = complete(self.server.base_url, prompt, slot_id=lease.slot_id, n_predict=2)
            lease.report(prompt_tokens=t["prompt_n"], cached_tokens=t["cache_n"], prompt_ms=t["prompt_ms"])
        return lease, t["prompt_n"], t["cache_n"]

    def unsaved(self) -> dict[str, int]:
        views = httpx.get(f"{self.daemon.url}/v1/sessions", headers=self.daemon.auth, timeout=30).json()
        return {v["id"]: v["unsaved_turns"] for v in views["sessions"]}


def test_exec_stop_saves_every_dirty_slot_and_a_restart_loses_no_turn(
    start_llama: StartServer, tmp_path: Path
) -> None:
    server = start_llama(parallel=2, ctx_size=8192)
    daemon = DaemonProcess(
        tmp_path / "d",
        base_url=server.base_url,
        snapshot_dir=server.save_dir,
        servers={"local": {"mode": "managed-slots"}},
        # only a checkpoint saves here: no idle save (30 s after a turn by default), no background save
        checkpoint={"idle_s": None, "max_unsaved_s": 0, "policy": "save-before-evict"},
    )
    daemon.start()
    try:
        harness = Turns(daemon, server)
        firsts = {s: harness.turn(s) for s in ("A", "B")}
        assert harness.unsaved() == {"A": 1, "B": 1} and not list(server.save_dir.glob("*.bin"))

        kvsidecar = shutil.which("kvsidecar", path=str(Path(sys.executable).parent))
        assert kvsidecar is not None
        units = tmp_path / "units"
        args = ["-c", str(daemon.config_path), "install-systemd", "--dest", str(units), "--force"]
        assert main([*args, "--kvsidecar", kvsidecar, "--llama-server", str(server.binary)]) == 0
        argv = exec_stop(units)
        assert argv == [
            kvsidecar,
            "-c",
            str(daemon.config_path),
            "checkpoint",
            "--server",
            "local",
            "--wait",
            "--timeout",
            "60",
        ]
        stopped = run_as_systemd(argv)
        assert stopped.returncode == 0, stopped.stderr
        assert stopped.stdout == "saved 2 dirty session(s) of local: nothing unsaved\n"
        assert harness.unsaved() == {"A": 0, "B": 0}  # committed before llama-server is told to stop

        server.restart()  # SIGTERM, as systemd sends it after ExecStop=; then started again
        seconds = {}
        for session in ("A", "B"):
            lease, prompt_n, cache_n = harness.turn(session)
            seconds[session] = prompt_n + cache_n
            first_prompt = firsts[session][1] + firsts[session][2]
            assert lease.outcome == "restored", (session, lease)
            # warm: the first turn's whole prompt is reused (llama-server's cache_n), only the new turn's
            # tokens are computed
            assert cache_n >= first_prompt - 8 and prompt_n <= prompt_n + cache_n - first_prompt + 8

        # the same planned stop without the checkpoint: each session's unsaved turn is gone with the slot
        assert harness.unsaved() == {"A": 1, "B": 1}
        server.restart()
        for session in ("A", "B"):
            lease, prompt_n, cache_n = harness.turn(session)
            # restored from the checkpoint's generation, a turn older: the lost turn is computed again
            assert lease.outcome == "restored", lease
            assert cache_n < seconds[session] - TURN_TOKENS // 2, (session, prompt_n, cache_n)
    finally:
        daemon.stop()


def test_exec_stop_fails_clearly_without_a_daemon_and_the_stop_goes_on(tmp_path: Path) -> None:
    """At shutdown kvsidecar stops first (its own checkpoint saved every slot): the ExecStop then finds no
    daemon, says so and exits 3; its `-` prefix lets systemd stop llama-server all the same."""
    config = tmp_path / "config.yaml"
    config.write_text(f"state_dir: {tmp_path / 'state'}\napi:\n  listen: 127.0.0.1:9\n")
    kvsidecar = shutil.which("kvsidecar", path=str(Path(sys.executable).parent))
    assert kvsidecar is not None
    done = run_as_systemd([kvsidecar, "-c", str(config), "checkpoint", "--server", "local", "--wait"])
    assert done.returncode == 3 and "kvsidecar is not reachable at http://127.0.0.1:9" in done.stderr
