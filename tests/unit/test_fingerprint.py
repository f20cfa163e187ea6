from __future__ import annotations

import os
from pathlib import Path

from kvsidecar.backend.base import BackendCapabilities
from kvsidecar.store.fingerprint import (
    FileDigestCache,
    ProcessInfo,
    build_fingerprint,
    parse_flags,
    sampled_file_digest,
)

CAPS = BackendCapabilities(
    kind="llama.cpp",
    alive=True,
    slots_endpoint=True,
    total_slots=1,
    n_ctx=4096,
    model_path=None,
    build_info="b1",
)


def proc(*args: str, pid: int = 10) -> ProcessInfo:
    argv = ["/usr/bin/llama-server", *args]
    return ProcessInfo(pid=pid, create_time=1.0, exe=None, cmdline=tuple(argv), flags=parse_flags(argv))


def test_parse_flags_both_spellings() -> None:
    flags = parse_flags(
        [
            "llama-server",
            "-m",
            "x.gguf",
            "-ctk",
            "q8_0",
            "--cache-type-v=q4_0",
            "-fa",
            "on",
            "--swa-full",
            "--lora",
            "a.gguf",
            "--lora-scaled",
            "b.gguf",
            "--port",
            "9000",
            "--no-cache-idle-slots",
            "-kvu",
        ]
    )
    assert flags == {
        "model": "x.gguf",
        "cache_type_k": "q8_0",
        "cache_type_v": "q4_0",
        "flash_attn": "on",
        "swa_full": "on",
        "lora": "a.gguf,b.gguf",
        "port": "9000",
        "no_cache_idle_slots": "on",
        "kv_unified": "on",
    }


def test_fingerprint_is_stable_and_sensitive(tmp_path: Path) -> None:
    model = tmp_path / "m.gguf"
    model.write_bytes(b"weights" * 1000)
    caps = BackendCapabilities(**{**CAPS.__dict__, "model_path": str(model)})
    digests = FileDigestCache(tmp_path / "d.json")

    def fp(*args: str, runtime_key: str | None = None, c: BackendCapabilities = caps) -> str:
        return build_fingerprint(caps=c, process=proc(*args), runtime_key=runtime_key, digests=digests).digest

    base = fp("-ctk", "f16")
    assert fp("-ctk", "f16") == base
    assert fp("-ctk", "q8_0") != base
    assert fp("-ctk", "f16", "--swa-full") != base
    assert fp("-ctk", "f16", runtime_key="v2") != base
    assert fp("-ctk", "f16", "--parallel", "4", "-c", "8192") == base  # geometry is checked at restore time
    assert fp("-ctk", "f16", c=BackendCapabilities(**{**caps.__dict__, "n_ctx": 2048})) == base
    model.write_bytes(b"replaced" * 1000)  # same path, new GGUF
    assert fp("-ctk", "f16") != base


def test_mismatch_reason_names_what_changed() -> None:
    a = build_fingerprint(caps=CAPS, process=proc("-ctk", "f16"), runtime_key=None, digests=None)
    b = build_fingerprint(caps=CAPS, process=proc("-ctk", "q4_0"), runtime_key=None, digests=None)
    c = build_fingerprint(caps=CAPS, process=proc("-ctk", "f16"), runtime_key="k2", digests=None)
    assert b.mismatch_reason(a.components) == "KV_LAYOUT_CHANGED"
    assert c.mismatch_reason(a.components) == "RUNTIME_KEY_CHANGED"
    assert a.mismatch_reason(None) == "FINGERPRINT_CHANGED"


def test_digest_cache_reads_a_file_once_per_version(tmp_path: Path) -> None:
    f = tmp_path / "big.bin"
    f.write_bytes(os.urandom(3 << 20))
    cache = FileDigestCache(tmp_path / "digests.json")
    d1 = cache.digest(f)
    assert cache.digest(f) == d1 and cache.computed == 1
    reopened = FileDigestCache(tmp_path / "digests.json")
    assert reopened.digest(f) == d1 and reopened.computed == 0  # persisted across restarts
    f.write_bytes(os.urandom(3 << 20))
    assert reopened.digest(f) != d1 and reopened.computed == 1
    assert cache.digest(tmp_path / "missing") is None


def test_sampled_digest_sees_changes_in_head_and_tail(tmp_path: Path) -> None:
    f = tmp_path / "big.bin"
    data = bytearray(40 << 20)
    f.write_bytes(data)
    base = sampled_file_digest(f)
    data[-1] = 1
    f.write_bytes(data)
    tail = sampled_file_digest(f)
    data[0] = 1
    f.write_bytes(data)
    assert len({base, tail, sampled_file_digest(f)}) == 3
