"""Random-weight llama models whose outputs really differ from one seed to the next (issue 26 A).

`kvsidecar.testing.models` draws its weights at a scale (0.02) where two seeds give nearly the same, nearly
uniform next-token distribution for every prompt, so KV restored into the wrong model can look like a cold
run. These are drawn larger, and optionally written as a split GGUF (`<name>-0000i-of-0000N.gguf`, the
first shard metadata only, as llama.cpp's gguf-split writes it).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvsidecar.testing import models
from kvsidecar.testing.llama import llama_server_binary, vocab_dir

SHAPE = models.ModelShape(n_layer=2, n_embd=128, n_head=4, n_head_kv=4, n_ff=256, n_ctx=4096)
SCALE = 0.4


def distinct_model(
    out: Path, *, seed: int, split: int = 0, redraw_rows: tuple[int, frozenset[int]] | None = None
) -> Path:
    """Write a model to `out` (a `.gguf` path); with `split`, at most that many tensors per shard after a
    metadata-only first shard. Returns the path to give llama-server (the first shard when split).

    `redraw_rows` (seed, kept): the embedding rows of every token not in `kept` drawn again from `seed`,
    everything else as `seed` gives it (a change the runtime canary's prompt does not see)."""
    import gguf
    import numpy as np

    out.parent.mkdir(parents=True, exist_ok=True)
    shape = models.ModelShape(**{**SHAPE.__dict__, "seed": seed})
    reader = gguf.GGUFReader(str(models._vocab_file(vocab_dir(llama_server_binary()))))
    writer = gguf.GGUFWriter(str(out), "llama", split_max_tensors=split, small_first_shard=split > 0)
    models._write_hparams(writer, shape)
    n_vocab = models._copy_tokenizer(reader, writer)
    rng = np.random.default_rng(seed)

    def weight(*dims: int) -> Any:
        return (rng.standard_normal(dims, dtype=np.float32) * SCALE).astype(np.float16)

    n_embd = shape.n_embd
    embd = weight(n_vocab, n_embd)
    if redraw_rows is not None:
        other_seed, kept = redraw_rows
        other = (
            np.random.default_rng(other_seed).standard_normal(embd.shape, dtype=np.float32) * SCALE
        ).astype(np.float16)
        rows = np.array([i not in kept for i in range(n_vocab)])
        embd[rows] = other[rows]
    writer.add_tensor("token_embd.weight", embd)
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    writer.add_tensor("output.weight", weight(n_vocab, n_embd))
    for i in range(shape.n_layer):
        p = f"blk.{i}."
        writer.add_tensor(p + "attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(p + name + ".weight", weight(n_embd, n_embd))
        writer.add_tensor(p + "ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(p + "ffn_gate.weight", weight(shape.n_ff, n_embd))
        writer.add_tensor(p + "ffn_up.weight", weight(shape.n_ff, n_embd))
        writer.add_tensor(p + "ffn_down.weight", weight(n_embd, shape.n_ff))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    if split:
        first = sorted(out.parent.glob(f"{out.stem}-00001-of-*.gguf"))
        assert len(first) == 1, first
        return first[0]
    return out
