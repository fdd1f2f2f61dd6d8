"""What ``run.threads: auto`` reads of the machine's load: the run queue of ``/proc/loadavg``,
this process's runnable threads, and their difference as a median of a few samples."""

from __future__ import annotations

import os
from pathlib import Path

from speedtronic.observe.cpu_load import busy_elsewhere, own_runnable_threads, runnable_tasks


def test_the_run_queue_is_the_fourth_field_of_loadavg() -> None:
    assert runnable_tasks("0.50 0.40 0.30 3/412 9876\n") == 3
    assert runnable_tasks("0.50 0.40 0.30") is None  # too short
    assert runnable_tasks("0.50 0.40 0.30 x/412 9876") is None
    assert runnable_tasks("0.50 0.40 0.30 412 9876") is None
    if Path("/proc/loadavg").exists():
        assert (runnable_tasks() or 0) >= 1  # the reader itself runs


def write_task(root: Path, tid: int, comm: str, state: str) -> None:
    (root / str(tid)).mkdir(parents=True)
    (root / str(tid) / "stat").write_text(f"{tid} ({comm}) {state} 1 2 3 4\n")


def test_own_runnable_threads_reads_the_state_after_the_last_parenthesis(tmp_path: Path) -> None:
    write_task(tmp_path, 1, "python", "R")
    write_task(tmp_path, 2, "pt_main) R (x", "S")  # a name made to look running
    write_task(tmp_path, 3, "omp worker", "R")
    write_task(tmp_path, 4, "io", "D")
    (tmp_path / "5").mkdir()  # a thread that ended between the listing and the read
    assert own_runnable_threads(tmp_path) == 2
    assert own_runnable_threads(tmp_path / "absent") is None
    if Path("/proc/self/task").exists():
        assert (own_runnable_threads() or 0) >= 1  # this thread is running


def test_busy_elsewhere_is_the_median_of_the_differences() -> None:
    cores = os.cpu_count() or 1
    totals = iter([5, 9, 4, 5, 6])
    owns = iter([1, 1, 1, 2, 1])
    pauses: list[float] = []
    busy = busy_elsewhere(
        cores, total=lambda: next(totals), own=lambda: next(owns), sleep=pauses.append
    )
    assert busy == 4  # differences 4, 8, 3, 3, 5: a task that woke for an instant is ignored
    assert len(pauses) == 4
    assert busy_elsewhere(cores, samples=1, total=lambda: 1, own=lambda: 3) == 0  # never < 0


def test_no_figure_when_the_load_is_not_of_this_process_cpus() -> None:
    cores = os.cpu_count() or 1
    assert busy_elsewhere(cores - 1, total=lambda: 9, own=lambda: 1) is None  # pinned
    assert busy_elsewhere(cores, total=lambda: None, own=lambda: 1) is None
    assert busy_elsewhere(cores, total=lambda: 9, own=lambda: None) is None
