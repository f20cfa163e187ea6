"""Each file of examples/ run as a user would (`python examples/X.py`, URLs and token from argv/env) against
`kvsidecar serve` and a real one-slot llama-server: the session switch A, A, B, A must show A's last turn
restored from disk and reused by the engine, in the example's own output and in the daemon's status."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from kvsidecar.testing.daemon import DaemonProcess
from tests.conftest import StartServer

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
TOKEN = "examples-token-0123456789abcdef"
SWITCH = ["cold", "resident", "cold", "restored"]  # A, A, B, A on one slot


@dataclass
class Setup:
    daemon: DaemonProcess

    def status(self) -> dict[str, Any]:
        return dict(httpx.get(f"{self.daemon.url}/v1/status", headers=self.daemon.auth).json())


@pytest.fixture
def setup(start_llama: StartServer, tmp_path: Path) -> Iterator[Setup]:
    llama = start_llama(ctx_size=4096)
    daemon = DaemonProcess(
        tmp_path / "d",
        base_url=llama.base_url,
        snapshot_dir=llama.save_dir,
        token=TOKEN,
        proxy={"enabled": True},
    ).start()
    try:
        yield Setup(daemon)
    finally:
        daemon.stop()


def run_example(name: str, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    """`python examples/<name> ...` from the repository's top, with only the given KVSIDECAR_* settings."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("KVSIDECAR_", "OPENAI_"))}
    return subprocess.run(
        [sys.executable, str(EXAMPLES / name), *args],
        cwd=REPO,
        env=clean | env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def turns(done: subprocess.CompletedProcess[str]) -> list[dict[str, Any]]:
    assert done.returncode == 0, done.stderr[-3000:]
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["session"] for r in rows] == ["A", "A", "B", "A"], done.stdout
    return rows


def assert_restored_once(setup: Setup) -> None:
    status = setup.status()
    assert status["stats"]["restore_hits"] == 1 and status["stats"]["restore_ineffective"] == 0
    assert status["leases"] == 0


def test_harness_loop_switches_sessions_and_restores(setup: Setup, tmp_path: Path) -> None:
    done = run_example("harness_loop.py", "--url", setup.daemon.url, "--json", KVSIDECAR_TOKEN=TOKEN)
    rows = turns(done)
    assert [r["outcome"] for r in rows] == SWITCH
    last = rows[-1]
    assert last["restored_tokens"] > 500 and last["reused"] > 500  # A's first two turns came from disk
    assert last["verification"] == "effective"  # the release carried the engine's numbers
    assert_restored_once(setup)
    # the other ways in: KVSIDECAR_URL and --token-file, and the plain output; a wrong token is refused
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    url = {"KVSIDECAR_URL": setup.daemon.url}
    plain = run_example("harness_loop.py", "--token-file", str(token_file), "--script", "C", **url)
    assert plain.returncode == 0, plain.stderr
    # cold: no snapshot of C; the slot's leftover KV may give a few tokens of common prefix (issue 28)
    m = re.fullmatch(r"turn 1  session C  outcome cold  computed (\d+)  reused (\d+)\n", plain.stdout)
    assert m is not None and int(m[2]) < 0.05 * int(m[1])
    refused = run_example("harness_loop.py", KVSIDECAR_TOKEN="x" * 32, **url)
    assert refused.returncode == 1 and "KV_UNAUTHORIZED" in refused.stderr


def test_openai_sdk_through_the_proxy(setup: Setup) -> None:
    url = f"{setup.daemon.proxy_url}/v1"
    done = run_example("openai_proxy.py", "--base-url", url, "--json", KVSIDECAR_TOKEN=TOKEN)
    rows = turns(done)
    assert [r["outcome"] for r in rows] == SWITCH
    assert int(rows[-1]["restored_tokens"]) > 500 and rows[-1]["reused"] > 500
    assert_restored_once(setup)
    refused = run_example("openai_proxy.py", KVSIDECAR_PROXY_URL=url, KVSIDECAR_TOKEN="x" * 32)
    assert refused.returncode == 1 and "proxy answered 401" in refused.stderr


def test_litellm_router_with_the_example_config(setup: Setup) -> None:
    url = f"{setup.daemon.proxy_url}/v1"
    done = run_example("litellm_router.py", "--json", KVSIDECAR_PROXY_URL=url, KVSIDECAR_TOKEN=TOKEN)
    rows = turns(done)
    assert [r["outcome"] for r in rows] == SWITCH
    assert int(rows[-1]["restored_tokens"]) > 500 and rows[-1]["reused"] > 500
    assert_restored_once(setup)


def test_litellm_config_forwards_the_session_header_for_its_model() -> None:
    """The LiteLLM proxy server forwards x- headers only for the model groups listed: ours must be."""
    config = yaml.safe_load((EXAMPLES / "litellm" / "config.yaml").read_text())
    names = [m["model_name"] for m in config["model_list"]]
    forwarded = config["litellm_settings"]["model_group_settings"]["forward_client_headers_to_llm_api"]
    assert names and set(forwarded) == set(names)
    params = config["model_list"][0]["litellm_params"]
    assert params["model"].startswith("openai/")  # any OpenAI-compatible server
    assert params["api_base"] == "os.environ/KVSIDECAR_PROXY_URL"
    assert params["api_key"] == "os.environ/KVSIDECAR_TOKEN"


def test_the_readme_example_is_the_harness_loops_turn() -> None:
    """README's Python block is harness_loop.py's `turn`, which the tests above run (a copy cannot drift)."""
    blocks = re.findall(r"^```python\n(.*?)^```$", (REPO / "README.md").read_text(), re.MULTILINE | re.DOTALL)
    assert blocks, "README.md has no ```python block"
    harness = {line.strip() for line in (EXAMPLES / "harness_loop.py").read_text().splitlines()}
    skip = ("import ", "from ", "with KvSidecar(")
    body = [line.strip() for line in blocks[0].splitlines() if line.strip()]
    missing = [line for line in body if not line.startswith(skip) and line not in harness]
    assert not missing, f"README lines not in examples/harness_loop.py: {missing}"
    assert any(line.startswith("with KvSidecar(") for line in body)
