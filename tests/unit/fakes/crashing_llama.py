"""A stand-in llama-server that really dies the way a miscompiled build does (issue 25), for the smoke check.

`python crashing_llama.py --port N ...` serves `/health` and `/completion` on 127.0.0.1:N like llama-server.
`CRASHING_LLAMA_MODE` picks what it does: `ok` (answers like a good build), `sigill-at-completion` (kills
itself with SIGILL at the first completion, before answering), `sigill-at-load` (dies before it is ready),
`exit-at-load` (exits 1 before it is ready), `decodes-nothing` (answers 200 with no generated token).
`CRASHING_LLAMA_LOG` names a file each start appends a line to, so a test can count starts.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from http.server import BaseHTTPRequestHandler, HTTPServer

MODE = os.environ.get("CRASHING_LLAMA_MODE", "ok")


class Handler(BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass

    def _answer(self, status: int, body: object) -> None:
        raw = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self) -> None:
        self._answer(200, {"status": "ok"})

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        self.rfile.read(length)
        if MODE == "sigill-at-completion":
            sys.stderr.write("ggml_backend_amx_mul_mat: about to run tilezero\n")
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGILL)
        predicted = 0 if MODE == "decodes-nothing" else 4
        self._answer(
            200, {"content": " x" * predicted, "timings": {"prompt_n": 240, "predicted_n": predicted}}
        )


def main() -> None:
    if log := os.environ.get("CRASHING_LLAMA_LOG"):
        with open(log, "a") as f:
            f.write(" ".join(sys.argv[1:]) + "\n")
    if MODE == "sigill-at-load":
        os.kill(os.getpid(), signal.SIGILL)
    if MODE == "exit-at-load":
        sys.stderr.write("error: failed to load model\n")
        sys.exit(1)
    port = int(sys.argv[sys.argv.index("--port") + 1])
    HTTPServer(("127.0.0.1", port), Handler).serve_forever()


if __name__ == "__main__":
    main()
