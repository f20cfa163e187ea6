"""The `fleet:` config section and `kvsidecar fleet status` against a real redis-server."""

from __future__ import annotations

import asyncio
import json
import socket
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvsidecar.cli import main
from kvsidecar.config import FleetConfig, config_from_mapping
from kvsidecar.config.errors import ConfigInvalid
from kvsidecar.fleet.ownership import Leases
from kvsidecar.fleet.plane import FleetPlane, HostRecord, ServerRecord, connect
from tests.fleet_helpers import RedisServer

SECRET = "pw-s3cret-s3cret"


def problems(fleet: dict[str, Any], **more: Any) -> list[str]:
    with pytest.raises(ConfigInvalid) as caught:
        config_from_mapping({"fleet": fleet, **more})
    assert caught.value.code == "KV_CONFIG_INVALID"
    return list(caught.value.problems)


def test_fleet_is_off_by_default_and_defaults_are_the_documented_ones() -> None:
    fleet = config_from_mapping({}).fleet
    assert fleet == FleetConfig()
    assert (fleet.enabled, fleet.heartbeat_s, fleet.host_ttl_s, fleet.owner_lease_ttl_s) == (False, 2, 6, 30)
    assert fleet.host_id is None and fleet.effective_host_id() == socket.gethostname()
    assert config_from_mapping({}).advertise_url() == "http://127.0.0.1:8377"


@pytest.mark.parametrize(
    ("fleet", "expected"),
    [
        ({"host_id": "a b"}, "fleet.host_id: must be 1-64 characters"),
        ({"host_id": "x" * 65}, "fleet.host_id: must be 1-64 characters"),
        ({"host_id": "h:1"}, "fleet.host_id: must be 1-64 characters"),
        ({"key_prefix": "a/b"}, "fleet.key_prefix: must be 1-64 characters"),
        ({"redis_url": f"http://u:{SECRET}@h:6379"}, "fleet.redis_url: must be redis://"),
        ({"heartbeat_s": 0}, "fleet.heartbeat_s: Input should be greater than 0"),
        ({"enabled": True, "heartbeat_s": 6}, "fleet.host_ttl_s: must be longer than fleet.heartbeat_s"),
        ({"enabled": True, "owner_lease_ttl_s": 1}, "fleet.owner_lease_ttl_s: must be longer than"),
        ({"advertise_url": "peer:8377"}, "fleet.advertise_url: must be an http(s) URL"),
        ({"enabled": True, "host_id": "h1"}, "fleet.shared_dir: required when fleet.enabled"),
        (
            {"enabled": True, "host_id": "h1", "shared_dir": "~/.local/state/kvsidecar/state/meta"},
            "fleet.shared_dir: must be apart from state_dir",
        ),
    ],
)
def test_bad_fleet_settings_are_refused_by_key(fleet: dict[str, Any], expected: str) -> None:
    found = problems(fleet)
    assert any(p.startswith(expected) for p in found), found
    assert all(SECRET not in p for p in found)  # a password in a bad URL is never echoed


def test_a_wildcard_listener_needs_an_advertised_url() -> None:
    wildcard = {"listen": "0.0.0.0:8377", "allow_public_bind": True, "token_file": "/etc/kvsidecar/token"}
    shared = "/srv/kv/meta"
    found = problems({"enabled": True, "host_id": "h1", "shared_dir": shared}, api=wildcard)
    assert found == ["fleet.advertise_url: required when api.listen is the wildcard '0.0.0.0'"]
    ok = config_from_mapping(
        {
            "fleet": {
                "enabled": True,
                "host_id": "h1",
                "advertise_url": "http://10.0.0.5:8377",
                "shared_dir": shared,
            },
            "api": wildcard,
        }
    )
    assert ok.advertise_url() == "http://10.0.0.5:8377"


def test_the_redis_url_is_not_in_the_config_repr() -> None:
    config = config_from_mapping({"fleet": {"redis_url": f"redis://:{SECRET}@h:6379/0"}})
    assert SECRET not in repr(config) and SECRET not in repr(config.fleet)


def write_config(tmp_path: Path, redis: RedisServer, *, enabled: bool = True) -> Path:
    path = tmp_path / "config.yaml"
    fleet = {"enabled": enabled, "redis_url": redis.url, "host_id": "cli", "key_prefix": "t"}
    fleet["shared_dir"] = str(tmp_path / "shared")
    path.write_text(yaml.safe_dump({"state_dir": str(tmp_path / "state"), "fleet": fleet}))
    return path


async def register(redis: RedisServer) -> None:
    client = connect(redis.url, timeout_s=2.0)
    try:
        plane = FleetPlane(client, key_prefix="t", host_ttl_s=60)
        for host, free in (("h1", 1), ("h2", 0)):
            server = ServerRecord(
                name="local",
                base_url="http://127.0.0.1:8080",
                fingerprint="ab" * 32,
                slots_total=2,
                slots_free=free,
                slots_clean=1,
            )
            record = HostRecord(
                host_id=host,
                advertise_url=f"http://{host}:8377",
                version="0.1.0",
                time=1e10,  # in the future: an age of 0
                servers=(server,),
            )
            await plane.register(record)
        await plane.replace_residency("h1", {"a" * 32: ("local", 0), "b" * 32: ("local", 1)})
        await Leases(client, key_prefix="t").campaign("h2", 60)
    finally:
        await client.aclose()


@pytest.fixture
def password_redis(tmp_path: Path) -> Any:
    server = RedisServer(tmp_path / "redis", password=SECRET).start()
    yield server
    server.stop()


async def test_fleet_status_reports_hosts_sessions_and_leader(
    tmp_path: Path, password_redis: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    await register(password_redis)
    path = write_config(tmp_path, password_redis)
    assert await _cli(["-c", str(path), "fleet", "status", "--json"]) == 0
    out, err = capsys.readouterr()
    report = json.loads(out)
    assert report["redis"]["up"] and report["redis"]["ping_ms"] >= 0 and report["leader"] == "h2"
    assert report["redis"]["url"] == f"redis://:***@127.0.0.1:{password_redis.port}/0"
    hosts = {h["host_id"]: h for h in report["hosts"]}
    assert hosts["h1"]["sessions"] == 2 and hosts["h2"]["sessions"] == 0
    assert hosts["h1"]["servers"][0] == {
        "name": "local",
        "base_url": "http://127.0.0.1:8080",
        "fingerprint": "ab" * 6,
        "slots_total": 2,
        "slots_free": 1,
        "slots_clean": 1,
    }
    assert hosts["h1"]["age_s"] == 0
    assert await _cli(["-c", str(path), "fleet", "status"]) == 0
    text, _ = capsys.readouterr()
    assert "leader   h2" in text and "hosts    2" in text and "local 1/1/2" in text
    assert SECRET not in out + err + text


async def test_fleet_status_with_redis_down_exits_3_without_the_password(
    tmp_path: Path, password_redis: RedisServer, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_config(tmp_path, password_redis, enabled=False)
    password_redis.stop()
    assert await _cli(["-c", str(path), "fleet", "status", "--timeout", "0.5"]) == 3
    out, err = capsys.readouterr()
    assert "DOWN (ConnectionError)" in out and "fleet.enabled is false" in err
    assert SECRET not in out + err


async def _cli(argv: list[str]) -> int:
    """main() runs its own event loop (asyncio.run): run it in a thread, off this test's loop."""
    return await asyncio.to_thread(main, argv)
