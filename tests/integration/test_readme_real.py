"""The README's Python example as a new user would run it: `kvsidecar serve` as its own process, a real
llama-server, and the example's own `httpx.post` to llama-server's /completion (the unit test uses the fake)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvsidecar.testing.daemon import DaemonProcess
from kvsidecar.testing.llama import words
from tests.conftest import StartServer
from tests.unit.test_readme import TOKEN, cache_n, compiled, lease_of, run_example, the_example


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
