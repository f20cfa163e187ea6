"""The recorded agent-client requests under tests/fixtures/clients (see its README.md)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "clients"
CLIENTS = ("claude", "codex", "opencode", "aider")


@dataclass(frozen=True)
class Recorded:
    client: str
    name: str
    method: str
    path: str
    query: str
    headers: list[tuple[str, str]]
    body: Any

    @property
    def header_map(self) -> dict[str, tuple[str, ...]]:
        out: dict[str, tuple[str, ...]] = {}
        for name, value in self.headers:
            out[name.lower()] = (*out.get(name.lower(), ()), value)
        return out

    def without(self, *names: str) -> dict[str, tuple[str, ...]]:
        drop = {n.lower() for n in names}
        return {k: v for k, v in self.header_map.items() if k not in drop}


def load(client: str, name: str) -> Recorded:
    data = json.loads((FIXTURES / client / f"{name}.json").read_text(encoding="utf-8"))
    return Recorded(
        client=client,
        name=name,
        method=data["method"],
        path=data["path"],
        query=data["query"],
        headers=[(k, v) for k, v in data["headers"]],
        body=data["body"],
    )


def all_recorded() -> list[Recorded]:
    return [load(c, p.stem) for c in CLIENTS for p in sorted((FIXTURES / c).glob("*.json"))]


def posts() -> list[Recorded]:
    return [r for r in all_recorded() if r.method == "POST"]
