"""The cost model, learned online per server (issue 15): what a save, a restore and a prefill cost here.

- save and restore bandwidth, from llama-server's own `save_ms`/`restore_ms` (or the measured time) and
  the bytes written or read;
- KV bytes per token, from the same saves and restores;
- prefill speed, from the `prompt_ms` the harness (or the proxy, from llama-server's timings) reports at
  release with the number of tokens computed;
- think times: from a release to the session's next acquire, per session (state.SessionRuntime.think_s)
  and for the server as a whole (the prior for a session that has too few of its own yet).

Each figure is an exponentially weighted mean (alpha 0.3) of what was seen, so a model follows a slower
disk or a busier machine within a few operations. A prediction is None until its inputs have been seen:
a policy that needs one it does not have falls back to today's behaviour (save before evict).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

_ALPHA = 0.3
_THINK_SAMPLES = 64  # the server's recent think times, every session's


def median(values: Iterable[float]) -> float | None:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else None


@dataclass
class Ewma:
    value: float | None = None
    samples: int = 0

    def update(self, x: float) -> None:
        """One observation; one that is not a finite number (a rate over a time of almost nothing) is not
        one: a mean that held inf or NaN would hold it for ever (every prefill free, no restore worth it)."""
        if not math.isfinite(x):
            return
        self.value = x if self.value is None else (1 - _ALPHA) * self.value + _ALPHA * x
        self.samples += 1


def transfer_s(tokens: int, bytes_per_token: float | None, bytes_per_s: float | None) -> float | None:
    """Predicted time to save or restore a slot holding `tokens`."""
    return None if bytes_per_token is None or not bytes_per_s else tokens * bytes_per_token / bytes_per_s


def prefill_time_s(tokens: int, tokens_per_s: float | None) -> float | None:
    return None if not tokens_per_s else tokens / tokens_per_s


class Costs(Protocol):
    """What the checkpoint decisions (decisions.py) read of a server's costs: the live model (ServerCosts)
    or a snapshot of its figures (CostFigures, as the golden files hold them)."""

    @property
    def think_s(self) -> Sequence[float]: ...  # the server's recent think times, every session's

    def save_s(self, tokens: int) -> float | None: ...

    def prefill_s(self, tokens: int) -> float | None: ...


@dataclass(frozen=True)
class CostFigures:
    """A server's learned figures at one moment, and what they predict (the same rules as ServerCosts)."""

    kv_bytes_per_token: float | None = None
    save_bytes_per_s: float | None = None
    restore_bytes_per_s: float | None = None
    prefill_tokens_per_s: float | None = None
    think_s: tuple[float, ...] = ()  # oldest first

    def save_s(self, tokens: int) -> float | None:
        return transfer_s(tokens, self.kv_bytes_per_token, self.save_bytes_per_s)

    def restore_s(self, tokens: int) -> float | None:
        return transfer_s(tokens, self.kv_bytes_per_token, self.restore_bytes_per_s)

    def prefill_s(self, tokens: int) -> float | None:
        return prefill_time_s(tokens, self.prefill_tokens_per_s)


@dataclass
class ServerCosts:
    save_bytes_per_s: Ewma = field(default_factory=Ewma)
    restore_bytes_per_s: Ewma = field(default_factory=Ewma)
    prefill_tokens_per_s: Ewma = field(default_factory=Ewma)
    kv_bytes_per_token: Ewma = field(default_factory=Ewma)
    think_s: deque[float] = field(default_factory=lambda: deque(maxlen=_THINK_SAMPLES))

    def save_s(self, tokens: int) -> float | None:
        """Predicted time to save a slot holding `tokens`."""
        return transfer_s(tokens, self.kv_bytes_per_token.value, self.save_bytes_per_s.value)

    def restore_s(self, tokens: int) -> float | None:
        return transfer_s(tokens, self.kv_bytes_per_token.value, self.restore_bytes_per_s.value)

    def prefill_s(self, tokens: int) -> float | None:
        return prefill_time_s(tokens, self.prefill_tokens_per_s.value)

    def figures(self) -> CostFigures:
        """The learned transfer and prefill figures now, as the start plan reads them (no think times)."""
        return CostFigures(
            kv_bytes_per_token=self.kv_bytes_per_token.value,
            save_bytes_per_s=self.save_bytes_per_s.value,
            restore_bytes_per_s=self.restore_bytes_per_s.value,
            prefill_tokens_per_s=self.prefill_tokens_per_s.value,
        )

    def view(self) -> dict[str, Any]:
        def r(e: Ewma) -> float | None:
            return None if e.value is None else round(e.value, 1)

        return {
            "save_bytes_per_s": r(self.save_bytes_per_s),
            "restore_bytes_per_s": r(self.restore_bytes_per_s),
            "prefill_tokens_per_s": r(self.prefill_tokens_per_s),
            "kv_bytes_per_token": r(self.kv_bytes_per_token),
            "think_median_s": median(self.think_s),
        }


class CostModel:
    def __init__(self) -> None:
        self.servers: dict[str, ServerCosts] = {}

    def server(self, name: str) -> ServerCosts:
        costs = self.servers.get(name)  # not setdefault: a ServerCosts built per call (the give-back path)
        if costs is None:
            costs = self.servers[name] = ServerCosts()
        return costs

    def observe_transfer(
        self, server: str, *, kind: str, nbytes: int, tokens: int, server_ms: float | None, measured_ms: float
    ) -> None:
        """A save or a restore of `nbytes` holding `tokens`: llama-server's own time when it reports one,
        else the time measured around the call."""
        ms = server_ms or measured_ms
        costs = self.server(server)
        if tokens > 0 and nbytes > 0:
            costs.kv_bytes_per_token.update(nbytes / tokens)
        if ms > 0 and nbytes > 0:
            bw = nbytes / (ms / 1000.0)
            (costs.save_bytes_per_s if kind == "save" else costs.restore_bytes_per_s).update(bw)

    def observe_prefill(self, server: str, *, tokens: int, ms: float) -> None:
        if tokens > 0 and ms > 0:
            self.server(server).prefill_tokens_per_s.update(tokens / (ms / 1000.0))

    def observe_think(self, server: str, seconds: float) -> None:
        self.server(server).think_s.append(seconds)

    def view(self) -> dict[str, dict[str, Any]]:
        return {name: costs.view() for name, costs in self.servers.items()}
