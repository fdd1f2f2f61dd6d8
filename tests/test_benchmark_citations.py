"""Every figure the docs quote from a benchmark cites its row in benchmarks/RESULTS.md, and
that row exists (``python benchmarks/run_all.py --quick`` writes the file)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITATION = re.compile(r"\[R:([a-z0-9_.]+)\]")
ROW = re.compile(r"^\| `\[R:([a-z0-9_.]+)\]` \|", re.MULTILINE)


def cited() -> dict[str, set[str]]:
    """Row id -> the documents that cite it."""
    found: dict[str, set[str]] = {}
    for document in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for row in CITATION.findall(document.read_text(encoding="utf-8")):
            found.setdefault(row, set()).add(str(document.relative_to(ROOT)))
    return found


def test_every_cited_benchmark_row_exists() -> None:
    rows = set(ROW.findall((ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")))
    citations = cited()
    assert citations, "no document cites a benchmark row"
    missing = {row: sorted(docs) for row, docs in citations.items() if row not in rows}
    assert not missing, f"cited rows absent from benchmarks/RESULTS.md: {missing}"


def test_run_all_writes_rows_in_the_cited_form(tmp_path: Path) -> None:
    import sys

    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import run_all
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    line = "| `[R:demo.row]` | x | 1 | **2** | 3 | x | m | `c` | l | 1 | d |"
    run_all.write(tmp_path / "RESULTS.md", {"demo.row": line}, ["# header"])
    text = (tmp_path / "RESULTS.md").read_text()
    assert ROW.findall(text) == ["demo.row"]
    assert run_all.existing_rows(tmp_path / "RESULTS.md") == {"demo.row": line}
    assert [b.name for b in run_all.BENCHMARKS if not b.script.exists()] == []
