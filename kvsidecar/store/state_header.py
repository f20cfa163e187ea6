"""The tokens a sequence-state file holds, read from its header only (`tokens_of`): what a planner compares
with the next prompt (coordinator/plan.py) before anything is restored.

The header is the first bytes of the file (`store/state_format.py`): magic, version, n_token, then n_token
i32 tokens, which llama-server writes as its `server_tokens` state (`text_tokens`). Nothing past the token
list is read, so it costs one small read however large the KV is. It is a read of a file of ours that the
candidate checks have already verified (size, header, checksum); anything unexpected raises
StateFormatError, and the caller treats the tokens as unknown.
"""

from __future__ import annotations

import os
import struct

from kvsidecar.store.state_format import KNOWN_VERSIONS, MAGIC, StateLayout, text_tokens
from kvsidecar.store.state_sections import MAX_TOKENS, StateFormatError

_HEAD = struct.Struct("<III")


def _read(fd: int, offset: int, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = os.pread(fd, n - len(out), offset + len(out))
        if not chunk:
            raise StateFormatError("STATE_TRUNCATED", "the file ends inside its token list")
        out += chunk
    return bytes(out)


def tokens_of(fd: int, size: int) -> tuple[int, ...]:
    """The text tokens of the state file open on `fd` (`size` bytes), from its header alone."""
    if size < _HEAD.size:
        raise StateFormatError("STATE_TRUNCATED", "shorter than a state header")
    magic, version, n_token = _HEAD.unpack(_read(fd, 0, _HEAD.size))
    if magic != MAGIC:
        raise StateFormatError("STATE_BAD_MAGIC", "not a llama.cpp sequence-state file")
    if version not in KNOWN_VERSIONS:
        raise StateFormatError("STATE_UNKNOWN_VERSION", f"state format version {version} is not one we know")
    if n_token > MAX_TOKENS or _HEAD.size + 4 * n_token > size:
        raise StateFormatError("STATE_BAD_FIELD", f"{n_token} tokens")
    raw = struct.unpack(f"<{n_token}i", _read(fd, _HEAD.size, 4 * n_token)) if n_token else ()
    return text_tokens(StateLayout(version=version, tokens=tuple(raw), streams=(), size=size))
