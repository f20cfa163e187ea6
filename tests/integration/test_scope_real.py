"""One credential's KV is never lent to another's request, against a real llama-server (docs/CLIENTS.md,
"Credential scopes"; coordinator/scope.py).

First what llama-server 11434 itself does, which the rule relies on (a test here fails if a build changes
it): `cache_prompt: false` reuses nothing; its RAM prompt cache (`--cache-ram`, on by default) is shared by
every slot and client, and a request pinned to a non-empty slot whose prompt keeps less than half of it is
given the best match from it; a request pinned to an empty slot is never given anything from it, nor is any
pinned request with `--slot-prompt-similarity 0`; a slot that never ran a task shows no `id_task`.

Then through kvsidecar's proxy, two clients with their own keys ("alice", "bob") and no `api.token_file`:
on one slot and on two, with the RAM cache on (the default) and with `--cache-ram 0`, bob never reuses a
token of alice's on any path (the same session id, an id-less chat, a title, `/completion`,
`/v1/completions`, a prefix donor, `/infill` and `/v1/embeddings` on one slot, the hook API's `prefix_from`,
after a kvsidecar restart), nor learns her secret by guessing one digit per turn of hers: llama-server's
`cache_n` for him is never more than the tokens his own earlier requests (or kvsidecar's own few tokens)
computed. With the operator's token all proxy clients are one scope by design, and they do share.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest

from kvsidecar.backend.llama_http import find_timings
from kvsidecar.coordinator.scope import PARK_PROMPT
from kvsidecar.testing.daemon import DaemonProcess
from kvsidecar.testing.llama import LlamaServer, words
from kvsidecar.testing.models import chat_template
from tests.conftest import StartServer
from tests.integration.test_agent_clients_real import CTX as AGENT_CTX
from tests.integration.test_agent_clients_real import TEMPLATE as AGENT_TEMPLATE
from tests.integration.test_agent_clients_real import agent_model, send
from tests.unit.client_fixtures import load

__all__ = ["agent_model"]  # the generated model with a large context, for agent prompts (a fixture)
SECRET = "4719"
TOKEN = "scope-token-" + "x" * 20
CTX = 4096
MODEL = "tiny"


# -- llama-server alone: what the rule relies on ----------------------------------------------------------
def complete(url: str, prompt: str, slot: int, *, cache_prompt: bool = True) -> tuple[int, int]:
    body = {"prompt": prompt, "n_predict": 2, "temperature": 0, "cache_prompt": cache_prompt, "id_slot": slot}
    timings = httpx.post(f"{url}/completion", json=body, timeout=300).raise_for_status().json()["timings"]
    return int(timings["prompt_n"]), int(timings["cache_n"])


def erase(url: str, slot: int) -> None:
    httpx.post(f"{url}/slots/{slot}?action=erase", timeout=60).raise_for_status()


ALICE = words("alice", 400) + " the secret is " + " ".join(SECRET)
OTHER = words("bob", 200)


@pytest.mark.parametrize(
    ("extra", "ram_lookups"),
    [((), True), (("--slot-prompt-similarity", "0"), False), (("--cache-ram", "0"), False)],
    ids=["default", "sps-0", "cache-ram-0"],
)
def test_what_llama_server_reuses_for_a_pinned_request(
    start_llama: StartServer, extra: tuple[str, ...], ram_lookups: bool
) -> None:
    llama = start_llama(ctx_size=CTX, extra_args=extra)
    url = llama.base_url
    assert not any("id_task" in s for s in httpx.get(f"{url}/slots").json())  # never ran a task
    alice_n = sum(complete(url, ALICE, 0))
    assert all("id_task" in s for s in httpx.get(f"{url}/slots").json())
    assert complete(url, ALICE, 0, cache_prompt=False) == (alice_n, 0)  # nothing reused
    complete(url, OTHER, 0)  # a non-empty slot, little kept: alice's KV is copied into the RAM cache
    erase(url, 0)
    assert complete(url, ALICE, 0) == (alice_n, 0)  # an empty slot: the RAM cache is never asked
    complete(url, OTHER, 0)
    computed, reused = complete(url, ALICE, 0)  # a non-empty slot, little kept: the RAM cache is asked
    assert (reused >= alice_n - 4) is ram_lookups, (computed, reused)


def test_llama_servers_ram_cache_is_shared_by_every_slot(start_llama: StartServer) -> None:
    llama = start_llama(ctx_size=2 * CTX, parallel=2, extra_args=())
    url = llama.base_url
    alice_n = sum(complete(url, ALICE, 0))
    complete(url, OTHER, 1)  # slot 0, idle, is copied into the RAM cache when this task starts
    erase(url, 1)
    assert complete(url, ALICE, 1) == (alice_n, 0)  # an empty slot: never given anything
    erase(url, 1)
    complete(url, OTHER, 1)
    computed, reused = complete(url, ALICE, 1)  # slot 1 never kept alice's KV: slot 0's, through the cache
    assert reused >= alice_n - 4, (computed, reused)


# -- through kvsidecar ------------------------------------------------------------------------------------
@dataclass
class Rig:
    llama: LlamaServer
    daemon: DaemonProcess
    token: bool
    # every prompt (as llama-server's tokens) bob's own requests computed, and kvsidecar's own few tokens
    own: list[list[int]] = field(default_factory=list)
    turns: int = 0

    def tokens(self, text: str) -> list[int]:
        body = {"content": text, "add_special": True}
        out = httpx.post(f"{self.llama.base_url}/tokenize", json=body, timeout=60).raise_for_status().json()
        return [int(t) for t in out["tokens"]]

    def rendered(self, path: str, body: dict[str, Any]) -> str:
        """The prompt llama-server computes for a request to `path`."""
        if "messages" not in body:
            return str(body.get("prompt", body.get("input_prefix", "")))
        applied = httpx.post(f"{self.llama.base_url}/apply-template", json=body, timeout=60)
        return str(applied.raise_for_status().json()["prompt"])

    def send(self, who: str, path: str, body: dict[str, Any], sid: str | None = None) -> httpx.Response:
        headers = {"Authorization": f"Bearer {TOKEN if self.token else who + '-key-0123456789'}"}
        if sid is not None:
            headers["X-Session-Id"] = sid
        return httpx.post(f"{self.daemon.proxy_url}{path}", json=body, headers=headers, timeout=300)

    def alice(self, path: str, body: dict[str, Any], sid: str | None = None) -> httpx.Response:
        answer = self.send("alice", path, body, sid)
        assert answer.status_code == 200, answer.text[:300]
        return answer

    def bob(self, path: str, body: dict[str, Any], sid: str | None = None) -> Found:
        """Bob's request, and the most his own earlier requests (or kvsidecar's few tokens) explain."""
        prompt = self.tokens(self.rendered(path, body))
        own = max((common(prompt, t) for t in [*self.own, self.tokens(PARK_PROMPT)]), default=0)
        answer = self.send("bob", path, body, sid)
        assert answer.status_code == 200, answer.text[:300]
        counts = find_timings(answer.text)
        assert counts is not None, answer.text[:300]
        self.own.append(prompt)
        return Found(int(counts["cache_n"]), own, len(prompt), int(counts["prompt_n"]))


class Found(NamedTuple):
    reused: int  # llama-server's cache_n
    own: int  # the most bob's own earlier requests explain
    prompt: int  # its tokens
    computed: int  # llama-server's prompt_n: what its prompt time is spent on


def common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def chat(system: str, user: str) -> dict[str, Any]:
    return {
        "model": MODEL,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}],
        "max_tokens": 2,
        "temperature": 0,
    }


def extended(body: dict[str, Any]) -> dict[str, Any]:
    """The conversation's next turn: its messages, the answer, a new question."""
    more = [{"role": "assistant", "content": "ok"}, {"role": "user", "content": "and then?"}]
    return {**body, "messages": [*body["messages"], *more]}


def raw(prompt: str) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "n_predict": 2, "max_tokens": 2, "temperature": 0}


def secret_text(tag: str) -> str:
    return words(tag, 300) + " the secret is " + " ".join(SECRET)


def opencode_title(text: str) -> dict[str, Any]:
    """opencode's title request (recorded), about `text`: recognized as auxiliary by its content."""
    body = dict(load("opencode", "run_title").body)
    body["messages"] = [*body["messages"][:-1], {"role": "user", "content": text}]
    body.update(stream=False, max_tokens=2, temperature=0, model=MODEL)
    return body


@pytest.fixture
def start_rig(start_llama: StartServer, tmp_path: Path) -> Iterator[Callable[..., Rig]]:
    daemons: list[DaemonProcess] = []

    def start(
        *, parallel: int = 1, cache_ram: str | None = None, token: bool = False, extra: tuple[str, ...] = ()
    ) -> Rig:
        extra += ("--cache-ram", cache_ram) if cache_ram is not None else ()
        server = start_llama(ctx_size=CTX * parallel, parallel=parallel, extra_args=extra)
        config: dict[str, Any] = {
            "proxy": {"enabled": True},
            "servers": {"local": {"mode": "managed-slots" if parallel > 1 else "single-slot"}},
        }
        if not token:
            config["api"] = {"token_file": None}
        daemon = DaemonProcess(
            tmp_path / f"kv-{len(daemons)}",
            base_url=server.base_url,
            snapshot_dir=server.save_dir,
            token=TOKEN,
            **config,
        ).start()
        daemons.append(daemon)
        return Rig(server, daemon, token)

    try:
        yield start
    finally:
        for d in daemons:
            d.stop()


def assert_none_of_alices(rig: Rig, what: str, found: Found) -> None:
    reused, own, prompt, _ = found
    assert reused <= own, f"{what}: bob reused {reused} of {prompt} tokens, his own requests explain {own}"


MATRIX = pytest.mark.parametrize(
    ("parallel", "cache_ram"),
    [(1, None), (1, "0"), (2, None), (2, "0")],
    ids=["1-slot-ram-cache", "1-slot-cache-ram-0", "2-slots-ram-cache", "2-slots-cache-ram-0"],
)


@MATRIX
def test_no_path_lends_one_credentials_kv_to_another(
    start_rig: Callable[..., Rig], parallel: int, cache_ram: str | None
) -> None:
    """Before each of bob's requests alice runs one with a secret bob's request shares; bob never reuses a
    token of hers, whatever the path."""
    rig = start_rig(parallel=parallel, cache_ram=cache_ram)
    # the same session id under another credential: another session (cold), not alice's KV
    rig.alice("/v1/chat/completions", chat("sys one", secret_text("a1")), sid="shared-id")
    found = rig.bob("/v1/chat/completions", chat("sys one", secret_text("a1")), sid="shared-id")
    assert_none_of_alices(rig, "the same X-Session-Id", found)
    again = rig.alice("/v1/chat/completions", extended(chat("sys one", secret_text("a1"))), sid="shared-id")
    assert again.headers["x-kv-outcome"] in ("resident", "restored"), "alice's own session is hers"
    # a chat without an id (a content-named session of bob's)
    rig.alice("/v1/chat/completions", chat("sys two", secret_text("a2")))
    assert_none_of_alices(rig, "no id", rig.bob("/v1/chat/completions", chat("sys two", secret_text("a2"))))
    # a title request (auxiliary, by its content)
    rig.alice("/v1/chat/completions", opencode_title(secret_text("a3")))
    assert_none_of_alices(rig, "title", rig.bob("/v1/chat/completions", opencode_title(secret_text("a3"))))
    # pass-through routes that compute: /completion and /v1/completions, alice's as a session of hers
    for n, path in enumerate(("/completion", "/v1/completions")):
        rig.alice(path, raw(secret_text(f"a4{n}")), sid=f"alice-raw-{n}")
        assert_none_of_alices(rig, path, rig.bob(path, raw(secret_text(f"a4{n}"))))
    # a prefix donor: bob's new conversation extends alice's, message for message
    rig.alice("/v1/chat/completions", chat("sys five", secret_text("a5")), sid="alice-donor")
    longer = extended(chat("sys five", secret_text("a5")))
    assert_none_of_alices(rig, "donor", rig.bob("/v1/chat/completions", longer, sid="bob-new"))
    assert status_of(rig)["stats"]["prefix_donor_restores"] == 0


@MATRIX
def test_guessing_a_secret_one_digit_per_turn_learns_nothing(
    start_rig: Callable[..., Rig], parallel: int, cache_ram: str | None
) -> None:
    """The issue's attack: alice's prompt ends with secret digits; after each turn of hers bob sends her
    prompt up to a digit he guesses, without an id, and reads `cache_n`. Right or wrong, it is what his own
    earlier guesses explain, never more; and so is the prompt llama-server computed for him (the timing)."""
    rig = start_rig(parallel=parallel, cache_ram=cache_ram)
    base = words("alice-secret", 300) + " the secret is"
    for position, digit in enumerate(SECRET):
        known = base + "".join(f" {d}" for d in SECRET[:position])
        found = []
        for guess in (digit, str((int(digit) + 1) % 10)):
            rig.alice("/completion", raw(base + " " + " ".join(SECRET)), sid="alice-g")
            found.append(rig.bob("/completion", raw(f"{known} {guess}")))
            assert_none_of_alices(rig, f"digit {position} guess {guess}", found[-1])
        right, wrong = found
        if right.own == wrong.own:  # his own guesses explain as much of either: both must show the same
            assert (right.reused, right.computed) == (wrong.reused, wrong.computed), (position, right, wrong)


@pytest.mark.parametrize("cache_ram", [None, "0"], ids=["ram-cache", "cache-ram-0"])
def test_pass_through_routes_on_one_slot_run_on_an_erased_slot(
    start_rig: Callable[..., Rig], cache_ram: str | None
) -> None:
    """`/v1/embeddings` (llama-server picks its one slot itself) and `/infill` (this model has no FIM
    tokens: refused by llama-server, after kvsidecar erased the slot): alice's KV is gone from the slot
    before bob's request reaches it."""
    rig = start_rig(cache_ram=cache_ram, extra=("--embeddings", "--pooling", "mean"))
    slot = f"{rig.llama.base_url}/slots"
    for path, body in (("/v1/embeddings", {"input": "hello"}), ("/infill", {"input_prefix": "def f("})):
        rig.alice("/completion", raw(secret_text("e1")), sid="alice-e")
        assert httpx.get(slot).json()[0]["n_prompt_tokens"] > 100
        answer = rig.send("bob", path, {**body, "model": MODEL})
        assert answer.status_code in (200, 501), answer.text[:300]
        assert httpx.get(slot).json()[0]["n_prompt_tokens"] < 10, path  # bob's few tokens, or none


@pytest.mark.parametrize("cache_ram", [None, "0"], ids=["ram-cache", "cache-ram-0"])
def test_after_a_kvsidecar_restart_another_credential_still_gets_nothing(
    start_rig: Callable[..., Rig], cache_ram: str | None
) -> None:
    """Alice's session is saved; kvsidecar restarts (llama-server keeps running): bob's request under her
    session id is another session, and the hook API's `prefix_from` naming her session restores nothing
    (its scope is checked on disk); alice's own session is still hers."""
    rig = start_rig(cache_ram=cache_ram)
    body = chat("sys restart", secret_text("r1"))
    rig.alice("/v1/chat/completions", body, sid="alice-r")
    auth = rig.daemon.auth if rig.token else {}
    saved = httpx.post(f"{rig.daemon.url}/v1/sessions/alice-r/save", headers=auth, timeout=60)
    assert saved.raise_for_status().json()["saved"] == 1
    rig.daemon.stop()
    rig.daemon.start()
    assert_none_of_alices(rig, "after a restart", rig.bob("/v1/chat/completions", body, sid="alice-r"))
    acquire = {"provider": "local", "model": MODEL, "prefix_from": "alice-r"}
    for hook_session in ("hook-h", "alice-r"):
        lease = httpx.post(f"{rig.daemon.url}/v1/sessions/{hook_session}/acquire", json=acquire, timeout=60)
        lease.raise_for_status()
        granted = lease.json()
        assert granted["shared_tokens"] is None and granted["outcome"] != "restored", granted
        assert not any(a.startswith("prefix_from") for a in granted["actions"]), granted
        prompt = rig.rendered("/v1/chat/completions", body)
        reused = complete(rig.llama.base_url, prompt, granted["slot_id"])[1]
        assert reused <= 1, f"{hook_session}: the operator's session reused {reused} of alice's tokens"
        erase(rig.llama.base_url, granted["slot_id"])  # the lease's holder: what it computed is not alice's
        release = {"status": "ok", "prompt_tokens": 1, "cached_tokens": reused}
        httpx.post(f"{rig.daemon.url}/v1/leases/{granted['lease_id']}/release", json=release, timeout=60)
    turn = rig.alice("/v1/chat/completions", extended(body), sid="alice-r")
    if cache_ram == "0":  # no RAM cache to fear: her own snapshot, restored
        assert turn.headers["x-kv-outcome"] == "restored", dict(turn.headers)


@pytest.mark.parametrize("parallel", [1, 2], ids=["1-slot", "2-slots"])
def test_with_the_operators_token_every_proxy_client_is_one_scope(
    start_rig: Callable[..., Rig], parallel: int
) -> None:
    """`api.token_file` set: every proxy client holds the operator's token, so they are one scope (the
    operator's) by design: the same session id is the same session, and KV is shared."""
    rig = start_rig(parallel=parallel, token=True)
    rig.alice("/v1/chat/completions", chat("sys one", secret_text("t1")), sid="shared-id")
    same = rig.send("bob", "/v1/chat/completions", chat("sys one", secret_text("t1") + " x"), "shared-id")
    assert same.headers["x-kv-outcome"] in ("resident", "restored"), dict(same.headers)
    rig.alice("/completion", raw(secret_text("t2")), sid="alice-raw")
    reused, own, prompt, _ = rig.bob("/completion", raw(secret_text("t2")), sid="alice-raw")
    assert reused > max(own, prompt // 2), (reused, own, prompt)  # one scope: alice's KV is bob's too
    assert status_of(rig)["stats"]["scope_erases"] == 0


def status_of(rig: Rig) -> dict[str, Any]:
    auth = rig.daemon.auth if rig.token else {}
    return dict(httpx.get(f"{rig.daemon.url}/v1/status", headers=auth, timeout=30).json())


# -- within one scope, no auxiliary request costs more than with llama-server alone ----------------------
# opencode's recorded requests in the order its `run` sent them, and in the order its UI sends them (the
# title of a conversation after its first turn): through kvsidecar the second conversation's title once
# computed its whole prompt where llama-server alone reused all but its last tokens from its RAM cache.
OPENCODE = {
    "run": ["run_title", "run_turn1", "run_turn2_continue", "run_conv2_title", "run_conv2_turn1"],
    "ui": ["run_turn1", "run_title", "run_turn2_continue", "run_conv2_title", "run_conv2_turn1"],
}


@pytest.mark.parametrize("token", [False, True], ids=["no-token", "token"])
@pytest.mark.parametrize("parallel", [1, 2], ids=["1-slot", "2-slots"])
@pytest.mark.parametrize("order", sorted(OPENCODE))
def test_no_request_computes_more_than_with_llama_server_alone(
    llama_bin: Path, agent_model: Path, tmp_path: Path, order: str, parallel: int, token: bool
) -> None:
    """llama-server's default RAM cache on both; one client (one scope, with or without the operator's
    token): through kvsidecar no step computes more prompt tokens than llama-server alone (within 1% of the
    prompt)."""
    extra = ("--jinja", "--chat-template-file", str(chat_template(AGENT_TEMPLATE)))

    def server(label: str) -> LlamaServer:
        return LlamaServer(
            binary=llama_bin,
            model=agent_model,
            slot_save_path=tmp_path / f"snapshots-{label}",
            log_path=tmp_path / f"llama-{label}.log",
            ctx_size=AGENT_CTX * parallel,
            parallel=parallel,
            extra_args=extra,
        ).start()

    alone, behind = server("alone"), server("behind")
    config: dict[str, Any] = {
        "proxy": {"enabled": True, "identity": "session"},
        "servers": {"local": {"mode": "managed-slots" if parallel > 1 else "single-slot"}},
    }
    if not token:
        config["api"] = {"token_file": None}
    daemon = DaemonProcess(
        tmp_path / "kv", base_url=behind.base_url, snapshot_dir=behind.save_dir, token=TOKEN, **config
    )
    try:
        daemon.start()
        report, worse = [], []
        for name in OPENCODE[order]:
            a = send(alone.base_url, "opencode", name)
            k = send(daemon.proxy_url, "opencode", name, token=TOKEN if token else None)
            report.append(
                f"{name}: prompt {k.prompt}; computed alone {a.computed}, through kvsidecar {k.computed}"
            )
            if k.computed > a.computed + math.ceil(0.01 * k.prompt):
                worse.append(report[-1])
        print("\n".join(report))
        assert not worse, "\n".join(worse)
    finally:
        daemon.stop()
        alone.stop()
        behind.stop()
