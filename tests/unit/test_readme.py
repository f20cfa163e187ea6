"""The README's Python example runs as written (watchfiles tests its docs the same way), and so do the
commands of its "Running it" on a fresh HOME.

Its ```python block is compiled from README.md itself, with the placeholders a harness would fill in
(`token`, `session_id`, `prompt`), and run (in a worker thread: the client is blocking) against the daemon
serving on a loopback port with the fake backend, its `httpx.post` to llama-server's /completion answered by
the fake: a change to the client's API that the README does not follow fails here.
tests/integration/test_readme_real.py runs the same block against a real llama-server.

"Running it" is run by bash as a new user would type it, on a fresh HOME, with `llama-server` a stand-in
that does what the real one does first (it exits "not a directory" when --slot-save-path is missing) and
`kvsidecar serve` replaced by `kvsidecar config check` (the integration test runs the real daemon and the
real llama-server).
"""

from __future__ import annotations

import ast
import asyncio
import contextlib
import inspect
import os
import re
import stat
import subprocess
import sys
import typing
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from types import CodeType
from typing import Any

import httpx
import pytest

from kvsidecar.backend.fake import FakeKvBackend
from kvsidecar.client import Lease
from kvsidecar.config import ApiConfig, load_config
from kvsidecar.coordinator.core import EventType
from kvsidecar.coordinator.state import Outcome
from kvsidecar.daemon.service import Daemon, build_server
from kvsidecar.store.naming import SnapshotIdentity
from kvsidecar.testing.llama import free_port
from kvsidecar.testing.poll import until
from tests.unit.coordinator_helpers import conversation, make_config

README = Path(__file__).resolve().parents[2] / "README.md"
TOKEN = "readme-example-token-0123456789"


@dataclass(frozen=True)
class Example:
    line: int  # of the block's first line in README.md
    source: str


def python_blocks(text: str) -> list[Example]:
    return [
        Example(text.count("\n", 0, m.start(1)) + 1, m.group(1))
        for m in re.finditer(r"^```python\n(.*?)^```$", text, re.MULTILINE | re.DOTALL)
    ]


def the_example() -> Example:
    blocks = python_blocks(README.read_text())
    assert len(blocks) == 1, "README.md has another ```python block: run it here too"
    return blocks[0]


def compiled(example: Example, url: str) -> CodeType:
    """The block as a program with top-level `async with`, pointed at `url` instead of the default address
    (which it must show). Its lines keep their README.md numbers, so a traceback points into the README."""
    default = f'"http://{ApiConfig().listen}"'
    assert example.source.count(default) == 1, f"the example no longer connects to {default}"
    source = "\n" * (example.line - 1) + example.source.replace(default, repr(url))
    code = compile(source, str(README), "exec", flags=ast.PyCF_ALLOW_TOP_LEVEL_AWAIT, dont_inherit=True)
    assert isinstance(code, CodeType)
    return code


async def run_example(code: CodeType, **placeholders: object) -> dict[str, Any]:
    """Run the compiled block with its placeholders defined, in a worker thread (the example uses the
    blocking client; the daemon may serve on this loop); returns the names it left behind."""
    namespace: dict[str, Any] = dict(placeholders)
    result = await asyncio.to_thread(eval, code, namespace)  # our own README
    if inspect.iscoroutine(result):  # an async example (top-level await)
        await result
    return namespace


def lease_of(namespace: dict[str, Any]) -> Lease:
    lease = namespace["lease"]
    assert isinstance(lease, Lease), lease
    assert lease.release_result is not None  # the `async with` released it
    return lease


def cache_n(namespace: dict[str, Any]) -> int:
    n = namespace["reply"]["timings"]["cache_n"]
    assert isinstance(n, int)
    return n


@dataclass
class Served:
    url: str
    daemon: Daemon
    fake: FakeKvBackend


@contextlib.asynccontextmanager
async def serve_daemon(tmp_path: Path) -> AsyncIterator[Served]:
    """`kvsidecar serve` in-process (API listener, lifespan, token auth) with the fake backend, one slot."""
    (tmp_path / "token").write_text(TOKEN)
    listen = f"127.0.0.1:{free_port()}"
    config = make_config(tmp_path, api={"listen": listen, "token_file": str(tmp_path / "token")})
    fake = FakeKvBackend(tmp_path / "snaps")
    server, socks, daemon = build_server(config, backends={"local": fake}, process_finder=None, watch=False)
    task = asyncio.ensure_future(server.serve(sockets=socks))

    def serving() -> bool:  # the lifespan startup ran and the socket listens
        if server.started:
            return True
        if task.done():
            task.result()
            raise AssertionError("the daemon stopped before it served")
        return False

    await until(serving, what="the daemon to serve")
    try:
        yield Served(f"http://{listen}", daemon, fake)
    finally:
        server.should_exit = True
        await task


class FakeReply:
    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body

    def raise_for_status(self) -> FakeReply:
        return self

    def json(self) -> dict[str, Any]:
        return self.body


def fake_completion(served: Served) -> Callable[..., FakeReply]:
    """The harness's own model call (`httpx.post` to llama-server's /completion), here on the fake backend."""

    def post(url: str, *, json: dict[str, Any], timeout: float) -> FakeReply:
        assert url == served.daemon.config.servers["local"].base_url + "/completion"
        assert json["id_slot"] is not None and json["cache_prompt"] is True
        prompt_n, cached = served.fake.infer(json["id_slot"], json["prompt"])
        timings = {"prompt_n": prompt_n, "cache_n": cached, "prompt_ms": 0.5 * prompt_n}
        return FakeReply({"content": "", "timings": timings})

    return post


async def test_the_readme_example_runs_against_the_daemon(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A, then B on the one slot, then A again: restored from the snapshot the example's flush wrote."""
    async with serve_daemon(tmp_path) as served:
        code = compiled(the_example(), served.url)
        monkeypatch.setattr(httpx, "post", fake_completion(served))

        async def turn(session: str, n: int) -> dict[str, Any]:
            prompt = conversation(session, n)
            return await run_example(code, token=TOKEN, session_id=session, prompt=prompt)

        first = await turn("A", 1)
        assert lease_of(first).outcome == "cold" and cache_n(first) == 0
        a = SnapshotIdentity(server="local", provider="local", model="qwen", session_id="A")
        manifest = served.daemon.store.get(a.key)
        assert manifest is not None and manifest.current is not None  # the example's flush saved it
        assert lease_of(await turn("B", 1)).outcome == "cold"
        again = await turn("A", 2)
        lease = lease_of(again)
        assert lease.outcome == "restored" and cache_n(again) == len(conversation("A", 1))
        # lease.report() reached the daemon: it checked the engine's reuse against what it restored
        assert lease.release_result is not None
        assert lease.release_result["restore_verification"] == "effective"


def test_the_example_names_only_real_outcomes_and_events() -> None:
    source = the_example().source
    outcomes = re.search(r"# lease\.outcome: (.*)", source)
    assert outcomes is not None
    assert outcomes.group(1).split(" | ") == [o.value for o in Outcome]
    events = re.search(r"# optional lifecycle hints: (.*), \.\.\.", source)
    assert events is not None
    assert set(events.group(1).split(", ")) <= set(typing.get_args(EventType))


def test_python_blocks_are_found_with_their_line_numbers() -> None:
    text = "intro\n```python\nx = 1\n```\n```bash\nls\n```\n```python\ny = 2\nz = 3\n```\n"
    assert python_blocks(text) == [Example(3, "x = 1\n"), Example(9, "y = 2\nz = 3\n")]


# "Running it" -------------------------------------------------------------------------------------------
def running_it() -> str:
    """The first ```bash block under README's "## Running it"."""
    text = README.read_text()
    section = text[text.index("\n## Running it\n") :]
    found = re.search(r"^```bash\n(.*?)^```$", section, re.MULTILINE | re.DOTALL)
    assert found is not None, 'README\'s "Running it" has no ```bash block'
    return found.group(1)


def save_path_of(command_line: str) -> str:
    found = re.search(r"--slot-save-path\s+(\S+)", command_line)
    assert found is not None, "README starts llama-server without --slot-save-path"
    return found.group(1)


def fresh_user(tmp_path: Path, bin_dir: Path) -> dict[str, str]:
    """The environment of a user who never ran kvsidecar: an empty HOME, our stand-ins first on PATH."""
    home = tmp_path / "home"
    home.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("KVSIDECAR_", "XDG_"))}
    return env | {"HOME": str(home), "PATH": f"{bin_dir}:{env.get('PATH', '')}"}


def stand_in(bin_dir: Path, name: str, script: str) -> None:
    bin_dir.mkdir(exist_ok=True)
    path = bin_dir / name
    path.write_text("#!/bin/bash\n" + script)
    path.chmod(0o755)


def test_running_it_works_as_written_on_a_fresh_home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bin_dir, record = tmp_path / "bin", tmp_path / "llama-server.record"
    stand_in(
        bin_dir,
        "llama-server",
        # llama-server's own first check (common/arg.cpp): the save path must be an existing directory
        f"""while [ $# -gt 0 ]; do [ "$1" = --slot-save-path ] && dir="$2"; shift; done
if [ -d "$dir" ]; then echo "started $dir" > {record}; else echo "not a directory: $dir" > {record}; exit 1; fi
""",
    )
    stand_in(
        bin_dir,
        "kvsidecar",
        f"""[ "$1" = serve ] && set -- config check  # no daemon in a unit test: it reads what serve would
exec {sys.executable} -m kvsidecar "$@"
""",
    )
    env = fresh_user(tmp_path, bin_dir)
    work = tmp_path / "work"  # an empty working directory: nothing of the checkout is there
    work.mkdir()
    block = running_it()
    done = subprocess.run(
        ["bash", "-e", "-c", block + "\nwait $!\n"],  # the last background job: llama-server
        cwd=work,
        env=env | {"PYTHONPATH": str(README.parent)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, (done.stdout, done.stderr)
    home = Path(env["HOME"])
    save_dir = Path(save_path_of(block).replace("~", str(home), 1))
    assert record.read_text().split() == ["started", str(save_dir)]
    config_file = home / ".config/kvsidecar/config.yaml"
    assert f"config file: {config_file}" in done.stdout and "config OK" in done.stdout
    monkeypatch.setenv("HOME", str(home))  # the config's `~` is that user's
    config = load_config(config_file, env={})
    assert config.servers["local"].snapshot_dir == save_dir  # kvsidecar manages what llama-server saves
    for made in (save_dir, config.state_dir, home / ".local/state/kvsidecar"):
        assert stat.S_IMODE(made.stat().st_mode) == 0o700, made
    assert list(work.iterdir()) == []


def test_running_it_starts_llama_server_only_after_its_save_directory_exists() -> None:
    """The order the README gives: whatever makes the snapshot directory comes before llama-server."""
    lines = [line for line in running_it().splitlines() if line.strip() and not line.startswith(" ")]
    llama = next(i for i, line in enumerate(lines) if line.startswith("llama-server "))
    assert any(line.startswith("kvsidecar config init") for line in lines[:llama]), lines
    assert "--no-dirs" not in " ".join(lines[:llama])
