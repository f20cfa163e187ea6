"""The README as a new user would follow it: its "Running it" commands on a fresh HOME with the real
llama-server and daemon, and its Python example: `kvsidecar serve` as its own process, a real llama-server,
and the example's own `httpx.post` to llama-server's /completion (the unit tests use stand-ins)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsidecar.client import KvSidecar
from kvsidecar.testing.daemon import DaemonProcess
from kvsidecar.testing.llama import free_port, words
from kvsidecar.testing.poll import eventually
from tests.conftest import StartServer
from tests.unit.test_readme import (
    README,
    TOKEN,
    cache_n,
    compiled,
    fresh_user,
    lease_of,
    run_example,
    running_it,
    stand_in,
    the_example,
)

REPO = README.parent


async def test_the_readme_example_on_a_real_llama_server(start_llama: StartServer, tmp_path: Path) -> None:
    server = start_llama()
    daemon = DaemonProcess(
        tmp_path / "d", base_url=server.base_url, snapshot_dir=server.save_dir, token=TOKEN
    )
    daemon.start()
    try:
        code = compiled(the_example(), daemon.url)

        async def turn(session: str, n: int) -> dict[str, Any]:
            prompt = words(session, 600 * n)
            return await run_example(code, token=TOKEN, session_id=session, prompt=prompt)

        first = await turn("A", 1)
        assert lease_of(first).outcome == "cold" and lease_of(first).base_url == server.base_url
        assert list(server.save_dir.glob("*.a.bin"))  # the example's flush event saved A
        assert lease_of(await turn("B", 1)).outcome == "cold"
        again = await turn("A", 2)
        lease = lease_of(again)
        assert lease.outcome == "restored" and cache_n(again) > 500  # A's first turn came back from disk
        assert lease.release_result is not None
        assert lease.release_result["restore_verification"] == "effective"
    finally:
        daemon.stop()


def test_running_it_on_a_fresh_home_with_a_real_llama_server(
    llama_bin: Path, tiny_model: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """README's "Running it" typed by a user who never ran kvsidecar: an empty HOME, an empty working
    directory with a model.gguf, the real llama-server and `kvsidecar serve`. Two liberties, both on the
    command line's edges: llama-server gets a free loopback port (and this test suite's small context and
    threads) appended, and the written config's ports are moved to free ones (other tests run here)."""
    llama_port, api_port, proxy_port = free_port(), free_port(), free_port()
    bin_dir = tmp_path / "bin"
    flags = f"--host 127.0.0.1 --port {llama_port} --ctx-size 4096 --threads 2 --no-webui --cache-ram 0"
    stand_in(bin_dir, "llama-server", f'exec {llama_bin} "$@" {flags}\n')
    ports = " ".join(
        f"-e 's#127.0.0.1:{default}#127.0.0.1:{port}#'"
        for default, port in ((8080, llama_port), (8377, api_port), (8378, proxy_port))
    )
    stand_in(
        bin_dir,
        "kvsidecar",
        f"""if [ "$1" = config ] && [ "$2" = init ]; then
  {sys.executable} -m kvsidecar "$@" || exit $?
  exec sed -i {ports} "${{XDG_CONFIG_HOME:-$HOME/.config}}/kvsidecar/config.yaml"
fi
exec {sys.executable} -m kvsidecar "$@"
""",
    )
    env = fresh_user(tmp_path, bin_dir) | {"PYTHONPATH": str(REPO)}
    work = tmp_path / "work"
    work.mkdir()
    (work / "model.gguf").symlink_to(tiny_model)
    log = (tmp_path / "running-it.log").open("wb")
    shell = subprocess.Popen(
        ["bash", "-e", "-c", running_it()],
        cwd=work,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # llama-server and the daemon: stopped together below
    )
    url = f"http://127.0.0.1:{api_port}"
    try:

        def serving() -> bool:
            if shell.poll() is not None:
                raise AssertionError(
                    f"exited {shell.returncode}:\n{(tmp_path / 'running-it.log').read_text()}"
                )
            with contextlib.suppress(httpx.HTTPError):
                status = httpx.get(f"{url}/v1/status", timeout=2).json()
                return bool(status["servers"][0]["available"])
            return False

        eventually(serving, timeout_s=180, what="llama-server and kvsidecar as README starts them")
        status = httpx.get(f"{url}/v1/status", timeout=5).json()
        local = status["servers"][0]
        assert local["persistence_now"]["state"] == "healthy", local
        assert local["warnings"] == []  # llama-server saves where kvsidecar reads (no save-path mismatch)
        home = Path(env["HOME"])
        save_dir = home / ".local/state/kvsidecar/snapshots"
        with KvSidecar(url) as kv:
            with kv.acquire("readme", provider="local", model="m") as lease:
                body = {"prompt": words("readme", 300), "id_slot": lease.slot_id, "n_predict": 2}
                reply = httpx.post(f"{lease.base_url}/completion", json=body, timeout=300).json()
                lease.report(prompt_tokens=reply["timings"]["prompt_n"], cached_tokens=0)
            assert kv.event("readme", "flush")["saved"] == 1
        assert list(save_dir.glob("*.bin"))  # llama-server wrote it, kvsidecar checked and kept it
        assert list(work.iterdir()) == [work / "model.gguf"]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(shell.pid, signal.SIGTERM)
        shell.wait(timeout=120)
        log.close()
