"""Carrying a session's snapshot over a llama.cpp upgrade (issue 29), lazily, on that session's own acquire.

When a session's newest generation was saved under another build (BUILD_CHANGED) and nothing else in the
fingerprint differs (`store/carryover.build_only_difference`: model, flags, environment, layout, and the
format-independent runtime canary are equal), `CarryOver.carry()`:

1. proves, once per pair of fingerprints, that the new build computes the same KV: on the slot this acquire
   holds (its content is forfeit: the session would start cold otherwise) it prefills the snapshot's first
   `ROWS_TO_PROVE` tokens, saves them, and compares every K and V byte of those positions with the snapshot
   (`rows_match`); the verdict is kept in the state directory;
2. writes a new generation of the session under the new fingerprint through the store's own save plan and
   commit (a new file of ours, checksummed, the manifest flipped only after the check), converting the state
   file where the format step is known (v3 -> v4, `store/state_format.py`) and copying it where the format
   is the same; the old generation stays until the new one is committed.

The caller then finds and restores that generation as any other, with every check of a restore (header,
checksum, the engine's reuse). Nothing here runs for other sessions, and every failure leaves the session
cold with a reason, never restored into a runtime that was not proven.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

from kvsidecar.backend.base import SaveResult
from kvsidecar.config import Config
from kvsidecar.coordinator.canary import canary_name, check_free, remove_at
from kvsidecar.coordinator.guard import Persisting
from kvsidecar.coordinator.server import ServerRuntime
from kvsidecar.coordinator.state import SessionRuntime, Slot
from kvsidecar.coordinator.telemetry import Telemetry
from kvsidecar.errors import KvError, SaveFailed, SnapshotCorrupt
from kvsidecar.fingerprint.gguf_meta import GgufError, read_metadata, sliding_window
from kvsidecar.fingerprint.runtime import RuntimeFingerprint
from kvsidecar.fingerprint.savepath import llama_save_dir
from kvsidecar.store.carryover import ROWS_TO_PROVE, RowsProof, Verdicts, rows_match
from kvsidecar.store.integrity import checksum_from_fd
from kvsidecar.store.manifest import GenerationRecord
from kvsidecar.store.snapshots import Rejection, SnapshotStore
from kvsidecar.store.state_format import ModelFacts, StateFormatError, convert_v3_to_v4, parse, text_tokens
from kvsidecar.store.trust import Decision, Saved, proven, trust

CARRIED = "CARRIED_OVER_BUILD"
_CARRY_REASONS = frozenset({"BUILD_CHANGED"})
_O_WRITE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_O_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


@dataclass(frozen=True, kw_only=True)
class _Proven:
    equal: bool
    version: int | None  # the state format the new build writes, when the proof ran now
    detail: str = "remembered verdict"


class CarryOver:
    def __init__(self, *, config: Config, store: SnapshotStore, telemetry: Telemetry) -> None:
        self.config = config
        self.store = store
        self.telemetry = telemetry
        self._verdicts: Verdicts | None = None
        # state format each build writes (by runtime fingerprint digest), learned by a proof: never by server
        # name, which outlives a build, nor from the store's last observed save (maybe the old build's)
        self._versions: dict[str, int] = {}

    def reconfigure(self, config: Config) -> None:
        """SIGHUP: `restore.carry_over_builds` is live."""
        self.config = config

    def _table(self) -> Verdicts:
        if self._verdicts is None:
            self._verdicts = Verdicts(self.store.layout.anchors["state"])
        return self._verdicts

    async def carry(
        self,
        load: Persisting,
        srv: ServerRuntime,
        slot: Slot,
        rt: SessionRuntime,
        rejections: list[Rejection],
        fingerprint: RuntimeFingerprint,
    ) -> str | None:
        """Write a generation of `rt` restorable under `fingerprint` from one saved under another build.
        Returns None when one was written (the caller finds and restores it), else why not (a reason code
        or a short text, for the outcome and the logs). `load`: the guarded load this runs in (its calls to
        the server are bounded by it; the proof is not a verdict on the server)."""
        if not self.config.restore.carry_over_builds:
            return "carry-over disabled"
        manifest = self.store.get(rt.key)
        if manifest is None:
            return "no manifest"
        for rej in rejections:
            rec = manifest.generations.get(rej.generation)
            if rej.reason not in _CARRY_REASONS or rec is None or not rec.valid:
                continue
            old = self.store.fingerprint_components(rec.fingerprint)
            saved = Saved(fingerprint=rec.fingerprint, components=old, tokens=rec.tokens)
            verdict = trust(saved, proven(fingerprint))  # the one trust rule: only the build may differ
            if verdict.decision not in (Decision.CARRY, Decision.PROVE):
                self.telemetry.carry_over(srv.name, rt, "refused", verdict.detail)
                return "CARRY_OVER_REFUSED"
            try:
                return await self._carry(load, srv, slot, rt, rec, fingerprint, saved)
            except KvError as exc:
                self.telemetry.carry_over(srv.name, rt, "failed", exc.message)
                return exc.code
            except OSError as exc:  # a full disk, a name taken or gone: this session is cold, no more
                why = f"{type(exc).__name__}: {exc.strerror or exc}"
                self.telemetry.carry_over(srv.name, rt, "failed", why)
                return "CARRY_OVER_FAILED"
        return "nothing to carry over"

    async def _carry(
        self,
        load: Persisting,
        srv: ServerRuntime,
        slot: Slot,
        rt: SessionRuntime,
        rec: GenerationRecord,
        fp: RuntimeFingerprint,
        saved: Saved,
    ) -> str | None:
        table = self._table()
        # A verdict from a proof over fewer rows than this snapshot offers does not serve it (the trust
        # rule's PROVE): prove again.
        rows = table.rows(rec.fingerprint, fp.digest)
        verdict = trust(saved, proven(fp), proven_rows=rows).decision is Decision.CARRY
        version = self._versions.get(fp.digest)
        detail = "remembered verdict"
        if not verdict or version is None:
            proof = await self._prove(load, srv, slot, rec, fp)
            verdict, version, detail = proof.equal, proof.version, proof.detail
        if not verdict:
            why = f"the new build computes other KV ({detail})"
            self.telemetry.carry_over(srv.name, rt, "different", why)
            return "KV_MATH_CHANGED"
        if version is None:
            return "STATE_FORMAT_UNKNOWN"
        facts = self._facts(srv)
        await asyncio.to_thread(self._write_generation, srv, rt, rec, fp, version, facts)
        how = "converted" if rec.format_version != version else "copied"
        self.telemetry.carry_over(srv.name, rt, how, f"v{rec.format_version} -> v{version}")
        return None

    async def _prove(
        self, load: Persisting, srv: ServerRuntime, slot: Slot, rec: GenerationRecord, fp: RuntimeFingerprint
    ) -> _Proven:
        """Recompute the snapshot's first rows under the new build and compare them byte for byte."""
        d = self.store.layout.snap[srv.name]
        tokens = await asyncio.to_thread(self._first_tokens, srv.name, rec)
        name = canary_name()  # a canary-pattern name: a crash leaves it to the canary sweep
        theirs = llama_save_dir(srv.process)
        backend = srv.backend
        try:
            await load.call(backend.erase_slot(slot.id))
            await load.call(backend.prefill(slot.id, tokens))
            await asyncio.to_thread(check_free, d.anchor, name, theirs)
            saved = await load.call(backend.save_slot(slot.id, name))
            d.anchor.ensure(theirs)
            if saved.tokens <= 0:
                raise SaveFailed("the carry-over proof saved no tokens")
            proof, version = await asyncio.to_thread(self._compare, srv.name, rec.filename, name)
        finally:
            await asyncio.to_thread(remove_at, d.anchor, name)
            with contextlib.suppress(Exception):
                await backend.erase_slot(slot.id)
        now = srv.fingerprint
        if now is None or now.digest != fp.digest:  # the server changed under the proof: it proves nothing
            raise SaveFailed("llama-server changed during the carry-over proof; nothing recorded")
        # Only "equal" is kept for the pair. Rows that differ may be this snapshot's own: positions that
        # llama-server decoded one token at a time (a short first prompt, then its answer) are not
        # bit-identical to the same positions prefilled in one batch, under any build. That leaves this
        # session cold, no other.
        if proof.equal and proof.rows > 0:
            await asyncio.to_thread(self._table().record, rec.fingerprint, fp.digest, proof)
        if version is not None:
            self._versions[fp.digest] = version
        return _Proven(equal=proof.equal, version=version, detail=proof.detail)

    def _first_tokens(self, server: str, rec: GenerationRecord) -> list[int]:
        with (
            self.store.layout.snap[server].open_file(rec.filename) as (fd, st),
            os.fdopen(os.dup(fd), "rb") as f,
        ):
            # A file damaged since its save proves nothing: its verdict would serve every other snapshot.
            _check_source(fd, st, rec)
            try:
                layout = parse(f)
                tokens = text_tokens(layout)
            except StateFormatError as exc:
                raise SaveFailed(
                    f"the old snapshot is not a state this build can vouch for: {exc.code}"
                ) from None
        n = min(ROWS_TO_PROVE, min((s.cell_count for s in layout.streams), default=0), len(tokens))
        if n < 1:
            raise SaveFailed("the old snapshot holds no tokens to prove")
        return list(tokens[:n])

    def _compare(self, server: str, old: str, new: str) -> tuple[RowsProof, int | None]:
        anchor = self.store.layout.snap[server].anchor
        with anchor.fd() as dfd:
            fd_new = os.open(new, _O_READ, dir_fd=dfd)
        with (
            os.fdopen(fd_new, "rb") as f_new,
            self.store.layout.snap[server].open_file(old) as (fd_old, _st),
            os.fdopen(os.dup(fd_old), "rb") as f_old,
        ):
            proof = rows_match(f_old, f_new)
            try:
                version: int | None = parse(f_new).version
            except StateFormatError:
                version = None
        return proof, version

    def _facts(self, srv: ServerRuntime) -> ModelFacts | None:
        """The model facts the v3 -> v4 step needs, from the GGUF the process loaded (its first shard)."""
        process, caps = srv.process, srv.caps
        if caps is None or not caps.model_path:
            return None
        path = caps.model_path
        if process is not None:
            if not os.path.isabs(path) and process.cwd:
                path = os.path.join(process.cwd, path)
            path = process.root + path
        arrays: set[str] = set()
        try:
            meta = read_metadata(Path(path), arrays=arrays)
        except (OSError, GgufError):
            return None
        arch = meta.get("general.architecture")
        n_layer = meta.get(f"{arch}.block_count")
        if not isinstance(arch, str) or not isinstance(n_layer, int):
            return None
        head_k, head_v = _heads(meta, arch, n_layer)
        environ = process.environ if process is not None else None
        rot_disabled: bool | None = None
        if environ is not None:
            raw = environ.get("LLAMA_ATTN_ROT_DISABLE", "0").strip()
            rot_disabled = raw.lstrip("-").isdigit() and int(raw) != 0
        return ModelFacts(
            arch=arch,
            n_layer=n_layer,
            head_k=head_k,
            head_v=head_v,
            rot_disabled=rot_disabled,
            mrope=f"{arch}.rope.dimension_sections" in arrays or f"{arch}.rope.dimension_sections" in meta,
            sliding_window=sliding_window(meta) is not None
            or any(k.startswith(f"{arch}.attention.sliding_window") for k in arrays),
            recurrent=any(
                k.startswith(f"{arch}.ssm.") or k.startswith(f"{arch}.wkv.") for k in (*meta, *arrays)
            ),
        )

    def _write_generation(
        self,
        srv: ServerRuntime,
        rt: SessionRuntime,
        rec: GenerationRecord,
        fp: RuntimeFingerprint,
        version: int,
        facts: ModelFacts | None,
    ) -> None:
        """A new generation of ours from `rec`'s file, under `fp`, by the store's save plan (in a thread)."""
        if rec.format_version not in (version, 3) or (rec.format_version == 3 and version != 4):
            raise SaveFailed(f"no known step from state format v{rec.format_version} to v{version}")
        if rec.format_version != version and facts is None:
            raise SaveFailed("the model's metadata could not be read: the format step is not proven")
        d = self.store.layout.snap[srv.name]
        plan = self.store.begin_save(rt.identity, fingerprint=fp)
        committed = False
        try:
            with d.open_file(rec.filename) as (src_fd, st), os.fdopen(os.dup(src_fd), "rb") as src:
                _check_source(src_fd, st, rec)
                d.anchor.ensure()
                with d.anchor.fd() as dfd:
                    out_fd = os.open(plan.filename, _O_WRITE, 0o600, dir_fd=dfd)
                with os.fdopen(out_fd, "wb") as dst:
                    if rec.format_version == version:
                        _copy_all(src, dst)
                    else:
                        assert facts is not None
                        try:
                            convert_v3_to_v4(src, dst, facts)
                        except StateFormatError as exc:
                            raise SaveFailed(f"not converted: {exc.code}: {exc.message}") from None
                    dst.flush()
                    os.fsync(dst.fileno())
                    size = dst.tell()
            result = SaveResult(
                slot_id=-1,
                filename=plan.filename,
                tokens=rec.tokens,
                bytes_written=size,
                server_ms=None,
                measured_ms=0.0,
            )
            self.store.commit_save(plan, result, fingerprint=fp, revision=rec.revision)
            committed = True
        finally:
            if not committed:
                self.store.abort_save(plan, discard=True)


def _heads(meta: dict[str, object], arch: str, n_layer: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per-layer head sizes of K and V where the metadata gives them as scalars (else unknown: ())."""
    key_len, value_len = meta.get(f"{arch}.attention.key_length"), meta.get(f"{arch}.attention.value_length")
    embd, heads = meta.get(f"{arch}.embedding_length"), meta.get(f"{arch}.attention.head_count")
    default = embd // heads if isinstance(embd, int) and isinstance(heads, int) and heads > 0 else None
    k = key_len if isinstance(key_len, int) else default
    v = value_len if isinstance(value_len, int) else default
    if k is None or v is None:
        return (), ()
    return (k,) * n_layer, (v,) * n_layer


def _copy_all(src: BinaryIO, dst: BinaryIO) -> None:
    src.seek(0)
    while block := src.read(8 << 20):
        dst.write(block)


def _check_source(fd: int, st: os.stat_result, rec: GenerationRecord) -> None:
    """The old generation's file is the one its record describes (size and, where recorded, checksum):
    a file damaged since its save is never carried into a new generation."""
    if st.st_size != rec.bytes:
        raise SnapshotCorrupt(f"{rec.filename[:40]}: {st.st_size} bytes, the record says {rec.bytes}")
    if rec.checksum is not None and checksum_from_fd(fd) != rec.checksum:
        raise SnapshotCorrupt(f"{rec.filename[:40]}: checksum mismatch; not carried over")
