"""Where request bodies crash or stall a real llama-server (the limits of `kvsidecar.backend.llama_body`).

Sent straight to llama-server (no proxy), each with the tiny test model:

- depth: JSON nested N deep (arrays, or objects) at the places llama-server reads it (an unused field, a
  tool's schema, `chat_template_kwargs`, `json_schema`, `response_format`, a Responses `input`, an Anthropic
  tool's `input_schema`); the smallest N that kills the process is found by bisection, the server restarted
  after each crash;
- width: how long llama-server takes, and its peak memory (VmHWM), for bodies of many values, of one wide
  object, and of one long string;
- nesting inside values: a GBNF `grammar` of N nested parentheses or a chain of N rules, a JSON schema's
  chain of N `$ref`s, a lazy grammar's trigger pattern of N nested groups or one word of N characters;
- llama-server's own fields from a client, once each: a `chat_parser` with a cycle, a trigger of an unknown
  type.

`python bench/bench_body_limits.py [--quick]` writes bench/results/body_limits.json; docs/RELIABILITY.md
quotes it.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, write

from kvsidecar.testing.llama import LlamaServer, llama_server_binary, vocab_dir
from kvsidecar.testing.models import TINY, generate_llama_model

Body = Callable[[int], bytes]
MSG = b'{"role":"user","content":"hi"}'


def nest(n: int, *, objects: bool = False) -> bytes:
    if objects:
        return b'{"a":' * n + b"1" + b"}" * n
    return b"[" * n + b"]" * n


def schema(n: int) -> bytes:
    """A JSON schema n objects deep (properties of properties)."""
    inner = b'{"type":"string"}'
    for _ in range(n // 2):
        inner = b'{"type":"object","properties":{"a":' + inner + b"}}"
    return inner


def schema_flat(n: int) -> bytes:
    """The same nesting as one string built at once (deep schemas above ~5,000 are too slow to build)."""
    half = n // 2
    return b'{"type":"object","properties":{"a":' * half + b'{"type":"string"}' + b"}}" * half


DEPTH_PROBES: dict[str, tuple[str, Body]] = {
    "tokenize, unused field (arrays)": ("/tokenize", lambda n: b'{"content":"x","x":' + nest(n) + b"}"),
    "tokenize, unused field (objects)": (
        "/tokenize",
        lambda n: b'{"content":"x","x":' + nest(n, objects=True) + b"}",
    ),
    "apply-template, chat_template_kwargs": (
        "/apply-template",
        lambda n: b'{"messages":[' + MSG + b'],"chat_template_kwargs":{"a":' + nest(n) + b"}}",
    ),
    "chat input_tokens, tool parameters": (
        "/v1/chat/completions/input_tokens",
        lambda n: (
            b'{"messages":['
            + MSG
            + b'],"tools":[{"type":"function","function":{"name":"f","parameters":'
            + schema_flat(n)
            + b"}}]}"
        ),
    ),
    "messages count_tokens, tool input_schema": (
        "/v1/messages/count_tokens",
        lambda n: (
            b'{"model":"m","messages":[' + MSG + b'],"tools":[{"name":"f","input_schema":'
            b'{"type":"object","properties":{"a":' + nest(n) + b"}}}]}"
        ),
    ),
    "responses input_tokens, input": (
        "/v1/responses/input_tokens",
        lambda n: b'{"input":[{"role":"user","content":"hi","x":' + nest(n) + b"}]}",
    ),
    "completion, json_schema": (
        "/completion",
        lambda n: b'{"prompt":"x","n_predict":1,"json_schema":' + schema_flat(n) + b"}",
    ),
    "chat, response_format json_schema": (
        "/v1/chat/completions",
        lambda n: (
            b'{"messages":['
            + MSG
            + b'],"max_tokens":1,"response_format":{"type":"json_schema","json_schema":{"schema":'
            + schema_flat(n)
            + b"}}}"
        ),
    ),
}

Width = tuple[str, Callable[[int], bytes], list[int]]
WIDTH_PROBES: list[Width] = [
    ("array of numbers", lambda n: b'{"content":"x","x":[' + b"0," * (n - 1) + b"0]}", [10**5, 10**6, 10**7]),
    (
        "array of empty objects",
        lambda n: b'{"content":"x","x":[' + b"{}," * (n - 1) + b"{}]}",
        [10**5, 10**6, 8 * 10**6],
    ),
    (
        "one object's members",
        lambda n: b'{"content":"x","x":{' + b",".join(b'"k%d":0' % i for i in range(n)) + b"}}",
        [10**4, 5 * 10**4, 10**5, 2 * 10**5],
    ),
    (
        "one long string (tokenized)",
        lambda n: b'{"content":"' + b"ab " * (n // 3) + b'"}',
        [10**6, 8 * 10**6, 32 * 10**6],
    ),
]


def rule_chain(n: int) -> bytes:
    rules = "root ::= r0\n" + "".join(f"r{i} ::= r{i + 1}\n" for i in range(n)) + f'r{n} ::= "a"\n'
    return json.dumps({"prompt": "x", "n_predict": 1, "grammar": rules}).encode()


def ref_chain(n: int) -> bytes:
    defs: dict[str, Any] = {f"a{i}": {"$ref": f"#/$defs/a{i + 1}"} for i in range(n)}
    defs[f"a{n}"] = {"type": "string"}
    return json.dumps(
        {"prompt": "x", "n_predict": 1, "json_schema": {"$ref": "#/$defs/a0", "$defs": defs}}
    ).encode()


def word_trigger(n: int) -> bytes:
    trigger = [{"type": 1, "value": "ab" * (n // 2)}]
    body = {
        "prompt": "x",
        "n_predict": 1,
        "grammar": 'root ::= "a"',
        "grammar_lazy": True,
        "grammar_triggers": trigger,
    }
    return json.dumps(body).encode()


CYCLIC_PARSER = {
    "parsers": [{"type": "rule", "name": "a", "child": 1, "trigger": False}, {"type": "ref", "name": "a"}],
    "rules": {"a": 0},
    "root": 0,
}
# One body each: does it kill llama-server at all?
ONCE: dict[str, tuple[str, bytes]] = {
    "chat_parser with a cycle": (
        "/completion",
        json.dumps(
            {"prompt": "x", "n_predict": 2, "chat_format": 1, "chat_parser": json.dumps(CYCLIC_PARSER)}
        ).encode(),
    ),
    "grammar trigger of an unknown type": (
        "/completion",
        json.dumps(
            {
                "prompt": "x",
                "n_predict": 2,
                "grammar": 'root ::= "a"',
                "grammar_lazy": True,
                "grammar_triggers": [{"type": 7, "value": "x"}],
            }
        ).encode(),
    ),
}

# Bisected between 100 and 400,000, except where a range is given: a chain of 400,000 `$ref`s keeps
# llama-server busy past the client's 300 s (it answers nothing, and lives), which bisection cannot read.
RANGES: dict[str, tuple[int, int]] = {"json_schema, a chain of $ref": (1_000, 40_000)}
GRAMMAR_PROBES: dict[str, tuple[str, Body]] = {
    "grammar, a chain of rules": ("/completion", rule_chain),
    "json_schema, a chain of $ref": ("/completion", ref_chain),
    "grammar trigger, one long word (characters)": ("/completion", word_trigger),
    "grammar, nested parentheses": (
        "/completion",
        lambda n: json.dumps(
            {"prompt": "x", "n_predict": 1, "grammar": "root ::= " + "(" * n + '"a"' + ")" * n}
        ).encode(),
    ),
    "grammar trigger pattern, nested groups": (
        "/completion",
        lambda n: json.dumps(
            {
                "prompt": "x",
                "n_predict": 4,
                "grammar": 'root ::= "a"',
                "grammar_lazy": True,
                "grammar_triggers": [{"type": 2, "value": "(" * n + "a" + ")" * n}],
            }
        ).encode(),
    ),
}


class Rig:
    def __init__(self, binary: Path, model: Path, tmp: Path) -> None:
        self.server = LlamaServer(
            binary=binary, model=model, slot_save_path=None, log_path=tmp / "llama.log", ctx_size=4096
        )
        self.server.start()
        self.restarts = 0

    def send(self, path: str, body: bytes, *, timeout_s: float = 300.0) -> dict[str, Any]:
        """One request; whether the server survived it, its status, the time, its peak memory."""
        if not self.server.alive:
            self.server.start()
            self.restarts += 1
        started = time.perf_counter()
        status: int | str
        try:
            status = httpx.post(
                self.server.base_url + path,
                content=body,
                headers={"content-type": "application/json"},
                timeout=timeout_s,
            ).status_code
        except httpx.HTTPError as exc:
            status = type(exc).__name__
        elapsed = time.perf_counter() - started
        alive = self.healthy()
        peak = self.peak_mib() if self.server.alive else None
        code = None if self.server.alive or self.server.proc is None else self.server.proc.returncode
        return {"status": status, "alive": alive, "exit": code, "s": round(elapsed, 3), "peak_mib": peak}

    def healthy(self) -> bool:
        """Alive and answering /health (a process that is dying is waited for)."""
        try:
            return (
                self.server.alive
                and httpx.get(self.server.base_url + "/health", timeout=10).status_code == 200
            )
        except httpx.HTTPError:
            if self.server.proc is not None:
                try:
                    self.server.proc.wait(timeout=10)
                except subprocess.TimeoutExpired:
                    return False
            return False

    def peak_mib(self) -> int | None:
        for line in Path(f"/proc/{self.server.pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) // 1024
        return None

    def fresh(self) -> None:
        self.server.stop()
        self.server.start()


def crash_depth(rig: Rig, path: str, body: Body, low: int, high: int) -> dict[str, Any]:
    """The smallest depth in (low, high] that kills llama-server (None: it survives high)."""
    tried: list[tuple[int, dict[str, Any]]] = []
    top = rig.send(path, body(high))
    tried.append((high, top))
    if top["alive"]:
        return {"crash_depth": None, "survives": high, "tried": tried}
    while high - low > max(100, low // 50):
        mid = (low + high) // 2
        result = rig.send(path, body(mid))
        tried.append((mid, result))
        if result["alive"]:
            low = mid
        else:
            high = mid
    return {"crash_depth": high, "survives": low, "tried": tried}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="depth only, a coarser search")
    parser.add_argument("--only", default="", help="run the probes whose name contains this")
    parser.add_argument(
        "--merge", action="store_true", help="update the existing result file with these probes"
    )
    args = parser.parse_args()
    binary = llama_server_binary()
    model = generate_llama_model(TINY, vocab_dir=vocab_dir(binary))
    out: dict[str, Any] = {"binary": str(binary), "depth": {}, "width": {}, "grammar": {}, "once": {}}
    with tempfile.TemporaryDirectory() as tmp:
        rig = Rig(binary, model, Path(tmp))
        try:
            for name, (path, body) in DEPTH_PROBES.items():
                if args.only in name:
                    out["depth"][name] = found = crash_depth(rig, path, body, 1_000, 200_000)
                    print(name, found["crash_depth"], found["survives"], flush=True)
            for name, (path, body) in GRAMMAR_PROBES.items():
                if args.only in name and not args.quick:
                    low, high = RANGES.get(name, (100, 400_000))
                    out["grammar"][name] = found = crash_depth(rig, path, body, low, high)
                    print(name, found["crash_depth"], found["survives"], flush=True)
            for name, (path, data) in ONCE.items():
                if args.only in name and not args.quick:
                    out["once"][name] = result = rig.send(path, data)
                    print(name, result, flush=True)
            for name, build, sizes in WIDTH_PROBES:
                if args.only in name and not args.quick:
                    rows = []
                    for n in sizes:
                        rig.fresh()
                        data = build(n)
                        rows.append({"n": n, "bytes": len(data), **rig.send("/tokenize", data)})
                        print(name, rows[-1], flush=True)
                    out["width"][name] = rows
        finally:
            rig.server.stop()
        out["restarts"] = rig.restarts
    if args.merge:  # a re-run of some probes: the others' figures are kept
        kept = json.loads((RESULTS / "body_limits.json").read_text())
        for section in ("depth", "width", "grammar", "once"):
            out[section] = {**kept.get(section, {}), **out[section]}
    print(write("body_limits", out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
