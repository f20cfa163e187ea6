"""What instruction a kernel crash record points at, where the record lets us see it (x86-64).

The kernel's record of a fault names the file the instruction pointer was in and that mapping's start
(`trap invalid opcode ip:7f3a12c4f1a0 sp:... error:0 in libggml-cpu.so[7f3a12c30000+139000]`); a segfault's
record is often followed by a `Code:` line with the bytes around it, the faulting one in `<..>`. From either
the bytes of the faulting instruction are read (from the `Code:` line, or from the named file at that
offset, when the file is one the configured server runs), and only their encoding is judged:

- EVEX (0x62): an AVX-512 instruction;
- VEX (0xC4/0xC5) in the 0F38 map with an AMX opcode (tile load/store/config/zero, the TDP* products): AMX;
- any other VEX: AVX (AVX, AVX2, FMA, F16C, AVX-VNNI).

Anything else, or bytes that cannot be read, is no claim (None). Never raises.
"""

from __future__ import annotations

import contextlib
import os
import re
import struct
from typing import BinaryIO

_SKIPPED_PREFIXES = frozenset({0x26, 0x2E, 0x36, 0x3E, 0x64, 0x65, 0x67, 0xF0})  # segment, addr size, lock
_AMX_OPCODES = frozenset({0x49, 0x4B, 0x5C, 0x5E, 0x6C})  # VEX.0F38: LDTILECFG.., TILELOADD.., TDP*, TCMM*
_CODE_LINE = re.compile(r"Code:((?: [0-9a-f]{2}| <[0-9a-f]{2}>| \([0-9a-f]{2}\))+)")
_PAGE = 4096
_MAX_READ = 16


def isa_of(code: bytes) -> str | None:
    """The instruction set extension of the instruction `code` starts with, by its encoding, or None."""
    i = 0
    while i < len(code) and code[i] in _SKIPPED_PREFIXES:
        i += 1
    if i >= len(code):
        return None
    first = code[i]
    if first == 0x62 and len(code) > i + 1:
        return "AVX-512"
    if first == 0xC4 and len(code) > i + 3:
        return "AMX" if code[i + 1] & 0x1F == 2 and code[i + 3] in _AMX_OPCODES else "AVX"
    if first == 0xC5 and len(code) > i + 2:
        return "AVX"
    return None


def code_bytes(line: str) -> bytes | None:
    """The bytes from the faulting one on, of a kernel `Code:` line (`... 48 8b <62> f1 7c ...`)."""
    m = _CODE_LINE.search(line)
    if m is None:
        return None
    tokens = m.group(1).split()
    start = next((i for i, t in enumerate(tokens) if t.startswith(("<", "("))), None)
    if start is None:
        return None
    return bytes(int(t.strip("<>()"), 16) for t in tokens[start:])


def read_at(path: str, vm_start: int, ip: int) -> bytes | None:
    """The bytes at `ip` of the ELF file `path`, mapped executable at `vm_start` (the kernel's record), or
    None where the file has not exactly one executable segment or cannot be read."""
    if ip < vm_start:
        return None
    with contextlib.suppress(OSError, ValueError, struct.error), open(path, "rb") as f:
        offset = _text_offset(f.read(64), f)
        if offset is None:
            return None
        f.seek(offset + ip - vm_start)
        return f.read(_MAX_READ) or None
    return None


def _text_offset(header: bytes, f: BinaryIO) -> int | None:
    """The page-aligned file offset of the one executable PT_LOAD segment of a 64-bit little-endian ELF."""
    if header[:4] != b"\x7fELF" or header[4] != 2 or header[5] != 1:
        return None
    (phoff,) = struct.unpack_from("<Q", header, 32)
    phentsize, phnum = struct.unpack_from("<HH", header, 54)
    if phentsize < 56 or not 0 < phnum <= 64:
        return None
    f.seek(phoff)
    table = f.read(phentsize * phnum)
    found = []
    for n in range(phnum):
        p_type, p_flags, p_offset = struct.unpack_from("<IIQ", table, n * phentsize)
        if p_type == 1 and p_flags & 1:  # PT_LOAD, PF_X
            found.append(p_offset - p_offset % _PAGE)
    return found[0] if len(found) == 1 else None


def same_file(name: str, candidates: tuple[str, ...]) -> str | None:
    """The one candidate path whose file name is `name` (the kernel prints only the base name)."""
    matches = {c for c in candidates if os.path.basename(c) == name}
    return matches.pop() if len(matches) == 1 else None
