"""The master's outer state in the store, so that a successor master (a standby that took the
lease, or a master started elsewhere with ``--take-over``) makes exactly the outer step the
dead one would have made: the same outer step number, momentum, ledger, rejection and norm
history, signatures of accepted deltas and fragment versions.

**Writing** (with each publication, by :class:`~speedtronic_diloco.master.publish.Publisher`):
the state of the outer step being published, in the one codec of
:mod:`speedtronic_diloco.master.state`, goes to an immutable side file
(``global/outer/s<step>-<sha12>.safetensors``, fenced by the lease) *before* the metadata (on
the Hub: in the publication's own commit); the metadata then names it
(``extra["outer_state"]``: file, sha256, size, outer step). The metadata is the commit
point: a master killed between the two leaves the previous metadata naming the previous
state, which is still in the store (the newest few are kept), so a reader always gets a
global and a state of the same outer step.

**Reading** (:func:`read_store_state`): the file the metadata names, at the metadata's
revision, at most its announced size (itself bounded by the global's size) and checked by
sha256; its outer step must be the metadata's and its tensors must be the global's names and
shapes. It is an untrusted file: anything else is one warning and ``None`` (the successor
then continues from the global with its momentum restarted, as before).
"""

from __future__ import annotations

import contextlib
import logging
import re
from pathlib import Path
from typing import Any

from speedtronic.checkpoint.fileio import sha256_file
from speedtronic.errors import TransportError
from speedtronic_diloco.master.state import OuterState, decode
from speedtronic_diloco.tensors import TensorDict, TensorFileError, load_tensors, save_tensors
from speedtronic_diloco.transports.base import GlobalMetadata, Lease, Transport
from speedtronic_diloco.transports.side_files import (
    OUTER_STATE_DIR,
    check_side_path,
    outer_state_path,
    side_files_of,
)

__all__ = [
    "KEEP_STATES",
    "STATE_ENTRY",
    "put_store_state",
    "read_store_state",
    "state_limit",
    "stores_state",
]

log = logging.getLogger("speedtronic.diloco.outer")

STATE_ENTRY = "outer_state"
"""The key of the metadata's ``extra`` that names the outer state of its outer step."""

KEEP_STATES = 3
"""Outer state files kept in the store, the one being written included: besides it, the one
the metadata names and room for an orphan of a publication that failed after its state."""

_STEP = re.compile(r"/s(\d{8})-")


def stores_state(transport: Transport) -> bool:
    """True when ``transport`` keeps side files (the outer state goes to the store)."""
    return side_files_of(transport) is not None


def put_store_state(
    transport: Transport,
    encoded: tuple[TensorDict, dict[str, str]],
    outer_step: int,
    directory: Path,
    fence: Lease | None,
) -> dict[str, Any]:
    """Write the encoded state of ``outer_step`` to the store (fenced; older state files
    beyond :data:`KEEP_STATES` are deleted with it) and return its metadata entry."""
    files = side_files_of(transport)
    assert files is not None
    directory.mkdir(parents=True, exist_ok=True)
    local = directory / f"outer_state_{outer_step:08d}.safetensors"
    try:
        save_tensors(local, *encoded)
        sha = sha256_file(local)
        path = outer_state_path(outer_step, sha)
        existing = sorted(files.list_side_files(OUTER_STATE_DIR), key=lambda e: _step(e[0]))
        keep = {name for name, _ in existing[-(KEEP_STATES - 1) :]}
        files.write_side_file(path, local, fence=fence, keep=keep, with_publication=True)
        return {"file": path, "sha256": sha, "size": local.stat().st_size, "outer_step": outer_step}
    finally:
        with contextlib.suppress(FileNotFoundError):
            local.unlink()


def state_limit(metadata: GlobalMetadata) -> int:
    """The largest outer state file accepted for ``metadata``'s global: the weights and their
    momentum, twice over for bf16-published globals, plus room for the JSON fields."""
    weights = metadata.size + sum(entry.size for entry in metadata.fragment_files)
    return 4 * weights + (16 << 20)


def read_store_state(
    transport: Transport,
    metadata: GlobalMetadata,
    directory: Path,
    reference: TensorDict | None = None,
) -> OuterState | None:
    """The outer state ``metadata`` names, checked (see the module docstring); None (with a
    warning when it is unusable) when there is none."""
    entry = metadata.extra.get(STATE_ENTRY) if isinstance(metadata.extra, dict) else None
    if entry is None or not stores_state(transport):
        return None
    files = side_files_of(transport)
    assert files is not None
    where = f"{transport.description}: the outer state of outer step {metadata.outer_step}"
    local = directory / f"store_outer_state_{metadata.outer_step:08d}.safetensors"
    try:
        path, sha, size, step = _entry(entry, metadata)
        directory.mkdir(parents=True, exist_ok=True)
        files.read_side_file(path, local, size=size, sha256=sha, revision=metadata.revision)
        tensors, meta = load_tensors(local)
        state = decode(tensors, meta)
        _check(state, step, reference)
    except (TransportError, TensorFileError, KeyError, ValueError, TypeError) as exc:
        log.warning("%s is not usable (%s); continuing from the global alone", where, exc)
        return None
    finally:
        with contextlib.suppress(FileNotFoundError):
            local.unlink()
    state.published_step = metadata.outer_step
    return state


def _entry(entry: Any, metadata: GlobalMetadata) -> tuple[str, str, int, int]:
    if not isinstance(entry, dict):
        raise ValueError("extra.outer_state is not an object")
    path = check_side_path(str(entry.get("file")))
    sha, size, step = str(entry.get("sha256", "")), int(entry["size"]), int(entry["outer_step"])
    if not re.fullmatch(r"[0-9a-f]{64}", sha) or not path.startswith(f"{OUTER_STATE_DIR}/"):
        raise ValueError("bad file or sha256")
    if step != metadata.outer_step:
        raise ValueError(f"it names outer step {step}, the metadata {metadata.outer_step}")
    limit = state_limit(metadata)
    if not 0 < size <= limit:
        raise ValueError(f"size {size} is not within 1..{limit} bytes")
    return path, sha, size, step


def _check(state: OuterState, step: int, reference: TensorDict | None) -> None:
    """The state is of ``step`` and its tensors fit the global ``reference``."""
    if state.outer_step != step:
        raise ValueError(f"its outer_step is {state.outer_step}, not {step}")
    weights = state.global_state or {}
    if not weights:
        raise ValueError("it has no global weights")
    if reference is not None:
        if set(weights) != set(reference):
            raise ValueError("its tensors are not the global's")
        for name, tensor in weights.items():
            if tuple(tensor.shape) != tuple(reference[name].shape):
                raise ValueError(f"{name} has shape {tuple(tensor.shape)}")
    for name, tensor in state.momentum.items():
        if name not in weights or tensor.shape != weights[name].shape:
            raise ValueError(f"momentum {name} does not fit the global")


def _step(path: str) -> int:
    match = _STEP.search(path)
    return int(match.group(1)) if match else -1
