"""Launching ``speedtronic train`` as a test would under ``--nproc-per-node``: a probe plugin
written next to the run (it records what each rank saw), the environment that finds it, the
command line, and one launch that must succeed (tests/e2e/test_ddp.py, test_fsdp_ranks.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

WAIT = 300  # seconds any one launch may take on a loaded machine


def probe_environment(directory: Path, plugin: str, source: str, **probe: str) -> dict[str, str]:
    """The environment of a run whose ranks load ``plugin`` (written from ``source`` into
    ``directory``); ``probe`` adds ``PROBE_*`` settings the plugin reads."""
    (directory / f"{plugin}.py").write_text(textwrap.dedent(source))
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(directory), os.environ.get("PYTHONPATH", "")]),
        "PROBE_DIR": str(directory),
        "OMP_NUM_THREADS": "1",
        **probe,
    }


def train_command(config: Path, nproc: int | None, plugin: str, *extra: str) -> list[str]:
    """``speedtronic train -c CONFIG ... --plugin PLUGIN [--nproc-per-node N]``."""
    line = [sys.executable, "-m", "speedtronic", "train", "-c", str(config), *extra]
    line += ["--plugin", plugin]
    return line + (["--nproc-per-node", str(nproc)] if nproc else [])


def train_ok(
    config: Path, nproc: int | None, plugin: str, env: dict[str, str], *extra: str
) -> None:
    """Run the command to its end and fail the test with its output unless it succeeded."""
    done = subprocess.run(
        train_command(config, nproc, plugin, *extra),
        capture_output=True,
        text=True,
        timeout=WAIT,
        env=env,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-4000:]
