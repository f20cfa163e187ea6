"""The hook API's acquire runs on the router model its `model` names, and its `prompt` is tokenized by that
model's server: never by the provider's default, another model's tokenizer."""

from __future__ import annotations

from typing import Any

from kvsidecar.api import hooks
from kvsidecar.api.bodies import AcquireBody


class Srv:
    def __init__(self, name: str) -> None:
        self.name = name
        self.backend = f"tokenizer of {name}"


class Coord:
    def __init__(self) -> None:
        self.servers = {"a": Srv("a"), "b": Srv("b")}

    def route(self, provider: str, model: str | None = None) -> Srv:
        return self.servers["b" if model == "b" else "a"]  # provider "local" -> a; model b -> b


async def test_the_hook_prompt_is_tokenized_by_the_model_the_acquire_runs_on(monkeypatch: Any) -> None:
    used: list[Any] = []

    async def fake_tokens(body: AcquireBody, tok: Any) -> None:
        used.append(tok)

    monkeypatch.setattr(hooks, "acquire_prompt_tokens", fake_tokens)
    body = AcquireBody.model_validate({"provider": "local", "model": "b", "prompt": "hello"})
    await hooks._prompt_tokens(Coord(), body)  # type: ignore[arg-type]
    print(used)
    assert used == ["tokenizer of b"], used
