"""One master per store, with real ``speedtronic train`` processes (issue 19), on a shared
directory and on the Hub emulator: a second master refuses to start with an error naming the
holder and the expiry while the first one publishes; after the first is SIGKILLed, a master
started with ``take_over`` waits for the lease to expire, takes it with epoch + 1 and continues
from the published state without aggregating any delta twice. Every wait is bounded polling."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from diloco_runs import tiny_run
from hub_emulator import HubEmulator

from speedtronic_diloco.transports import GLOBAL_METADATA, GlobalMetadata, Lease
from speedtronic_diloco.transports.base import LEASE_FILE

pytestmark = pytest.mark.slow

WAIT = 120.0
TOKEN = "hf_test_secret_token"
REPO = "org/lease-run"
TTL = 3.0


class Store:
    """Where the run syncs, and how a test reads it (without going through a transport)."""

    def __init__(self, kind: str, tmp_path: Path, hub: HubEmulator | None) -> None:
        self.kind, self.tmp_path, self.hub = kind, tmp_path, hub
        self.repo_id = str(tmp_path / "store") if kind == "shared_dir" else REPO

    def raw(self, path: str) -> bytes | None:
        if self.hub is None:
            try:
                return (Path(self.repo_id) / path).read_bytes()
            except FileNotFoundError:
                return None
        try:
            return self.hub.files(REPO).get(path)
        except KeyError:
            return None

    def metadata(self) -> GlobalMetadata | None:
        raw = self.raw(GLOBAL_METADATA)
        try:
            return GlobalMetadata.loads(raw) if raw else None
        except Exception:  # a document being replaced right now
            return None

    def lease(self) -> Lease | None:
        raw = self.raw(LEASE_FILE)
        return Lease.loads(raw) if raw else None


@pytest.fixture(params=["shared_dir", "hub"])
def store(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Store]:
    if request.param == "shared_dir":
        yield Store("shared_dir", tmp_path, None)
        return
    with HubEmulator(require_token=TOKEN) as emulator:
        monkeypatch.setenv("HF_ENDPOINT", emulator.endpoint)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        yield Store("hub", tmp_path, emulator)


def config_file(tmp_path: Path, store: Store) -> Path:
    config = tiny_run(
        tmp_path,
        run={"name": "lease", "max_steps": 1_000_000, "output_dir": None},
        data={"micro_batch_size": 2},
        optimizer={"lr": 1e-3},
        scheduler={"name": "constant"},
        checkpoint={"interval": 0},
        logging={"log_every": 1000},
        distributed={
            "node_id": None,
            "repo_id": store.repo_id,
            "inner_steps": 5,
            "poll_interval": 0.2,
            "round_timeout": 1.0,
            "lease_ttl": TTL,
            "retry_backoff": 0.05,
            "max_retries": 2,
            "request_timeout": 10.0,
        },
    )
    path = tmp_path / "master.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


class Master:
    def __init__(self, tmp_path: Path, config: Path, node_id: str, *extra: str) -> None:
        self.output = tmp_path / node_id
        self.output.mkdir(parents=True, exist_ok=True)
        self.log = self.output / "log.txt"
        self.metrics = self.output / "metrics.jsonl"
        command = [
            sys.executable,
            "-m",
            "speedtronic",
            "train",
            "--config",
            str(config),
            "--output-dir",
            str(self.output),
            "--set",
            f"distributed.node_id={node_id}",
            "--set",
            f"logging.json_file={self.metrics}",
            *extra,
        ]
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        env.pop("SPEEDTRONIC_LOAD_PLUGINS", None)
        with open(self.log, "wb") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)

    def events(self, name: str) -> list[dict[str, Any]]:
        out = []
        if self.metrics.exists():
            for line in self.metrics.read_text().splitlines():
                try:
                    record = json.loads(line)
                except json.JSONDecodeError:
                    continue
                if record.get("event") == name:
                    out.append(record)
        return out

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-3000:] if self.log.exists() else ""

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait(WAIT)


def wait_until(predicate: Callable[[], Any], what: str, *alive: Master) -> Any:
    deadline = time.monotonic() + WAIT
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        for master in alive:
            if master.process.poll() is not None:
                pytest.fail(
                    f"master exited ({master.process.returncode}) waiting for {what}:\n"
                    f"{master.tail()}"
                )
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}\n" + "\n".join(m.tail() for m in alive))


def test_a_second_master_refuses_while_the_first_publishes(store: Store, tmp_path: Path) -> None:
    config = config_file(tmp_path, store)
    first = Master(tmp_path, config, "m1")
    second: Master | None = None
    try:
        wait_until(
            lambda: (store.metadata() or GlobalMetadata(0, "0" * 64, 0)).outer_step >= 1,
            "the first master's outer steps",
            first,
        )
        second = Master(tmp_path, config, "m2")
        assert second.process.wait(WAIT) == 2, second.tail()
        output = second.tail()
        assert "error:" in output and "'m1'" in output and "expires in" in output, output
        assert "take_over" in output
        assert "Traceback" not in output
        meta = store.metadata()
        assert meta.master == "m1" and meta.lease_epoch == 1
        assert store.lease().holder == "m1"
        assert not second.events("outer_step")
        assert first.process.poll() is None  # the first one is untouched
    finally:
        first.stop()
        if second is not None:
            second.stop()


def test_sigkilled_master_is_taken_over_without_double_aggregation(
    store: Store, tmp_path: Path
) -> None:
    config = config_file(tmp_path, store)
    first = Master(tmp_path, config, "m1")
    second: Master | None = None
    try:
        wait_until(lambda: len(first.events("outer_step")) >= 2, "two outer steps", first)
        first.process.send_signal(signal.SIGKILL)
        first.process.wait(WAIT)
        killed = store.metadata()
        assert killed is not None and killed.master == "m1"
        high = {node: int(s.get("high", -1)) for node, s in killed.nodes.items()}
        second = Master(tmp_path, config, "m2", "--take-over")  # the plugin's train flag
        rounds = wait_until(lambda: second.events("outer_step"), "the new master's round", second)
        lease = store.lease()
        assert (lease.holder, lease.epoch) == ("m2", 2)
        assert lease.renewed_at is not None and lease.renewed_at >= store_lease_expiry(killed)
        first_round = rounds[0]
        assert first_round["outer_step"] == killed.outer_step + 1, second.tail()
        again = [
            (node, int(step))
            for node, step in (item.split("@") for item in first_round["included"].split(","))
            if int(step) <= high.get(node, -1)
        ]
        assert not again, f"aggregated again: {again}"
        log = second.log.read_text(errors="replace")
        assert "master lease of" in log and "taken: epoch 2 from 'm1'" in log, log[-3000:]
        meta = wait_until(
            lambda: (m := store.metadata()) is not None and m.master == "m2" and m,
            "a publication by the new master",
            second,
        )
        assert meta.lease_epoch == 2
    finally:
        first.stop()
        if second is not None:
            second.stop()


def store_lease_expiry(metadata: GlobalMetadata) -> float:
    """A lower bound of when the SIGKILLed master's lease expired: its last publication."""
    return float(metadata.published_at or 0.0)


def test_a_master_whose_lease_is_taken_stops_without_waiting_for_a_round(
    tmp_path: Path,
) -> None:
    """Issue 34, L6: a real master waiting for a quorum that never comes (``min_deltas`` 2,
    ``round_timeout`` an hour) loses its lease to another holder; it stops with an error at
    its next poll instead of training on until its next publication."""
    store = Store("shared_dir", tmp_path, None)
    config = config_file(tmp_path, store)
    quorum = ("--set", "distributed.min_deltas=2", "--set", "distributed.round_timeout=3600")
    master = Master(tmp_path, config, "m1", *quorum)
    try:
        wait_until(lambda: store.metadata() is not None, "the bootstrap publication", master)
        taken = Lease("m2", 9, time.time() + 600, time.time())
        path = Path(store.repo_id) / LEASE_FILE
        path.with_suffix(".tmp").write_bytes(taken.dumps())
        os.replace(path.with_suffix(".tmp"), path)  # another master holds it now
        deadline = time.monotonic() + WAIT
        while master.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert master.process.poll() is not None, "still training:\n" + master.tail()
        output = master.tail()
        assert master.process.returncode != 0, output
        # The whole log, not its tail: a loaded machine trains (and logs) on until the next
        # poll notices, which can push the one "lease lost" line out of the last 3000 chars.
        whole = master.log.read_text(errors="replace")
        assert "master lease lost" in whole and "'m2'" in whole, output
        assert "Traceback" not in whole
        assert not master.events("outer_step")  # it never published over its successor
        assert store.lease().holder == "m2"
    finally:
        master.stop()
