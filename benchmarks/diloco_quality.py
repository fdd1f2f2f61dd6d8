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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
DEMO_CONFIG = REPO / "configs" / "diloco.yaml"
DEFAULT_CORPUS = REPO / "benchmarks" / "data" / "pride_and_prejudice.txt"  # see its README

QUICK = {"nodes": 3, "inner_steps": 10, "steps": 100, "eval_batches": 8}


@dataclass
class Process:
    """One `speedtronic train` process of the run and where its events land."""

    name: str
    command: list[str]
    events: Path
    log: Path
    popen: subprocess.Popen | None = None
    started: float = 0.0
    wall_s: float | None = None


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
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="a UTF-8 text file")
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
        for key, value in QUICK.items():
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


def prepare_corpus(corpus: Path, out: Path) -> tuple[Path, int]:
    """Token shards of ``corpus`` (bytes, 10% of its paragraphs held out); their vocabulary."""
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


def train_process(name: str, config: Path, root: Path, *sets: str) -> Process:
    out = root / name
    events = out / "events.jsonl"
    command = [sys.executable, "-m", "speedtronic", "train", "-c", str(config)]
    command += ["--output-dir", str(out), "--set", f"logging.json_file={events}"]
    for item in sets:
        command += ["--set", item]
    return Process(name, command, events, root / f"{name}.log")


def start(process: Process) -> None:
    process.events.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    log = open(process.log, "w")  # noqa: SIM115 - closed by the child's exit
    process.popen = subprocess.Popen(
        process.command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=process.events.parent
    )
    process.started = time.monotonic()


def wait_all(processes: list[Process], timeout: float) -> None:
    """Wait for every process (bounded); kill the rest on timeout or on the first failure."""
    deadline = time.monotonic() + timeout
    pending = list(processes)
    failed: Process | None = None
    while pending and failed is None and time.monotonic() < deadline:
        for process in list(pending):
            assert process.popen is not None
            code = process.popen.poll()
            if code is None:
                continue
            process.wall_s = time.monotonic() - process.started
            pending.remove(process)
            if code != 0:
                failed = process
        time.sleep(0.5)
    for process in pending:
        assert process.popen is not None
        process.popen.kill()
        process.popen.wait(timeout=30)
    if failed is not None or pending:
        culprit = failed or pending[0]
        tail = culprit.log.read_text(errors="replace")[-3000:]
        why = "failed" if failed is not None else f"did not finish in {timeout:.0f} s"
        raise SystemExit(f"{culprit.name} {why}; its log ends:\n{tail}")


def finished(process: Process) -> bool:
    """True when ``process`` already ran to its end (a reused reference)."""
    return any(
        e["event"] == "train_end" and e.get("status") == "ok" for e in read_events(process.events)
    )


def read_events(path: Path) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


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
    corpus_key = hashlib.sha256(str(args.corpus.resolve()).encode()).hexdigest()[:12]
    shards, vocab = prepare_corpus(args.corpus, root / f"shards-{corpus_key}")
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

    load_before = load_average()
    started = time.monotonic()
    print(f"# {args.nodes} DiLoCo nodes ({', '.join(names)}) in {root}; load {load_before}")
    # The master first: it creates the store and publishes the initial global.
    start(diloco[0])
    time.sleep(1.0)  # not a wait for a condition: it only orders the start lines
    for process in diloco[1:]:
        start(process)
    wait_all(diloco, args.timeout)
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
        "corpus": str(args.corpus),
        "config": str(args.config),
        "seed": args.seed,
        "command": " ".join([Path(sys.argv[0]).name, *sys.argv[1:]]),
    }
    return Result(settings, rows, summary)


def fmt(value: float | None, width: int = 7) -> str:
    return f"{value:{width}.3f}" if isinstance(value, float) else f"{'-':>{width}}"


def report(result: Result) -> None:
    s = result.settings
    print(
        f"\nDiLoCo {s['nodes']} nodes, H {s['inner_steps']}, {s['steps']} steps x batch "
        f"{s['batch']} per node, node data {s['node_data']}, overrides {s['overrides'] or '-'}"
    )
    print(" outer  node step  nodes  staleness   global  one node  N x batch  reason")
    for row in result.outer:
        stale = ",".join(map(str, row["staleness"])) or "-"
        step = row["node_step"] if row["node_step"] is not None else "-"
        print(
            f"{row['outer_step']:6d}  {step!s:>9}  {row['nodes']:5d}  {stale:>9}  "
            f"{fmt(row['global_loss'])}  {fmt(row['one_node'], 8)}  {fmt(row['n_x_batch'], 9)}"
            f"  {row['reason']}"
        )
    m = result.summary
    own = ", ".join(f"{k} {fmt(v, 0)}" for k, v in m["nodes_own"].items())
    print(
        f"\nfinal global {fmt(m['final_global'], 0)} | one node {fmt(m['one_node'], 0)} | "
        f"{s['nodes']} x batch {fmt(m['n_x_batch'], 0)} | nodes' own: {own}"
    )
    print(
        f"best global {fmt(m['best_global'], 0)} (outer step {m['best_global_outer_step']}); "
        f"global / one node {fmt(m['global_over_one_node'], 0)}, global / N x batch "
        f"{fmt(m['global_over_n_x_batch'], 0)}, gap closed {fmt(m['gap_closed'], 0)}"
    )
    print(
        f"outer steps {m['outer_steps']}, with fewer than {s['nodes']} nodes "
        f"{m['short_rounds']} (by nodes: {m['rounds_by_nodes']}); staleness mean "
        f"{fmt(m['staleness_mean'], 0)} max {m['staleness_max']} (histogram "
        f"{m['staleness_hist']})"
    )
    print(
        f"second half's worst global {fmt(m['second_half_worst'], 0)} vs first half's best "
        f"{fmt(m['first_half_best'], 0)}: {fmt(m['second_half_above_best'], 0)} above"
    )
    print(
        f"wall: DiLoCo {m['diloco_wall_s']} s, references {m['references_wall_s']} s; load "
        f"average {m['load_average']}"
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
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
