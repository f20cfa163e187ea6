"""Fleet mode through the proxy (docs/FLEET.md): a session's requests sent to any host's proxy listener land
on the host where its KV is warm, and move to another host from the shared directory when that host dies.
Two real llama-servers, two real kvsidecars with their proxies, a real redis-server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from kvsidecar.testing.fleet import SERVE_HERE, LocalFleet, event, live_hosts
from kvsidecar.testing.poll import eventually
from tests.fleet_helpers import RedisServer


@pytest.fixture
def fleet(
    tmp_path: Path, redis_server: RedisServer, llama_bin: Path, tiny_model: Path
) -> Iterator[LocalFleet]:
    with LocalFleet(
        tmp_path,
        redis_server.url,
        binary=llama_bin,
        model=tiny_model,
        n_hosts=2,
        parallel=1,
        daemon_overrides={"proxy": {"enabled": True}},
    ) as f:
        f.wait_live()
        yield f


def history(turns: int) -> str:
    return "".join(
        f" Turn {i}: the agent read file number {i} and wrote a summary of it." for i in range(turns)
    )


def ask(fleet: LocalFleet, host: str, session: str, turns: int) -> tuple[httpx.Response, dict[str, Any]]:
    """One model call through `host`'s proxy: the session's history so far."""
    h = fleet.host(host)
    r = httpx.post(
        f"{h.daemon.proxy_url}/completion",
        json={"prompt": history(turns), "n_predict": 4},
        headers={**h.auth, "X-Session-Id": session},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    return r, r.json()


def test_a_session_follows_its_kv_through_any_hosts_proxy(fleet: LocalFleet) -> None:
    first, _ = ask(fleet, "h1", "agent-7", 8)
    home = first.headers["x-kv-host"]
    assert first.headers["x-kv-outcome"] == "cold"
    other = "h2" if home == "h1" else "h1"
    # the next turn, sent to the OTHER host's proxy, is served where the session is resident
    second, body = ask(fleet, other, "agent-7", 10)
    assert second.headers["x-kv-host"] == home
    assert second.headers["x-kv-outcome"] == "resident"
    assert body["timings"]["cache_n"] > 0  # its history was not prefilled again
    assert "x-kv-fleet-host" not in second.headers  # the peer named itself to this host, not the client
    assert (
        httpx.get(f"{fleet.host(home).daemon.proxy_url}/health", headers=fleet.host(home).auth).status_code
        == 200
    )


def test_when_the_sessions_host_dies_its_proxy_calls_move_to_a_live_host(fleet: LocalFleet) -> None:
    first, _ = ask(fleet, "h1", "agent-9", 8)
    home = first.headers["x-kv-host"]
    other = "h2" if home == "h1" else "h1"
    assert event(fleet.host(home), "agent-9", "flush", hop=True)["saved"] == 1  # its last saved generation
    fleet.host(home).kill()
    after, body = ask(fleet, other, "agent-9", 10)  # at once: the dead host is still listed as live
    assert after.headers["x-kv-host"] == other
    assert after.headers["x-kv-outcome"] == "restored"
    assert int(after.headers["x-kv-restored-tokens"]) > 0
    assert body["timings"]["cache_n"] > 0
    eventually(lambda: live_hosts(fleet.host(other)) == [other] or None, what="the dead host to expire")


def test_a_forced_call_is_served_where_it_lands(fleet: LocalFleet) -> None:
    first, _ = ask(fleet, "h1", "agent-3", 6)
    home = first.headers["x-kv-host"]
    other = "h2" if home == "h1" else "h1"
    h = fleet.host(other)
    r = httpx.post(
        f"{h.daemon.proxy_url}/completion",
        json={"prompt": history(7), "n_predict": 4},
        headers={**h.auth, "X-Session-Id": "agent-3", "X-KV-Fleet-Hop": SERVE_HERE},
        timeout=120,
    )
    assert r.status_code == 200 and r.headers["x-kv-host"] == other
