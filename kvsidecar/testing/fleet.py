"""A local fleet (docs/FLEET.md) on one machine: N hosts, each a real llama-server plus a `kvsidecar serve`.

Every host shares one directory: `<root>/shared/slots` is every llama-server's `--slot-save-path` and every
kvsidecar's `snapshot_dir`; `<root>/shared/meta` is `fleet.shared_dir`. Each host has its own work dir
(`<root>/<host id>`: state_dir, config, logs), API port and host id (`h1`, `h2`, ...), and all of them
point at one Redis URL with one API token. For the three-host tests and the routing benchmark.
"""

from __future__ import annotations

import contextlib
import secrets
import signal
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import yaml

from kvsidecar.testing.daemon import DaemonProcess, _merge
from kvsidecar.testing.llama import LlamaServer, Timings
from kvsidecar.testing.llama import complete as llama_complete
from kvsidecar.testing.poll import eventually

HOP_HEADER = "X-KV-Fleet-Hop"
# The hop count of a call a peer insists on (kvsidecar.fleet.routing.MAX_HOPS): served where it lands, never
# forwarded. (1 is a routed call: its receiver still follows a claim another host made meanwhile.)
SERVE_HERE = "2"
PROVIDER, MODEL = "local", "tiny"
# Short enough for tests: a dead or paused host drops out within 2 s.
TEST_FLEET: dict[str, Any] = {"heartbeat_s": 0.5, "host_ttl_s": 2.0, "owner_lease_ttl_s": 5.0}


@dataclass
class FleetHost:
    host_id: str
    llama: LlamaServer
    daemon: DaemonProcess
    paused: bool = False

    @property
    def url(self) -> str:
        """This host's kvsidecar hook API (its advertise_url)."""
        return self.daemon.url

    @property
    def auth(self) -> dict[str, str]:
        return self.daemon.auth

    def kill(self) -> None:
        """SIGKILL both processes: what a dead machine looks like to the rest of the fleet."""
        self.resume()
        self.daemon.kill()
        self.llama.kill()

    def pause(self) -> None:
        """SIGSTOP the kvsidecar only (its llama-server keeps running): a host frozen mid-run."""
        self.daemon.signal(signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        if self.paused and self.daemon.alive:
            self.daemon.signal(signal.SIGCONT)
        self.paused = False

    def restart_daemon(self, *, timeout_s: float = 60.0) -> None:
        """SIGTERM the kvsidecar (its shutdown checkpoint runs), start it again: same port, same config."""
        self.resume()
        self.daemon.stop(timeout_s=timeout_s)
        self.daemon.start()

    def stop(self) -> None:
        self.resume()
        try:
            self.daemon.stop(timeout_s=30.0)
        finally:
            self.llama.stop()


@dataclass
class LocalFleet:
    """`with LocalFleet(root, redis_url, binary=b, model=m) as fleet:` starts the hosts; exit stops them."""

    root: Path
    redis_url: str
    binary: Path
    model: Path
    n_hosts: int = 3
    # per host (index i is host h{i+1}); a missing or None entry: `model` / `extra_args`
    models: Sequence[Path | None] = ()
    extra_args: Sequence[str] = ("--cache-ram", "0")
    host_extra_args: Sequence[Sequence[str] | None] = ()
    parallel: int = 2
    ctx_size: int = 4096
    fleet: Mapping[str, Any] = field(default_factory=lambda: dict(TEST_FLEET))
    daemon_overrides: Mapping[str, Any] = field(default_factory=dict)
    token: str = field(default_factory=lambda: secrets.token_hex(16))
    hosts: list[FleetHost] = field(default_factory=list)

    @property
    def slots_dir(self) -> Path:
        return self.root / "shared" / "slots"

    @property
    def meta_dir(self) -> Path:
        return self.root / "shared" / "meta"

    def host(self, host_id: str) -> FleetHost:
        return next(h for h in self.hosts if h.host_id == host_id)

    def __enter__(self) -> LocalFleet:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        self.slots_dir.mkdir(parents=True, exist_ok=True)
        self.meta_dir.mkdir(parents=True, exist_ok=True)
        ids = [f"h{i + 1}" for i in range(self.n_hosts)]
        llamas = [self._llama(i, host_id) for i, host_id in enumerate(ids)]
        _parallel([s.start for s in llamas])
        daemons = [self._daemon(host_id, llama) for host_id, llama in zip(ids, llamas, strict=True)]
        self.hosts = [FleetHost(h, s, d) for h, s, d in zip(ids, llamas, daemons, strict=True)]
        _parallel([d.start for d in daemons])

    def _llama(self, i: int, host_id: str) -> LlamaServer:
        model = self.models[i] if i < len(self.models) else None
        args = self.host_extra_args[i] if i < len(self.host_extra_args) else None
        return LlamaServer(
            binary=self.binary,
            model=model or self.model,
            slot_save_path=self.slots_dir,
            log_path=self.root / host_id / "llama.log",
            ctx_size=self.ctx_size,
            parallel=self.parallel,
            extra_args=tuple(self.extra_args if args is None else args),
        )

    def _daemon(self, host_id: str, llama: LlamaServer) -> DaemonProcess:
        fleet = {
            "enabled": True,
            "redis_url": self.redis_url,
            "host_id": host_id,
            "shared_dir": str(self.meta_dir),
            **self.fleet,
        }
        overrides: dict[str, Any] = {"fleet": fleet}
        if self.parallel > 1:  # kvsidecar uses every slot only in managed-slots mode
            overrides["servers"] = {"local": {"mode": "managed-slots"}}
        daemon = DaemonProcess(
            self.root / host_id,
            base_url=llama.base_url,
            snapshot_dir=self.slots_dir,
            token=self.token,
            **_merge(overrides, dict(self.daemon_overrides)),
        )
        # the API port is chosen by DaemonProcess: advertise it explicitly, as an operator would
        daemon.config["fleet"]["advertise_url"] = daemon.url
        daemon.config_path.write_text(yaml.safe_dump(daemon.config))
        return daemon

    def stop(self) -> None:
        _parallel([h.stop for h in self.hosts], suppress=True)

    def wait_live(self, host_ids: Sequence[str] | None = None, *, timeout_s: float = 20.0) -> None:
        """Until every running host's status lists exactly `host_ids` (default: all hosts) as live."""
        want = sorted(host_ids if host_ids is not None else [h.host_id for h in self.hosts])
        askers = [h for h in self.hosts if h.host_id in want]
        eventually(
            lambda: all(live_hosts(h) == want for h in askers),
            timeout_s=timeout_s,
            what=f"every host to see {want} live",
        )


def _parallel(calls: Sequence[Callable[[], object]], *, suppress: bool = False) -> None:
    with ThreadPoolExecutor(max_workers=max(1, len(calls))) as pool:
        futures = [pool.submit(c) for c in calls]
    errors = [e for e in (f.exception() for f in futures) if e is not None]
    if errors and not suppress:
        raise errors[0]


# -- a small sync client ------------------------------------------------------------------------------


def call(
    host: FleetHost,
    method: str,
    path: str,
    body: Mapping[str, Any] | None = None,
    *,
    hop: bool = False,
    timeout_s: float = 120.0,
) -> httpx.Response:
    """One hook API call to `host` as is; `hop=True`: served there (the hop header of a peer that insists)."""
    headers = {**host.auth, **({HOP_HEADER: SERVE_HERE} if hop else {})}
    return httpx.request(method, f"{host.url}{path}", json=body, headers=headers, timeout=timeout_s)


def ok(response: httpx.Response) -> dict[str, Any]:
    if response.status_code != 200:
        raise AssertionError(
            f"{response.request.method} {response.request.url}: {response.status_code} {response.text}"
        )
    out = response.json()
    assert isinstance(out, dict), out
    return out


def acquire(host: FleetHost, sid: str, *, hop: bool = False, model: str = MODEL) -> dict[str, Any]:
    """POST /v1/sessions/{sid}/acquire: the answer (`host`, `base_url`, `slot_id`, `lease_id`, `outcome`)."""
    body = {"provider": PROVIDER, "model": model}
    return ok(call(host, "POST", f"/v1/sessions/{sid}/acquire", body, hop=hop))


def release_call(
    host: FleetHost, lease_id: str, *, status: str = "ok", **counts: int | float
) -> httpx.Response:
    return call(host, "POST", f"/v1/leases/{lease_id}/release", {"status": status, **counts})


def release(host: FleetHost, lease_id: str, *, status: str = "ok", **counts: int | float) -> dict[str, Any]:
    """Release a lease; `counts`: prompt_tokens, cached_tokens, prompt_ms."""
    return ok(release_call(host, lease_id, status=status, **counts))


def event(host: FleetHost, sid: str, kind: str, *, hop: bool = False) -> dict[str, Any]:
    return ok(call(host, "POST", f"/v1/sessions/{sid}/events", {"type": kind}, hop=hop))


def complete(base_url: str, slot_id: int, prompt: str, n_predict: int = 4) -> Timings:
    """llama-server /completion in `slot_id`, cache_prompt on: timings prompt_n (computed), cache_n (kept)."""
    return llama_complete(base_url, prompt, slot_id=slot_id, n_predict=n_predict)


def turn(host: FleetHost, sid: str, prompt: str, *, hop: bool = False) -> tuple[dict[str, Any], Timings]:
    """A harness turn at `host`: acquire, the model call where the answer says, release with the counts."""
    lease = acquire(host, sid, hop=hop)
    timings = complete(lease["base_url"], lease["slot_id"], prompt)
    release(host, lease["lease_id"], prompt_tokens=timings["prompt_n"], cached_tokens=timings["cache_n"])
    return lease, timings


def status(host: FleetHost) -> dict[str, Any]:
    return ok(call(host, "GET", "/v1/status", timeout_s=10.0))


def live_hosts(host: FleetHost) -> list[str]:
    """The live host ids this host's last heartbeat saw ([] when it cannot answer)."""
    with contextlib.suppress(httpx.HTTPError, AssertionError):
        fleet = status(host).get("fleet") or {}
        return sorted(fleet.get("hosts") or [])
    return []
