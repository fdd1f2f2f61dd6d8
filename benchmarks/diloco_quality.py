"""Does the shipped DumbDiLoCo learn? Real `speedtronic train` processes on real text, beside
their two references, in one run.

The corpus (default: Pride and Prejudice, about 0.7 MB) is prepared with
`speedtronic data prepare --tokenizer bytes --blank-line-documents --eval-fraction 0.1`, so
training reads shuffled windows of `train/` and every loss below is measured on the SAME
`--eval-batches` micro-batches of the held-out `eval/` split (windows spread evenly over
it). Three things train:

- **DiLoCo**: a master and N - 1 workers (the master trains too: N nodes), each a
  `speedtronic train -c <config>` process on a shared-directory store, with `configs/diloco.yaml`
  as the user's config (model, optimizer, rounds); only the store, the data, the step count, H
  and the eval section are set here, plus anything passed with `--set`. The master scores every
  global it publishes (`outer_eval` events).
- **one node**: a plain `speedtronic train` (no `distributed` section), the same per-node batch
  and steps: what DiLoCo must beat.
- **N x batch**: a plain run with N times the batch and the same steps: what synchronous data
  parallel on N nodes computes; DiLoCo at its best approaches it.

The references evaluate every H steps, so each outer step's global is printed next to them at
the same node step (the newest step among the deltas the round included). At the end: the final
global, the nodes' own final weights, both references, ratios, and
gap closed = (one_node - global) / (one_node - N x batch): 1 matches the N x batch run, 0 is no
better than one node, negative is worse. Also the outer steps that averaged fewer than N nodes,
the staleness of the included deltas (outer steps between a delta's base global and the round),
and the issue's "falls steadily" check (the worst global of the second half against the best
of the first half).

    python benchmarks/diloco_quality.py --quick                   # a few minutes on 2 cores
    python benchmarks/diloco_quality.py                           # 3 nodes, H 25, 600 x 8
    python benchmarks/diloco_quality.py --set distributed.outer_momentum=0.9 --json out.json

`--set KEY=VALUE` (repeatable) changes the DiLoCo nodes' config; a key outside `distributed.`
(`optimizer.lr=...`) changes the references too, so they stay comparable. `--node-data`:
`auto` (what one config gives every node), `ranked` (`num_nodes`/`node_rank`: disjoint slices),
`same` (`data.node_split: none`, when this version has the key). `--rounds async|sync` sets
`distributed.rounds`, only when this version has that key.

Conditions (how real swarms start and run):

- `--stagger SECONDS`: each worker starts that many seconds after the previous node (the
  master first). Without it the workers all start 1 s after the master ("together").
- `--stagger-after-outer K`: the first worker starts once the master's published global has
  reached outer step K, the others `--stagger` seconds apart after it (at once without
  `--stagger`). `K = 0` is the user's way: a terminal per worker, opened once the master's
  first global exists.
- `--slow-node FACTOR`: the last worker runs FACTOR x slower: `benchmarks/slow_node.py`
  (loaded with `--plugin slow_node`) sleeps (FACTOR - 1) x that process's own median step
  time after each of its optimizer steps, so the factor holds on any machine.
- `--corpus`: any UTF-8 text file (prepared here as above) or a directory of prepared shards
  (what `speedtronic data prepare` writes: `index.json`, `train/`, and an `eval/` split).

Besides the losses it reports the **time to one node's final loss**: seconds from the
master's start until a global first scored at most the one-node run's final held-out loss (the
`time` of the master's `outer_eval` events), and that time over the one-node run's own wall
time; the same in node steps (the newest node step of that global over the run's steps: what
the wall ratio is when every node has a machine of its own, while here the N nodes share the
machine's cores); and, per DiLoCo node, the share of its wall time spent in boundary waits
that ended by a timeout: its own (`round_wait_timeout` events) or the master's, a wait for a
round the master closed by `round_timeout` (`round_waited` events of an outer step whose
`outer_step` event says `reason: timeout`). Sync workers waiting for the master's first
global have no event: not counted.

`--matrix` runs {together, staggered (`--matrix-stagger`, 10 s), one node 2x slower} x
{the config's `distributed.rounds`, the other mode} on each `--corpus` (default: both corpora
of `benchmarks/data/`), the references shared per corpus, and prints `RESULT` lines
(`benchmarks/results.py`) `diloco_quality.<corpus>.<condition>.<mode>.<figure>` for
`run_all.py` (see `benchmarks/diloco_matrix.py`):

    python benchmarks/diloco_quality.py --stagger-after-outer 0 --rounds sync
    python benchmarks/diloco_quality.py --stagger 10 --slow-node 2 --corpus my_text.txt
    python benchmarks/diloco_quality.py --matrix --quick           # every cell at --quick size
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from diloco_processes import (
    Process,
    finished,
    read_events,
    slow_down,
    start,
    start_nodes,
    train_process,
    wait_all,
)
from diloco_report import report
from diloco_timing import (
    loss_points,
    steps_to_loss,
    time_to_loss,
    timeout_rounds,
    timeout_share,
    wait_totals,
)

REPO = Path(__file__).resolve().parent.parent
DEMO_CONFIG = REPO / "configs" / "diloco.yaml"
DEFAULT_CORPUS = REPO / "benchmarks" / "data" / "pride_and_prejudice.txt"  # see its README
# The public-domain corpora the repository ships (benchmarks/data/README.md): --matrix's default.
CORPORA = (DEFAULT_CORPUS, REPO / "benchmarks" / "data" / "kjv_genesis_to_numbers.txt")

TIMING_FILE = "timing.json"  # a reference's start time and wall seconds, beside its events
QUICK = {"nodes": 3, "inner_steps": 10, "steps": 100, "eval_batches": 8}


@dataclass
class Result:
    """What one benchmark run measured (also the `--json` summary)."""

    settings: dict[str, Any]
    outer: list[dict[str, Any]] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=3, help="DiLoCo nodes, the master included")
    parser.add_argument("--inner-steps", type=int, default=25, help="H: inner steps per round")
    parser.add_argument("--steps", type=int, default=600, help="optimizer steps per node")
    parser.add_argument("--batch", type=int, default=8, help="micro-batch (samples) per node")
    parser.add_argument(
        "--rounds",
        choices=("async", "sync"),
        default=None,
        help="distributed.rounds (only where this version has the key); default: the config's",
    )
    parser.add_argument(
        "--node-data",
        choices=("auto", "ranked", "same"),
        default="auto",
        help="auto: one config for every node; ranked: num_nodes/node_rank (disjoint slices); "
        "same: data.node_split=none (every node the same stream)",
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a config override (YAML value) for the DiLoCo nodes; keys outside distributed. "
        "apply to the references too",
    )
    parser.add_argument("--threads", type=int, default=1, help="torch threads per process")
    parser.add_argument("--eval-batches", type=int, default=32, help="held-out micro-batches")
    parser.add_argument("--seed", type=int, default=0, help="run.seed of every process")
    parser.add_argument(
        "--corpus",
        type=Path,
        nargs="+",
        default=None,
        help="a UTF-8 text file or a directory of prepared shards (several with --matrix); "
        "default: benchmarks/data/pride_and_prejudice.txt (--matrix: every shipped corpus)",
    )
    parser.add_argument(
        "--stagger",
        type=float,
        default=None,
        metavar="SECONDS",
        help="each worker starts SECONDS after the previous node (default: all 1 s after the "
        "master)",
    )
    parser.add_argument(
        "--stagger-after-outer",
        type=int,
        default=None,
        metavar="K",
        help="the first worker starts once the master's global reached outer step K (0: its "
        "first global), the others --stagger apart",
    )
    parser.add_argument(
        "--slow-node",
        type=float,
        default=None,
        metavar="FACTOR",
        help="the last worker runs FACTOR x slower (a sleep after each step sized from its own "
        "median step time: benchmarks/slow_node.py)",
    )
    parser.add_argument(
        "--matrix",
        action="store_true",
        help="{together, staggered, one node 2x slower} x {the config's rounds, the other} on "
        "each --corpus; RESULT lines for run_all.py",
    )
    parser.add_argument(
        "--matrix-stagger",
        type=float,
        default=10.0,
        metavar="SECONDS",
        help="--matrix: the staggered condition's --stagger (--quick: 2)",
    )
    parser.add_argument("--config", type=Path, default=DEMO_CONFIG, help="the user's config")
    parser.add_argument("--quick", action="store_true", help=f"small preset: {QUICK}")
    parser.add_argument("--json", type=Path, default=None, help="write the summary here")
    parser.add_argument(
        "--workdir",
        type=Path,
        default=None,
        help="keep the run's files here; the references of an identical earlier run in the "
        "same workdir are reused (they do not depend on timing)",
    )
    parser.add_argument(
        "--timeout", type=float, default=3600, help="seconds before the processes are killed"
    )
    parser.add_argument(
        "--no-references", action="store_true", help="DiLoCo only (the ratios are then absent)"
    )
    args = parser.parse_args(argv)
    if args.quick:
        # The quick runs last seconds: a 10 s stagger would start the workers after the end.
        for key, value in {**QUICK, "matrix_stagger": 2.0}.items():
            # A preset value only where the user kept the default.
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
    if args.nodes < 2:
        parser.error("--nodes must be at least 2 (a master and a worker)")
    if args.rounds is not None and "rounds" not in distributed_keys():
        parser.error(
            "--rounds: this version has no distributed.rounds key (sync rounds are not built "
            "yet); leave --rounds out"
        )
    if args.node_data == "same" and "node_split" not in data_keys():
        parser.error("--node-data same: this version has no data.node_split key")
    if args.inner_steps < 1 or args.steps < args.inner_steps:
        parser.error("need 1 <= --inner-steps <= --steps")
    if args.corpus is None:
        args.corpus = list(CORPORA) if args.matrix else [DEFAULT_CORPUS]
    if len(args.corpus) > 1 and not args.matrix:
        parser.error("--corpus: one corpus per run (several with --matrix)")
    if args.stagger is not None and args.stagger < 0:
        parser.error("--stagger must be at least 0")
    if args.stagger_after_outer is not None and args.stagger_after_outer < 0:
        parser.error("--stagger-after-outer must be at least 0")
    if args.slow_node is not None and args.slow_node < 1:
        parser.error("--slow-node must be at least 1 (a factor of slowness)")
    chosen_per_cell = (args.stagger, args.stagger_after_outer, args.slow_node, args.rounds)
    if args.matrix and any(value is not None for value in chosen_per_cell):
        parser.error("--matrix sets --rounds, --stagger and --slow-node itself")
    return args


def parse_overrides(pairs: list[str]) -> dict[str, Any]:
    """``KEY=VALUE`` strings as a mapping, each value read as YAML (``0.9``, ``true``, ``x``)."""
    overrides: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--set needs KEY=VALUE, got {pair!r}")
        overrides[key.strip()] = yaml.safe_load(value)
    return overrides


def set_key(config: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``a.b.c`` in a nested mapping (``None`` removes the key)."""
    *parents, last = dotted.split(".")
    node = config
    for part in parents:
        node = node.setdefault(part, {})
    if value is None:
        node.pop(last, None)
    else:
        node[last] = value


def distributed_keys() -> set[str]:
    """The keys this version's ``distributed`` section knows."""
    import dataclasses

    from speedtronic_diloco.config import DistributedConfig

    return {f.name for f in dataclasses.fields(DistributedConfig)}


def data_keys() -> set[str]:
    """The keys this version's ``data`` section knows."""
    import dataclasses

    from speedtronic.config import DataConfig

    return {f.name for f in dataclasses.fields(DataConfig)}


def corpus_name(corpus: Path) -> str:
    """The corpus's name in row ids: a text file's stem, a shard directory's name."""
    return corpus.stem if corpus.is_file() else corpus.resolve().name


def prepare_corpus(corpus: Path, out: Path) -> tuple[Path, int]:
    """Token shards of ``corpus`` (bytes, 10% of its paragraphs held out), or ``corpus`` itself
    when it is a directory of prepared shards; their vocabulary."""
    if corpus.is_dir():
        index_path = corpus / "index.json"
        if not index_path.exists():
            raise SystemExit(f"--corpus {corpus}: a directory without index.json (not shards)")
        index = json.loads(index_path.read_text())
        if not index.get("splits", {}).get("eval", {}).get("tokens"):
            raise SystemExit(
                f"--corpus {corpus}: the shards hold no eval split; prepare them with "
                "`speedtronic data prepare ... --eval-fraction 0.1`"
            )
        return corpus.resolve(), int(index["vocab_size"])
    if not (out / "index.json").exists():
        command = [
            sys.executable, "-m", "speedtronic", "data", "prepare", str(corpus), "--out",
            str(out), "--tokenizer", "bytes", "--blank-line-documents", "--eval-fraction",
            "0.1", "--workers", "1", "--no-progress",
        ]  # fmt: skip
        done = subprocess.run(command, capture_output=True, text=True, timeout=600)
        if done.returncode != 0:
            raise SystemExit(f"speedtronic data prepare failed:\n{done.stdout}{done.stderr}")
    index = json.loads((out / "index.json").read_text())
    return out, int(index["vocab_size"])


def base_config(args: argparse.Namespace, shards: Path, vocab: int, root: Path) -> dict[str, Any]:
    """The user's config (``--config``) with this benchmark's data, steps and eval."""
    config = yaml.safe_load(args.config.read_text())
    config["run"].update(
        {"max_steps": args.steps, "seed": args.seed, "threads": args.threads, "device": "cpu"}
    )
    config["model"]["vocab_size"] = max(int(config["model"].get("vocab_size", vocab)), vocab)
    data = config.setdefault("data", {})
    data.pop("text_path", None)
    data.update({"shards": str(shards), "micro_batch_size": args.batch})
    config["eval"] = {
        "at_end": True,
        "batches": args.eval_batches,
        "micro_batch_size": 8,  # the same held-out windows whatever the training batch
    }
    config["checkpoint"] = {"interval": args.steps, "keep_last": 1}
    config["logging"] = {"log_every": args.inner_steps, "progress": False}
    section = config.setdefault("distributed", {})
    section.update(
        {
            "enabled": True,
            "repo_id": f"file://{root / 'store'}",
            "inner_steps": args.inner_steps,
        }
    )
    if args.rounds is not None:
        section["rounds"] = args.rounds
    if args.node_data == "same":
        data["node_split"] = "none"
    return config


def reference_config(config: dict[str, Any], batch: int, inner_steps: int) -> dict[str, Any]:
    """A plain (no DiLoCo) copy of ``config`` that evaluates every H steps."""
    plain = json.loads(json.dumps(config))
    plain.pop("distributed", None)
    plain["data"]["micro_batch_size"] = batch
    plain["data"].pop("node_split", None)
    plain["eval"]["every"] = inner_steps
    return plain


def write_yaml(path: Path, config: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


def eval_curve(events: list[dict[str, Any]]) -> dict[int, float]:
    """Held-out loss by optimizer step from a run's ``eval`` events."""
    return {int(e["step"]): float(e["loss"]) for e in events if e["event"] == "eval"}


def final_eval(events: list[dict[str, Any]]) -> float | None:
    curve = eval_curve(events)
    return curve[max(curve)] if curve else None


def at_step(curve: dict[int, float], step: int) -> float | None:
    """The reference's loss at ``step`` (its nearest evaluated step at or below)."""
    below = [s for s in curve if s <= step]
    return curve[max(below)] if below else None


def load_average() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def outer_rows(master_events: list[dict[str, Any]], nodes: int) -> list[dict[str, Any]]:
    """One row per outer step: nodes, newest node step, staleness, the global's loss."""
    losses = {
        int(e["outer_step"]): float(e["loss"]) for e in master_events if e["event"] == "outer_eval"
    }
    rows = []
    for event in master_events:
        if event["event"] != "outer_step":
            continue
        included = [p.rpartition("@") for p in str(event.get("included", "")).split(",") if p]
        steps = [int(s) for _, _, s in included]
        staleness = [
            int(s) for s in str(event.get("staleness", "")).split(",") if s not in ("", "?")
        ]
        rows.append(
            {
                "outer_step": int(event["outer_step"]),
                "included": str(event.get("included", "")),
                "node_step": max(steps) if steps else None,
                "nodes": int(event.get("nodes_included", 0)),
                "deltas": int(event.get("deltas_included", 0)),
                "staleness": staleness,
                "waited_s": event.get("waited_s"),
                "reason": event.get("reason"),
                "global_loss": losses.get(int(event["outer_step"])),
                "short": int(event.get("nodes_included", 0)) < nodes,
            }
        )
    return rows


def reference_wall(process: Process) -> float | None:
    """A reference's wall seconds: measured now, or by the run that left it in the workdir."""
    if process.wall_s is not None:
        return process.wall_s
    path = process.events.parent / TIMING_FILE
    return json.loads(path.read_text()).get("wall_s") if path.exists() else None


def timing_figures(
    diloco: list[Process], master_events: list[dict[str, Any]], one: float | None, ref: Process
) -> dict[str, Any]:
    """Time to one node's final loss (from the master's start) against one node's wall time;
    each node's boundary waits and the share of its wall time in those that timed out."""
    reached = None
    if one is not None:
        reached = time_to_loss(loss_points(master_events), one, diloco[0].started_wall)
    one_wall = reference_wall(ref) if one is not None else None
    waits: dict[str, dict[str, Any]] = {}
    closed = timeout_rounds(master_events)
    for process in diloco:
        events = read_events(process.events)
        totals = wait_totals(events, closed)
        wall = process.wall_s or 0.0
        waits[process.name] = {
            **totals,
            "wall_s": round(wall, 1),
            "timeout_share": timeout_share(events, wall, closed),
            "wait_share": (totals["timeout_s"] + totals["waited_s"]) / wall if wall > 0 else None,
        }
    shares = [w["timeout_share"] for w in waits.values() if w["timeout_share"] is not None]
    return {
        "time_to_one_node_s": round(reached, 1) if reached is not None else None,
        "one_node_wall_s": round(one_wall, 1) if one_wall is not None else None,
        "time_to_one_node_ratio": reached / one_wall if reached is not None and one_wall else None,
        "waits": waits,
        "timeout_wait_share": max(shares) if shares else None,
    }


def slow_node_summary(process: Process) -> dict[str, Any]:
    """What the slowed node's ``slow_node`` event says (the factor, its median step, seconds
    slept), with the mechanism in words."""
    told = [e for e in read_events(process.events) if e["event"] == "slow_node"]
    return {
        "node": process.name,
        **({k: v for k, v in told[-1].items() if k not in ("event", "time")} if told else {}),
        "mechanism": "benchmarks/slow_node.py: after each optimizer step a sleep of "
        "(FACTOR - 1) x the node's median step interval (last 50 steps)",
    }


def run(args: argparse.Namespace) -> Result:
    overrides = parse_overrides(args.overrides)
    keep = args.workdir is not None
    root = Path(args.workdir or tempfile.mkdtemp(prefix="diloco_quality_")).resolve()
    root.mkdir(parents=True, exist_ok=True)
    try:
        return _run(args, overrides, root)
    finally:
        if not keep:
            shutil.rmtree(root, ignore_errors=True)


def _run(args: argparse.Namespace, overrides: dict[str, Any], root: Path) -> Result:
    (corpus,) = args.corpus
    corpus_key = hashlib.sha256(str(corpus.resolve()).encode()).hexdigest()[:12]
    shards, vocab = prepare_corpus(corpus, root / f"shards-{corpus_key}")
    config = base_config(args, shards, vocab, root)
    for key, value in overrides.items():
        set_key(config, key, value)
    # Each run starts from an empty store and empty node directories.
    shutil.rmtree(root / "diloco", ignore_errors=True)
    nodes_root = root / "diloco"
    nodes_root.mkdir()
    config["distributed"]["repo_id"] = f"file://{nodes_root / 'store'}"
    nodes_config = write_yaml(nodes_root / "diloco.yaml", config)
    shared = {k: v for k, v in overrides.items() if not k.startswith("distributed.")}
    refs: list[Process] = []
    for name, batch in (("one_node", args.batch), ("n_x_batch", args.batch * args.nodes)):
        plain = reference_config(config, batch, args.inner_steps)
        for key, value in shared.items():
            set_key(plain, key, value)
        text = yaml.safe_dump(plain, sort_keys=True)
        folder = root / "references" / f"{name}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"
        folder.mkdir(parents=True, exist_ok=True)
        refs.append(train_process(name, write_yaml(folder / "config.yaml", plain), folder))

    names = ["master"] + [f"worker-{i}" for i in range(1, args.nodes)]
    diloco = []
    for rank, name in enumerate(names):
        sets = [f"distributed.node_id={name}"]
        sets.append(f"distributed.role={'master' if rank == 0 else 'worker'}")
        if args.node_data == "ranked":
            sets += [f"distributed.num_nodes={args.nodes}", f"distributed.node_rank={rank}"]
        diloco.append(train_process(name, nodes_config, nodes_root, *sets))
    if args.slow_node is not None:
        slow_down(diloco[-1], args.slow_node)

    load_before = load_average()
    started = time.monotonic()
    print(f"# {args.nodes} DiLoCo nodes ({', '.join(names)}) in {root}; load {load_before}")
    # The master first: it creates the store and publishes the initial global.
    starts = start_nodes(
        diloco,
        nodes_root / "store",
        stagger=args.stagger,
        after_outer=args.stagger_after_outer,
        timeout=args.timeout,
    )
    late = wait_all(diloco, args.timeout, late_ok=True)
    diloco_wall = time.monotonic() - started
    load_diloco = load_average()

    ref_wall = None
    todo = [p for p in refs if not finished(p)]
    if not args.no_references and todo:
        started = time.monotonic()
        print(f"# references ({', '.join(p.name for p in todo)}); load {load_diloco}")
        for process in todo:
            shutil.rmtree(process.events.parent, ignore_errors=True)
            start(process)
        wait_all(todo, args.timeout)
        ref_wall = time.monotonic() - started
        for process in todo:  # kept beside the events, for a later run that reuses them
            timing = {"started": process.started_wall, "wall_s": process.wall_s}
            (process.events.parent / TIMING_FILE).write_text(json.dumps(timing))
    elif not args.no_references:
        print("# references: reused from an identical earlier run in this workdir")
    load_after = load_average()

    master_events = read_events(diloco[0].events)
    rows = outer_rows(master_events, args.nodes)
    curves = {p.name: eval_curve(read_events(p.events)) for p in refs}
    for row in rows:
        step = row["node_step"]
        for name in ("one_node", "n_x_batch"):
            row[name] = at_step(curves[name], step) if step is not None else None

    own = {p.name: final_eval(read_events(p.events)) for p in diloco}
    evaluated = [r for r in rows if r["global_loss"] is not None]
    final_global = evaluated[-1]["global_loss"] if evaluated else None
    one = final_eval(read_events(refs[0].events)) if not args.no_references else None
    big = final_eval(read_events(refs[1].events)) if not args.no_references else None
    staleness = [s for r in rows for s in r["staleness"]]
    half = len(evaluated) // 2
    first_best = min((r["global_loss"] for r in evaluated[:half]), default=None)
    second_worst = max((r["global_loss"] for r in evaluated[half:]), default=None)
    best = min(evaluated, key=lambda r: r["global_loss"], default=None)
    summary: dict[str, Any] = {
        "final_global": final_global,
        "best_global": best["global_loss"] if best else None,
        "best_global_outer_step": best["outer_step"] if best else None,
        "one_node": one,
        "n_x_batch": big,
        "nodes_own": own,
        "gap_closed": (one - final_global) / (one - big)
        if None not in (one, big, final_global) and one != big
        else None,
        "global_over_one_node": final_global / one if final_global and one else None,
        "global_over_n_x_batch": final_global / big if final_global and big else None,
        "outer_steps": len(rows),
        "short_rounds": sum(r["short"] for r in rows),
        "rounds_by_nodes": {
            str(n): sum(r["nodes"] == n for r in rows) for n in sorted({r["nodes"] for r in rows})
        },
        "staleness_mean": sum(staleness) / len(staleness) if staleness else None,
        "staleness_max": max(staleness) if staleness else None,
        "staleness_hist": {str(s): staleness.count(s) for s in sorted(set(staleness))},
        "first_half_best": first_best,
        "second_half_worst": second_worst,
        "second_half_above_best": second_worst - first_best
        if None not in (first_best, second_worst)
        else None,
        **timing_figures(diloco, master_events, one, refs[0]),
        **steps_to_loss(evaluated, one, args.steps),
        "starts": starts,
        "arrived_after_the_end": late,
        "round_reasons": dict(sorted(Counter(str(r["reason"]) for r in rows).items())),
        "slow_node": slow_node_summary(diloco[-1]) if args.slow_node is not None else None,
        "diloco_wall_s": round(diloco_wall, 1),
        "references_wall_s": round(ref_wall, 1) if ref_wall is not None else None,
        "load_average": {"before": load_before, "after_diloco": load_diloco, "end": load_after},
    }
    settings = {
        "nodes": args.nodes,
        "inner_steps": args.inner_steps,
        "steps": args.steps,
        "batch": args.batch,
        "rounds": args.rounds,
        "node_data": args.node_data,
        "overrides": overrides,
        "threads": args.threads,
        "eval_batches": args.eval_batches,
        "corpus": str(corpus),
        "corpus_name": corpus_name(corpus),
        "stagger": args.stagger,
        "stagger_after_outer": args.stagger_after_outer,
        "slow_node": args.slow_node,
        "config": str(args.config),
        "seed": args.seed,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }
    return Result(settings, rows, summary)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.matrix:
        from diloco_matrix import run_matrix

        return run_matrix(args, sys.modules[__name__])
    result = run(args)
    report(result)
    if args.json is not None:
        args.json.write_text(
            json.dumps(
                {"settings": result.settings, "outer": result.outer, "summary": result.summary},
                indent=2,
            )
        )
        print(f"summary written to {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
