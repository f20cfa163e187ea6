"""`kvsidecar serve` as a child process, as systemd would run it: for tests, the demo and benchmarks."""

from __future__ import annotations

import contextlib
import secrets
import signal
import subprocess
import sys
from pathlib import Path
from typing import IO, Any

import httpx
import yaml

from kvsidecar.testing.llama import free_port
from kvsidecar.testing.poll import eventually


def _merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in extra.items():
        out[key] = (
            _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
        )
    return out


class DaemonProcess:
    """Writes a config for one llama-server into `work`, runs the daemon, waits for /healthz."""

    def __init__(
        self,
        work: Path,
        *,
        base_url: str,
        snapshot_dir: Path,
        token: str | None = None,
        **overrides: Any,
    ) -> None:
        self.work, self.token = work, token or secrets.token_hex(16)
        work.mkdir(parents=True, exist_ok=True)
        (work / "token").write_text(self.token)
        self.port = free_port()
        config = {
            "state_dir": str(work / "state"),
            "servers": {"local": {"base_url": base_url, "snapshot_dir": str(snapshot_dir)}},
            "api": {"listen": f"127.0.0.1:{self.port}", "token_file": str(work / "token")},
        }
        self.config = _merge(config, overrides)
        proxy = self.config.get("proxy")
        if isinstance(proxy, dict) and proxy.get("enabled") and "listen" not in proxy:
            self.config["proxy"] = {**proxy, "listen": f"127.0.0.1:{free_port()}"}
        self.config_path = work / "config.yaml"
        self.config_path.write_text(yaml.safe_dump(self.config))
        self.log_path = work / "daemon.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def proxy_url(self) -> str:
        """The proxy listener (`proxy={"enabled": True}` without a `listen` gets a free loopback port)."""
        return f"http://{self.config['proxy']['listen']}"

    @property
    def auth(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.token}"}

    def start(self, *, timeout_s: float = 30.0) -> DaemonProcess:
        self._log = self.log_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvsidecar", "-c", str(self.config_path), "serve"],
            stdout=self._log,
            stderr=self._log,
        )
        try:
            eventually(self._answers, timeout_s=timeout_s, what="kvsidecar to answer /healthz")
        except AssertionError:  # it exited, or never answered
            self.stop()
            raise RuntimeError(f"kvsidecar did not start:\n{self.log()[-2000:]}") from None
        return self

    def _answers(self) -> bool:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError("kvsidecar exited")
        with contextlib.suppress(httpx.HTTPError):
            return httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200
        return False

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        assert self.proc is not None
        self.proc.send_signal(sig)

    def stop(self, *, timeout_s: float = 90.0) -> int | None:
        """SIGTERM (the shutdown checkpoint runs), wait; returns the exit code."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.proc.returncode if self.proc is not None else None

    def kill(self) -> None:
        """kill -9: what a crash looks like."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        if self._log is not None:
            self._log.close()
            self._log = None
