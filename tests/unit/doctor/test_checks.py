"""The doctor's deep check goes through the backend (issue 14, item 2): one llama.cpp client, so it carries
llama-server's API key like every other call, and its verdict comes from the engine's own counts."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import httpx

from kvsidecar.backend.base import BackendCapabilities
from kvsidecar.backend.fake import FakeKvBackend
from kvsidecar.backend.llamacpp import LlamaCppBackend
from kvsidecar.doctor.checks import Doctor
from kvsidecar.doctor.probe import CHECK
from kvsidecar.doctor.report import DoctorReport
from tests.unit.coordinator_helpers import make_config

KEY = "llama-key-0123456789"


def deep_check(report: DoctorReport) -> tuple[str, str]:
    check = next(c for c in report.checks if c.name == CHECK)
    return check.status, check.detail


def doctor(tmp_path: Path, backend: LlamaCppBackend | FakeKvBackend) -> Doctor:
    (tmp_path / "snaps").mkdir(exist_ok=True)
    return Doctor(
        config=make_config(tmp_path), server="local", backend=backend, process_finder=lambda _url: None
    )


class KeyedLlama:
    """A small llama-server that wants its API key on every route but /health, like the real one with
    --api-key, and saves slot files into `snaps`. Its cache is a list of words per slot."""

    def __init__(self, snaps: Path) -> None:
        self.snaps = snaps
        self.cache: list[str] = []
        self.unauthorized: list[str] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        if request.headers.get("authorization") != f"Bearer {KEY}":
            self.unauthorized.append(request.url.path)
            return httpx.Response(401, json={"error": {"code": 401, "message": "Invalid API Key"}})
        path, body = request.url.path, json.loads(request.content or b"{}")
        if path == "/props":
            return httpx.Response(200, json={"total_slots": 1, "model_path": "/m.gguf", "build_info": "b1"})
        if path == "/slots":
            n = len(self.cache)
            return httpx.Response(200, json=[{"id": 0, "n_ctx": 4096, "is_processing": False, "n_past": n}])
        if path == "/completion":
            return self._complete(body)
        if path == "/tokenize":  # one token a word, ids in a small vocabulary
            words = str(body["content"]).split()
            return httpx.Response(200, json={"tokens": [sum(w.encode()) % 1000 for w in words]})
        if path == "/v1/models":
            model = {"meta": {"n_vocab": 1000}, "architecture": {"input_modalities": ["text"]}}
            return httpx.Response(200, json={"data": [model]})
        return self._slot_action(request.url.params.get("action"), body)

    def _complete(self, body: dict[str, object]) -> httpx.Response:
        assert body["id_slot"] == 0 and body["cache_prompt"] is True
        prompt = body["prompt"]
        words = [str(t) for t in prompt] if isinstance(prompt, list) else str(prompt).split()
        reused = 0
        for a, b in zip(self.cache, words, strict=False):
            if a != b:
                break
            reused += 1
        reused = min(reused, len(words) - 1)
        self.cache = words
        return httpx.Response(
            200, json={"content": "x", "timings": {"prompt_n": len(words) - reused, "cache_n": reused}}
        )

    def _slot_action(self, action: str | None, body: dict[str, object]) -> httpx.Response:
        if action == "erase":
            self.cache = []
            return httpx.Response(200, json={"id_slot": 0, "n_erased": 1})
        name = str(body["filename"])
        if action == "save":
            (self.snaps / name).write_text("\n".join(self.cache))
            return httpx.Response(200, json={"id_slot": 0, "filename": name, "n_saved": len(self.cache)})
        self.cache = (self.snaps / name).read_text().split("\n")
        return httpx.Response(200, json={"id_slot": 0, "filename": name, "n_restored": len(self.cache)})


async def test_deep_round_trip_carries_the_api_key(tmp_path: Path) -> None:
    llama = KeyedLlama(tmp_path / "snaps")
    backend = LlamaCppBackend(base_url="http://llama", api_key=KEY, transport=httpx.MockTransport(llama))
    try:
        report = await doctor(tmp_path, backend).run(deep=True)
    finally:
        await backend.aclose()
    status, detail = deep_check(report)
    assert llama.unauthorized == []
    assert status == "OK" and "reused" in detail, detail
    assert list((tmp_path / "snaps").iterdir()) == []  # the probe files are removed


async def test_deep_round_trip_with_the_fake_engine(tmp_path: Path) -> None:
    fake = FakeKvBackend(tmp_path / "snaps")
    status, _ = deep_check(await doctor(tmp_path, fake).run(deep=True))
    assert status == "OK"
    # the cold prompt, save, erase, restore, the extension and its save (the snapshot's cost); a second
    # restore for the divergent prompt; and the slot erased at the end (nothing of the probe stays in it)
    assert [c[0] for c in fake.calls][-11:] == [
        *("erase", "prompt", "save", "erase", "restore", "prompt", "save"),
        *("erase", "restore", "prompt", "erase"),
    ]


async def test_deep_round_trip_sees_a_restore_the_engine_does_not_reuse(tmp_path: Path) -> None:
    fake = FakeKvBackend(tmp_path / "snaps")
    fake.knobs.restore_reuses_nothing = True  # what an SWA model without --swa-full does
    status, detail = deep_check(await doctor(tmp_path, fake).run(deep=True))
    assert status == "WARN" and "reused only 0" in detail


async def test_deep_round_trip_failure_is_reported_with_the_backend_code(tmp_path: Path) -> None:
    llama = KeyedLlama(tmp_path / "snaps")
    backend = LlamaCppBackend(base_url="http://llama", api_key="wrong", transport=httpx.MockTransport(llama))
    try:
        report = await doctor(tmp_path, backend).run(deep=True)
    finally:
        await backend.aclose()
    assert report.result == "NOT READY"
    assert next(c for c in report.checks if c.name == "server reachable").status == "FAIL"


async def test_a_routers_model_is_checked_on_its_childs_process(tmp_path: Path) -> None:
    """A router's model runs in a child llama-server of its own (`process_url`: where the coordinator finds
    it, with the arguments the router started it with). doctor must read that process, as the coordinator's
    identity does for the class status shows and the planner uses: the router's own process has other
    arguments (no `--swa-full` of a preset's child, say), so doctor said another class."""
    fake = FakeKvBackend(tmp_path / "snaps")
    probe = fake.probe

    async def child_probe() -> BackendCapabilities:
        return replace(await probe(), process_url="http://127.0.0.1:40123")

    fake.probe = child_probe  # type: ignore[method-assign]
    asked: list[str] = []
    (tmp_path / "snaps").mkdir(exist_ok=True)
    doc = Doctor(
        config=make_config(tmp_path),
        server="local",
        backend=fake,
        process_finder=lambda url: asked.append(url) or None,  # type: ignore[func-returns-value]
    )
    await doc.run()
    assert asked == ["http://127.0.0.1:40123"]
