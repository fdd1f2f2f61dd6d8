"""When the master dies: the whole take-over as a user lives it (issue 41, scenario 1), beside the
same run with no kill.

Three `speedtronic train` processes on a shared-directory store, with `configs/diloco.yaml` as the
user's config (its byte-level model: vocabulary 257, 64 tokens, 2 layers, d 64; its rounds, outer
optimizer, `min_deltas: 3` and `round_timeout`) training on Pride and Prejudice
(benchmarks/data/, prepared with `speedtronic data prepare --tokenizer bytes
--blank-line-documents --eval-fraction 0.1`):

- master `m` (`distributed.failover: true`, 4000 steps), worker `w1` (`failover: true`: a
  standby) and worker `w2`, 3000 steps each, the workers started once `m` published its first
  global; `inner_steps` 10, `lease_ttl` 6 s, `poll_interval` 0.5 s; eval on (`at_end`, 8
  held-out micro-batches), so whoever is master scores every global it publishes (`outer_eval`).
- Each pair is that run twice, the no-kill reference first: in the second `m` gets SIGKILL once
  it made 3 outer steps, and the workers train on to their end.

The timeline is read from outside, by polling the store every 50 ms (`global/lease.json`: who
holds the lease; `global/step_count.json`: each publication's outer step and master): a
successor's queued events (`master_takeover`, `outer_step`) are written by its training thread,
so their `time` is when that thread next ran, not when the round happened. Figures:

- the global's held-out loss curve (`outer_eval`) before and after the kill, beside the no-kill
  run's global at the same outer step;
- seconds from the kill to the lease changing hands (`takeover_s`) and to the successor's first
  published outer step (`first_round_after_kill_s`), against the issue's bound `lease_ttl` +
  3 `poll_interval`s;
- publications per minute of the dead master before the kill and of the successor while it still
  trains (up to its `train_end`, its final round left out), and their ratio (the issue: at least
  0.5); the no-kill master's while all three train, for scale;
- the final global's held-out loss (the last `outer_eval`; the killed run ends with the
  successor's step 3000, the no-kill run with `m`'s step 4000, alone for its last 1000 steps),
  killed / no kill (the issue: at most 1.05), and the no-kill global at the killed run's final
  outer step;
- seconds from the successor's `train_end` to its final global's publication (`Master.finish`
  waits up to `round_timeout` for the final deltas of the nodes it counts as recent: a dead
  master counted there would cost a whole `round_timeout`).

    python benchmarks/diloco_failover.py --quick   # 2 pairs at 600 / 800 steps (about 7 min)
    python benchmarks/diloco_failover.py           # 2 pairs at 3000 / 4000 (about 30 min)
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from diloco_processes import (
    Process,
    global_outer_step,
    read_events,
    run_finished_exit,
    start,
    train_process,
)
from diloco_quality import DEFAULT_CORPUS, DEMO_CONFIG, prepare_corpus
from results import emit

from speedtronic_diloco.config import DistributedConfig
from speedtronic_diloco.transports import GlobalMetadata, Lease
from speedtronic_diloco.transports.base import GLOBAL_METADATA, LEASE_FILE

TTL = 6.0
POLL = 0.5
INNER = 10
BOUND = TTL + 3 * POLL  # the issue's bound on kill -> the successor's first outer step
WAIT = 1800.0  # seconds one run may take before its processes are killed
QUICK = {"master_steps": 800, "worker_steps": 600, "pairs": 2}


def node_config(args: argparse.Namespace, shards: Path, vocab: int, store: Path) -> dict[str, Any]:
    """The user's config with this benchmark's data, store, round cadence and eval."""
    config = yaml.safe_load(args.config.read_text())
    config["run"].update({"seed": 0, "device": "cpu", "threads": 1})
    config["model"]["vocab_size"] = max(int(config["model"].get("vocab_size", vocab)), vocab)
    data = config.setdefault("data", {})
    data.pop("text_path", None)
    data["shards"] = str(shards)
    # The same held-out windows for every global, killed run or not.
    config["eval"] = {"at_end": True, "batches": args.eval_batches, "micro_batch_size": 8}
    config["checkpoint"] = {"interval": 0}
    config["logging"] = {"log_every": 500, "progress": False}
    config.setdefault("distributed", {}).update(
        {
            "enabled": True,
            "repo_id": f"file://{store}",
            "inner_steps": INNER,
            "lease_ttl": TTL,
            "poll_interval": POLL,
        }
    )
    if args.rounds is not None:
        config["distributed"]["rounds"] = args.rounds
    return config


def events(process: Process, name: str | None = None) -> list[dict[str, Any]]:
    """``process``'s metric events (``name`` only); a half-written last line is skipped."""
    return [e for e in read_events(process.events) if name is None or e.get("event") == name]


class Observer:
    """Polls the store's lease and pointer every 50 ms in a thread: when each lease holder and
    each published outer step was first seen (``time.time()``)."""

    def __init__(self, store: Path) -> None:
        self.store = store
        self.leases: list[tuple[float, str, int]] = []  # (seen at, holder, epoch)
        self.published: list[tuple[float, int, str]] = []  # (seen at, outer step, master)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _read(self, name: str) -> bytes | None:
        try:
            return (self.store / name).read_bytes()
        except OSError:
            return None

    def _loop(self) -> None:
        while not self._stop.is_set():
            now = time.time()
            try:
                raw = self._read(LEASE_FILE)
                lease = Lease.loads(raw) if raw else None
                if lease is not None and (
                    not self.leases or self.leases[-1][1:] != (lease.holder, lease.epoch)
                ):
                    self.leases.append((now, lease.holder, lease.epoch))
                raw = self._read(GLOBAL_METADATA)
                meta = GlobalMetadata.loads(raw) if raw else None
                if meta is not None and (
                    not self.published or self.published[-1][1] != meta.outer_step
                ):
                    self.published.append((now, int(meta.outer_step), str(meta.master)))
            except Exception:  # a file being replaced right now: read it again next time
                pass
            self._stop.wait(0.05)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)


@dataclass
class Run:
    """One run's processes, the store's timeline and how the processes ended."""

    killed: bool
    nodes: dict[str, Process] = field(default_factory=dict)
    observer: Observer | None = None
    killed_at: float | None = None  # time.time() right after the SIGKILL
    exits: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0


def tail(process: Process) -> str:
    return process.log.read_text(errors="replace")[-3000:] if process.log.exists() else ""


def until(predicate: Any, what: str, run: Run, deadline: float) -> Any:
    """Poll ``predicate`` until it is true (bounded by ``deadline``); a node that failed ends
    the wait with its log."""
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        for name, process in run.nodes.items():
            assert process.popen is not None
            code = process.popen.poll()
            if code not in (None, 0, run_finished_exit()) and not (run.killed and name == "m"):
                raise SystemExit(
                    f"{name} failed (exit {code}) waiting for {what}:\n{tail(process)}"
                )
        time.sleep(0.1)
    raise SystemExit(f"timed out waiting for {what}")


def one_run(args: argparse.Namespace, shards: Path, vocab: int, root: Path, kill: bool) -> Run:
    root.mkdir(parents=True)
    store = root / "store"
    path = root / "config.yaml"
    path.write_text(yaml.safe_dump(node_config(args, shards, vocab, store), sort_keys=False))
    run = Run(kill, observer=Observer(store))
    started = time.monotonic()
    deadline = started + WAIT

    def node(name: str, role: str, steps: int, *sets: str) -> Process:
        process = train_process(
            name,
            path,
            root,
            f"distributed.node_id={name}",
            f"distributed.role={role}",
            f"run.max_steps={steps}",
            *sets,
        )
        start(process)
        run.nodes[name] = process
        return process

    try:
        m = node("m", "master", args.master_steps, "distributed.failover=true")
        until(lambda: global_outer_step(store) is not None, "m's first global", run, deadline)
        node("w1", "worker", args.worker_steps, "distributed.failover=true")
        node("w2", "worker", args.worker_steps)
        if kill:
            until(
                lambda: len(events(m, "outer_step")) >= args.kill_after,
                f"m's {args.kill_after} outer steps",
                run,
                deadline,
            )
            assert m.popen is not None
            m.popen.send_signal(signal.SIGKILL)
            run.killed_at = time.time()
            m.popen.wait(60)
        until(
            lambda: all(
                p.popen is not None and p.popen.poll() is not None for p in run.nodes.values()
            ),
            "the run's end",
            run,
            deadline,
        )
    finally:
        run.observer.stop()
        for process in run.nodes.values():
            assert process.popen is not None
            if process.popen.poll() is None:
                process.popen.kill()
                process.popen.wait(60)
            run.exits[process.name] = process.popen.returncode
    run.wall_s = time.monotonic() - started
    for name, code in run.exits.items():
        if code not in (0, run_finished_exit()) and not (kill and name == "m"):
            raise SystemExit(f"{name} exited {code}:\n{tail(run.nodes[name])}")
    return run


def per_minute(times: list[float]) -> float | None:
    """Rounds per minute over the intervals between ``times`` (at least two)."""
    times = sorted(times)
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    return 60.0 * (len(times) - 1) / (times[-1] - times[0])


def curve(run: Run) -> dict[int, tuple[float, str]]:
    """The global's held-out loss by outer step: ``(loss, the master that scored it)``."""
    found: dict[int, tuple[float, str]] = {}
    for name, process in run.nodes.items():
        for e in events(process, "outer_eval"):
            if e.get("loss") is not None:
                found[int(e["outer_step"])] = (float(e["loss"]), name)
    return found


def train_end(process: Process) -> float | None:
    ended = events(process, "train_end")
    return float(ended[-1]["time"]) if ended else None


def measure(reference: Run, killed: Run) -> dict[str, Any]:
    """The figures of one pair: the no-kill ``reference`` and the ``killed`` run."""
    assert killed.killed_at is not None and killed.observer and reference.observer
    kill = killed.killed_at
    leases = [entry for entry in killed.observer.leases if entry[1] != "m"]
    if not leases:
        raise SystemExit("no standby took over:\n" + tail(killed.nodes["w1"]))
    taken_at, winner_name, epoch = leases[0]
    winner = killed.nodes[winner_name]
    ended = train_end(winner)
    if ended is None:
        raise SystemExit(f"the successor {winner_name} did not end:\n{tail(winner)}")
    published = killed.observer.published
    before = [t for t, step, who in published if who == "m" and step >= 1]
    after = [(t, step) for t, step, who in published if who == winner_name]
    if not after:
        raise SystemExit(f"the successor {winner_name} published nothing:\n{tail(winner)}")
    training = [t for t, _ in after if t <= ended]
    final_t, final_step = after[-1]
    final_events = [e for e in events(winner, "outer_step") if e.get("reason") == "final"]
    # The no-kill master's publications while all three train (up to a worker's end).
    ref_end = min(train_end(p) or float("inf") for n, p in reference.nodes.items() if n != "m")
    ref_rounds = [
        t
        for t, step, who in reference.observer.published
        if who == "m" and step >= 1 and t <= ref_end
    ]
    killed_curve, ref_curve = curve(killed), curve(reference)
    last, ref_last = max(killed_curve), max(ref_curve)
    rate_before, rate_after = per_minute(before), per_minute(training)
    takeover_events = events(winner, "master_takeover")
    return {
        "winner": winner_name,
        "epoch": epoch,
        "winners": sum(1 for p in killed.nodes.values() if events(p, "master_takeover")),
        "takeover_s": taken_at - kill,
        "takeover_event_lag_s": (
            float(takeover_events[0]["time"]) - taken_at if takeover_events else None
        ),
        "lapsed_for_s": takeover_events[0].get("lapsed_for_s") if takeover_events else None,
        "takeover_outer_step": max(step for _, step, who in published if who == "m"),
        "first_round_s": after[0][0] - kill,
        "first_round_step": after[0][1],
        "rounds_before": len(before),
        "rounds_after": len(training),
        "rate_before": rate_before,
        "rate_after": rate_after,
        "rate_ratio": rate_after / rate_before if rate_before and rate_after else None,
        "rate_no_kill": per_minute(ref_rounds),
        "final_wait_s": final_t - ended,
        "final_step": final_step,
        "final_round": final_events[-1] if final_events else None,
        "final_outer_step": last,
        "final_loss": killed_curve[last][0],
        "no_kill_outer_step": ref_last,
        "no_kill_loss": ref_curve[ref_last][0],
        "no_kill_at_same_step": ref_curve[last][0] if last in ref_curve else None,
        "ratio": killed_curve[last][0] / ref_curve[ref_last][0],
        "curve": killed_curve,
        "ref_curve": ref_curve,
        "times": {step: t - kill for t, step, _ in published},
        "exits": killed.exits,
        "wall_s": (reference.wall_s, killed.wall_s),
    }


def fmt(value: float | None, spec: str = ".2f") -> str:
    return "-" if value is None else format(value, spec)


def show(index: int, row: dict[str, Any]) -> None:
    """One pair: the loss curve around the kill (every step near it, then sampled), then the
    timeline, the cadence and the final global."""
    killed, ref, times = row["curve"], row["ref_curve"], row["times"]
    steps = sorted(killed)
    near = [s for s in steps if s <= row["first_round_step"] + 4]
    rest = [s for s in steps if s not in near]
    shown = sorted({*near, *rest[:: max(1, len(rest) // 10)], steps[-1]})
    print(f"\npair {index}: the global's held-out loss ({row['winner']} took over)")
    print(f"{'outer step':>10}{'published, s after kill':>25}{'by':>4}{'loss':>8}{'no kill':>9}")
    for step in shown:
        loss, by = killed[step]
        other = ref.get(step)
        print(
            f"{step:>10}{fmt(times.get(step), '.1f'):>25}{by:>4}{loss:>8.4f}"
            f"{(f'{other[0]:.4f}' if other else '-'):>9}"
        )
    print(
        f"kill -> lease taken (epoch {row['epoch']}) {row['takeover_s']:.2f} s "
        f"(lapsed_for_s {fmt(row['lapsed_for_s'])}; the master_takeover event written "
        f"{fmt(row['takeover_event_lag_s'])} s later), -> first published outer step "
        f"({row['first_round_step']}) {row['first_round_s']:.2f} s; bound {BOUND:g} s; "
        f"standbys that took over: {row['winners']}"
    )
    print(
        f"rounds/min: m before the kill {fmt(row['rate_before'], '.1f')} "
        f"({row['rounds_before']} publications), successor while it trains "
        f"{fmt(row['rate_after'], '.1f')} ({row['rounds_after']}), ratio "
        f"{fmt(row['rate_ratio'])}; no-kill master while all three train "
        f"{fmt(row['rate_no_kill'], '.1f')}"
    )
    print(
        f"final global: killed {row['final_loss']:.4f} (outer step {row['final_outer_step']}), "
        f"no kill {row['no_kill_loss']:.4f} (outer step {row['no_kill_outer_step']}; "
        f"{fmt(row['no_kill_at_same_step'], '.4f')} at outer step {row['final_outer_step']}), "
        f"killed / no kill {row['ratio']:.4f}"
    )
    final = row["final_round"] or {}
    print(
        f"successor's final global (outer step {row['final_step']}) published "
        f"{row['final_wait_s']:.2f} s after its train_end (final round: nodes "
        f"{final.get('nodes')}, included {final.get('included')}, waited_s "
        f"{final.get('waited_s')}); exits {row['exits']}; wall {row['wall_s'][0]:.0f} s "
        f"(no kill), {row['wall_s'][1]:.0f} s (killed)"
    )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help=f"small preset: {QUICK}")
    parser.add_argument("--pairs", type=int, default=2, help="pairs of runs (no kill, killed)")
    parser.add_argument("--master-steps", type=int, default=4000, help="m's max_steps")
    parser.add_argument("--worker-steps", type=int, default=3000, help="w1's and w2's max_steps")
    parser.add_argument("--kill-after", type=int, default=3, help="m's outer steps before SIGKILL")
    parser.add_argument("--eval-batches", type=int, default=8, help="held-out micro-batches")
    parser.add_argument(
        "--rounds", choices=("async", "sync"), default=None, help="default: the config's"
    )
    parser.add_argument("--config", type=Path, default=DEMO_CONFIG, help="the user's config")
    parser.add_argument("--corpus", type=Path, default=DEFAULT_CORPUS, help="a UTF-8 text file")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    parser.add_argument("--workdir", type=Path, default=None, help="keep the runs' files here")
    args = parser.parse_args()
    if args.quick:
        for key, value in QUICK.items():
            if getattr(args, key) == parser.get_default(key):
                setattr(args, key, value)
    if args.worker_steps < INNER * (args.kill_after + 2) or args.master_steps < args.worker_steps:
        parser.error("need --master-steps >= --worker-steps, long enough to kill and go on")
    return args


def main() -> None:
    args = parse_args()
    root = Path(args.workdir or tempfile.mkdtemp(prefix="diloco_failover_")).resolve()
    rows = []
    try:
        shards, vocab = prepare_corpus(args.corpus, root / "shards")
        for index in range(args.pairs):
            pair = root / f"pair{index}"
            shutil.rmtree(pair, ignore_errors=True)
            reference = one_run(args, shards, vocab, pair / "no_kill", kill=False)
            killed = one_run(args, shards, vocab, pair / "killed", kill=True)
            rows.append(measure(reference, killed))
            print(
                f"pair {index} done ({reference.wall_s:.0f} s + {killed.wall_s:.0f} s)", flush=True
            )
    finally:
        if args.workdir is None:
            shutil.rmtree(root, ignore_errors=True)
    section = yaml.safe_load(args.config.read_text()).get("distributed", {})
    mode = args.rounds or section.get("rounds", DistributedConfig().rounds)
    setting = (
        f"{args.config.name} ({mode} rounds, min_deltas {section.get('min_deltas')}, "
        f"round_timeout {section.get('round_timeout')} s), {args.corpus.name}, m "
        f"{args.master_steps} steps (failover), w1 (failover) and w2 {args.worker_steps}, "
        f"inner_steps {INNER}, lease_ttl {TTL:g} s, poll_interval {POLL:g} s, SIGKILL after "
        f"{args.kill_after} outer steps"
    )
    print(setting)
    for index, row in enumerate(rows):
        show(index, row)
    if args.json is not None:
        skip = ("curve", "ref_curve", "times")
        summary = [{k: v for k, v in r.items() if k not in skip} for r in rows]
        args.json.write_text(json.dumps({"setting": setting, "pairs": summary}, indent=1))
    method = (
        f"wall clock (the store polled every 50 ms), {args.pairs} pairs of runs, the no-kill "
        f"one first; {setting}"
    )

    def figure(key: str, name: str, unit: str, label: str) -> None:
        values = [r[key] for r in rows if r[key] is not None]
        if values:
            emit(f"diloco_failover.{name}", values, unit=unit, method=method, label=label)

    figure("takeover_s", "takeover_s", "s", "kill -> a standby holds the lease")
    figure(
        "first_round_s",
        "first_round_after_kill_s",
        "s",
        f"kill -> the successor's first published outer step (issue: <= {BOUND:g} s)",
    )
    figure(
        "rate_before", "rounds_per_min_before", "/min", "outer steps a minute, m before the kill"
    )
    figure(
        "rate_after",
        "rounds_per_min_after",
        "/min",
        "outer steps a minute, the successor while it trains",
    )
    figure(
        "rate_ratio",
        "rounds_per_min_ratio",
        "x",
        "successor / dead master outer steps a minute (issue: >= 0.5)",
    )
    figure(
        "rate_no_kill",
        "rounds_per_min_no_kill",
        "/min",
        "outer steps a minute, the no-kill master while all three train",
    )
    figure("final_loss", "final_loss_killed", "nats", "final global's held-out loss, killed")
    figure("no_kill_loss", "final_loss_no_kill", "nats", "final global's held-out loss, no kill")
    figure(
        "ratio", "final_vs_no_kill", "x", "final global's loss, killed / no kill (issue: <= 1.05)"
    )
    figure(
        "final_wait_s",
        "final_round_s",
        "s",
        "the successor's train_end -> its final global published",
    )


if __name__ == "__main__":
    main()
