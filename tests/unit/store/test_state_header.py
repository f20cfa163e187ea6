"""The tokens of a state file from its header alone (kvsidecar/store/state_header.py)."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest

from kvsidecar.store.state_format import MAGIC
from kvsidecar.store.state_header import tokens_of
from kvsidecar.store.state_sections import StateFormatError


def _file(tmp_path: Path, words: list[int], tail: bytes = b"\x00" * 64) -> tuple[int, int]:
    data = struct.pack(f"<{len(words)}i", *words) + tail
    path = tmp_path / "state"
    path.write_bytes(data)
    return os.open(path, os.O_RDONLY), len(data)


def test_plain_token_list(tmp_path: Path) -> None:
    fd, size = _file(tmp_path, [MAGIC, 4, 3, 7, 8, 9])
    try:
        assert tokens_of(fd, size) == (7, 8, 9)
    finally:
        os.close(fd)


def test_server_tokens_state(tmp_path: Path) -> None:
    """llama-server writes LLAMA_TOKEN_NULL, version 1, n, the tokens, a media count of 0."""
    fd, size = _file(tmp_path, [MAGIC, 4, 7, -1, 1, 3, 5, 6, 7, 0])
    try:
        assert tokens_of(fd, size) == (5, 6, 7)
    finally:
        os.close(fd)


@pytest.mark.parametrize(
    "words",
    [
        [0x1234, 4, 1, 5],  # not a state file
        [MAGIC, 9, 1, 5],  # a version we do not know
        [MAGIC, 4, 1 << 27, 5],  # more tokens than any slot
        [MAGIC, 4, 1000, 5],  # more tokens than the file holds
        [MAGIC, 4, 5, -1, 1, 1, 5, 1],  # media in the slot
    ],
)
def test_refused(tmp_path: Path, words: list[int]) -> None:
    fd, size = _file(tmp_path, words, tail=b"")
    try:
        with pytest.raises(StateFormatError):
            tokens_of(fd, size)
    finally:
        os.close(fd)
