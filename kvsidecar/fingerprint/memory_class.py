"""What kind of memory a model has, read from its GGUF file and the server's settings, not from a list of
architecture names: plain attention, sliding-window attention (SWA), hybrid (attention and recurrent
layers) or recurrent only; and what llama-server does with context checkpoints for it.

How llama.cpp (11434) decides, and what is read here for each:

- **Recurrent layers.** llama.cpp marks them per architecture in `load_arch_hparams`: from
  `{arch}.attention.recurrent_layers` (an array of flags), else `{arch}.full_attention_interval` (every
  n-th layer attends; Qwen3-Next/3.5), else a zero in the per-layer `{arch}.attention.head_count_kv` array
  (Granite 4, Nemotron-H, Jamba, LFM2, ...), or all layers (Mamba, RWKV). A recurrent layer is the one with
  the recurrent weights, so this module reads them from the tensor names: layer i is recurrent when it has
  a `blk.i.ssm_*`, `blk.i.shortconv.*` or `blk.i.time_mix_*` tensor. Where the metadata names the layers
  too (the three keys above), both must agree, else the class is `unknown` (a caller treats that as the
  strictest class).
- **Which recurrent kind**: from the same tensors (`ssm_beta`: gated delta net; `ssm_x`: Mamba; `ssm_in`:
  Mamba2; `shortconv`: LFM2's short convolution; `time_mix`: RWKV). The state rows a save holds per
  recurrent layer follow from `{arch}.ssm.*` for the SSM kinds (llama_hparams::n_embd_r, n_embd_s).
- **SWA**: `{arch}.attention.sliding_window` > 0 is the window (n_swa); the SWA layers are given by
  `{arch}.attention.sliding_window_pattern` (an array of flags, or every n-th layer global), or by the
  architecture's own default when the key is absent (Gemma 3: 5 local to 1 global), so their count may be
  unknown here. `--swa-full` keeps every position in the SWA layers' cache, and llama-server then
  treats the model as if it had no window (n_swa 0) when it reuses a cache.
- **M-RoPE cells**: `{arch}.rope.dimension_sections` with a non-zero section: every KV cell then carries
  its 2-D position and token in a saved state (`cell_ext`).
- **Checkpoints** (`tools/server/server-context.cpp`): llama-server keeps up to `--ctx-checkpoints`
  (default 32) copies of the unrollable part of a slot's memory when the model is recurrent or hybrid, or
  SWA without `--swa-full`: 4 and 4 + n_ubatch tokens before each prompt's end, and at user-message
  starts of chat requests at least `--checkpoint-min-step` (8192) tokens apart. A slot save writes none
  of them, and a restore clears them; the RAM cache (`--cache-ram`, default 8192 MiB) keeps them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Final

from kvsidecar.fingerprint.gguf_meta import GgufError, GgufFile, read_gguf
from kvsidecar.fingerprint.llama_settings import RuntimeSettings

PLAIN, SWA, HYBRID, RECURRENT, UNKNOWN = "plain", "swa", "hybrid", "recurrent", "unknown"

_LAYER = re.compile(r"blk\.(\d+)\.(.+)")
_RECURRENT_PREFIXES = ("ssm_", "shortconv.", "time_mix_")
_ATTENTION_PREFIXES = ("attn_k.", "attn_kv_a_mqa.", "attn_k_b.")
_PER_LAYER_ARRAYS = (
    "attention.head_count_kv",
    "attention.recurrent_layers",
    "attention.sliding_window_pattern",
    "feed_forward_length",
    "rope.dimension_sections",
)


@dataclass(frozen=True, kw_only=True)
class Checkpoints:
    """What llama-server does with context checkpoints for this model and these settings."""

    made: bool  # it keeps checkpoints of a slot's unrollable memory
    max_per_slot: int  # --ctx-checkpoints
    min_step: int  # --checkpoint-min-step
    before_end: tuple[int, ...]  # tokens before a prompt's end where one is made: 4 + n_ubatch, 4
    ram_cache_mib: int  # --cache-ram (0: off, -1: unbounded); it stores checkpoints with each prompt


@dataclass(frozen=True, kw_only=True)
class MemoryClass:
    kind: str  # plain / swa / hybrid / recurrent / unknown
    arch: str
    n_layer: int
    attention_layers: int
    recurrent_layers: int = 0
    recurrent_kind: str | None = None  # gated-delta-net, mamba, mamba2, short-conv, rwkv, ssm
    n_swa: int = 0  # the window; 0: none
    swa_layers: int | None = None  # None: the architecture's default pattern, not written in the file
    swa_full: bool = False
    cell_ext: bool = False
    r_row_bytes: int | None = None  # a recurrent layer's saved rows (f32), when known from ssm.* keys
    s_row_bytes: int | None = None
    checkpoints: Checkpoints | None = None
    why: str = ""

    @property
    def restore_keeps(self) -> str:
        """What a restored slot state can give the next prompt, in this build: `prefix` (any common
        prefix, plain attention), `extension` (only a prompt that extends every saved token: the recurrent
        state is at the last one, and `--swa-full` files keep only the window's positions), `nothing`
        (SWA without `--swa-full`: llama-server resets even for the exact extension)."""
        if self.kind == PLAIN:
            return "prefix"
        if self.kind == SWA and not self.swa_full:
            return "nothing"
        return "extension"

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["restore_keeps"] = self.restore_keeps
        return out


def _layers(tensors: Mapping[str, tuple[int, ...]], n_layer: int) -> tuple[set[int], set[int], set[str]]:
    """(recurrent layers, attention layers, the recurrent tensors' suffixes) among layers < n_layer."""
    recurrent: set[int] = set()
    attention: set[int] = set()
    suffixes: set[str] = set()
    fused: set[int] = set()
    for name in tensors:
        m = _LAYER.fullmatch(name)
        if m is None or int(m[1]) >= n_layer:
            continue
        il, rest = int(m[1]), m[2]
        if rest.startswith(_RECURRENT_PREFIXES):
            recurrent.add(il)
            suffixes.add(rest)
        elif rest.startswith(_ATTENTION_PREFIXES):
            attention.add(il)
        elif rest.startswith("attn_qkv."):
            fused.add(il)
    # a fused QKV projection is attention, except in a gated-delta-net layer (its own input projection)
    return recurrent, attention | (fused - recurrent), suffixes


def _recurrent_kind(suffixes: set[str]) -> str | None:
    if not suffixes:
        return None
    if any(s.startswith(("ssm_beta", "ssm_alpha")) for s in suffixes):
        return "gated-delta-net"
    if any(s.startswith("ssm_x.") for s in suffixes):
        return "mamba"
    if any(s.startswith("ssm_in.") for s in suffixes):
        return "mamba2"
    if any(s.startswith("shortconv.") for s in suffixes):
        return "short-conv"
    if any(s.startswith("time_mix_") for s in suffixes):
        return "rwkv"
    return "ssm"


def _per_layer(value: Any, n_layer: int) -> list[int] | None:
    if isinstance(value, list) and len(value) >= n_layer:
        return [int(v) for v in value[:n_layer]]
    if isinstance(value, int | float) and not isinstance(value, bool):
        return [int(value)] * n_layer
    return None


def _declared_recurrent(meta: Mapping[str, Any], arch: str, n_layer: int) -> set[int] | None:
    """The recurrent layers the metadata names, by llama.cpp's rules; None where it names none."""
    flags = _per_layer(meta.get(f"{arch}.attention.recurrent_layers"), n_layer)
    if flags is not None:
        return {i for i, f in enumerate(flags) if f}
    interval = meta.get(f"{arch}.full_attention_interval")
    if isinstance(interval, int) and interval > 0:
        return {i for i in range(n_layer) if (i + 1) % interval != 0}
    kv = meta.get(f"{arch}.attention.head_count_kv")
    if isinstance(kv, list) and len(kv) >= n_layer and any(v == 0 for v in kv[:n_layer]):
        ff = _per_layer(meta.get(f"{arch}.feed_forward_length"), n_layer) or [0] * n_layer
        # Nemotron-H has layers of three kinds, and its feed-forward layers have no attention heads
        # either: there a layer is recurrent when it has neither. Where every layer has a feed-forward
        # (Granite 4, Jamba, LFM2) a zero head count alone decides.
        split_ffn = any(f == 0 for f in ff)
        return {i for i in range(n_layer) if kv[i] == 0 and (not split_ffn or ff[i] == 0)}
    return None


# Architectures that llama.cpp 11434 may run with a sliding (or chunked) window that the GGUF does not state:
# its loader sets a default window or type for them (src/models/<arch>.cpp: llama4 chunks at 8192 unless the
# key says 0, gemma2 and a 64-layer exaone4 default to 4096, ...). Without the key such a model's class is
# not known (the strict rule), never plain.
WINDOW_BY_DEFAULT: Final = frozenset(
    {
        "afmoe",
        "cohere2",
        "cohere2moe",
        "deepseek4",
        "dflash",
        "dots3note",
        "exaone4",
        "exaone-moe",
        "gemma-embedding",
        "gemma2",
        "gemma3",
        "gemma3n",
        "gemma4",
        "gemma4-assistant",
        "granite_swa",
        "laguna",
        "llama4",
        "maple",
        "mellum",
        "mimo2",
        "modern-bert",
        "muse-glimmer",
        "olmo2",
        "gpt-oss",
        "phi3",
        "phimoe",
        "plamo3",
        "smallthinker",
        "spark2_5",
        "step35",
    }
)


def _swa(meta: Mapping[str, Any], arch: str, n_layer: int) -> tuple[int, int | None]:
    window = meta.get(f"{arch}.attention.sliding_window")
    if not isinstance(window, int) or isinstance(window, bool) or window <= 0:
        return 0, None
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list) and len(pattern) >= n_layer:
        return window, sum(1 for p in pattern[:n_layer] if p)
    if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 0:
        # llama_hparams::set_swa_pattern (dense last): every layer SWA when 0
        return window, sum(1 for i in range(n_layer) if pattern == 0 or i % pattern < pattern - 1)
    return window, None


def _ssm_rows(meta: Mapping[str, Any], arch: str, kind: str | None) -> tuple[int | None, int | None]:
    """Bytes of one recurrent layer's conv (r) and state (s) rows in f32 (llama_hparams::n_embd_r/s)."""
    if kind not in ("gated-delta-net", "mamba", "mamba2"):
        return None, None
    conv, inner, state = (meta.get(f"{arch}.ssm.{k}") for k in ("conv_kernel", "inner_size", "state_size"))
    groups = meta.get(f"{arch}.ssm.group_count", 0)
    if not all(isinstance(v, int) and v > 0 for v in (conv, inner, state)) or not isinstance(groups, int):
        return None, None
    assert isinstance(conv, int) and isinstance(inner, int) and isinstance(state, int)
    return 4 * (conv - 1) * (inner + 2 * groups * state), 4 * state * inner


def classify(gguf: GgufFile) -> MemoryClass:
    """The model's memory class from its metadata and tensor names (settings not applied)."""
    meta = gguf.meta
    arch = meta.get("general.architecture")
    n_all = meta.get(f"{arch}.block_count") if isinstance(arch, str) else None
    if not isinstance(arch, str) or not isinstance(n_all, int) or not 0 < n_all <= 4096:
        return MemoryClass(kind=UNKNOWN, arch=str(arch), n_layer=0, attention_layers=0, why="no architecture")
    nextn = meta.get(f"{arch}.nextn_predict_layers", 0)
    n_layer = n_all - nextn if isinstance(nextn, int) and 0 <= nextn < n_all else n_all
    recurrent, attention, suffixes = _layers(gguf.tensors, n_layer)
    declared = _declared_recurrent(meta, arch, n_layer)
    kind_r = _recurrent_kind(suffixes)
    n_swa, swa_layers = _swa(meta, arch, n_layer)
    sections = meta.get(f"{arch}.rope.dimension_sections")
    r_row, s_row = _ssm_rows(meta, arch, kind_r)
    base = MemoryClass(
        kind=UNKNOWN,
        arch=arch,
        n_layer=n_layer,
        attention_layers=len(attention),
        recurrent_layers=len(recurrent),
        recurrent_kind=kind_r,
        n_swa=n_swa,
        swa_layers=swa_layers,
        cell_ext=isinstance(sections, list) and any(sections),
        r_row_bytes=r_row,
        s_row_bytes=s_row,
    )
    if declared is not None and declared != recurrent:
        return _replace(base, why="the metadata's recurrent layers differ from the tensors'")
    if recurrent:
        kind = HYBRID if attention else RECURRENT
        return _replace(base, kind=kind)
    if declared:  # the metadata names recurrent layers the tensors do not have
        return _replace(base, why="recurrent layers named in the metadata have no recurrent weights")
    if not n_swa and arch in WINDOW_BY_DEFAULT and f"{arch}.attention.sliding_window" not in meta:
        return _replace(base, why=f"{arch}: llama.cpp may run it with a window its metadata does not state")
    return _replace(base, kind=SWA if n_swa else PLAIN)


def _replace(c: MemoryClass, **changes: Any) -> MemoryClass:
    return MemoryClass(**{**asdict(c), "checkpoints": c.checkpoints, **changes})


def _int_setting(settings: RuntimeSettings | None, key: str, default: int) -> int:
    raw = settings.effective(key) if settings is not None else None
    try:
        return int(raw.strip()) if raw is not None else default
    except ValueError:
        return default


def apply_settings(c: MemoryClass, settings: RuntimeSettings | None) -> MemoryClass:
    """The class under a server's settings (None: not known, llama-server's defaults assumed):
    `--swa-full`, and what it does with checkpoints."""
    swa_full = c.n_swa > 0 and settings is not None and settings.effective("swa-full") == "on"
    n_ckpt = _int_setting(settings, "ctx-checkpoints", 32)
    ubatch = _int_setting(settings, "ubatch-size", 512)
    batch = _int_setting(settings, "batch-size", 2048)
    unrollable = c.kind in (HYBRID, RECURRENT) or (c.kind == SWA and not swa_full)
    checkpoints = Checkpoints(
        made=n_ckpt > 0 and unrollable,
        max_per_slot=max(0, n_ckpt),
        min_step=_int_setting(settings, "checkpoint-min-step", 8192),
        before_end=(min(batch, 4 + ubatch), min(batch, 4)),
        ram_cache_mib=_int_setting(settings, "cache-ram", 8192),
    )
    return MemoryClass(**{**asdict(c), "swa_full": swa_full, "checkpoints": checkpoints})


def model_class(paths: Sequence[Path], settings: RuntimeSettings | None = None) -> MemoryClass:
    """The memory class of the model in `paths` (every file of a split GGUF, the first with the
    metadata) under `settings`. A file that cannot be read makes the class `unknown`, never a guess."""
    meta: dict[str, Any] = {}
    tensors: dict[str, tuple[int, ...]] = {}
    for i, path in enumerate(paths):
        try:
            info = read_gguf(path, array_suffixes=_PER_LAYER_ARRAYS, tensors=True)
        except (OSError, GgufError) as exc:
            why = f"model file {i + 1} of {len(paths)} is unreadable ({type(exc).__name__})"
            return MemoryClass(kind=UNKNOWN, arch="", n_layer=0, attention_layers=0, why=why)
        if i == 0:
            meta = dict(info.meta)
        tensors.update(info.tensors)
    if not paths:
        return MemoryClass(kind=UNKNOWN, arch="", n_layer=0, attention_layers=0, why="no model file")
    return apply_settings(classify(GgufFile(meta, frozenset(), tensors)), settings)
