"""Re-measure every published figure: run each benchmark's quick (or full) mode and write
benchmarks/RESULTS.md.

Each benchmark prints one ``RESULT {...}`` line per figure (see ``results.py``): min / median /
max over its rounds, the unit and the method (CPU or wall-clock time, rounds, threads). This
script runs them one after another as child processes, records the machine (cores, the load
average before and after each benchmark), the date and the commit, and writes one table row per
figure. A doc that quotes a figure cites its row id, e.g. ``[R:model_throughput.d128]``; a test
checks that every cited row exists in RESULTS.md.

    python benchmarks/run_all.py --quick                       # everything registered below
    python benchmarks/run_all.py --quick --only model_throughput,overhead

With ``--only`` the rows of the other benchmarks are kept from the existing RESULTS.md.
To add a benchmark, append a :class:`Benchmark` to ``BENCHMARKS``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from results import PREFIX

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"


@dataclass(frozen=True)
class Benchmark:
    """One script of benchmarks/ and the arguments of its quick and full modes.

    ``name`` is the prefix of the row ids the run writes; ``script`` names the file when one
    script has two registered modes (``checkpoint`` and ``checkpoint_stall``).
    """

    name: str
    quick: tuple[str, ...] = ("--quick",)
    full: tuple[str, ...] = ()
    timeout_s: int = 3600
    script_name: str = ""

    @property
    def script(self) -> Path:
        return HERE / f"{self.script_name or self.name}.py"


# The registry: every benchmark whose figures the docs quote. Append new ones here.
BENCHMARKS: list[Benchmark] = [
    Benchmark("model_throughput"),
    Benchmark("generate_kv_cache"),
    Benchmark("ooo_backprop"),
    Benchmark("overhead"),
    Benchmark("checkpoint"),
    # The headline rows of the lock-step table (the quick grid's H = 100 rows, both data sets).
    Benchmark(
        "diloco_convergence",
        quick=("--quick", "--select", "synthetic/100/none/1,synthetic/100/int8/1,text/100/none/1"),
    ),
    # The table of docs/diloco.md: the whole 1000-step grid, 2 processes (about 40 minutes on
    # two cores); its own row ids (diloco_grid.<data>.<H>.<codec>.<K>[.fewer_bytes]).
    Benchmark(
        "diloco_grid",
        script_name="diloco_convergence",
        quick=("--jobs", "2", "--rows-id", "diloco_grid"),
        full=("--jobs", "2", "--rows-id", "diloco_grid"),
        timeout_s=7200,
    ),
    # The asynchronous rows (real lanes and outer thread, one node 2x slower): a few minutes.
    Benchmark(
        "diloco_convergence_async", script_name="diloco_convergence", quick=("--async-rows",)
    ),
    Benchmark("eval_overhead"),
    # Fewer steps than the script's own quick preset: torch's default threads under load run
    # at a fraction of a step per second, and each run is a whole `speedtronic train` process.
    # --arriving: hogs that start 2 s into a 150-step run (auto's governor has to follow them).
    Benchmark("threads", quick=("--quick", "--steps", "8", "--arriving", "2")),
    # The smoke model only: a reference-small CPU run at 128 tokens takes tens of seconds a step.
    Benchmark(
        "checkpoint_stall",
        script_name="checkpoint",
        quick=("--stall", "--models", "smoke"),
        full=("--stall",),
    ),
    Benchmark("stop_agreement"),
    Benchmark("data_throughput"),
    # The docs' table: 200 steps, 2 rounds (the script's --quick is a 25-step smoke test).
    Benchmark("optimizers", quick=("--steps", "200", "--rounds", "2")),
    # The full mode is the docs' table and takes about two minutes (mostly the 2 s requests).
    Benchmark("diloco_stall", quick=()),
    Benchmark("diloco_storage", quick=("--hub",)),
    # Real FSDP sharding in 1, 2 and 4 gloo processes on the meta device; quick: 30M parameters.
    Benchmark("fsdp_memory"),
    # torchft 0.2.0's DiLoCo on the quality benchmark's full setting (the outer step of
    # configs/diloco.yaml, both corpora), one run per seed: the reference docs/diloco.md
    # compares the shipped rounds with (needs torchft installed).
    Benchmark(
        "torchft_diloco",
        quick=(*("--nodes", "3", "--inner-steps", "25", "--steps", "600"), "--seeds", "0,1,2"),
        full=("--nodes", "3", "--seeds", "0,1,2"),
    ),
    # Issue 40's matrix at its own size (3 nodes, H 25, 600 x 8; both corpora of
    # benchmarks/data/): {together, staggered 10 s, one node 2x slower} x {both round modes}.
    # Sync cells that stall at round_timeout take minutes each, hence the long timeout.
    Benchmark("diloco_quality", quick=("--matrix",), full=("--matrix",), timeout_s=14400),
    # The CPU time-per-step estimate against measured steps: smoke, and reference-small with
    # one micro-batch per step in quick mode (a few minutes on one core).
    Benchmark("step_estimate"),
    # Issue 41's take-over with real processes, beside the same run with no kill: quick is
    # 2 pairs at 600 / 800 steps (about 7 minutes), full 2 pairs at 3000 / 4000 (about 30).
    Benchmark("diloco_failover"),
]


def machine() -> str:
    """Cores this process may use, of how many, and the CPU model."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"{usable} usable of {os.cpu_count()} cores, {model}, {platform.system()}"


def commit() -> str:
    """The checkout's commit, with ``+changes`` when the tree differs from it."""
    try:
        sha = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=HERE
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            cwd=HERE,
        ).stdout.strip()
    except OSError:
        return "unknown"
    return (sha or "unknown") + (" +changes" if dirty else "")


def load() -> str:
    return " / ".join(f"{value:.1f}" for value in os.getloadavg())


def run(benchmark: Benchmark, quick: bool) -> tuple[list[dict], dict]:
    """Run one benchmark; its RESULT records and how the run went."""
    arguments = benchmark.quick if quick else benchmark.full
    command = [sys.executable, str(benchmark.script), *arguments]
    before, started = load(), time.monotonic()
    print(f"== {benchmark.name} {' '.join(arguments)} (load {before})", flush=True)
    environment = {**os.environ, "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "1")}
    try:
        done = subprocess.run(
            command,
            capture_output=True,
            text=True,
            timeout=benchmark.timeout_s,
            env=environment,
            cwd=HERE.parent,
        )
        output, status = done.stdout, f"exit {done.returncode}"
        if done.returncode != 0:
            print(done.stderr[-3000:], file=sys.stderr)
    except subprocess.TimeoutExpired as exc:
        output = exc.stdout.decode() if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        status = f"timed out after {benchmark.timeout_s} s"
    records = [
        json.loads(line[len(PREFIX) :]) for line in output.splitlines() if line.startswith(PREFIX)
    ]
    run_info = {
        "command": "python benchmarks/" + benchmark.script.name + " " + " ".join(arguments),
        "load": f"{before} -> {load()}",
        "wall_s": time.monotonic() - started,
        "status": status,
    }
    if not records:
        print(f"   no RESULT line ({status})", file=sys.stderr)
    for record in records:
        print(f"   {record['id']}: {number(record['median'])} {record['unit']}", flush=True)
    return records, run_info


def number(value: float) -> str:
    """Three significant digits at most: the rounds do not support more."""
    if value == 0 or not (abs(value) < 1e15):
        return f"{value:g}"
    return f"{value:.3g}" if abs(value) < 1000 else f"{value:,.0f}"


ROW = re.compile(r"^\| `\[R:([a-z0-9_.]+)\]` \|")


def existing_rows(path: Path) -> dict[str, str]:
    """Row id -> the table line, from an earlier RESULTS.md."""
    if not path.exists():
        return {}
    rows = {}
    for line in path.read_text().splitlines():
        match = ROW.match(line)
        if match:
            rows[match.group(1)] = line
    return rows


def write(path: Path, rows: dict[str, str], header: list[str]) -> None:
    lines = [
        *header,
        "",
        "| row | figure | min | median | max | unit | method | command "
        "| load 1/5/15 min: before -> after | wall s | date, commit |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *(rows[key] for key in sorted(rows)),
        "",
    ]
    path.write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="each benchmark's quick mode")
    parser.add_argument("--only", help="comma-separated benchmark names (default: all)")
    parser.add_argument("--output", type=Path, default=RESULTS, help="the file to write")
    args = parser.parse_args()
    chosen = BENCHMARKS
    if args.only:
        names = {name.strip() for name in args.only.split(",")}
        unknown = names - {b.name for b in BENCHMARKS}
        if unknown:
            parser.error(f"unknown benchmark(s): {', '.join(sorted(unknown))}")
        chosen = [b for b in BENCHMARKS if b.name in names]
    rows = existing_rows(args.output) if args.only else {}
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    revision = commit()
    for benchmark in chosen:
        rows = {k: v for k, v in rows.items() if not k.startswith(benchmark.name + ".")}
        records, info = run(benchmark, args.quick)
        for record in records:
            cells = [
                f"`[R:{record['id']}]`",
                record["label"],
                number(record["min"]),
                f"**{number(record['median'])}**",
                number(record["max"]),
                record["unit"],
                record["method"],
                f"`{info['command'].strip()}`",
                info["load"],
                f"{info['wall_s']:.0f}",
                f"{stamp}, {revision}",
            ]
            rows[record["id"]] = "| " + " | ".join(cells) + " |"
    header = [
        "# Benchmark results",
        "",
        "Written by `python benchmarks/run_all.py"
        + (" --quick" if args.quick else "")
        + "` (`nox -s benchmarks`); do not edit by hand. Each row is one figure: min / median / "
        "max over the benchmark's rounds (or seeds), how it was measured, and the load average "
        "of the machine before and after that benchmark ran: figures measured under load are "
        "noisy, and their spread says how much.",
        "",
        f"Machine: {machine()}; Python {platform.python_version()}.",
    ]
    write(args.output, rows, header)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
