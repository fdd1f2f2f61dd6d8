"""Model state as plain CPU tensors: snapshots, pseudo-gradients, installation, files.

Floating (and complex) tensors take part in deltas and the outer optimizer; integer and boolean
buffers travel with the global weights but are never differenced or averaged.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path

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


def compute_pseudo_gradient(
    baseline: Mapping[str, torch.Tensor], current: Mapping[str, torch.Tensor]
) -> TensorDict:
    """``baseline - current`` over the floating tensors: the direction the node moved, with
    the sign of a gradient. Raises StateMismatchError when keys or shapes differ."""
    base = floating_only(baseline)
    now = floating_only(current)
    if base.keys() != now.keys():
        missing = sorted(base.keys() - now.keys())[:5]
        extra = sorted(now.keys() - base.keys())[:5]
        raise StateMismatchError(
            f"model keys changed since the baseline (missing {missing}, new {extra})"
        )
    for name, before in base.items():
        after = now[name]
        if before.shape != after.shape:
            raise StateMismatchError(
                f"{name}: shape {tuple(after.shape)} differs from the baseline's "
                f"{tuple(before.shape)}"
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


def check_delta(delta: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]) -> None:
    """Raise StateMismatchError unless ``delta`` has exactly the floating keys and shapes of
    ``reference`` and only finite values."""
    expected = floating_only(reference)
    if delta.keys() != expected.keys():
        missing = sorted(expected.keys() - delta.keys())[:5]
        extra = sorted(delta.keys() - expected.keys())[:5]
        raise StateMismatchError(f"delta keys differ (missing {missing}, unexpected {extra})")
    for name, tensor in delta.items():
        if tensor.shape != expected[name].shape:
            raise StateMismatchError(
                f"{name}: delta shape {tuple(tensor.shape)} != {tuple(expected[name].shape)}"
            )
        if not is_floating(tensor):
            raise StateMismatchError(f"{name}: delta dtype {tensor.dtype} is not floating")
        if not bool(torch.isfinite(tensor).all()):
            raise StateMismatchError(f"{name}: delta has non-finite values")


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
