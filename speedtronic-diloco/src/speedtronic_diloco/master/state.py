"""The master's persisted state (:class:`OuterState`) and its one codec.

The same encoding goes to the state file (``<state_dir>/outer_state.safetensors``: global
weights and momentum as tensors, everything else as JSON strings in the safetensors metadata,
no pickle) and to the trainer checkpoint (the same strings under ``meta``, the same tensors
under ``global`` and ``momentum``), so a master resumed from either continues exactly: outer
step, momentum, ledger, rejections, signatures of accepted deltas, fragment counters and the
published step.

:func:`from_checkpoint` also reads the checkpoint form of the previous release (a dict with
``outer_step``, ``global``, ``momentum``, ``processed``...).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from speedtronic_diloco.ledger import DeltaLedger
from speedtronic_diloco.master.fragments import MasterFragments
from speedtronic_diloco.tensors import TensorDict, TensorFileError, load_tensors, save_tensors
from speedtronic_diloco.transports.base import FragmentFile, PermanentTransportError

__all__ = [
    "CHECKPOINT_FORMAT",
    "KEEP_REJECTIONS",
    "KEEP_SIGNATURES",
    "NORM_HISTORY",
    "STATE_FILE",
    "STATE_FORMAT",
    "OuterState",
    "decode",
    "encode",
    "from_checkpoint",
    "load_state",
    "save_state",
    "to_checkpoint",
]

STATE_FILE = "outer_state.safetensors"
STATE_FORMAT = "1"
CHECKPOINT_FORMAT = "outer_state/1"
NORM_HISTORY = 32  # accepted contribution norms the outlier rule takes its median of
KEEP_REJECTIONS = 200  # rejection records kept
KEEP_SIGNATURES = 256  # signatures of accepted deltas remembered against replays


@dataclass
class OuterState:
    """Everything a successor master needs to continue exactly where this one stopped."""

    outer_step: int = 0
    global_state: TensorDict | None = None
    momentum: TensorDict = field(default_factory=dict)
    processed: DeltaLedger = field(default_factory=DeltaLedger)
    published_step: int = -1
    norm_history: list[float] = field(default_factory=list)
    rejections: list[dict[str, Any]] = field(default_factory=list)
    halted: str | None = None  # why the loop stopped publishing (a bad candidate), or None
    signatures: list[str] = field(default_factory=list)
    fragments: MasterFragments = field(default_factory=MasterFragments.unfragmented)
    rolled_back: dict[str, Any] | None = None  # the last `diloco rollback` that made this state

    def trimmed(self) -> OuterState:
        """Bounded lists: the newest norms, rejections and signatures only."""
        self.norm_history = self.norm_history[-NORM_HISTORY:]
        self.rejections = self.rejections[-KEEP_REJECTIONS:]
        self.signatures = self.signatures[-KEEP_SIGNATURES:]
        return self


def encode(state: OuterState, node_id: str) -> tuple[TensorDict, dict[str, str]]:
    """``(tensors, metadata strings)`` of ``state``."""
    tensors = {f"global/{k}": v for k, v in (state.global_state or {}).items()}
    tensors.update({f"momentum/{k}": v for k, v in state.momentum.items()})
    meta = {
        "format": STATE_FORMAT,
        "node_id": node_id,
        "outer_step": str(state.outer_step),
        "published_step": str(state.published_step),
        **state.processed.state_meta(),
        "norm_history": json.dumps(state.norm_history[-NORM_HISTORY:]),
        "rejections": json.dumps(state.rejections[-KEEP_REJECTIONS:]),
        "halted": state.halted or "",
        "signatures": json.dumps(state.signatures[-KEEP_SIGNATURES:]),
    }
    book = state.fragments
    if book.steps:
        saved: dict[str, Any] = {"steps": book.steps, "versions": book.versions}
        if any(entry is not None for entry in book.files):
            saved["files"] = [None if e is None else e.to_json() for e in book.files]
        meta["fragment_state"] = json.dumps(saved)
    if state.rolled_back is not None:
        meta["rolled_back"] = json.dumps(state.rolled_back)
    return tensors, meta


def decode(tensors: Mapping[str, Any], meta: Mapping[str, str]) -> OuterState:
    """The state :func:`encode` wrote; ValueError (or KeyError, TypeError) when malformed."""
    if meta.get("format") != STATE_FORMAT:
        raise ValueError(f"unknown format {meta.get('format')!r}")
    saved = dict(json.loads(meta.get("fragment_state") or "{}"))
    rolled = json.loads(meta.get("rolled_back") or "null")
    return OuterState(
        outer_step=int(meta["outer_step"]),
        global_state=_prefixed(tensors, "global/"),
        momentum=_prefixed(tensors, "momentum/"),
        processed=DeltaLedger.from_state_meta(meta),
        published_step=int(meta.get("published_step", -1)),
        norm_history=[float(n) for n in _listed(meta, "norm_history")],
        rejections=[r for r in _listed(meta, "rejections") if isinstance(r, dict)],
        halted=meta.get("halted") or None,
        signatures=[str(s) for s in _listed(meta, "signatures")],
        fragments=MasterFragments.unfragmented(
            steps=[int(s) for s in saved.get("steps") or ()],
            versions=[int(s) for s in saved.get("versions") or ()],
            files=_files_from_json(saved.get("files")),
        ),
        rolled_back=rolled if isinstance(rolled, dict) else None,
    )


def save_state(path: str | Path, state: OuterState, node_id: str) -> Path:
    """Write ``state`` to ``path`` atomically."""
    tensors, meta = encode(state, node_id)
    return save_tensors(path, tensors, meta)


def load_state(path: str | Path) -> OuterState:
    """The state in ``path``; TensorFileError (naming the file) when it is unreadable."""
    tensors, meta = load_tensors(path)
    try:
        return decode(tensors, meta)
    except (KeyError, ValueError, TypeError) as exc:
        raise TensorFileError(f"{path}: not a master state file ({exc})") from None


def to_checkpoint(state: OuterState, node_id: str) -> dict[str, Any]:
    """``state`` for a trainer checkpoint: the state file's strings under ``meta``, its
    tensors as the ``global`` and ``momentum`` dicts, and the outer step (for readers)."""
    tensors, meta = encode(state, node_id)
    return {
        "format": CHECKPOINT_FORMAT,
        "outer_step": state.outer_step,
        "global": _prefixed(tensors, "global/"),
        "momentum": _prefixed(tensors, "momentum/"),
        "meta": meta,
    }


def from_checkpoint(data: Mapping[str, Any]) -> OuterState:
    """The state :func:`to_checkpoint` wrote, or the previous release's checkpoint dict."""
    if data.get("format") == CHECKPOINT_FORMAT:
        tensors = {f"global/{k}": v for k, v in (data.get("global") or {}).items()}
        tensors.update({f"momentum/{k}": v for k, v in (data.get("momentum") or {}).items()})
        return decode(tensors, dict(data.get("meta") or {}))
    return OuterState(  # the previous release: no rejections, signatures or published step
        outer_step=int(data.get("outer_step", 0)),
        global_state=dict(data.get("global") or {}) or None,
        momentum=dict(data.get("momentum") or {}),
        processed=DeltaLedger.from_json(data.get("processed")),
        norm_history=[float(n) for n in data.get("norm_history") or ()],
        halted=data.get("halted") or None,
        fragments=MasterFragments.unfragmented(
            steps=[int(s) for s in data.get("fragment_steps") or ()],
            versions=[int(s) for s in data.get("fragment_versions") or ()],
            files=_files_from_json(data.get("fragment_files")),
        ),
    )


def _prefixed(tensors: Mapping[str, Any], prefix: str) -> TensorDict:
    return {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}


def _listed(meta: Mapping[str, str], key: str) -> list[Any]:
    value = json.loads(meta.get(key) or "[]")
    if not isinstance(value, list):
        raise ValueError(f"{key} is not a list")
    return value


def _files_from_json(data: Any) -> list[FragmentFile | None]:
    """Saved fragment file entries; an unreadable one is None (published again)."""
    if not isinstance(data, list):
        return []
    out: list[FragmentFile | None] = []
    for entry in data:
        try:
            out.append(None if entry is None else FragmentFile.from_json(entry, STATE_FILE))
        except PermanentTransportError:
            out.append(None)
    return out
