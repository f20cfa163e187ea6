"""schemathesis against the daemon's own OpenAPI, over real HTTP: every route, generated and mutated
inputs, no 500, no hang, and every answer as the document declares it. The daemon's llama-server is
unreachable on purpose: every acquire then takes the cold-fallback path, which must hold up too."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from kvsidecar.testing.daemon import DaemonProcess
from kvsidecar.testing.llama import free_port

TOKEN = "fuzz-token-0123456789abcdef"


def test_schemathesis_finds_no_server_error(tmp_path: Path) -> None:
    st = shutil.which("schemathesis") or str(Path(sys.executable).with_name("schemathesis"))
    if not Path(st).exists():
        pytest.fail("schemathesis is a test dependency: pip install -e '.[test]'")
    daemon = DaemonProcess(
        tmp_path,
        base_url=f"http://127.0.0.1:{free_port()}",
        snapshot_dir=tmp_path / "snaps",
        token=TOKEN,
        servers={"local": {"slot_wait_s": 2}},
        api={"lease_ttl_s": 5},
        logging={"level": "warning"},
    ).start()
    try:
        url = daemon.url
        result = subprocess.run(
            [
                st,
                "run",
                f"{url}/openapi.json",
                "-H",
                f"Authorization: Bearer {TOKEN}",
                "--checks",
                # no 500, and every answer (status, body, content type, headers) as /openapi.json says
                "not_a_server_error,status_code_conformance,response_schema_conformance,"
                "content_type_conformance,response_headers_conformance",
                "--max-examples",
                "25",
                "--request-timeout",
                "10",
                "--seed",
                "7",
                "--no-color",
            ],
            capture_output=True,
            text=True,
            timeout=600,
            cwd=tmp_path,  # its example cache (.schemathesis/) stays out of the checkout
        )
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
        assert daemon.alive  # still up
        assert httpx.get(f"{url}/healthz").status_code == 200
    finally:
        daemon.stop()
