"""The master's history: the last ``keep_history`` state files under ``state_dir/history/``,
and :func:`roll_back` (``speedtronic diloco rollback --to N``), which continues from one of
them as a new outer step."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import threading
import time
from dataclasses import replace
from pathlib import Path

from speedtronic.errors import SpeedtronicError
from speedtronic_diloco.master.state import STATE_FILE, load_state, save_state
from speedtronic_diloco.tensors import TensorFileError, load_tensors

__all__ = ["HISTORY_DIR", "history_steps", "keep_history", "roll_back"]

log = logging.getLogger("speedtronic.diloco.outer")

HISTORY_DIR = "history"


def history_steps(state_dir: str | Path) -> list[int]:
    """The outer steps kept for rollback under ``state_dir/history``, oldest first."""
    directory = Path(state_dir) / HISTORY_DIR
    steps = []
    with contextlib.suppress(FileNotFoundError, NotADirectoryError):
        for path in directory.glob("outer_*.safetensors"):
            with contextlib.suppress(ValueError):
                steps.append(int(path.stem[len("outer_") :]))
    return sorted(steps)


def keep_history(state_dir: Path, step: int, keep: int) -> None:
    """Keep the state file just written as ``history/outer_<step>.safetensors`` (a hard
    link where possible) and prune to ``keep`` entries; a failure is a warning."""
    if keep <= 0:
        return
    directory = state_dir / HISTORY_DIR
    try:
        directory.mkdir(parents=True, exist_ok=True)
        target = directory / f"outer_{step:08d}.safetensors"
        tmp = directory / f".outer_{step:08d}.{os.getpid()}.{threading.get_ident()}.tmp"
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
        try:
            os.link(state_dir / STATE_FILE, tmp)
        except OSError:
            shutil.copyfile(state_dir / STATE_FILE, tmp)
        os.replace(tmp, target)
        for old in history_steps(state_dir)[:-keep]:
            with contextlib.suppress(FileNotFoundError):
                (directory / f"outer_{old:08d}.safetensors").unlink()
    except OSError as exc:
        log.warning("keeping outer step %d for rollback failed: %s", step, exc)


def roll_back(state_dir: str | Path, to_step: int) -> int:
    """Make the master state in ``state_dir`` continue from the global and momentum of outer
    step ``to_step`` (a kept history entry, or the current step), as a *new* outer step (the
    current one + 1, so every node installs it); the ledger is kept (deltas processed since are
    not aggregated again) and a halt is cleared; with streaming fragments every fragment's
    version becomes the new outer step, so every fragment file is published again and every
    node installs all of it. The master must not be running. Returns the new outer step; the
    restarted master publishes it."""
    state_dir = Path(state_dir)
    path = state_dir / STATE_FILE
    try:
        current = load_state(path)
        node_id = load_tensors(path)[1].get("node_id", "")
    except TensorFileError as exc:
        raise SpeedtronicError(f"no readable master state at {path} ({exc})") from None
    source = current
    if to_step != current.outer_step:
        kept = history_steps(state_dir)
        if to_step not in kept:
            raise SpeedtronicError(
                f"outer step {to_step} is not kept in {state_dir / HISTORY_DIR} "
                f"(kept: {', '.join(map(str, kept)) or 'none'}; current: {current.outer_step})"
            )
        try:
            source = load_state(state_dir / HISTORY_DIR / f"outer_{to_step:08d}.safetensors")
        except TensorFileError as exc:
            raise SpeedtronicError(str(exc)) from None
    if not source.global_state:
        raise SpeedtronicError(f"outer step {to_step}: no global weights in the kept state")
    new_step = current.outer_step + 1
    current.fragments.restart_versions(new_step)
    rolled = replace(
        current,
        global_state=source.global_state,
        momentum=source.momentum,
        outer_step=new_step,
        published_step=-1,
        halted=None,
        rolled_back={"to": to_step, "from": current.outer_step, "at": time.time()},
    )
    save_state(path, rolled, node_id)
    log.warning(
        "master state %s: rolled back to the global of outer step %d, as outer step %d "
        "(published when the master starts)",
        path,
        to_step,
        new_step,
    )
    return new_step
