"""Fail-over that keeps the run learning (issue 41), with real ``speedtronic train`` processes on
a shared directory:

* a SIGKILLed master's successor runs rounds *while it trains*, with both surviving nodes in
  them, closed by their deltas (not by ``round_timeout`` waiting for the dead master), and
  goes on scoring every global (``outer_eval``), in async and in sync rounds, with
  ``min_deltas`` naming all three nodes of the run;
* a master frozen past its lease and resumed after another master took over writes nothing
  that any node reads: the pointer (sampled every 50 ms) never names it again, and no file it
  wrote after the take-over is in the store, on a shared directory and on the Hub emulator;
* a worker that joins a finished run says so in one line and exits 3 without uploading a
  delta, or (``finished_run: train_alone``) trains on alone, uploading nothing;
  ``speedtronic diloco status`` shows the run as finished.

Every wait is a bounded poll on events and store files; nothing asserts a duration.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_diloco_lease_processes import WAIT, Master, Store, config_file, store, wait_until
from test_failover_processes import freeze_outside_the_lock

from speedtronic_diloco.node.finished import EXIT_RUN_FINISHED
from speedtronic_diloco.signing import read_header
from speedtronic_diloco.transports.base import GLOBAL_METADATA, LEASE_FILE, GlobalMetadata, Lease
from speedtronic_diloco.transports.shared_dir import SharedDirectoryTransport

__all__ = ["store"]

pytestmark = pytest.mark.slow

FAILOVER = ("--set", "distributed.failover=true")
WORKER = ("--set", "distributed.role=worker")
ALL_THREE = ("--set", "distributed.min_deltas=3", "--set", "distributed.round_timeout=60")
EVAL = ("--set", "eval.at_end=true", "--set", "eval.batches=2")


def shared_store(tmp_path: Path) -> Store:
    return Store("shared_dir", tmp_path, None)


@pytest.mark.parametrize("rounds", ["async", "sync"])
def test_the_successor_of_a_killed_master_runs_rounds_while_it_trains(
    tmp_path: Path, rounds: str
) -> None:
    store = shared_store(tmp_path)
    config = config_file(tmp_path, store)
    common = ("--set", f"distributed.rounds={rounds}", *ALL_THREE, *EVAL)
    m = Master(tmp_path, config, "m", *FAILOVER, *common)
    nodes = [m]
    try:
        wait_until(lambda: store.metadata() is not None, "m's first global", m)
        w1 = Master(tmp_path, config, "w1", *WORKER, *FAILOVER, *common)
        w2 = Master(tmp_path, config, "w2", *WORKER, *common)
        nodes += [w1, w2]
        wait_until(lambda: len(m.events("outer_step")) >= 3, "m's three outer steps", m, w1, w2)
        m.process.send_signal(signal.SIGKILL)
        m.process.wait(WAIT)
        wait_until(lambda: w1.events("master_takeover"), "w1's take-over", w1, w2)

        def both_in_rounds() -> list[dict]:
            full = [
                e for e in w1.events("outer_step") if {"w1", "w2"} <= set(e["nodes"].split(","))
            ]
            return full if len(full) >= 3 else []

        # Only a successor whose rounds close on the two live nodes' deltas gets three rounds
        # of both of them before this wait ends: rounds waiting round_timeout (60 s) for the
        # dead master would take 180 s.
        rounds_run = wait_until(
            both_in_rounds, "three rounds of w1 and w2 by the successor", w1, w2
        )
        assert all(e["reason"] == "quorum" for e in rounds_run), rounds_run
        assert all(e["mode"] == rounds for e in rounds_run)
        assert w1.process.poll() is None and w2.process.poll() is None  # still training
        taken = w1.events("master_takeover")[0]
        assert taken["previous_master"] == "m" and taken["epoch"] == 2
        assert rounds_run[0]["outer_step"] > taken["outer_step"]
        scored = wait_until(
            lambda: [e for e in w1.events("outer_eval") if e["outer_step"] > taken["outer_step"]],
            "the successor's outer_eval",
            w1,
            w2,
        )
        assert all(e["loss"] == e["loss"] for e in scored)  # finite numbers, not NaN
        meta = store.metadata()
        assert meta is not None and meta.master == "w1" and meta.lease_epoch == 2
    finally:
        for node in nodes:
            node.stop()


def run_to_end(tmp_path: Path, config: Path, node: str, *extra: str) -> Master:
    process = Master(tmp_path, config, node, *extra)
    process.process.wait(WAIT)
    return process


def worker_deltas(store: Store, node: str) -> list:
    return [d for d in SharedDirectoryTransport(store.repo_id).list_deltas() if d.node_id == node]


def test_a_worker_that_joins_a_finished_run_stops_and_uploads_nothing(tmp_path: Path) -> None:
    store = shared_store(tmp_path)
    config = config_file(tmp_path, store)
    short = ("--set", "run.max_steps=20")
    master = run_to_end(tmp_path, config, "m", *short)
    assert master.process.returncode == 0, master.tail()
    lease = store.lease()
    assert lease is not None and lease.released

    late = run_to_end(tmp_path, config, "late", *WORKER, *short)
    assert late.process.returncode == EXIT_RUN_FINISHED, late.tail()
    output = late.log.read_text(errors="replace")
    lines = [line for line in output.splitlines() if line.startswith("error:")]
    assert len(lines) == 1, output[-3000:]
    assert "is finished" in lines[0] and "'m'" in lines[0] and "train_alone" in lines[0]
    assert "Traceback" not in output
    assert not late.events("delta_uploaded") and not worker_deltas(store, "late")

    alone = run_to_end(
        tmp_path, config, "alone", *WORKER, *short, "--set", "distributed.finished_run=train_alone"
    )
    assert alone.process.returncode == 0, alone.tail()
    assert "training on alone" in alone.log.read_text(errors="replace")
    ended = alone.events("train_end")
    assert ended and ended[-1]["steps"] == 20
    assert not alone.events("delta_uploaded") and not worker_deltas(store, "alone")

    status = subprocess.run(
        [sys.executable, "-m", "speedtronic", "diloco", "status", "-c", str(config), "--json"],
        capture_output=True,
        text=True,
        timeout=WAIT,
    )
    assert status.returncode == 0, status.stderr
    assert json.loads(status.stdout)["finished"] is True
    text = subprocess.run(
        [sys.executable, "-m", "speedtronic", "diloco", "status", "-c", str(config)],
        capture_output=True,
        text=True,
        timeout=WAIT,
    )
    assert "finished: the master ended after its last step" in text.stdout, text.stdout


def test_a_fenced_master_writes_nothing_a_node_reads(store: Store, tmp_path: Path) -> None:
    config = config_file(tmp_path, store)
    m1 = Master(tmp_path, config, "m1")
    w: Master | None = None
    m2: Master | None = None
    samples: list[tuple[float, bytes]] = []  # (time, step_count.json)

    def sample() -> None:
        raw = store.raw(GLOBAL_METADATA)
        if raw:
            samples.append((time.time(), raw))

    try:
        wait_until(lambda: store.metadata() is not None, "m1's first global", m1)
        w = Master(tmp_path, config, "w", *WORKER)
        wait_until(lambda: len(m1.events("outer_step")) >= 2, "m1's outer steps", m1, w)
        freeze_outside_the_lock(m1, store)
        frozen = store.raw(GLOBAL_METADATA)
        deadline = time.monotonic() + WAIT
        while time.monotonic() < deadline and (store.lease() or Lease("", 0, 0)).live():
            time.sleep(0.05)  # m1's lease lapses: it renews nothing while frozen
        m2 = Master(tmp_path, config, "m2", "--take-over")
        while time.monotonic() < deadline:
            sample()
            lease = store.lease()
            if lease is not None and lease.holder == "m2":
                break
            assert m2.process.poll() is None, m2.tail()
            time.sleep(0.05)
        taken_at = time.time()
        assert store.lease().holder == "m2", m2.tail()
        while time.time() < taken_at + 4:  # m1 stays frozen a while under m2's lease
            sample()
            time.sleep(0.05)
        m1.process.send_signal(signal.SIGCONT)
        while m1.process.poll() is None or not samples or b'"m2"' not in samples[-1][1]:
            assert time.monotonic() < deadline, m1.tail() + m2.tail()
            sample()
            time.sleep(0.05)
        for _ in range(40):  # two more seconds of the pointer after m1 stopped
            sample()
            time.sleep(0.05)
        assert m1.process.returncode == 2, m1.tail()
        output = m1.log.read_text(errors="replace")
        assert "master lease lost" in output and "Traceback" not in output, output[-3000:]

        after = [raw for at, raw in samples if at >= taken_at]
        by_m1 = [raw for raw in after if GlobalMetadata.loads(raw).master == "m1"]
        assert all(raw == frozen for raw in by_m1), "m1 published after m2's take-over"
        first_m2 = next(
            i for i, raw in enumerate(after) if GlobalMetadata.loads(raw).master == "m2"
        )
        assert not [raw for raw in after[first_m2:] if GlobalMetadata.loads(raw).master == "m1"]
        assert GlobalMetadata.loads(after[-1]).lease_epoch == 2
        if store.kind == "shared_dir":
            # No file of m1's in global/ from after the take-over (a version file written
            # before its fence check would be one, read by nobody but still m1's).
            late = [
                p
                for p in (Path(store.repo_id) / "global").rglob("*.safetensors")
                if p.stat().st_mtime >= taken_at and not p.name.startswith("latest")
            ]
            masters = {read_header(p)[1].get("__metadata__", {}).get("master") for p in late}
            assert "m1" not in masters, late
        lease = Lease.loads(store.raw(LEASE_FILE))
        assert (lease.holder, lease.epoch) == ("m2", 2)
    finally:
        if m1.process.poll() is None:
            m1.process.send_signal(signal.SIGCONT)
        for node in (m1, w, m2):
            if node is not None:
                node.stop()


def test_a_sync_worker_whose_master_finished_stops_waiting(tmp_path: Path) -> None:
    """Issue 40: after its master's last round a sync worker used to wait 2 x round_timeout at
    each of its remaining boundaries; now it finds the run finished while it waits. With
    round_timeout 60 s and a worker that would train a million steps, only that look ends it
    within this wait (each boundary's wait would otherwise be 120 s)."""
    store = shared_store(tmp_path)
    config = config_file(tmp_path, store)
    sync = ("--set", "distributed.rounds=sync", "--set", "distributed.min_deltas=2")
    # The master's own end-of-run wait for the worker's final delta is its round_timeout: 2 s.
    short = ("--set", "distributed.round_timeout=2", "--set", "run.max_steps=100")
    master = Master(tmp_path, config, "m", *sync, *short)
    worker: Master | None = None
    try:
        wait_until(lambda: store.metadata() is not None, "m's first global", master)
        worker = Master(
            tmp_path, config, "w", *WORKER, *sync, "--set", "distributed.round_timeout=60"
        )
        assert master.process.wait(WAIT) == 0, master.tail()
        assert worker.process.wait(WAIT) == EXIT_RUN_FINISHED, worker.tail()
        assert worker.events("delta_uploaded"), "the worker trained in the run before it ended"
        assert not worker.events("round_wait_timeout")
        assert "is finished" in worker.log.read_text(errors="replace")
    finally:
        for node in (master, worker):
            if node is not None:
                node.stop()
