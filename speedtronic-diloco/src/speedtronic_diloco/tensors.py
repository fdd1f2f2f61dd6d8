"""Model state as plain CPU tensors: snapshots, pseudo-gradients, installation, files.

Floating (and complex) tensors take part in deltas and the outer optimizer; integer and boolean
buffers travel with the global weights but are never differenced or averaged.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn

from speedtronic.checkpoint.fileio import atomic_write_with
from speedtronic.errors import SpeedtronicError

log = logging.getLogger("speedtronic.diloco")

TensorDict = dict[str, torch.Tensor]


class StateMismatchError(SpeedtronicError, ValueError):
    """Two states that should line up (baseline and model, delta and global) do not."""


class TensorFileError(SpeedtronicError):
    """A safetensors file is unreadable or malformed."""


def is_floating(tensor: torch.Tensor) -> bool:
    """True for tensors that deltas and the outer optimizer act on."""
    return tensor.is_floating_point() or tensor.is_complex()


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype to do arithmetic in: at least float32, complex stays complex."""
    return torch.promote_types(dtype, torch.float32)


def cpu_state_dict(state: Mapping[str, torch.Tensor]) -> TensorDict:
    """Detached, contiguous CPU copies that later training steps cannot change."""
    out: TensorDict = {}
    for name, tensor in state.items():
        copy = tensor.detach().to("cpu", copy=True)
        out[name] = copy.contiguous()
    return out


def floating_only(state: Mapping[str, torch.Tensor]) -> TensorDict:
    """The floating entries of ``state``."""
    return {k: v for k, v in state.items() if is_floating(v)}


@dataclass(frozen=True)
class Mismatch:
    """How a tensor dict differs from its reference: keys missing or extra (the first few,
    sorted), else the first tensor whose shape differs."""

    missing: tuple[str, ...] = ()
    extra: tuple[str, ...] = ()
    name: str = ""
    shape: tuple[int, ...] = ()
    expected: tuple[int, ...] = ()


def mismatch(
    tensors: Mapping[str, Any], reference: Mapping[str, Any], limit: int = 5
) -> Mismatch | None:
    """None when ``tensors`` has exactly the keys of ``reference``, each in its shape (any
    tensors, or anything with a ``shape``)."""
    missing = sorted(reference.keys() - tensors.keys())[:limit]
    extra = sorted(tensors.keys() - reference.keys())[:limit]
    if missing or extra:
        return Mismatch(tuple(missing), tuple(extra))
    for name, expected in reference.items():
        shape = tuple(tensors[name].shape)
        if shape != tuple(expected.shape):
            return Mismatch(name=name, shape=shape, expected=tuple(expected.shape))
    return None


def compute_pseudo_gradient(
    baseline: Mapping[str, torch.Tensor], current: Mapping[str, torch.Tensor]
) -> TensorDict:
    """``baseline - current`` over the floating tensors: the direction the node moved, with
    the sign of a gradient. Raises StateMismatchError when keys or shapes differ."""
    base = floating_only(baseline)
    now = floating_only(current)
    problem = mismatch(now, base)
    if problem is not None and problem.name:
        raise StateMismatchError(
            f"{problem.name}: shape {problem.shape} differs from the baseline's {problem.expected}"
        )
    if problem is not None:
        raise StateMismatchError(
            f"model keys changed since the baseline (missing {list(problem.missing)}, new "
            f"{list(problem.extra)})"
        )
    return combine(base, now, sign=-1)


def combine(
    base: Mapping[str, torch.Tensor], *others: Mapping[str, torch.Tensor], sign: int
) -> TensorDict:
    """``base + sign * (others...)`` in the compute dtype, cast back once: over the floating
    tensors of ``base``, each term where an ``other`` has that name in the same shape; every
    other entry of ``base`` as it is."""
    out = dict(base)
    for name, value in base.items():
        terms = [o[name] for o in others if name in o and o[name].shape == value.shape]
        if not is_floating(value) or not terms:
            continue
        work = compute_dtype(value.dtype)
        total = value.to(work)
        for term in terms:
            total = total - term.to(work) if sign < 0 else total + term.to(work)
        out[name] = total.to(value.dtype)
    return out


def install_state(
    model: nn.Module, incoming: Mapping[str, torch.Tensor]
) -> tuple[list[str], list[str]]:
    """Load the entries of ``incoming`` whose key exists in ``model`` with the same shape.

    Missing keys, extra local keys and shape mismatches are kept/ignored instead of raising.
    Returns ``(installed, skipped)`` key lists.
    """
    local = model.state_dict()
    filtered: TensorDict = {}
    skipped: list[str] = []
    for name, tensor in incoming.items():
        target = local.get(name)
        if target is None or target.shape != tensor.shape:
            skipped.append(name)
            continue
        filtered[name] = tensor
    if skipped:
        log.warning(
            "global state: %d entries skipped (absent here or other shape), e.g. %s",
            len(skipped),
            skipped[:3],
        )
    with torch.no_grad():
        model.load_state_dict(filtered, strict=False)
    return sorted(filtered), skipped


def save_tensors(
    path: str | Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
) -> Path:
    """Write ``tensors`` as a safetensors file atomically (temp, fsync, rename)."""
    path = Path(path)
    data = {k: v.contiguous() for k, v in tensors.items()}
    meta = {k: str(v) for k, v in (metadata or {}).items()}
    atomic_write_with(path, lambda tmp: save_file(data, tmp, metadata=meta))
    return path


def load_tensors(path: str | Path) -> tuple[TensorDict, dict[str, str]]:
    """``(tensors, metadata)`` of a safetensors file; TensorFileError when it is unreadable."""
    try:
        with safe_open(str(path), framework="pt", device="cpu") as handle:
            metadata = dict(handle.metadata() or {})
            tensors = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise TensorFileError(f"{path}: not a readable safetensors file ({exc})") from None
    return tensors, metadata
