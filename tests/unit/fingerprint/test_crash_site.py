"""What instruction a kernel crash record points at: judged by its encoding only, read from the record's
`Code:` line or from the named file at the recorded address."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from kvsidecar.fingerprint.crash_site import code_bytes, isa_of, read_at, same_file

TILERELEASE = bytes.fromhex("c4e27849c0")  # AMX: VEX.128.NP.0F38.W0 49 C0
VPADDD_ZMM = bytes.fromhex("62f17d48fec1")  # AVX-512 (EVEX)
VFMADD231PS = bytes.fromhex("c4e27db8c1")  # FMA/AVX2 (VEX, map 0F38, not an AMX opcode)
VZEROUPPER = bytes.fromhex("c5f877")  # AVX (two-byte VEX)
UD2 = bytes.fromhex("0f0b")


@pytest.mark.parametrize(
    ("code", "isa"),
    [
        (TILERELEASE, "AMX"),
        (VPADDD_ZMM, "AVX-512"),
        (VFMADD231PS, "AVX"),
        (VZEROUPPER, "AVX"),
        (b"\x64" + VPADDD_ZMM, "AVX-512"),  # a segment prefix first
        (UD2, None),
        (b"\x48\x8b\x07", None),  # a plain mov
        (b"\xc4", None),  # cut short
        (b"", None),
    ],
)
def test_the_encoding_names_the_extension(code: bytes, isa: str | None) -> None:
    assert isa_of(code) == isa


def test_a_code_line_gives_the_bytes_from_the_faulting_one() -> None:
    line = "Code: 48 89 e5 41 57 41 56 <c4> e2 78 49 c0 5d c3 0f 1f 44 00 00"
    assert code_bytes(line) == bytes.fromhex("c4e27849c05dc30f1f440000")
    assert code_bytes("Code: Unable to access opcode bytes at 0x7f12.") is None
    assert code_bytes("Code: 48 89 e5") is None  # no marked byte


def elf_with_text(path: Path, code: bytes, *, segments: int = 1) -> None:
    """A 64-bit little-endian ELF with `segments` executable PT_LOAD segments at file offset 0x1000."""
    header = b"\x7fELF\x02\x01\x01" + bytes(9)
    header += struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 64, 0, 0, 64, 56, segments, 0, 0, 0)
    phdrs = b"".join(
        struct.pack("<IIQQQQQQ", 1, 5, 0x1000, 0x1000, 0x1000, len(code), len(code), 0x1000)
        for _ in range(segments)
    )
    blob = header + phdrs
    path.write_bytes(blob + bytes(0x1000 - len(blob)) + code)


def test_the_instruction_is_read_from_the_file_at_the_recorded_address(tmp_path: Path) -> None:
    lib = tmp_path / "libggml-cpu.so"
    elf_with_text(lib, UD2 * 8 + TILERELEASE + UD2)
    start = 0x7F3A12C31000  # where the kernel says the executable mapping begins
    assert isa_of(read_at(str(lib), start, start + 16) or b"") == "AMX"
    assert isa_of(read_at(str(lib), start, start) or b"") is None  # ud2
    assert read_at(str(lib), start, start - 1) is None
    assert read_at(str(tmp_path / "gone.so"), start, start) is None
    (tmp_path / "not-elf.so").write_bytes(b"#!/bin/sh\n" * 500)
    assert read_at(str(tmp_path / "not-elf.so"), start, start) is None
    two = tmp_path / "two.so"
    elf_with_text(two, TILERELEASE, segments=2)
    assert read_at(str(two), start, start) is None  # which mapping was it: no claim


def test_a_file_name_from_the_record_names_one_known_file() -> None:
    files = ("/opt/llama/lib/libggml-cpu.so.0.26.0", "/opt/llama/bin/llama-server")
    assert same_file("libggml-cpu.so.0.26.0", files) == files[0]
    assert same_file("libc.so.6", files) is None
    assert same_file("libggml-cpu.so.0.26.0", (*files, "/other/libggml-cpu.so.0.26.0")) is None
