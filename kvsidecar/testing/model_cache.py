"""What the model generators share: the cache root their files go under, llama.cpp's vocabulary file they
take a real tokenizer from, and the copy of its tokenizer keys into a new GGUF."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any


def cache_root() -> Path:
    return Path(os.environ.get("KVSIDECAR_CACHE", Path.home() / ".cache" / "kvsidecar"))


def vocab_file(vocab_dir: Path) -> Path:
    path = vocab_dir / "ggml-vocab-llama-spm.gguf"
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing: run scripts/provision-llama-server first")
    return path


def copy_tokenizer(reader: Any, writer: Any) -> int:
    """Copy the vocabulary file's tokenizer keys; returns the vocabulary size."""
    n_vocab = 0
    for name, field in reader.fields.items():
        if not name.startswith("tokenizer."):
            continue
        value = field.contents()
        if name == "tokenizer.ggml.tokens":
            n_vocab = len(value)
        sub_type = field.types[1] if len(field.types) > 1 else None
        writer.add_key_value(name, value, field.types[0], sub_type=sub_type)
    writer.add_vocab_size(n_vocab)
    return n_vocab
