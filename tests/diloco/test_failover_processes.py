"""Fail-over with real ``speedtronic train`` processes (issue 30), on a shared directory and on
the Hub emulator: a SIGKILLed master is replaced by exactly one of two standbys, whose outer
steps continue from the next number without aggregating a delta twice; a master that was
frozen (SIGSTOP) past its lease and comes back is fenced and goes on as a worker whose deltas
the new master aggregates; a process killed while it holds the shared directory's lock does not
block the take-over. Every wait is bounded polling on events and store files."""

from __future__ import annotations

import fcntl
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_diloco_lease_processes import Master, Store, config_file, store, wait_until

from speedtronic_diloco.lease import LeaseKeeper
from speedtronic_diloco.standby import Standby
from speedtronic_diloco.transports.shared_dir import LOCK_FILE, SharedDirectoryTransport

__all__ = ["store"]

pytestmark = pytest.mark.slow

FAILOVER = ("--set", "distributed.failover=true")
WORKER = ("--set", "distributed.role=worker", *FAILOVER)


def included(event: dict) -> list[tuple[str, int]]:
    items = [item.split("@") for item in str(event.get("included") or "").split(",") if item]
    return [(node, int(step)) for node, step in items]


def wait_stopped(pid: int, deadline: float) -> None:
    """Until every thread of ``pid`` is stopped: a SIGSTOP is delivered asynchronously, and a
    thread still running (on a loaded machine) could take the lock right after the probe."""
    tasks = Path(f"/proc/{pid}/task")
    if not tasks.is_dir():  # no procfs: the signal's delivery cannot be watched
        return
    while True:
        states = []
        for stat in tasks.glob("*/stat"):
            try:  # "pid (comm) S ...": the state follows the last ")"
                states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
            except (OSError, IndexError):
                continue  # a thread that just ended
        if states and all(state in ("T", "t") for state in states):
            return
        assert time.monotonic() < deadline, f"process {pid} never stopped: {states}"
        time.sleep(0.01)


def freeze_outside_the_lock(master: Master, store: Store) -> None:
    """SIGSTOP ``master`` at a moment it does not hold a shared directory's lock (a process
    frozen inside it blocks every writer until it resumes: the lock's documented limit)."""
    master.process.send_signal(signal.SIGSTOP)
    if store.kind != "shared_dir":
        return
    deadline = time.monotonic() + 60
    wait_stopped(master.process.pid, deadline)
    with open(Path(store.repo_id) / LOCK_FILE, "a+b") as handle:
        while True:
            try:
                fcntl.lockf(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                assert time.monotonic() < deadline, "the master never let go of the lock"
                master.process.send_signal(signal.SIGCONT)
                time.sleep(0.02)
                master.process.send_signal(signal.SIGSTOP)
                wait_stopped(master.process.pid, deadline)
                continue
            fcntl.lockf(handle.fileno(), fcntl.LOCK_UN)
            return


def test_a_sigkilled_master_is_replaced_by_exactly_one_standby(
    store: Store, tmp_path: Path
) -> None:
    config = config_file(tmp_path, store)
    m1 = Master(tmp_path, config, "m1", *FAILOVER)
    standbys: list[Master] = []
    try:
        wait_until(lambda: store.metadata() is not None, "m1's first global", m1)
        standbys = [Master(tmp_path, config, node, *WORKER) for node in ("w1", "w2")]
        wait_until(
            lambda: (
                all(s.events("delta_uploaded") for s in standbys)
                and len(m1.events("outer_step")) >= 2
            ),
            "m1's outer steps and the standbys' deltas",
            m1,
            *standbys,
        )
        m1.process.send_signal(signal.SIGKILL)
        m1.process.wait(120)
        killed = store.metadata()
        high = {node: int(s.get("high", -1)) for node, s in killed.nodes.items()}

        def winner() -> Master | None:
            return next((s for s in standbys if s.events("outer_step")), None)

        new = wait_until(winner, "the successor's first outer step", *standbys)
        taken = new.events("master_takeover")
        assert len(taken) == 1, new.tail()
        event = taken[0]
        assert event["previous_master"] == "m1" and event["epoch"] == 2
        assert event["outer_step"] == killed.outer_step
        first = new.events("outer_step")[0]
        assert first["outer_step"] == killed.outer_step + 1, new.tail()
        again = [(n, s) for n, s in included(first) if s <= high.get(n, -1)]
        assert not again, f"aggregated again: {again}"
        loser = next(s for s in standbys if s is not new)
        assert not loser.events("master_takeover") and loser.process.poll() is None
        lease = store.lease()
        assert (lease.holder, lease.epoch) == (new.output.name, 2)
        log = new.log.read_text(errors="replace")
        assert (
            f"took over as master from 'm1' (lease epoch 2) at outer step {killed.outer_step}"
            in log
        )
        meta = wait_until(
            lambda: (m := store.metadata()) is not None and m.master == new.output.name and m,
            "a publication by the successor",
            *standbys,
        )
        assert meta.lease_epoch == 2 and meta.outer_step > killed.outer_step
    finally:
        for process in (m1, *standbys):
            process.stop()


def test_a_master_that_comes_back_is_fenced_and_goes_on_as_a_worker(
    store: Store, tmp_path: Path
) -> None:
    config = config_file(tmp_path, store)
    m1 = Master(tmp_path, config, "m1", *FAILOVER)
    w1: Master | None = None
    try:
        wait_until(lambda: store.metadata() is not None, "m1's first global", m1)
        w1 = Master(tmp_path, config, "w1", *WORKER)
        wait_until(lambda: w1.events("delta_uploaded"), "w1's first delta", m1, w1)
        freeze_outside_the_lock(m1, store)  # frozen: no renewals, no publications
        wait_until(lambda: w1.events("outer_step"), "w1's outer step as the master", w1)
        m1.process.send_signal(signal.SIGCONT)
        wait_until(
            lambda: "continues as a worker" in m1.log.read_text(errors="replace"),
            "m1 to notice it was fenced",
            m1,
            w1,
        )
        wait_until(
            lambda: any(n == "m1" for e in w1.events("outer_step") for n, _ in included(e)),
            "a delta of m1 aggregated by w1",
            m1,
            w1,
        )
        output = m1.log.read_text(errors="replace")
        fenced = [line for line in output.splitlines() if "master lease lost" in line]
        assert len(fenced) == 1 and "'w1'" in fenced[0], output[-3000:]
        assert "Traceback" not in output and "the run stops" not in output
        assert m1.process.poll() is None  # still training
        wait_until(
            lambda: (m := store.metadata()) is not None and m.master == "w1",
            "a publication by w1",
            m1,
            w1,
        )
        assert store.lease().holder == "w1" and m1.process.poll() is None
    finally:
        if m1.process.poll() is None:
            m1.process.send_signal(signal.SIGCONT)
        m1.stop()
        if w1 is not None:
            w1.stop()


HOLD_THE_LOCK = """
import sys, time
from speedtronic_diloco.transports.shared_dir import LOCK_FILE, SharedDirectoryTransport
store = SharedDirectoryTransport(sys.argv[1])
with store.files.exclusive():
    print("locked", flush=True)
    time.sleep(600)
"""


def test_a_process_killed_holding_the_store_lock_does_not_block_a_takeover(
    tmp_path: Path,
) -> None:
    root = tmp_path / "store"
    store = SharedDirectoryTransport(root)
    store.create_store()
    dead = LeaseKeeper(store, "m1", ttl=2.0)
    assert dead.acquire() is not None  # m1's lease, never renewed: it lapses
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_THE_LOCK, str(root)], stdout=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "locked"
        holder.send_signal(signal.SIGKILL)
        holder.wait(120)
        standby = Standby(store, "w1", ttl=2.0, clock=lambda: time.time() + 60)
        won = standby.check()
        assert won is not None and store.read_lease().holder == "w1"
        won.keeper.mark_lost("the test is done with it")
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait(120)
