"""``speedtronic diloco status`` as a subprocess, against a shared directory and the Hub
emulator: JSON and table output, ``--watch`` ending by itself after ``--count`` looks, fields
the store does not record shown as ``-``, and the store left exactly as it was."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml
from diloco_fakes import make_master
from hub_emulator import HubEmulator

from speedtronic_diloco.lease import LeaseKeeper
from speedtronic_diloco.plugin import diloco_subcommands
from speedtronic_diloco.retry import RetryPolicy
from speedtronic_diloco.tensors import cpu_state_dict, save_tensors
from speedtronic_diloco.transports import Transport
from speedtronic_diloco.transports.hub import HubTransport
from speedtronic_diloco.transports.shared_dir import SharedDirectoryTransport

TOKEN = "hf_test_secret_token"
REPO = "org/status-run"
WAIT = 120.0


def tiny() -> dict:
    import torch

    torch.manual_seed(0)
    return cpu_state_dict(torch.nn.Linear(3, 2).state_dict())


def seed_run(store: Transport, tmp_path: Path) -> None:
    """Two outer steps by master 'm' (holding the lease), deltas of 'a' and 'b', one of b's
    rejected (non-finite)."""
    import torch

    store.create_store()
    keeper = LeaseKeeper(store, "m", ttl=600.0, retry=RetryPolicy(retries=0, backoff=0))
    keeper.acquire()
    loop = make_master(store, tmp_path, rules={"outlier_policy": "off", "keep_history": 0})
    loop.lease = keeper
    loop.keeper.bootstrap(tiny())
    loop.publish()
    for step, bad in ((5, False), (10, True)):
        for node in ("a", "b"):
            delta = {k: torch.full(v.shape, 0.01) for k, v in tiny().items()}
            if bad and node == "b":
                delta["weight"] = torch.full_like(delta["weight"], float("nan"))
            path = save_tensors(
                tmp_path / f"{node}{step}.safetensors",
                delta,
                {"format": "1", "node_id": node, "local_step": step, "base_outer_step": 0},
            )
            store.upload_delta(node, step, path)
        loop.run_round()
    path = save_tensors(tmp_path / "c.safetensors", tiny())
    store.upload_delta("c", 3, path)  # pending: not aggregated yet


def config_for(tmp_path: Path, repo_id: str) -> Path:
    path = tmp_path / "run.yaml"
    config = {
        "model": {"name": "reference_transformer"},
        "distributed": {"enabled": True, "role": "worker", "repo_id": repo_id},
    }
    path.write_text(yaml.safe_dump(config))
    return path


def status(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ}
    env.pop("SPEEDTRONIC_LOAD_PLUGINS", None)
    return subprocess.run(
        [sys.executable, "-m", "speedtronic", "diloco", "status", "--config", str(config), *args],
        capture_output=True,
        text=True,
        timeout=WAIT,
        env=env,
    )


def snapshot(root: Path) -> dict[str, tuple[int, bytes]]:
    return {
        str(p.relative_to(root)): (p.stat().st_mtime_ns, p.read_bytes())
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


@pytest.fixture(params=["shared_dir", "hub"])
def run(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Path, Transport, HubEmulator | None]]:
    if request.param == "shared_dir":
        store = SharedDirectoryTransport(tmp_path / "store")
        seed_run(store, tmp_path)
        yield config_for(tmp_path, str(tmp_path / "store")), store, None
        return
    with HubEmulator(require_token=TOKEN) as hub:
        monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
        monkeypatch.setenv("HF_TOKEN", TOKEN)
        monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        store = HubTransport(REPO, token=TOKEN, endpoint=hub.endpoint, request_timeout=10)
        seed_run(store, tmp_path)
        yield config_for(tmp_path, REPO), store, hub


def test_status_json_reports_the_run_and_reads_only(
    run: tuple[Path, Transport, HubEmulator | None], tmp_path: Path
) -> None:
    config, _, hub = run
    before = snapshot(tmp_path / "store") if hub is None else hub.head(REPO)
    writes_before = len([r for r in hub.requests if r.method == "POST"]) if hub else 0
    done = status(config, "--json")
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert report["outer_step"] == 2 and report["master"] == "m"
    assert report["lease"]["holder"] == "m" and report["lease"]["state"] == "live"
    assert report["lease_epoch"] == 1
    assert report["publication_age_s"] is not None and report["publication_age_s"] < WAIT
    assert report["store_bytes"] > 0
    assert report["eval_loss"] is None  # not evaluated in this run: shown as "-"
    # The published round: its mode and the staleness of each included delta (b's was rejected;
    # a's was computed from outer step 0 and went into outer step 2).
    assert report["last_round"]["mode"] == "async"
    assert report["last_round"]["nodes"] == ["a"] and report["last_round"]["staleness"] == [1]
    nodes = {row["node_id"]: row for row in report["nodes"]}
    assert set(nodes) == {"a", "b", "c"}
    assert nodes["a"]["last_delta_step"] == 10 and nodes["a"]["accepted"] == 2
    assert nodes["a"]["base_outer_step"] == 0 and nodes["a"]["norm"] > 0
    assert nodes["b"]["accepted"] == 1 and nodes["b"]["rejected"] == 1
    assert "non_finite" in nodes["b"]["last_rejection"]
    assert nodes["c"]["pending"] == 1 and nodes["c"]["accepted"] is None
    assert nodes["a"]["age_s"] is not None
    after = snapshot(tmp_path / "store") if hub is None else hub.head(REPO)
    assert after == before  # nothing written, not even a timestamp
    if hub is not None:
        assert len([r for r in hub.requests if r.method == "POST"]) == writes_before
        assert TOKEN not in done.stdout + done.stderr


def test_status_table_and_a_bounded_watch(
    run: tuple[Path, Transport, HubEmulator | None],
) -> None:
    config, _, _ = run
    done = status(config, "--watch", "--count", "2", "--interval", "0.1")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.count("outer step   2 by m") == 2  # two looks, then it ends by itself
    for expected in ("lease        m (epoch 1, expires in", "eval loss    -", "last rejection"):
        assert expected in out, out
    assert "non_finite" in out
    assert "last round   async, 1 node, staleness 1 (mean 1)" in out, out
    lines = [line for line in out.splitlines() if line.startswith("│ c")]
    assert lines and " - " in lines[0]  # c: nothing recorded by the ledger yet


def test_status_of_an_unreachable_store_is_one_error_line(tmp_path: Path) -> None:
    config = config_for(tmp_path, str(tmp_path / "missing"))
    done = status(config)
    assert done.returncode == 0  # an empty store: nothing published yet is not an error
    assert "outer step   -" in done.stdout
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "global").mkdir()
    (tmp_path / "bad" / "global" / "step_count.json").write_text("{broken")
    done = status(config_for(tmp_path, str(tmp_path / "bad")))
    assert done.returncode == 2 and done.stderr.startswith("error:"), done.stderr
    assert "Traceback" not in done.stderr
    # The CLI's global --debug works on this nested command too, after its name.
    debug = status(config_for(tmp_path, str(tmp_path / "bad")), "--debug")
    assert debug.returncode != 0 and "Traceback (most recent call last)" in debug.stderr


def test_the_diloco_command_group_is_shared() -> None:
    """A second module adding to ``speedtronic diloco`` gets the same group."""
    import argparse

    parser = argparse.ArgumentParser()
    sub = parser.add_subparsers()
    first = diloco_subcommands(sub)
    first.add_parser("status")
    again = diloco_subcommands(sub)
    again.add_parser("rollback")
    assert first is again and set(first.choices) == {"status", "rollback"}


WATCH = ["--watch", "--interval", "0.2", "--json"]


def test_watch_ends_on_ctrl_c(tmp_path: Path) -> None:
    import signal

    store = SharedDirectoryTransport(tmp_path / "store")
    seed_run(store, tmp_path)
    env = {**os.environ}
    env.pop("SPEEDTRONIC_LOAD_PLUGINS", None)
    config = config_for(tmp_path, str(tmp_path / "store"))
    process = subprocess.Popen(
        [sys.executable, "-m", "speedtronic", "diloco", "status", "-c", str(config), *WATCH],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        first = process.stdout.readline()  # blocks until the first look is printed
        assert json.loads(first)["outer_step"] == 2
        process.send_signal(signal.SIGINT)
        assert process.wait(WAIT) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(WAIT)
