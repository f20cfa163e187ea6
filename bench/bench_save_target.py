"""How a save's target name is cleared, at Llama-3-8B KV sizes (issue 15: a switch's save + restore).

A save writes a session's older generation again: the name holds a ~380 MB file (2,900 tokens at 128 KiB per
token) that must go. Freeing a file's blocks costs time in proportion to its size. Four ways, one real
llama-server, interleaved round by round, each round timed from the first file operation to the end of the
incoming session's restore (the part of a switch before its prefill):

- unlink-first: delete the old file, then have llama-server save (kvsidecar before this benchmark);
- aside: rename the old file to a fresh name, delete it in a thread while llama-server saves (kvsidecar now);
- overwrite: let llama-server's save truncate the existing file (a harness driving /slots by hand);
- keep-until-after: rename it aside and delete it only after the save (shows that freeing it late is worse).

`--state clean` syncs the disk before each round (an older generation written a while ago); `dirty` leaves the
previous rounds' pages unwritten (a generation written seconds ago).

`--incoming cold` drops the incoming session's file from the page cache before each round
(POSIX_FADV_DONTNEED; on a VM the host may still cache it) and compares two ways only: aside, and
aside+preread, which first asks the kernel to read the incoming file (POSIX_FADV_WILLNEED, as kvsidecar does
before a switch's save), so that the read overlaps the save instead of following it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write

from kvsidecar.store.readahead import read_ahead, step_bytes
from kvsidecar.testing.llama import LlamaServer, llama_server_binary, vocab_dir, words
from kvsidecar.testing.models import LLAMA3_8B_GEOMETRY, generate_llama_model

WAYS = ("unlink-first", "aside", "overwrite", "keep-until-after")
COLD_WAYS = ("aside", "aside+preread")


def advise(path: Path, advice: int) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, advice)
    finally:
        os.close(fd)


def one_round(http: httpx.Client, base: str, snaps: Path, way: str, name: str) -> dict[str, float]:
    target, retired = snaps / name, snaps / "retired.bin"
    dropper: threading.Thread | None = None
    reader: threading.Thread | None = None
    t0 = time.perf_counter()
    if way == "aside+preread":  # in steps the kernel honours, in a thread, as kvsidecar does
        incoming = snaps / "incoming.bin"
        fd = os.open(incoming, os.O_RDONLY)
        size = os.fstat(fd).st_size
        step = step_bytes(os.fstat(fd).st_dev)

        def pre_read() -> None:
            try:
                read_ahead(fd, size, step, stop=lambda: False)
            finally:
                os.close(fd)

        reader = threading.Thread(target=pre_read)
        reader.start()
    if way == "unlink-first":
        target.unlink()
    elif way in ("aside", "aside+preread", "keep-until-after"):
        target.rename(retired)
        if way != "keep-until-after":
            dropper = threading.Thread(target=retired.unlink)
            dropper.start()
    saved = http.post(f"{base}/slots/0?action=save", json={"filename": name})
    t1 = time.perf_counter()
    saved.raise_for_status()
    if way == "keep-until-after":
        dropper = threading.Thread(target=retired.unlink)
        dropper.start()
    restored = http.post(f"{base}/slots/0?action=restore", json={"filename": "incoming.bin"})
    t2 = time.perf_counter()
    restored.raise_for_status()
    if dropper is not None:
        dropper.join()
    if reader is not None:
        reader.join()
    return {
        "path_ms": (t2 - t0) * 1000,
        "save_ms": (t1 - t0) * 1000,
        "llama_save_ms": float(saved.json()["timings"]["save_ms"]),
        "restore_ms": (t2 - t1) * 1000,
    }


def run(work: Path, rounds: int, n_words: int, state: str, incoming: str) -> dict[str, Any]:
    binary = llama_server_binary()
    model = generate_llama_model(LLAMA3_8B_GEOMETRY, vocab_dir=vocab_dir(binary))
    snaps = work / "snaps"
    llama = LlamaServer(
        binary=binary,
        model=model,
        slot_save_path=snaps,
        log_path=work / "llama.log",
        ctx_size=4096,
        extra_args=("--cache-ram", "0"),
    )
    llama.start()
    ways = COLD_WAYS if incoming == "cold" else WAYS
    rows: dict[str, list[dict[str, float]]] = {w: [] for w in ways}
    try:
        with httpx.Client(timeout=600) as http:
            body = {"prompt": words("A", n_words), "n_predict": 1, "cache_prompt": True, "id_slot": 0}
            http.post(f"{llama.base_url}/completion", json=body).raise_for_status()
            for name in ("g0.bin", "g1.bin", "incoming.bin"):
                http.post(f"{llama.base_url}/slots/0?action=save", json={"filename": name}).raise_for_status()
            size = (snaps / "g0.bin").stat().st_size
            for i in range(rounds * len(ways)):
                way = ways[(i + i // len(ways)) % len(ways)]  # rotate which way follows which
                if state == "clean":
                    os.sync()
                if incoming == "cold":
                    advise(snaps / "incoming.bin", os.POSIX_FADV_DONTNEED)
                time.sleep(0.5)
                rows[way].append(one_round(http, llama.base_url, snaps, way, f"g{i % 2}.bin"))
    finally:
        llama.stop()
    p50 = {w: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for w, rs in rows.items()}
    return {
        "model": "llama3-8b-geometry",
        "file_bytes": size,
        "state": state,
        "incoming": incoming,
        "rounds": rounds,
        "p50": p50,
        "rows": rows,
    }


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=8, help="rounds per way")
    parser.add_argument("--words", type=int, default=1700, help="history in generated words (~2,900 tokens)")
    parser.add_argument("--state", choices=("clean", "dirty"), default="clean")
    parser.add_argument("--incoming", choices=("cached", "cold"), default="cached")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = run(Path(tmp), args.rounds, args.words, args.state, args.incoming)
    name = f"save_target_{args.state}" + ("_cold_incoming" if args.incoming == "cold" else "")
    print(write(name, result))
    print(
        f"{result['file_bytes'] / 1e6:,.0f} MB slot files, old file {args.state}, incoming {args.incoming}; p50 ms:"
    )
    for way, p in result["p50"].items():
        print(
            f"  {way:17} save + restore {p['path_ms']:7.1f}  (save {p['save_ms']:6.1f}, "
            f"llama-server's save_ms {p['llama_save_ms']:6.1f}, restore {p['restore_ms']:5.1f})"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
