"""The machine-readable line a benchmark prints per published figure, for run_all.py.

``emit("model_throughput.d128", ratios, unit="x", method="CPU time, 7 interleaved rounds,
1 thread")`` prints ``RESULT {"id": ..., "min": ..., "median": ..., "max": ..., ...}``: the
spread over rounds beside the median, never a single best round. run_all.py collects these
lines into RESULTS.md; docs cite a figure by its id (``[R:model_throughput.d128]``).
"""

from __future__ import annotations

import json
import re
import statistics
from collections.abc import Sequence

PREFIX = "RESULT "


def spread(values: Sequence[float]) -> tuple[float, float, float]:
    """``(min, median, max)`` of ``values``."""
    return min(values), statistics.median(values), max(values)


def figure_id(name: str) -> str:
    """``name`` as a row id: lower case letters, digits, ``_`` and ``.`` only."""
    return re.sub(r"[^a-z0-9_.]+", "_", name.lower()).strip("_")


def emit(figure: str, values: Sequence[float], *, unit: str, method: str, label: str = "") -> None:
    """Print the RESULT line of one figure measured once per round in ``values``."""
    low, middle, high = spread(values)
    record = {
        "id": figure_id(figure),
        "label": label or figure,
        "min": low,
        "median": middle,
        "max": high,
        "rounds": len(values),
        "unit": unit,
        "method": method,
    }
    print(PREFIX + json.dumps(record), flush=True)
