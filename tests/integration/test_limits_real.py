"""`kvsidecar serve` under a low descriptor limit, flooded with half-sent requests (issue 16, item 13).

~1,100 unauthenticated partial requests used to exhaust 1,024 descriptors and /healthz stopped answering.
Here the daemon runs with 256 descriptors (soft and hard) and gets 300 half-sent requests on each
listener: the connection caps keep it far from the limit, /healthz and the proxy still answer, and every
partial request is closed once header_timeout_s has passed. Loopback only; no llama-server is needed.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from kvsidecar.testing.daemon import DaemonProcess
from kvsidecar.testing.llama import free_port
from tests.unit.rawhttp import closed_by_peer, open_socket

FLOOD = 300
NOFILE = 256


class LimitedDaemon(DaemonProcess):
    """The daemon started under `prlimit --nofile=N:N`, as a unit with a low LimitNOFILE would run it."""

    def start(self, *, timeout_s: float = 30.0) -> LimitedDaemon:
        self._log = self.log_path.open("ab")
        limited = ["prlimit", f"--nofile={NOFILE}:{NOFILE}", "--", sys.executable, "-m", "kvsidecar"]
        self.proc = subprocess.Popen(
            [*limited, "-c", str(self.config_path), "serve"],
            stdout=self._log,
            stderr=self._log,
        )
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                if httpx.get(f"{self.url}/healthz", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"kvsidecar did not start:\n{self.log()[-2000:]}")


@pytest.mark.skipif(shutil.which("prlimit") is None, reason="needs prlimit (util-linux)")
def test_half_sent_requests_cannot_exhaust_descriptors(tmp_path: Path) -> None:
    limits = {"max_connections": 32, "header_timeout_s": 2.0}
    daemon = LimitedDaemon(
        tmp_path,
        base_url=f"http://127.0.0.1:{free_port()}",  # nothing there: /healthz does not need it
        snapshot_dir=tmp_path / "snapshots",
        api=limits,
        proxy={"enabled": True, **limits},
    ).start()
    socks = []
    try:
        for url in (daemon.url, daemon.proxy_url):
            for _ in range(FLOOD):
                s = open_socket(url)
                s.sendall(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Never: ")
                socks.append(s)
        for _ in range(3):
            assert httpx.get(f"{daemon.url}/healthz", timeout=10).status_code == 200
        proxied = httpx.get(f"{daemon.proxy_url}/health", timeout=10)
        assert proxied.status_code == 502  # through the proxy to the absent llama-server: answered

        async def all_closed() -> list[bool]:
            return await asyncio.gather(*(closed_by_peer(s, within_s=30) for s in socks))

        assert all(asyncio.run(all_closed()))
        assert daemon.alive and httpx.get(f"{daemon.url}/healthz", timeout=10).status_code == 200
        assert "Too many open files" not in daemon.log()
    finally:
        for s in socks:
            s.close()
        daemon.stop()
