"""Security defaults: loopback only unless told otherwise, tokens, private directories and files."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kvsidecar.config import Config, config_from_mapping
from kvsidecar.daemon.listen import listen_sockets, read_token
from kvsidecar.errors import ConfigError
from kvsidecar.testing.llama import free_port
from tests.unit.store.test_snapshots import make_store, save


def cfg(tmp_path: Path, **api: object) -> Config:
    return config_from_mapping(
        {"state_dir": str(tmp_path / "s"), "api": {"listen": f"127.0.0.1:{free_port()}", **api}}
    )


def test_public_bind_is_refused_without_an_explicit_flag(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="allow_public_bind"):
        listen_sockets(config_from_mapping({"api": {"listen": f"0.0.0.0:{free_port()}"}}))


def test_public_bind_needs_a_token_even_when_allowed(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="token"):
        listen_sockets(
            config_from_mapping({"api": {"listen": f"0.0.0.0:{free_port()}", "allow_public_bind": True}})
        )


def test_unix_socket_is_0600(tmp_path: Path) -> None:
    socks = listen_sockets(cfg(tmp_path, unix_socket=str(tmp_path / "run" / "api.sock")))
    try:
        assert (tmp_path / "run" / "api.sock").stat().st_mode & 0o777 == 0o600
    finally:
        for s in socks:
            s.close()


def test_short_or_missing_token_file_is_a_config_error(tmp_path: Path) -> None:
    (tmp_path / "t").write_text("short")
    with pytest.raises(ConfigError, match="16"):
        read_token(cfg(tmp_path, token_file=str(tmp_path / "t")))
    with pytest.raises(ConfigError, match="cannot read"):
        read_token(cfg(tmp_path, token_file=str(tmp_path / "missing")))


def test_state_and_snapshot_dirs_are_0700_and_snapshots_0600(tmp_path: Path) -> None:
    old = os.umask(0)
    try:
        store = make_store(tmp_path)
        save(store, 10)
    finally:
        os.umask(old)
    for d in (store.manifests_dir, store.snapshot_dirs["local"]):
        assert d.stat().st_mode & 0o777 == 0o700
    for f in store.snapshot_dirs["local"].iterdir():
        assert f.stat().st_mode & 0o777 == 0o600
    for f in store.manifests_dir.iterdir():
        assert f.stat().st_mode & 0o777 == 0o600
