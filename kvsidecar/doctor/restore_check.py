"""The specification's §61 check of a restore, per memory class, and its verdict: `supported`,
`experimental` or `broken`, with the evidence and what kvsidecar will and will not restore on this server.

The check (`measure`, on a slot the caller holds): a cold prompt P (the slot then holds exactly P), save,
erase, restore, then P plus a few new tokens: llama-server's own `cache_n` says whether it reused the
restored tokens. Every class is asked the same extension, since a hybrid or recurrent model reuses a
restore only for a prompt that extends it (P itself again is a reset there: at least one token is always
computed, and a recurrent state cannot step back). Where the extension is reused, a second restore is
asked a prompt that diverges `DIVERGE` tokens before the saved end, which shows each class's rule: a plain
model reuses the common prefix, a hybrid one nothing, and a sliding-window model with `--swa-full` the
prefix too, but over a window its file does not hold (the file keeps only the window's last positions in
its SWA layers: `window`, read from the saved file), which is why kvsidecar never restores for it.

`verdict` maps the class and the evidence (docs/MODELS.md, "What doctor says"); it is pure."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from kvsidecar.backend.base import KvBackend
from kvsidecar.doctor.report import Status
from kvsidecar.fingerprint.memory_class import HYBRID, PLAIN, RECURRENT, SWA
from kvsidecar.fingerprint.server_memory import SWA_FULL_FIX, ServerMemory

SUPPORTED, EXPERIMENTAL, BROKEN = "supported", "experimental", "broken"
DIVERGE = 3  # the divergent prompt leaves the saved tokens this many tokens before their end
_BASE_TOKENS = 256  # the cold prompt; a sliding-window model's is longer than its window
_SUFFIX = " and then the doctor asks one more short question"
_OTHER = (" but a different ending follows here", " whereas another ending follows")
_EXTENDS = "a restore is reused only when the next prompt extends the saved tokens exactly"


@dataclass(frozen=True, kw_only=True)
class Prompts:
    cold: list[int]  # P
    extension: list[int]  # P + new tokens
    divergent: list[int]  # P less its last DIVERGE tokens + other tokens


@dataclass(frozen=True, kw_only=True)
class Evidence:
    cold: int  # tokens of P (computed cold)
    saved: int  # tokens the save wrote
    restored: int  # tokens the restore read back
    extension: int  # tokens of P + new
    extension_reused: int  # llama-server's cache_n for it after the restore
    divergent_reused: int | None = None  # cache_n after a second restore, for the divergent prompt
    window: tuple[int, int] | None = None  # positions the file's SWA layers hold (a sliding-window model)
    files: tuple[tuple[int, int], ...] = ()  # (tokens, bytes) of each probe save: P, then P + new

    @property
    def reused(self) -> bool:
        return self.saved > 0 and self.extension_reused >= self.saved

    @property
    def cost(self) -> tuple[int, int] | None:
        """What a snapshot of this server costs: (bytes a token, fixed bytes), from the two probe saves'
        sizes (the fixed part: a recurrent state, an SWA window's cells, the headers); None when not
        measured."""
        if len(self.files) < 2 or self.files[1][0] <= self.files[0][0]:
            return None
        (t1, b1), (t2, b2) = self.files[:2]
        per = round((b2 - b1) / (t2 - t1))
        return per, b1 - t1 * per

    def to_dict(self) -> dict[str, Any]:
        return {
            "cold_tokens": self.cold,
            "saved_tokens": self.saved,
            "restored_tokens": self.restored,
            "extension_tokens": self.extension,
            "extension_reused": self.extension_reused,
            "diverge_before_end": DIVERGE,
            "divergent_reused": self.divergent_reused,
            "swa_window_saved": list(self.window) if self.window else None,
            "bytes_per_token": self.cost[0] if self.cost else None,
            "fixed_bytes": self.cost[1] if self.cost else None,
        }


@dataclass(frozen=True, kw_only=True)
class Verdict:
    compatibility: str  # supported / experimental / broken
    status: Status
    detail: str
    fix: str = ""


def probe_length(memory: ServerMemory, n_ctx: int | None) -> int:
    """P's length: longer than a sliding window (so the file drops positions), within the context."""
    n = _BASE_TOKENS
    if memory.kind == SWA and memory.memory.n_swa:
        n = max(n, memory.memory.n_swa + 64)
    return max(16, min(n, n_ctx - 64)) if n_ctx else n


async def probe_prompts(backend: KvBackend, n: int) -> Prompts:
    """P (n tokens of the server's own tokenizer), its extension, and a prompt diverging DIVERGE before
    P's end (its first new token differs from P's there)."""
    text = " ".join(f"doctor{i} probe" for i in range(n))
    cold = (await backend.tokenize(text, add_special=True, parse_special=False))[:n]
    suffix = await backend.tokenize(_SUFFIX, add_special=False, parse_special=False)
    other: list[int] = []
    for candidate in _OTHER:
        other = await backend.tokenize(candidate, add_special=False, parse_special=False)
        if other and other[0] != cold[-DIVERGE]:
            break
    return Prompts(cold=cold, extension=cold + suffix, divergent=cold[:-DIVERGE] + other)


async def measure(
    backend: KvBackend,
    slot_id: int,
    prompts: Prompts,
    *,
    names: tuple[str, str],
    ensure: Callable[[], None],
    window: Callable[[], tuple[int, int] | None],
    size: Callable[[str], int | None],
) -> Evidence:
    """The check on a held slot. `names`: the two probe files (the caller removes them: P's, and P + new
    saved after the extension, for the snapshot's cost); `ensure`: raises unless the snapshot directory is
    still where the paths lead (before and after each save); `window`: the SWA positions P's file holds;
    `size`: a probe file's bytes."""
    name, second = names
    await backend.erase_slot(slot_id)
    await backend.run_prompt(slot_id, prompts.cold, n_predict=1)
    ensure()
    saved = await backend.save_slot(slot_id, name)
    ensure()
    held = window()
    await backend.erase_slot(slot_id)
    restored = await backend.restore_slot(slot_id, name)
    ext = await backend.run_prompt(slot_id, prompts.extension, n_predict=1)
    again = await backend.save_slot(slot_id, second)
    ensure()
    sizes = [(saved.tokens, size(name)), (again.tokens, size(second))]
    files = tuple((t, b) for t, b in sizes if b is not None)
    divergent = None
    if saved.tokens and ext.reused >= saved.tokens:
        await backend.erase_slot(slot_id)
        await backend.restore_slot(slot_id, name)
        divergent = (await backend.run_prompt(slot_id, prompts.divergent, n_predict=1)).reused
    return Evidence(
        cold=len(prompts.cold),
        saved=saved.tokens,
        restored=restored.tokens,
        extension=len(prompts.extension),
        extension_reused=ext.reused,
        divergent_reused=divergent,
        window=held,
        files=files,
    )


def _evidence(ev: Evidence) -> str:
    text = (
        f"cold prompt of {ev.cold} tokens, saved {ev.saved}, erased, restored {ev.restored}, then the same "
        f"prompt plus {ev.extension - ev.cold} tokens: llama-server reused {ev.extension_reused} (cache_n)"
    )
    if ev.divergent_reused is not None:
        text += (
            f"; restored again, a prompt diverging {DIVERGE} tokens before the saved end: "
            f"reused {ev.divergent_reused}"
        )
    if ev.cost is not None:
        text += f"; a snapshot costs {ev.cost[0]:,} B a token + {ev.cost[1]:,} B fixed"
    return text


def _swa_full(memory: ServerMemory, ev: Evidence) -> str:
    """What kvsidecar restores for a sliding-window model with --swa-full, and why not more."""
    out = (
        "kvsidecar restores only for a prompt that extends the saved tokens or diverges at the last one "
        "(within one token of the saved end)"
    )
    if ev.window is not None and ev.divergent_reused:
        first = ev.saved - DIVERGE
        out += (
            f"; the file's SWA layers hold only positions {ev.window[0]}-{ev.window[1]}, and the token "
            f"recomputed at position {first} attends back to {max(0, first - memory.memory.n_swa + 1)}: "
            f"llama-server reused {ev.divergent_reused} tokens over a window the file does not hold, a wrong "
            "context, so such a prompt is never restored"
        )
    elif ev.divergent_reused:
        out += (
            f"; llama-server reused {ev.divergent_reused} tokens for a prompt diverging {DIVERGE} tokens "
            "before the saved end, over window positions the file does not hold: never restored"
        )
    return out


def verdict(memory: ServerMemory, ev: Evidence) -> Verdict:
    """The §61 verdict for this class and evidence, with what kvsidecar will and will not restore."""
    kind, seen = memory.kind, _evidence(ev)
    what = memory.describe()
    if memory.swa_without_full:
        fix = f"{SWA_FULL_FIX}: {memory.swa_full_cost()}"
        if ev.reused:  # not what this build does (docs/MODELS.md): nothing is claimed from one check
            detail = f"{what}; {seen}; reused against what is known of this class: kvsidecar saves nothing"
            return Verdict(compatibility=EXPERIMENTAL, status="WARN", detail=detail, fix=fix)
        detail = (
            f"{what}; {seen}: not even an exact extension reuses a restore, so kvsidecar saves nothing on "
            "this server and restores nothing"
        )
        return Verdict(compatibility=BROKEN, status="WARN", detail=detail, fix=fix)
    if not ev.reused:
        if kind in (PLAIN, HYBRID, RECURRENT, SWA):
            detail = f"{what}; {seen}, of {ev.saved} saved: a restore this build does not reuse"
            fix = "snapshots cost disk and give nothing on this model and build; see docs/MODELS.md"
            return Verdict(compatibility=BROKEN, status="WARN", detail=detail, fix=fix)
        detail = f"{what}; {seen}: reused only {ev.extension_reused} of {ev.saved} saved"
        fix = "run llama-server on this host (its model and settings are read), or see docs/MODELS.md"
        return Verdict(compatibility=EXPERIMENTAL, status="WARN", detail=detail, fix=fix)
    if kind == PLAIN:
        restores = "kvsidecar restores for any prompt that shares a prefix with the saved tokens"
    elif kind in (HYBRID, RECURRENT):
        restores = f"{_EXTENDS}; kvsidecar restores only then"
    elif kind == SWA:
        restores = _swa_full(memory, ev)
    else:
        restores = "the class is not known, so nothing is claimed for a prompt that diverges"
    return Verdict(compatibility=SUPPORTED, status="OK", detail=f"{what}; {seen}: {restores}")
