"""A tiny llama-spm-style vocabulary file, for the model generators in unit tests (the real one comes with
the provisioned llama-server build)."""

from __future__ import annotations

from pathlib import Path

N_VOCAB = 64


def write_vocab(folder: Path) -> Path:
    """`folder/ggml-vocab-llama-spm.gguf` with N_VOCAB tokens; returns the folder."""
    import gguf

    folder.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(folder / "ggml-vocab-llama-spm.gguf"), "llama")
    writer.add_tokenizer_model("llama")
    writer.add_token_list([f"t{i}" for i in range(N_VOCAB)])
    writer.add_token_scores([0.0] * N_VOCAB)
    writer.add_token_types([1] * N_VOCAB)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return folder
