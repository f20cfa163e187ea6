"""What `--swa-full` costs: the size of a sliding-window model's SWA KV cache with and without it, computed
the way llama.cpp 11434 sizes it (`llama_kv_cache_iswa`, src/llama-kv-cache-iswa.cpp, and the layers'
tensors in `llama_kv_cache`, src/llama-kv-cache.cpp) from the model's GGUF metadata, the server's
settings and the context llama-server reports for a slot. Pure: no file is read here.

- **Cells per stream.** Without `--swa-full`: GGML_PAD(min(n_ctx_seq, n_swa x (n_seq_max if the cache is
  unified else 1) + n_ubatch), 256); with it, n_ctx_seq (every position).
- **Streams.** One with a unified KV cache, else one per slot (n_seq_max). The cache is unified with
  `--kv-unified`, and always when the slot count is left to llama-server (`-np` absent or -1: 4 slots,
  unified, `tools/server/server.cpp`).
- **n_ctx_seq** is what `/props` reports as a slot's context (`n_ctx_slot()`), except where
  `--kv-unified-per-slot` caps it: the figure is then not known here.
- **n_ubatch**: min(`--batch-size`, `--ubatch-size`) (2048, 512 by default).
- **Bytes of a cell**: over the SWA layers, ggml_row_size(type_k, n_embd_k_gqa(il)) +
  ggml_row_size(type_v, n_embd_v_gqa(il)); n_embd_k_gqa(il) = head_count_kv(il) x the key length
  (`attention.key_length_swa`, else `attention.key_length`, else embedding_length / head_count). Where
  the V width differs between layers a transposed V cache (flash attention off) takes the widest for
  every layer: the figure is then not known here.
- **Which layers are SWA**: `attention.sliding_window_pattern` (flags, or "every n-th is global"), else
  the pattern the architecture sets in code (`load_swa_pattern` in src/models/*.cpp: `_DEFAULT_PATTERN`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from kvsidecar.fingerprint.llama_settings import RuntimeSettings

MIB = 1024 * 1024
_PAD = 256
# ggml type -> (bytes of a block, elements in a block), for the types --cache-type-k/-v accept
_TYPE_SIZE = {
    "f32": (4, 1),
    "f16": (2, 1),
    "bf16": (2, 1),
    "q8_0": (34, 32),
    "q4_0": (18, 32),
    "q4_1": (20, 32),
    "iq4_nl": (18, 32),
    "q5_0": (22, 32),
    "q5_1": (24, 32),
}
# architecture -> (n_pattern, dense_first) that llama.cpp 11434 sets where the file has no pattern key
_DEFAULT_PATTERN = {
    "gemma2": (2, False),
    "gemma3": (6, False),
    "gemma3n": (5, False),
    "gemma-embedding": (6, False),
    "gpt-oss": (2, False),
    "cohere2": (4, False),
    "cohere2moe": (4, True),
    "exaone4": (4, False),
    "exaone-moe": (4, False),
    "olmo2": (4, False),
    "plamo3": (8, False),
    "mellum": (4, False),
    "afmoe": (4, False),
    "muse-glimmer": (4, False),
    "smallthinker": (4, True),
    "laguna": (4, True),
}


@dataclass(frozen=True, kw_only=True)
class SwaCache:
    """The SWA layers' KV cache on this server, without and with `--swa-full`."""

    layers: int  # SWA layers
    streams: int
    cells: int  # per stream, without --swa-full
    cells_full: int  # per stream, with it
    bytes_per_cell: int  # one cell across the SWA layers, K and V

    @property
    def bytes(self) -> int:
        return self.streams * self.cells * self.bytes_per_cell

    @property
    def bytes_full(self) -> int:
        return self.streams * self.cells_full * self.bytes_per_cell

    def text(self) -> str:
        """The figure, as doctor, the log and status say it."""
        per = f" x {self.streams} streams" if self.streams > 1 else ""
        return (
            f"--swa-full takes the SWA cache from {_mib(self.bytes)} to {_mib(self.bytes_full)} MiB "
            f"({self.cells:,} -> {self.cells_full:,} cells{per}, {self.layers} layers)"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            **asdict(self),
            "mib": round(self.bytes / MIB, 2),
            "mib_swa_full": round(self.bytes_full / MIB, 2),
        }


def _mib(n: int) -> str:
    return f"{n / MIB:,.2f}".rstrip("0").rstrip(".")


def _pad(n: int) -> int:
    return (n + _PAD - 1) // _PAD * _PAD


def per_layer_ints(value: Any, n: int) -> list[int] | None:
    """A per-layer key: an array of n numbers, or one number for every layer."""
    if isinstance(value, list) and len(value) >= n and all(isinstance(v, int) for v in value[:n]):
        return [int(v) for v in value[:n]]
    if isinstance(value, int) and not isinstance(value, bool):
        return [value] * n
    return None


def swa_layers(meta: Mapping[str, Any], arch: str, n_layer: int) -> list[int] | None:
    """The SWA layers (llama_hparams::set_swa_pattern), or None where neither the file nor the table of
    architecture defaults says."""
    pattern = meta.get(f"{arch}.attention.sliding_window_pattern")
    if isinstance(pattern, list) and len(pattern) >= n_layer:
        return [i for i in range(n_layer) if pattern[i]]
    dense_first = False
    if isinstance(pattern, int) and not isinstance(pattern, bool) and pattern >= 0:
        n = pattern
        dense_first = _DEFAULT_PATTERN.get(arch, (0, False))[1]
    elif arch in _DEFAULT_PATTERN:
        n, dense_first = _DEFAULT_PATTERN[arch]
    else:
        return None
    if dense_first:
        return [i for i in range(n_layer) if n == 0 or i % n != 0]
    return [i for i in range(n_layer) if n == 0 or i % n < n - 1]


def row_bytes(type_name: str, n: int) -> int | None:
    size = _TYPE_SIZE.get(type_name)
    if size is None or n % size[1]:
        return None
    return n // size[1] * size[0]


def _cell_bytes(meta: Mapping[str, Any], arch: str, n_layer: int, settings: RuntimeSettings) -> int | None:
    """Bytes of one cell across the SWA layers (K and V), or None where a figure it needs is not known."""
    key = f"{arch}.attention."
    heads = per_layer_ints(meta.get(key + "head_count"), n_layer)
    embd = meta.get(f"{arch}.embedding_length")
    if not heads or not heads[0] or not isinstance(embd, int):
        return None
    kv_heads = per_layer_ints(meta.get(key + "head_count_kv"), n_layer) or heads
    v_full = meta.get(key + "value_length", embd // heads[0])
    k_len = meta.get(key + "key_length_swa", meta.get(key + "key_length", embd // heads[0]))
    v_len = meta.get(key + "value_length_swa", v_full)
    layers = swa_layers(meta, arch, n_layer)
    if not all(isinstance(n, int) for n in (k_len, v_len, v_full)) or layers is None:
        return None
    assert isinstance(k_len, int) and isinstance(v_len, int) and isinstance(v_full, int)
    widths = {kv_heads[i] * (v_len if i in layers else v_full) for i in range(n_layer)}
    if len(widths) > 1 and settings.effective("flash-attn") != "on":
        return None  # a transposed V cache takes the widest layer's width for every layer
    type_k = settings.effective("cache-type-k") or "f16"
    type_v = settings.effective("cache-type-v") or "f16"
    total = 0
    for il in layers:
        k, v = row_bytes(type_k, kv_heads[il] * k_len), row_bytes(type_v, kv_heads[il] * v_len)
        if k is None or v is None:
            return None
        total += k + v
    return total


def _int_setting(settings: RuntimeSettings, key: str, default: int) -> int | None:
    raw = settings.effective(key)
    try:
        return int(raw.strip()) if raw is not None else default
    except ValueError:
        return None


def swa_cache(
    meta: Mapping[str, Any], settings: RuntimeSettings, *, n_ctx_seq: int | None, n_slots: int | None
) -> SwaCache | None:
    """The SWA cache of a model with a window (`meta`: its GGUF metadata, per-layer arrays decoded) under
    `settings`, with `n_ctx_seq` (a slot's context, from /props) and `n_slots`. None where a figure it
    needs is not known (no window, an unknown cache type, --kv-unified-per-slot, ...)."""
    arch = meta.get("general.architecture")
    n_all = meta.get(f"{arch}.block_count")
    n_swa = meta.get(f"{arch}.attention.sliding_window")
    if not isinstance(arch, str) or not isinstance(n_all, int) or not isinstance(n_swa, int) or n_swa <= 0:
        return None
    if not n_ctx_seq or not n_slots or settings.effective("kv-unified-per-slot") not in (None, "0"):
        return None
    nextn = meta.get(f"{arch}.nextn_predict_layers", 0)
    n_layer = n_all - nextn if isinstance(nextn, int) and 0 <= nextn < n_all else n_all
    parallel = _int_setting(settings, "parallel", -1)
    ubatch, batch = _int_setting(settings, "ubatch-size", 512), _int_setting(settings, "batch-size", 2048)
    cell = _cell_bytes(meta, arch, n_layer, settings)
    if parallel is None or ubatch is None or batch is None or cell is None:
        return None
    unified = parallel < 0 or settings.effective("kv-unified") == "on"
    cells = _pad(min(n_ctx_seq, n_swa * (n_slots if unified else 1) + min(batch, ubatch)))
    layers = swa_layers(meta, arch, n_layer) or []
    return SwaCache(
        layers=len(layers),
        streams=1 if unified else n_slots,
        cells=cells,
        cells_full=n_ctx_seq,
        bytes_per_cell=cell,
    )
