"""`FakeKvBackend`: a deterministic in-process engine with failure injection (spec §77), for unit tests.

It keeps each slot's cached tokens in memory and writes real snapshot files in llama-server's layout
(u32 magic "ggsq", u32 version, u32 token count, then the tokens), so the snapshot store's size, header and
checksum checks run against it unchanged. `infer()` models the engine's prefix reuse, returning
(prompt_n, cache_n) as llama-server's `timings` would. Every management call is recorded in `calls`.
Like the real server, restoring a truncated file "crashes" it: the fake becomes unavailable.

Its tokenizer and chat template (`tokenize`, `apply_template`, recorded in `prompt_calls`) are the
deterministic stand-ins of `kvsidecar.backend.fake_prompts`.
"""

from __future__ import annotations

import asyncio
import secrets
import struct
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from kvsidecar.backend.base import (
    BackendCapabilities,
    BackendSlot,
    EraseResult,
    InstanceState,
    PromptResult,
    RestoreResult,
    SaveResult,
    TokenizerInfo,
)
from kvsidecar.backend.fake_prompts import FAKE_VOCAB, fake_render, fake_tokenize
from kvsidecar.errors import (
    BackendUnavailable,
    EraseFailed,
    OperationTimeout,
    RestoreFailed,
    SaveFailed,
    SlotNotFound,
)

MAGIC = 0x67677371
VERSION = 4
_HEADER = struct.Struct("<III")


@dataclass
class _Knobs:
    fail_saves: int = 0
    fail_restores: int = 0
    fail_erases: int = 0
    save_delay_s: float = 0.0
    restore_delay_s: float = 0.0
    # A restore that answers 200 but leaves nothing usable (what SWA models without --swa-full do).
    restore_reuses_nothing: bool = False
    unavailable: bool = False
    hang_s: float | None = None  # every call times out after this


@dataclass
class Hold:
    """A save or restore stopped in flight (see `FakeKvBackend.hold`)."""

    entered: asyncio.Event = field(default_factory=asyncio.Event)  # the call is under way
    released: asyncio.Event = field(default_factory=asyncio.Event)

    def release(self) -> None:
        self.released.set()


@dataclass
class _Slot:
    tokens: list[int] = field(default_factory=list)
    is_processing: bool = False
    used: bool = False  # a task ran on it since the (fake) server started


class FakeKvBackend:
    kind = "fake"

    def __init__(
        self,
        snapshot_dir: Path,
        *,
        total_slots: int = 1,
        n_ctx: int = 4096,
        model_path: str = "/models/fake.gguf",
        build_info: str = "fake-1",
        bytes_per_token: int = 64,
    ) -> None:
        self.snapshot_dir = Path(snapshot_dir)
        self.slots = [_Slot() for _ in range(total_slots)]
        self.n_ctx = n_ctx
        self.model_path = model_path
        self.build_info = build_info
        self.bytes_per_token = bytes_per_token
        # What the "weights" and settings are: the KV a prompt computes to depends on it (see prefill).
        self.kv_salt = f"{model_path}|{build_info}"
        self.nonce: str | None = secrets.token_hex(8)  # changes at every restart, like media_marker
        self.knobs = _Knobs()
        self.calls: list[tuple[str, int, str | None]] = []
        self.crashed = False
        # Invariant 8 checker: which operation is running on each slot right now.
        self.busy: dict[int, str] = {}
        self.violations: list[str] = []
        # Sleep mode: the model and every slot freed; any call that needs them loads the model again
        # (with `model_on_wake` as the "weights" then, when set: another file renamed over the path).
        self.sleeping = False
        self.wakes = 0
        self.model_on_wake: str | None = None
        self._holds: dict[str, Hold] = {}
        self.multimodal = False  # a projector loaded: OpenAI routes tokenize with mtmd
        self.prompt_calls: list[str] = []  # "tokenize", "apply-template", "tokenizer-info", in order

    # failure injection (spec §77) -------------------------------------------------------------------
    def fail_next_save(self, times: int = 1) -> None:
        self.knobs.fail_saves += times

    def fail_next_restore(self, times: int = 1) -> None:
        self.knobs.fail_restores += times

    def fail_next_erase(self, times: int = 1) -> None:
        self.knobs.fail_erases += times

    def delay_restore(self, ms: float) -> None:
        self.knobs.restore_delay_s = ms / 1000.0

    def delay_save(self, ms: float) -> None:
        self.knobs.save_delay_s = ms / 1000.0

    def hold(self, op: str) -> Hold:
        """Stop the next `op` ("save" or "restore") where a delay would sleep, until `Hold.release()`:
        a test acts while the call is in flight (`await hold.entered.wait()`) without racing a timer."""
        self._holds[op] = hold = Hold()
        return hold

    async def _held(self, op: str) -> None:
        hold = self._holds.pop(op, None)
        if hold is not None:
            hold.entered.set()
            await hold.released.wait()

    def set_unavailable(self, unavailable: bool = True) -> None:
        self.knobs.unavailable = unavailable

    def remove_snapshot(self, filename: str) -> None:
        (self.snapshot_dir / filename).unlink(missing_ok=True)

    def corrupt_snapshot(self, filename: str) -> None:
        path = self.snapshot_dir / filename
        data = bytearray(path.read_bytes())
        data[-1] ^= 0xFF
        path.write_bytes(bytes(data))

    def truncate_snapshot(self, filename: str) -> None:
        path = self.snapshot_dir / filename
        path.write_bytes(path.read_bytes()[: max(1, path.stat().st_size // 2)])

    def restart(self, *, model_path: str | None = None, kv_salt: str | None = None) -> None:
        """A server restart: every slot comes back empty; optionally another model or KV-shaping setting."""
        self.slots = [_Slot() for _ in self.slots]
        self.crashed = False
        self.knobs.unavailable = False
        self.nonce = secrets.token_hex(8) if self.nonce is not None else None
        if model_path is not None:
            self.model_path = model_path
        if model_path is not None or kv_salt is not None:
            self.kv_salt = kv_salt if kv_salt is not None else f"{self.model_path}|{self.build_info}"

    def sleep(self, *, model_on_wake: str | None = None) -> None:
        """Enter sleep mode, like llama-server after `--sleep-idle-seconds` of idleness."""
        self.sleeping, self.model_on_wake = True, model_on_wake
        self.slots = [_Slot() for _ in self.slots]

    def _wake_up(self) -> None:
        if self.sleeping:
            self.sleeping, self.wakes = False, self.wakes + 1
            if self.model_on_wake is not None:
                self.kv_salt = f"{self.model_on_wake}|{self.build_info}"

    # the engine ----------------------------------------------------------------------------------------
    def _enter(self, slot_id: int, op: str) -> None:
        if slot_id in self.busy:
            self.violations.append(f"{op} on slot {slot_id} while {self.busy[slot_id]} runs")
        self.busy[slot_id] = op

    def _leave(self, slot_id: int) -> None:
        self.busy.pop(slot_id, None)

    def infer(self, slot_id: int, prompt: list[int]) -> tuple[int, int]:
        """Process `prompt` on a slot; returns (prompt_n computed, cache_n reused) like llama-server."""
        self._gate()
        if slot_id in self.busy:
            self.violations.append(f"inference on slot {slot_id} while {self.busy[slot_id]} runs")
        slot = self.slots[slot_id]
        common = 0
        for a, b in zip(slot.tokens, prompt, strict=False):
            if a != b:
                break
            common += 1
        # llama-server always recomputes at least the last prompt token.
        common = min(common, max(0, len(prompt) - 1))
        slot.tokens, slot.used = list(prompt), True
        return len(prompt) - common, common

    def slot_tokens(self, slot_id: int) -> list[int]:
        return list(self.slots[slot_id].tokens)

    # the interface ------------------------------------------------------------------------------------
    def _gate(self, *, wakes: bool = True) -> None:
        if self.crashed or self.knobs.unavailable:
            raise BackendUnavailable("fake backend is unavailable")
        if wakes:
            self._wake_up()

    async def _maybe_hang(self) -> None:
        if self.knobs.hang_s is not None:
            await asyncio.sleep(self.knobs.hang_s)
            raise OperationTimeout("fake backend timed out")

    def _slot(self, slot_id: int) -> _Slot:
        if not 0 <= slot_id < len(self.slots):
            raise SlotNotFound(f"slot {slot_id} does not exist")
        return self.slots[slot_id]

    async def probe(self) -> BackendCapabilities:
        self._gate(wakes=False)
        await self._maybe_hang()
        return BackendCapabilities(
            kind=self.kind,
            alive=True,
            slots_endpoint=True,
            total_slots=len(self.slots),
            n_ctx=self.n_ctx,
            model_path=self.model_path,
            build_info=self.build_info,
            instance_id=self.nonce,
            sleeping=self.sleeping,
            props={
                "model_path": self.model_path,
                "build_info": self.build_info,
                "total_slots": len(self.slots),
            },
        )

    async def inspect_slots(self) -> list[BackendSlot]:
        self._gate()
        await self._maybe_hang()
        return [
            BackendSlot(
                id=i, n_ctx=self.n_ctx, is_processing=s.is_processing, n_tokens=len(s.tokens), used=s.used
            )
            for i, s in enumerate(self.slots)
        ]

    async def save_slot(self, slot_id: int, filename: str) -> SaveResult:
        self._enter(slot_id, "save")
        try:
            return await self._save(slot_id, filename)
        finally:
            self._leave(slot_id)

    async def _save(self, slot_id: int, filename: str) -> SaveResult:
        self._gate()
        self.calls.append(("save", slot_id, filename))
        await self._maybe_hang()
        slot = self._slot(slot_id)
        started = time.perf_counter()
        if self.knobs.save_delay_s:
            await asyncio.sleep(self.knobs.save_delay_s)
        await self._held("save")
        if self.knobs.fail_saves:
            self.knobs.fail_saves -= 1
            raise SaveFailed(f"save slot {slot_id}: injected failure")
        payload = b"".join(struct.pack("<I", t) for t in slot.tokens)
        pad = b"\0" * max(0, self.bytes_per_token - 4) * len(slot.tokens)
        data = _HEADER.pack(MAGIC, VERSION, len(slot.tokens)) + payload + pad
        (self.snapshot_dir / filename).write_bytes(data)
        return SaveResult(
            slot_id=slot_id,
            filename=filename,
            tokens=len(slot.tokens),
            bytes_written=len(data),
            server_ms=0.1,
            measured_ms=(time.perf_counter() - started) * 1000,
        )

    async def restore_slot(self, slot_id: int, filename: str) -> RestoreResult:
        self._enter(slot_id, "restore")
        try:
            return await self._restore(slot_id, filename)
        finally:
            self._leave(slot_id)

    async def _restore(self, slot_id: int, filename: str) -> RestoreResult:
        self._gate()
        self.calls.append(("restore", slot_id, filename))
        await self._maybe_hang()
        slot = self._slot(slot_id)
        started = time.perf_counter()
        if self.knobs.restore_delay_s:
            await asyncio.sleep(self.knobs.restore_delay_s)
        await self._held("restore")
        if self.knobs.fail_restores:
            self.knobs.fail_restores -= 1
            raise RestoreFailed(f"restore slot {slot_id}: injected failure")
        path = self.snapshot_dir / filename
        if not path.exists():
            slot.tokens = []  # what llama-server does to a used slot when the file is missing
            raise RestoreFailed(f"restore slot {slot_id}: HTTP 400 Unable to restore slot")
        data = path.read_bytes()
        magic, version, n = _HEADER.unpack_from(data) if len(data) >= _HEADER.size else (0, 0, 0)
        if magic != MAGIC or version != VERSION:
            raise RestoreFailed(f"restore slot {slot_id}: HTTP 400 Unable to restore slot")
        if len(data) < _HEADER.size + 4 * n:
            self.crashed = True  # GGML_ASSERT(nread <= state_size): the whole server is gone
            raise BackendUnavailable("fake llama-server aborted while restoring a truncated file")
        tokens = list(struct.unpack_from(f"<{n}I", data, _HEADER.size))
        slot.tokens = [] if self.knobs.restore_reuses_nothing else tokens
        return RestoreResult(
            slot_id=slot_id,
            filename=filename,
            tokens=n,
            bytes_read=len(data),
            server_ms=0.1,
            measured_ms=(time.perf_counter() - started) * 1000,
        )

    async def erase_slot(self, slot_id: int) -> EraseResult:
        self._enter(slot_id, "erase")
        try:
            return await self._erase(slot_id)
        finally:
            self._leave(slot_id)

    async def _erase(self, slot_id: int) -> EraseResult:
        self._gate()
        self.calls.append(("erase", slot_id, None))
        await self._maybe_hang()
        slot = self._slot(slot_id)
        if self.knobs.fail_erases:
            self.knobs.fail_erases -= 1
            raise EraseFailed(f"erase slot {slot_id}: injected failure")
        n = len(slot.tokens)
        slot.tokens = []
        return EraseResult(slot_id=slot_id, tokens=n, measured_ms=0.01)

    async def instance_id(self) -> str | None:
        self._gate(wakes=False)
        await self._maybe_hang()
        return self.nonce

    async def instance_state(self) -> InstanceState:
        self._gate(wakes=False)
        await self._maybe_hang()
        return InstanceState(nonce=self.nonce, sleeping=self.sleeping)

    async def wake(self) -> None:
        self._gate()
        await self._maybe_hang()

    async def tokenizer_info(self) -> TokenizerInfo:
        self._gate()
        await self._maybe_hang()
        self.prompt_calls.append("tokenizer-info")
        return TokenizerInfo(n_vocab=FAKE_VOCAB, multimodal=self.multimodal)

    async def tokenize(
        self, content: str | Sequence[str | int], *, add_special: bool, parse_special: bool
    ) -> list[int]:
        self._gate()
        await self._maybe_hang()
        self.prompt_calls.append("tokenize")
        return fake_tokenize(content, add_special=add_special, parse_special=parse_special)

    async def apply_template(self, chat_body: bytes | Mapping[str, Any]) -> str:
        self._gate()
        await self._maybe_hang()
        self.prompt_calls.append("apply-template")
        return fake_render(chat_body)

    async def prefill(self, slot_id: int, prompt: str | list[int]) -> int:
        """The KV of a text under this "model": tokens derived from the text and the model's salt."""
        self._enter(slot_id, "prefill")
        try:
            self._gate()
            self.calls.append(("prefill", slot_id, None))
            words = prompt.split() if isinstance(prompt, str) else [str(t) for t in prompt]
            self._slot(slot_id).tokens = [
                xxhash.xxh32_intdigest(f"{self.kv_salt}|{i}|{w}".encode()) for i, w in enumerate(words)
            ]
            return len(words)
        finally:
            self._leave(slot_id)

    async def run_prompt(self, slot_id: int, prompt: str | list[int], *, n_predict: int = 0) -> PromptResult:
        """`prompt` on the slot with the engine's prefix reuse (`infer`); nothing is generated."""
        self._gate()
        self._slot(slot_id)
        self.calls.append(("prompt", slot_id, None))
        tokens = [
            xxhash.xxh32_intdigest(f"{self.kv_salt}|{i}|{w}".encode())
            for i, w in enumerate(prompt.split() if isinstance(prompt, str) else map(str, prompt))
        ]
        computed, reused = self.infer(slot_id, tokens)
        return PromptResult(slot_id=slot_id, computed=computed, reused=reused)

    async def aclose(self) -> None:
        return None
