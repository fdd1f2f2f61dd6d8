"""A test-only plugin for the DumbDiLoCo end-to-end tests, loaded into ``speedtronic train``
processes with ``--plugin diloco_e2e_plugin`` (``tests/e2e`` on ``PYTHONPATH``).

Environment variables (all optional):

* ``DILOCO_E2E_STEP_SLEEP``: seconds every optimizer step sleeps (a slower, more realistic node);
* ``DILOCO_E2E_UPLOAD_DELAY`` with ``DILOCO_E2E_UPLOAD_STEP``: the shared-directory upload of
  that local step waits that long before it lands (an upload still in flight when the
  checkpoint of that step is written);
* ``DILOCO_E2E_UPLOAD_AFTER``: a checkpoint directory (``.../checkpoints/step_NNNNNNNN``); the
  upload of that step (or of the failing one) also waits until that checkpoint is the latest
  (``latest.json`` next to it names it or a later step: a save renames its directory into
  place first and moves the pointer after, so the directory alone is not yet a checkpoint a
  resume would load), at most ``DILOCO_E2E_HOLD_S`` (default 120 s): a checkpoint written
  meanwhile, however slowly the node trains;
* ``DILOCO_E2E_FAIL_UPLOAD_STEP``: that step's upload fails (after the delay), permanently;
* ``DILOCO_E2E_HOLD_LATER``: ``1``: the uploads of later local steps wait ``DILOCO_E2E_HOLD_S``
  before they land, so a node killed meanwhile has sent nothing after the chosen step;
* ``DILOCO_E2E_BARRIER``: a directory; at train start the node writes ``<name>.ready`` there
  (``DILOCO_E2E_BARRIER_NAME``, default its node id) and waits (at most
  ``DILOCO_E2E_BARRIER_S``, default 120 s) for a ``go`` file, so the
  test starts every node's training together however long each process took to start.
"""

from __future__ import annotations

import os
import time
from typing import Any

from speedtronic import hookimpl

STEP_SLEEP = float(os.environ.get("DILOCO_E2E_STEP_SLEEP", "0") or 0)
UPLOAD_STEP = int(os.environ.get("DILOCO_E2E_UPLOAD_STEP", "-1") or -1)
UPLOAD_DELAY = float(os.environ.get("DILOCO_E2E_UPLOAD_DELAY", "0") or 0)
FAIL_STEP = int(os.environ.get("DILOCO_E2E_FAIL_UPLOAD_STEP", "-1") or -1)
UPLOAD_AFTER = os.environ.get("DILOCO_E2E_UPLOAD_AFTER")
HOLD_LATER = os.environ.get("DILOCO_E2E_HOLD_LATER") == "1"
HOLD_S = float(os.environ.get("DILOCO_E2E_HOLD_S", "120") or 120)
BARRIER = os.environ.get("DILOCO_E2E_BARRIER")
BARRIER_S = float(os.environ.get("DILOCO_E2E_BARRIER_S", "120") or 120)
BARRIER_NAME = os.environ.get("DILOCO_E2E_BARRIER_NAME")

if UPLOAD_STEP >= 0 or FAIL_STEP >= 0:
    from speedtronic_diloco.transports.base import PermanentTransportError
    from speedtronic_diloco.transports.shared_dir import SharedDirectoryTransport

    _real_upload = SharedDirectoryTransport.upload_delta

    def _hold(until: Any) -> None:
        deadline = time.monotonic() + HOLD_S
        while not until() and time.monotonic() < deadline:
            time.sleep(0.05)

    def _is_latest(checkpoint: str) -> bool:
        """``latest.json`` beside ``checkpoint`` names it or a later step."""
        from pathlib import Path

        from speedtronic.checkpoint import step_of
        from speedtronic.checkpoint.reader import CheckpointReader

        path = Path(checkpoint)
        target = CheckpointReader(path.parent).pointer_target()
        named = -1 if target is None else step_of(target.name)
        wanted = step_of(path.name)
        return named is not None and wanted is not None and named >= wanted

    def _upload_delta(self: Any, node_id: str, local_step: int, source: Any) -> None:
        if local_step in (UPLOAD_STEP, FAIL_STEP):
            time.sleep(UPLOAD_DELAY)
            if UPLOAD_AFTER:
                _hold(lambda: _is_latest(UPLOAD_AFTER))
        elif HOLD_LATER and local_step > max(UPLOAD_STEP, FAIL_STEP):
            _hold(lambda: False)
        if local_step == FAIL_STEP:
            raise PermanentTransportError("injected upload failure (diloco_e2e_plugin)")
        _real_upload(self, node_id, local_step, source)

    SharedDirectoryTransport.upload_delta = _upload_delta  # type: ignore[method-assign]


@hookimpl(trylast=True)
def on_train_start(trainer: Any) -> None:
    if not BARRIER:
        return
    from pathlib import Path

    barrier = Path(BARRIER)
    name = BARRIER_NAME or trainer.config.plugins["distributed"].node_id
    (barrier / f"{name}.ready").write_text("ready")
    deadline = time.monotonic() + BARRIER_S
    while not (barrier / "go").exists() and time.monotonic() < deadline:
        time.sleep(0.05)


@hookimpl(tryfirst=True)
def after_optimizer_step(trainer: Any, step: int) -> None:
    if STEP_SLEEP:
        time.sleep(STEP_SLEEP)
