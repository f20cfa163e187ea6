"""Process discovery finds llama.cpp's server whether it runs as `llama-server` or as the unified binary's
`llama serve` (comm `llama`; a router's children carry LLAMA_APP_CMD=serve), and nothing else that is
called llama. tests/integration/test_llama_app_real.py finds a real `llama serve` process."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import psutil
import pytest

from kvsidecar.fingerprint.llama_process import find_llama_process, server_program


@pytest.mark.parametrize(
    ("cmdline", "name", "environ", "program"),
    [
        (["/usr/bin/llama-server", "-m", "x"], "llama-server", None, "llama-server"),
        (["/opt/llama/llama", "serve", "-m", "x"], "llama", None, "llama serve"),
        (["llama", "server", "--port", "1"], "llama", None, "llama server"),
        # a router that is the unified binary starts its children with the subcommand re-injected, and
        # LLAMA_APP_CMD in their environment
        (["/opt/llama/llama", "-m", "x"], "llama", {"LLAMA_APP_CMD": "serve"}, "llama serve"),
        (["/opt/llama/llama", "cli", "-m", "x"], "llama", {"LLAMA_APP_CMD": "cli"}, None),
        (["/opt/llama/llama", "bench", "-m", "x"], "llama", None, None),
        (["/usr/bin/python3", "serve.py"], "python3", {"LLAMA_APP_CMD": "serve"}, None),
        (["/usr/bin/nginx", "serve"], "nginx", None, None),
        ([], "llama", None, None),
    ],
)
def test_which_processes_run_the_server(
    cmdline: list[str], name: str, environ: dict[str, str] | None, program: str | None
) -> None:
    assert server_program(cmdline, name, environ) == program


class _Fake:
    """This test process, shown to discovery with another command line, name and environment."""

    def __init__(self, cmdline: list[str], name: str, environ: dict[str, str]) -> None:
        self._real = psutil.Process(os.getpid())
        self.info: dict[str, Any] = {
            "pid": os.getpid(),
            "name": name,
            "cmdline": cmdline,
            "create_time": self._real.create_time(),
            "exe": "/opt/llama/" + name,
        }
        self._environ = environ

    def environ(self) -> dict[str, str]:
        return self._environ

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._real, attr)


@pytest.fixture
def processes(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[_Fake]]:
    shown: list[_Fake] = []
    monkeypatch.setattr(psutil, "process_iter", lambda attrs=None: iter(shown))
    yield shown


def test_llama_serve_is_found_by_its_port(processes: list[_Fake]) -> None:
    processes.append(_Fake(["/opt/llama/llama", "cli", "--port", "8090"], "llama", {}))
    processes.append(_Fake(["/opt/llama/llama", "serve", "-m", "/m.gguf", "--port", "8090"], "llama", {}))
    found = find_llama_process("http://127.0.0.1:8090")
    assert found is not None and found.program == "llama serve"
    assert found.cmdline[:2] == ("/opt/llama/llama", "serve")
    assert found.settings.effective("model") == "/m.gguf" and "?positional" not in found.settings.values
    assert found.flags["port"] == "8090"
    assert find_llama_process("http://127.0.0.1:8091") is None


def test_a_router_child_is_found_by_its_environment(processes: list[_Fake]) -> None:
    env = {"LLAMA_APP_CMD": "serve", "LLAMA_ARG_PORT": "8092", "LLAMA_ARG_HOST": "127.0.0.1"}
    processes.append(_Fake(["/opt/llama/llama", "-m", "/m.gguf"], "llama", env))
    found = find_llama_process("http://127.0.0.1:8092")
    assert found is not None and found.program == "llama serve"
    assert found.environ is not None and found.environ.get("LLAMA_APP_CMD") == "serve"


def test_both_spellings_on_one_port_are_not_trusted(processes: list[_Fake]) -> None:
    processes.append(_Fake(["/usr/bin/llama-server", "--port", "8093"], "llama-server", {}))
    processes.append(_Fake(["/opt/llama/llama", "serve", "--port", "8093"], "llama", {}))
    assert find_llama_process("http://127.0.0.1:8093") is None
