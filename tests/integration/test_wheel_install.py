"""A pip user's first steps, with nothing from the git checkout: build the wheel, install it into a clean
venv (no system site-packages; dependencies from PyPI through pip's own cache), then, from an empty
directory with an empty HOME, `kvsidecar config init`, `config check`, `serve` against a real llama-server
(readiness by `kvsidecar wait-ready`), `status`, SIGTERM, and `install-systemd` into a temporary directory.

The venv is built once per module (wheel build and install: 19-34 s on 2 cores with a warm pip cache; the
whole module 30-55 s) and also serves the snapshot_dir vs --slot-save-path warning test.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvsidecar.testing.llama import free_port
from tests.conftest import StartServer

REPO = Path(__file__).resolve().parents[2]
# What a wheel is built from (the build runs on a copy: never in the checkout, which others may be using).
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "kvsidecar")


@dataclass(frozen=True)
class Installed:
    venv: Path
    wheel: Path
    seconds: float

    def env(self, home: Path) -> dict[str, str]:
        """A user's environment: the venv first on PATH, a HOME of its own, nothing of the checkout."""
        keep = {k: v for k, v in os.environ.items() if k in ("LANG", "LC_ALL", "TMPDIR", "TERM")}
        return {**keep, "HOME": str(home), "PATH": f"{self.venv / 'bin'}:/usr/bin:/bin"}

    def run(self, home: Path, cwd: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            [str(self.venv / "bin" / "kvsidecar"), *args],
            cwd=cwd,
            env=self.env(home),
            capture_output=True,
            text=True,
            timeout=120,
        )
        if check:
            assert result.returncode == 0, (args, result.stdout, result.stderr)
        return result


def _pip(python: Path, *args: str) -> None:
    subprocess.run(
        [str(python), "-m", "pip", "--disable-pip-version-check", "-q", *args], check=True, timeout=900
    )


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Installed]:
    start = time.monotonic()
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    src.mkdir()
    for name in SOURCES:
        path = REPO / name
        if path.is_dir():
            shutil.copytree(path, src / name, ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
        else:
            shutil.copy2(path, src / name)
    _pip(Path(sys.executable), "wheel", "--no-deps", "-w", str(work / "dist"), str(src))
    wheel = next((work / "dist").glob("kvsidecar-*.whl"))
    subprocess.run([sys.executable, "-m", "venv", str(work / "venv")], check=True, timeout=300)
    python = work / "venv" / "bin" / "python"
    _pip(python, "install", str(wheel))
    seconds = time.monotonic() - start
    print(f"\nwheel {wheel.name}: {wheel.stat().st_size} bytes; built and installed in {seconds:.1f}s")
    yield Installed(venv=work / "venv", wheel=wheel, seconds=seconds)


def _user(tmp_path: Path) -> tuple[Path, Path]:
    home, cwd = tmp_path / "home", tmp_path / "somewhere"
    home.mkdir()
    cwd.mkdir()
    return home, cwd


def _configure(path: Path, **changes: Any) -> None:
    """Edit the file `config init` wrote, as a user would (servers.local, state_dir, api.listen)."""
    data = yaml.safe_load(path.read_text())
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = data
        for part in parents:
            node = node[part]
        node[leaf] = value
    path.write_text(yaml.safe_dump(data))


def test_the_installed_venv_is_clean_and_has_the_package_data(installed: Installed, tmp_path: Path) -> None:
    home, cwd = _user(tmp_path)
    python = installed.venv / "bin" / "python"
    probe = (
        "import kvsidecar, sys, importlib.resources as r; "
        "print(kvsidecar.__file__); print(sys.flags.no_user_site); "
        "print(r.files('kvsidecar').joinpath('py.typed').is_file())"
    )
    out = subprocess.run(
        [str(python), "-c", probe],
        cwd=cwd,
        env=installed.env(home),
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert out[0].startswith(str(installed.venv)) and not out[0].startswith(str(REPO))
    assert out[2] == "True"
    assert "include-system-site-packages = false" in (installed.venv / "pyvenv.cfg").read_text()


def test_init_check_serve_install_systemd_from_the_wheel(
    installed: Installed, start_llama: StartServer, tmp_path: Path
) -> None:
    home, cwd = _user(tmp_path)
    llama = start_llama()
    # config init, with and without a file already there
    assert "wrote" in installed.run(home, cwd, "config", "init", "--path", "kv.yaml").stdout
    assert (
        "KV_CONFIG_EXISTS"
        in installed.run(home, cwd, "config", "init", "--path", "kv.yaml", check=False).stderr
    )
    if not Path("/etc/kvsidecar/config.yaml").exists():  # a machine set up for real has one
        assert installed.run(home, cwd, "config", "check").stdout.startswith("no config file found")
    port = free_port()
    _configure(
        cwd / "kv.yaml",
        servers__local__base_url=llama.base_url,
        servers__local__snapshot_dir=str(llama.save_dir),
        state_dir=str(tmp_path / "state"),
        api__listen=f"127.0.0.1:{port}",
    )
    checked = installed.run(home, cwd, "-c", "kv.yaml", "config", "check")
    assert checked.stdout.splitlines() == [f"config file: {cwd / 'kv.yaml'}", "config OK"]
    # serve, readiness, status, SIGTERM
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen(
        [str(installed.venv / "bin" / "kvsidecar"), "-c", "kv.yaml", "serve"],
        cwd=cwd,
        env=installed.env(home),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        installed.run(home, cwd, "-c", "kv.yaml", "wait-ready", "--timeout", "60")
        status = json.loads(installed.run(home, cwd, "-c", "kv.yaml", "status", "--json").stdout)
        assert [s["name"] for s in status["servers"]] == ["local"] and status["servers"][0]["available"]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
        log.close()
    text = (tmp_path / "serve.log").read_text()
    assert "kv.api.listening" in text and "KV_SAVE_PATH_MISMATCH" not in text
    # install-systemd, for a system layout, into a temporary directory, as an ordinary file write
    _configure(
        cwd / "kv.yaml",
        state_dir="/var/lib/kvsidecar/state",
        servers__local__snapshot_dir="/var/lib/kvsidecar/snapshots",
    )
    units = tmp_path / "units"
    installed.run(
        home, cwd, "-c", "kv.yaml", "install-systemd", "--dest", str(units),
        "--kvsidecar", "/opt/kvsidecar/bin/kvsidecar", "--config-path", str(cwd / "kv.yaml"),
        "--force",  # the config path must exist, and this one is under /tmp (PRIVATE_TMP)
    )  # fmt: skip
    assert sorted(p.name for p in units.iterdir()) == ["kvsidecar.service", "llama-server.service"]
    unit = (units / "kvsidecar.service").read_text()
    assert "/opt/kvsidecar/bin/kvsidecar" in unit and f"KVSIDECAR_CONFIG={cwd / 'kv.yaml'}" in unit


def test_serve_warns_when_llama_server_saves_elsewhere(
    installed: Installed, start_llama: StartServer, tmp_path: Path
) -> None:
    """The real llama-server saves into its --slot-save-path; kvsidecar is told another directory: serve
    starts (doctor explains more) but says so at WARNING with a stable code, naming both directories."""
    home, cwd = _user(tmp_path)
    llama = start_llama(slot_save_path=tmp_path / "llama-saves")
    installed.run(home, cwd, "config", "init", "--path", "kv.yaml")
    port = free_port()
    _configure(
        cwd / "kv.yaml",
        servers__local__base_url=llama.base_url,
        servers__local__snapshot_dir=str(tmp_path / "kv-snapshots"),
        state_dir=str(tmp_path / "state"),
        api__listen=f"127.0.0.1:{port}",
    )
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen(
        [str(installed.venv / "bin" / "kvsidecar"), "-c", "kv.yaml", "serve"],
        cwd=cwd,
        env=installed.env(home),
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    try:
        installed.run(home, cwd, "-c", "kv.yaml", "wait-ready", "--timeout", "60")
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=90) == 0
        log.close()
    warning = next(
        line for line in (tmp_path / "serve.log").read_text().splitlines() if "KV_SAVE_PATH_MISMATCH" in line
    )
    assert "WARNING" in warning and "kv.config.save_path_mismatch" in warning
    assert str(tmp_path / "llama-saves") in warning and str(tmp_path / "kv-snapshots") in warning
