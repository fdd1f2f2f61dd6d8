"""Every figure the docs quote from a benchmark cites its row in benchmarks/RESULTS.md, that row
exists (``python benchmarks/run_all.py --quick`` writes the file), and the bold number quoted
next to a citation is the row's median."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CITATION = re.compile(r"\[R:([a-z0-9_.]+)\]")
ROW = re.compile(r"^\| `\[R:([a-z0-9_.]+)\]` \|", re.MULTILINE)
# A quoted figure: bold, optionally signed, optionally with thousands separators.
BOLD_NUMBER = re.compile(r"\*\*([+-]?[0-9][0-9,]*(?:\.[0-9]+)?)")
MEDIAN = re.compile(r"\*\*([^*]+)\*\*")


def documents() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def cited() -> dict[str, set[str]]:
    """Row id -> the documents that cite it."""
    found: dict[str, set[str]] = {}
    for document in documents():
        for row in CITATION.findall(document.read_text(encoding="utf-8")):
            found.setdefault(row, set()).add(str(document.relative_to(ROOT)))
    return found


def medians(text: str) -> dict[str, str]:
    """Row id -> its median cell as written (three significant digits at most)."""
    out = {}
    for line in text.splitlines():
        match = ROW.match(line)
        if match:
            cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
            out[match.group(1)] = MEDIAN.fullmatch(cells[3]).group(1)  # type: ignore[union-attr]
    return out


def quoted_figures(text: str) -> list[tuple[str, str, str]]:
    """(row id, the bold number just before its citation, the text quoting it) per citation.

    The figure a citation belongs to is the last bold number between it and the previous
    citation, within the same paragraph or table row; citations with no bold number there
    (a list of rows, say) quote nothing."""
    found = []
    previous_end = 0
    for match in CITATION.finditer(text):
        window = text[previous_end : match.start()]
        for boundary in ("\n\n", "\n|"):  # a paragraph, or a table row, ends the window
            if boundary in window:
                window = window[window.rindex(boundary) :]
        numbers = BOLD_NUMBER.findall(window)
        if numbers:
            found.append((match.group(1), numbers[-1], window.strip()[-160:]))
        previous_end = match.end()
    return found


def agrees(quoted: str, median: str) -> bool:
    """The doc's number is the row's median rounded to the digits the doc shows."""
    value, target = float(quoted.replace(",", "")), float(median.replace(",", ""))
    decimals = len(quoted.split(".")[1]) if "." in quoted else 0
    # Half a unit of the doc's last digit, plus the row's own rounding to 3 significant digits.
    slack = 0.5 * 10**-decimals + abs(target) * 0.005 + 1e-12
    return abs(value - target) <= slack


def test_every_cited_benchmark_row_exists() -> None:
    rows = set(ROW.findall((ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")))
    citations = cited()
    assert citations, "no document cites a benchmark row"
    missing = {row: sorted(docs) for row, docs in citations.items() if row not in rows}
    assert not missing, f"cited rows absent from benchmarks/RESULTS.md: {missing}"


def test_quoted_figures_are_the_rows_medians() -> None:
    table = medians((ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8"))
    stale = []
    for document in documents():
        for row, quoted, context in quoted_figures(document.read_text(encoding="utf-8")):
            if row in table and not agrees(quoted, table[row]):
                name = document.relative_to(ROOT)
                stale.append(f"{name}: {quoted} for [R:{row}] (median {table[row]}): {context}")
    assert not stale, "docs quote figures RESULTS.md no longer holds (update the docs):\n" + (
        "\n".join(stale)
    )


def test_the_checks_catch_a_missing_row_and_a_stale_figure() -> None:
    text = (
        "Saves cost **1.73x** (1.39 - 2.59) [R:demo.save] and loads **1.06x** [R:demo.load].\n\n"
        "| a | **-9 us** (-80 to +267) | [R:demo.tiny] |\n"
        "| b | see the rows [R:demo.save], [R:demo.load] |\n"
    )
    assert quoted_figures(text) == [
        ("demo.save", "1.73", "Saves cost **1.73x** (1.39 - 2.59)"),
        ("demo.load", "1.06", "and loads **1.06x**"),
        ("demo.tiny", "-9", "| a | **-9 us** (-80 to +267) |"),
    ]
    assert agrees("1.73", "1.73") and agrees("1.7", "1.73") and agrees("-9", "-9.01")
    assert agrees("1,234", "1,234") and agrees("90", "90.4")
    assert not agrees("1.43", "1.38") and not agrees("90", "91") and not agrees("2.83", "2.01")
    results = "| `[R:demo.save]` | f | 1 | **1.73** | 3 | x | m | `c` | l | 1 | d |\n"
    assert medians(results) == {"demo.save": "1.73"}
    assert set(ROW.findall(results)) == {"demo.save"}  # demo.load and demo.tiny: missing


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
    assert medians(text) == {"demo.row": "2"}
    assert run_all.existing_rows(tmp_path / "RESULTS.md") == {"demo.row": line}
    assert [b.name for b in run_all.BENCHMARKS if not b.script.exists()] == []
    names = [b.name for b in run_all.BENCHMARKS]
    assert len(names) == len(set(names)), "two registered benchmarks share a row prefix"
