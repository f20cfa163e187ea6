"""What llama-server alone reuses after a save, erase and restore, on each memory class (docs/MODELS.md).

One slot, a raw-token prompt P of 4,000 tokens and n_predict 4: the slot then holds P plus the 3 generated
tokens that were decoded (4,003; the 4th sampled token is never decoded). The next prompt is one of

    a     every saved token, then 100 new ones                     (an exact extension)
    b     P, then 100 new ones                                      (diverges 3 tokens before the saved end)
    c16   P less its last 16 tokens, then 100 new ones
    c300  P less its last 300 tokens, then 100 new ones

and it comes after one of

    restored  P; save the slot; erase it; restore the file      (what a kvsidecar restore gives today)
    resident  P                                                  (the slot kept it: the best case)
    switched  P; another 1,000-token prompt Q on the slot        (llama-server alone: its RAM cache, if on,
                                                                  brings P back with its checkpoints)

Each row is llama-server's `cache_n` for the next prompt (tokens it reused), and `prompt_n` (tokens it
computed). The saved file is parsed with kvsidecar's state parser under the model's memory class (read from
the GGUF, `fingerprint/memory_class.py`): the sections, cells and bytes of each, and the bytes a token adds
(from a second save after case a). Models: the generated tiny llama (plain), `qwen35` (gated delta net
hybrid), `granitehybrid` (Mamba2 hybrid), `gemma3` with a 128-token window, and Gemma 3 270M (window 512),
each with `--cache-ram 0` and with llama-server's default RAM cache.

    .venv/bin/python bench/bench_classes.py                       # every model (about an hour on 2 cores)
    .venv/bin/python bench/bench_classes.py --models qwen35 plain --kinds restored --ram 0
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, write

from kvsidecar.fingerprint.llama_settings import parse_settings
from kvsidecar.fingerprint.memory_class import model_class
from kvsidecar.store.state_format import StateFormatError, parse, text_tokens
from kvsidecar.store.state_sections import PLAIN_LAYOUT, layout_for
from kvsidecar.testing.arch_models import GEMMA3_SWA, GRANITE_HYBRID, QWEN35, generate_arch_model
from kvsidecar.testing.llama import LlamaServer, llama_server_binary, vocab_dir, words
from kvsidecar.testing.models import ModelShape, gemma3_270m, generate_llama_model

CASES = ("a", "b", "c16", "c300")
KINDS = ("restored", "resident", "switched")
RAM = {"0": ("--cache-ram", "0"), "default": ()}
NEW = 100
Q_TOKENS = 1000
# the tiny llama (4 layers of 256, 4 KV heads) with the generated models' training context, so that
# llama-server does not cap the slot at 4,096 tokens
PLAIN = ModelShape(n_ctx=32768)


def _models(binary: Path) -> dict[str, tuple[Callable[[], Path], tuple[str, ...]]]:
    vocab = vocab_dir(binary)
    return {
        "plain": (lambda: generate_llama_model(PLAIN, vocab_dir=vocab), ()),
        "qwen35": (lambda: generate_arch_model(QWEN35, vocab_dir=vocab), ()),
        "granitehybrid": (lambda: generate_arch_model(GRANITE_HYBRID, vocab_dir=vocab), ()),
        "gemma3-swa": (lambda: generate_arch_model(GEMMA3_SWA, vocab_dir=vocab), ()),
        "gemma3-swa --swa-full": (lambda: generate_arch_model(GEMMA3_SWA, vocab_dir=vocab), ("--swa-full",)),
        "gemma3-270m": (gemma3_270m, ()),
        "gemma3-270m --swa-full": (gemma3_270m, ("--swa-full",)),
    }


class Bench:
    def __init__(self, server: LlamaServer) -> None:
        self.server = server
        self.http = httpx.Client(base_url=server.base_url, timeout=1800)

    def tokens(self, text: str, n: int) -> list[int]:
        toks = self.http.post("/tokenize", json={"content": text}).json()["tokens"]
        assert len(toks) >= n, (len(toks), n)
        return [int(t) for t in toks[:n]]

    def complete(self, prompt: list[int]) -> dict[str, Any]:
        body = {
            "prompt": prompt,
            "n_predict": 4,
            "temperature": 0,
            "cache_prompt": True,
            "id_slot": 0,
            "n_probs": 5,
        }
        t0 = time.perf_counter()
        r = self.http.post("/completion", json=body)
        if r.status_code != 200:
            raise RuntimeError(f"/completion answered {r.status_code}: {r.text[:300]}")
        answer = r.json()
        t = answer["timings"]
        probs = answer.get("completion_probabilities") or [{}]
        top = [[int(p["id"]), float(p["logprob"])] for p in probs[0].get("top_logprobs", [])]
        return {
            "cache_n": t["cache_n"],
            "prompt_n": t["prompt_n"],
            "s": round(time.perf_counter() - t0, 2),
            "content": answer.get("content", ""),
            "top5": top,  # the first generated token's five most likely tokens and their log-probabilities
        }

    def action(self, action: str, filename: str | None = None) -> dict[str, Any]:
        body = {} if filename is None else {"filename": filename}
        r = self.http.post(f"/slots/0?action={action}", json=body)
        r.raise_for_status()
        out: dict[str, Any] = r.json()
        return out


def _nexts(p: list[int], saved: list[int], new: list[int]) -> dict[str, list[int]]:
    nexts = {"a": saved + new, "b": p + new, "c16": p[:-16] + new, "c300": p[:-300] + new}
    for name, cut in (("b", len(p)), ("c16", len(p) - 16), ("c300", len(p) - 300)):
        # the next prompt really diverges where the case says
        assert nexts[name][cut] != saved[cut], (name, "the new text starts with the saved token")
    return nexts


def _layout(path: Path, model: Path, args: tuple[str, ...]) -> dict[str, Any]:
    cls = model_class([model], parse_settings(["llama-server", *args], {}))
    memory = layout_for(cls)
    assert memory is not None, cls
    with path.open("rb") as f:
        layout = parse(f, memory=memory)
        try:
            parse(f, memory=PLAIN_LAYOUT)
            as_plain = "parses"
        except StateFormatError as exc:
            as_plain = exc.code
    rec = layout.recurrent
    return {
        "class": cls.to_dict(),
        "parts": list(memory.parts),
        "size": path.stat().st_size,
        "tokens": len(text_tokens(layout)),
        "kv": [
            [
                {
                    "cells": s.cell_count,
                    "layers": s.n_layer,
                    "bytes_per_cell": s.bytes_per_cell,
                    "positions": [min(s.positions), max(s.positions)],
                }
                for s in part
            ]
            for part in layout.kv_parts
        ],
        "recurrent": None
        if rec is None
        else {
            "cells": rec.cell_count,
            "position": list(rec.positions),
            "layers": len(rec.r),
            "r_row": rec.r[0].row,
            "s_row": rec.s[0].row,
            "bytes": rec.bytes,
        },
        "read_as_plain": as_plain,
    }


def _run(b: Bench, kinds: tuple[str, ...], model: Path) -> dict[str, Any]:
    p = b.tokens(words("p", 4600), 4000)
    q = b.tokens(words("q", 1300), Q_TOKENS)
    new = b.tokens(words("zz", 200), NEW)
    b.action("erase")
    first = b.complete(p)
    saved_info = b.action("save", "p.bin")
    path = b.server.save_dir / "p.bin"
    with path.open("rb") as f:
        saved = list(text_tokens(parse(f, memory=layout_for(model_class([model])) or PLAIN_LAYOUT)))
    out: dict[str, Any] = {
        "p": first,
        "n_saved": saved_info["n_saved"],
        "file": _layout(path, model, tuple(b.server.extra_args)),
        "cases": {},
    }
    nexts = _nexts(p, saved, new)
    for kind in kinds:
        rows = {}
        for case in CASES:
            b.action("erase")
            row: dict[str, Any] = {}
            if kind == "restored":
                row["n_restored"] = b.action("restore", "p.bin")["n_restored"]
            else:
                row["p"] = b.complete(p)
                if kind == "switched":
                    row["q"] = b.complete(q)
            row |= b.complete(nexts[case])
            rows[case] = row
            if kind == "restored" and case == "a":
                b.action("save", "a.bin")
                two = b.server.save_dir / "a.bin"
                n_two = len(nexts["a"]) + 3
                per = (two.stat().st_size - path.stat().st_size) / (n_two - len(saved))
                out["bytes_per_token"] = round(per, 1)
                out["fixed_bytes"] = round(path.stat().st_size - per * len(saved))
        out["cases"][kind] = rows
    _compare(out["cases"])
    return out


def _compare(cases: dict[str, dict[str, dict[str, Any]]]) -> None:
    """For each restored and switched row: does its next prompt continue as the resident run's does (the
    same five most likely first tokens, and how far apart their log-probabilities are)?"""
    resident = cases.get("resident", {})
    for kind in ("restored", "switched"):
        for case, row in cases.get(kind, {}).items():
            ref = resident.get(case)
            if ref is None:
                continue
            mine, theirs = dict(map(tuple, row["top5"])), dict(map(tuple, ref["top5"]))
            row["same_top5_as_resident"] = [i for i, _ in row["top5"]] == [i for i, _ in ref["top5"]]
            common = set(mine) & set(theirs)
            row["max_logprob_diff"] = round(max((abs(mine[i] - theirs[i]) for i in common), default=99.0), 6)


CASE_LABELS = {
    "a": "extends all saved tokens",
    "b": "P + new text (diverges 3 before the saved end)",
    "c16": "diverges 16 before P's end",
    "c300": "diverges 300 before P's end",
}
KIND_LABELS = {
    "restored": "save, erase, restore",
    "resident": "resident (no restore)",
    "switched": "another prompt in between (llama-server alone)",
}


def table(results: list[dict[str, Any]]) -> str:
    """docs/MODELS.md's tables: `cache_n` per next prompt (rows) and model (columns), one table per kind;
    restored and resident under --cache-ram 0, switched under the default RAM cache (with --cache-ram 0
    it is 0 everywhere). Where the other RAM setting measured something else, both are shown."""
    models = list(dict.fromkeys(r["model"] for r in results))
    by = {(r["model"], r["ram"]): r for r in results}
    out = []
    for kind, ram, other in (
        ("restored", "0", "default"),
        ("resident", "0", "default"),
        ("switched", "default", "0"),
    ):
        out.append(f"**{KIND_LABELS[kind]}**, `--cache-ram {ram}`\n")
        out.append("| next prompt | " + " | ".join(models) + " |")
        out.append("|---" + "|---:" * len(models) + "|")
        for case in CASES:
            cells = []
            for m in models:
                row = by.get((m, ram), {}).get("cases", {}).get(kind, {}).get(case)
                alt = by.get((m, other), {}).get("cases", {}).get(kind, {}).get(case)
                cell = "—" if row is None else f"{row['cache_n']:,}"
                if (
                    row is not None
                    and alt is not None
                    and alt["cache_n"] != row["cache_n"]
                    and kind != "switched"
                ):
                    cell += f" ({alt['cache_n']:,} with `--cache-ram {other}`)"
                cells.append(cell)
            out.append(f"| {CASE_LABELS[case]} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def diffs_table(results: list[dict[str, Any]]) -> str:
    """After a restore (`--cache-ram 0`): tokens reused, and the largest difference between the first
    generated token's top-5 log-probabilities and the resident slot's (`*`: another top-5 order; `†`:
    another generated text, at temperature 0)."""
    lines = [
        "| model | " + " | ".join(CASE_LABELS[c] for c in CASES) + " |",
        "|---" + "|---:" * len(CASES) + "|",
    ]
    for r in results:
        if r["ram"] != "0" or "resident" not in r["cases"]:
            continue
        cells = []
        for case in CASES:
            row = r["cases"]["restored"][case]
            mark = "" if row.get("same_top5_as_resident", True) else " *"
            if row["content"] != r["cases"]["resident"][case]["content"]:
                mark += " †"
            cells.append(f"{row['cache_n']:,}: {row['max_logprob_diff']:.4f}{mark}")
        lines.append(f"| {r['model']} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def layouts_table(results: list[dict[str, Any]]) -> str:
    """The saved file of each model at 4,003 tokens, as kvsidecar's parser reads it."""
    lines = [
        "| model | sections | KV cells x layers (bytes a cell) | recurrent state | file | bytes a token | fixed |",
        "|---|---|---|---|---:|---:|---:|",
    ]
    seen = set()
    for r in results:
        f = r["file"]
        if r["ram"] != "0" or r["model"].replace(" --swa-full", "") in seen:
            continue
        seen.add(r["model"].replace(" --swa-full", ""))
        kv = "; ".join(
            f"{s['cells']:,} x {s['layers']} ({s['bytes_per_cell']:,} B, positions {s['positions'][0]:,}-{s['positions'][1]:,})"
            for part in f["kv"]
            for s in part
        )
        rec = f["recurrent"]
        state = (
            "—"
            if rec is None
            else f"{rec['layers']} layers x ({rec['r_row']:,} + {rec['s_row']:,} B) = {rec['bytes']:,} B"
        )
        lines.append(
            f"| {r['model']} | {' + '.join(f['parts'])} | {kv} | {state} | {f['size']:,} | "
            f"{r['bytes_per_token']:,.0f} | {r['fixed_bytes']:,} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    names = list(_models(Path("/")))
    parser.add_argument("--models", nargs="+", choices=names, default=names)
    parser.add_argument("--kinds", nargs="+", choices=KINDS, default=list(KINDS))
    parser.add_argument("--ram", nargs="+", choices=list(RAM), default=list(RAM))
    parser.add_argument("--out", default="classes")
    parser.add_argument("--append", action="store_true", help="add to the results already in --out")
    parser.add_argument("--table", action="store_true", help="print --out's table (markdown) and stop")
    args = parser.parse_args(argv)
    if args.table:
        done = json.loads((RESULTS / f"{args.out}.json").read_text())["results"]
        print(table(done), diffs_table(done), layouts_table(done), sep="\n\n")
        return 0
    binary = llama_server_binary()
    models = _models(binary)
    results: list[dict[str, Any]] = []
    if args.append and (RESULTS / f"{args.out}.json").exists():
        results = json.loads((RESULTS / f"{args.out}.json").read_text())["results"]
    for name in args.models:
        make, flags = models[name]
        model = make()
        for ram in args.ram:
            with tempfile.TemporaryDirectory() as tmp:
                server = LlamaServer(
                    binary=binary,
                    model=model,
                    slot_save_path=Path(tmp) / "slots",
                    log_path=Path(tmp) / "llama.log",
                    ctx_size=8192,
                    extra_args=(*RAM[ram], *flags),
                )
                server.start(timeout_s=600)
                try:
                    run = _run(Bench(server), tuple(args.kinds), model)
                finally:
                    server.stop()
            results = [r for r in results if (r["model"], r["ram"]) != (name, ram)]
            results.append({"model": name, "ram": ram, "kinds": list(args.kinds), **run})
            print(
                name,
                "cache-ram",
                ram,
                {k: {c: r["cache_n"] for c, r in v.items()} for k, v in run["cases"].items()},
            )
            # after each run: a long benchmark that stops keeps what it measured
            print(write(args.out, {"prompt_tokens": 4000, "new_tokens": NEW, "results": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
