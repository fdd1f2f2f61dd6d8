"""Shared test setup: no network, no user caches, and tests/ importable (hub_emulator)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

TESTS = Path(__file__).parent
sys.path.insert(0, str(TESTS))

# Keep every external service offline and out of the user's home directory.
os.environ.setdefault("WANDB_MODE", "offline")
os.environ.setdefault("WANDB_SILENT", "true")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
os.environ.setdefault("DO_NOT_TRACK", "1")
