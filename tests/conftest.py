"""Shared test setup: no network, no user caches, pinned plugins, tests/ importable."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

TESTS = Path(__file__).parent

# A shell starts a background job (`pytest ... &`, no job control) with SIGINT ignored, and every
# child inherits that through exec: the graceful stop the tests send (SIGINT) would then do
# nothing. Catching SIGINT here instead makes children start with the default again.
if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
sys.path.insert(0, str(TESTS))

# Keep every external service offline and out of the user's home directory.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")

# Load the first-party plugins only, never whatever else happens to be installed here (as llm
# and datasette pin theirs); a test about discovery sets SPEEDTRONIC_LOAD_PLUGINS itself.
FIRST_PARTY_PLUGINS = "speedtronic-models,speedtronic-diloco,speedtronic-logging"
os.environ["SPEEDTRONIC_LOAD_PLUGINS"] = FIRST_PARTY_PLUGINS

# The suite runs training processes side by side (master + workers, CLI subprocesses) on small
# CI machines: one intra-op thread each avoids oversubscribing the cores. Subprocesses inherit
# the environment variable; this process sets torch directly.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

import torch  # noqa: E402  (after the thread environment is set)

torch.set_num_threads(1)
