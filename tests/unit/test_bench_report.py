"""docs/BENCHMARKS.md is exactly what bench/report.py writes from the committed results and notes.

Hand edits to the generated file were lost at the next `bench/run`; analysis now lives in bench/notes/*.md.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_benchmarks_md_is_generated_from_results_and_notes() -> None:
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        report = importlib.import_module("report")
        rendered = report.render()
    finally:
        sys.path.remove(str(ROOT / "bench"))
    on_disk = (ROOT / "docs" / "BENCHMARKS.md").read_text()
    assert rendered == on_disk, "docs/BENCHMARKS.md differs from bench/report.py's output: run it"


def test_every_notes_file_belongs_to_a_section() -> None:
    text = (ROOT / "bench" / "report.py").read_text()
    for note in (ROOT / "bench" / "notes").glob("*.md"):
        assert f'"{note.stem}")' in text, f"{note.name} is never included"
