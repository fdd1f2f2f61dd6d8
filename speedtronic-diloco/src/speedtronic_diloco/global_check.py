"""Is a global safe to install? The check every reader of a store's global makes on the
weights themselves (a node installing it, a master adopting it, ``--global`` of ``eval``,
``export`` and ``generate``), after the transport checked size and sha256 and, with a key,
the signature.

An unsigned store can be written by anyone with write access, with a matching
``step_count.json``: size, sha256 and header prove nothing about the values. So, before
downloading, the size the metadata lists is bounded by what the reader's own weights
(``reference``) can take (:func:`size_limit`: 8 bytes per element, or more for a wider dtype,
plus a header allowance), and after it, tensor by tensor against those weights:

* **dtype**: a floating tensor must be in the model's dtype, or in bfloat16 when the file
  declares the ``bf16`` global codec (``codec: bf16`` in its header) and the model's tensor is
  float32 or float64; every other tensor in exactly the model's dtype.
* **finite after conversion**: values are cast to the model's dtype first, then checked, so
  float64 1e300 (finite) that becomes inf in a float32 model is refused.
* **update size**: the change from ``reference`` (L2 norm over the floating tensors, in
  float64) may be at most ``max_update_ratio`` x the norm of the reference's floating tensors:
  the rule the master applies to each new global it computes
  (:func:`~speedtronic_diloco.aggregation.candidate_problem`).

A failure is a :class:`GlobalRefusedError` whose ``reason`` is ``too_large``, ``dtype``,
``non_finite`` or ``update_too_large`` and whose message starts with the file's store path.
Tensors absent from the reference, or in another shape, are left to the installer (it skips
them).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping

import torch

from speedtronic.errors import TransportError
from speedtronic_diloco.tensors import TensorDict, is_floating

__all__ = [
    "HEADER_ALLOWANCE",
    "HEADER_PER_TENSOR",
    "GlobalRefusedError",
    "check_global_dtypes",
    "check_global_size",
    "check_update_size",
    "checked_global",
    "size_limit",
    "weights_norm",
]

#: Bytes a global file may take beyond its tensors' payload: the safetensors header (a tensor
#: table entry per tensor, the metadata, the signature).
HEADER_ALLOWANCE = 64 << 10
HEADER_PER_TENSOR = 512

#: Floating dtypes the ``bf16`` global codec may store a model's tensor in.
_BF16_SOURCES = (torch.float32, torch.float64)


class GlobalRefusedError(TransportError):
    """A global's weights are not safe to install; ``reason`` says which rule they break."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def size_limit(reference: Mapping[str, torch.Tensor]) -> int:
    """The most bytes a global file holding ``reference``'s tensors may take: each at 8 bytes
    per element (or its own element size when larger: a master may keep float32 weights for a
    bf16 model), plus the header allowance."""
    payload = sum(t.numel() * max(t.element_size(), 8) for t in reference.values())
    return payload + HEADER_ALLOWANCE + HEADER_PER_TENSOR * len(reference)


def check_global_size(listed: int, reference: Mapping[str, torch.Tensor], where: str) -> None:
    """Before a download: GlobalRefusedError (``too_large``) when the ``listed`` size of the
    global file ``where`` is more than ``reference``'s tensors can take (:func:`size_limit`):
    a forged file is never downloaded to disk nor loaded into memory."""
    limit = size_limit(reference)
    if listed > limit:
        raise GlobalRefusedError(
            "too_large",
            f"{where}: {listed} bytes listed, more than this model's weights can take ({limit})",
        )


def _matching(
    tensors: Mapping[str, torch.Tensor], reference: Mapping[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor, torch.Tensor]]:
    """The entries of ``tensors`` the reference has, in its shape (what gets installed)."""
    for name, tensor in tensors.items():
        mine = reference.get(name)
        if mine is not None and tuple(mine.shape) == tuple(tensor.shape):
            yield name, tensor, mine


def check_global_dtypes(
    tensors: Mapping[str, torch.Tensor],
    reference: Mapping[str, torch.Tensor],
    where: str,
    codec: str | None = None,
) -> TensorDict:
    """``tensors`` in the dtypes of ``reference`` (see the module docstring): GlobalRefusedError
    (``dtype`` or ``non_finite``) unless each is in an allowed dtype and finite once cast."""
    out = dict(tensors)
    for name, tensor, mine in _matching(tensors, reference):
        allowed = {mine.dtype}
        if codec == "bf16" and mine.dtype in _BF16_SOURCES:
            allowed.add(torch.bfloat16)
        if tensor.dtype not in allowed:
            raise GlobalRefusedError(
                "dtype",
                f"{where}: {name} is {tensor.dtype}, the model's is {mine.dtype}"
                + (" (or bfloat16 under the bf16 global codec)" if len(allowed) > 1 else ""),
            )
        if tensor.dtype != mine.dtype:
            tensor = tensor.to(mine.dtype)
        if is_floating(tensor) and not bool(torch.isfinite(tensor).all()):
            raise GlobalRefusedError(
                "non_finite", f"{where}: {name} has NaN or infinite values in {mine.dtype}"
            )
        out[name] = tensor
    return out


def weights_norm(reference: Mapping[str, torch.Tensor]) -> float:
    """The L2 norm of ``reference``'s floating tensors, in float64 (or complex128)."""
    size = 0.0
    for mine in reference.values():
        if is_floating(mine):
            wide = torch.promote_types(mine.dtype, torch.float64)
            size += float(torch.linalg.vector_norm(mine.to(wide))) ** 2
    return math.sqrt(size)


def check_update_size(
    tensors: Mapping[str, torch.Tensor],
    reference: Mapping[str, torch.Tensor],
    where: str,
    max_update_ratio: float,
    norm: float | None = None,
) -> None:
    """GlobalRefusedError (``update_too_large``) when ``tensors`` (already in the reference's
    dtypes) move the floating tensors of ``reference`` they hold by more than
    ``max_update_ratio`` x the norm of all of the reference's floating tensors (``norm``, when
    the caller knows it: :func:`weights_norm`)."""
    change = 0.0
    for _, tensor, mine in _matching(tensors, reference):
        if is_floating(mine):
            wide = torch.promote_types(mine.dtype, torch.float64)
            change += float(torch.linalg.vector_norm(tensor.to(wide) - mine.to(wide))) ** 2
    size = weights_norm(reference) if norm is None else norm
    change, size = math.sqrt(change), max(size, 1e-12)
    if not math.isfinite(change) or change > max_update_ratio * size:
        raise GlobalRefusedError(
            "update_too_large",
            f"{where}: it moves the weights by {change:.4g}, more than max_update_ratio "
            f"{max_update_ratio:g} x their norm {size:.4g}",
        )


def checked_global(
    tensors: Mapping[str, torch.Tensor],
    reference: Mapping[str, torch.Tensor],
    where: str,
    *,
    codec: str | None,
    max_update_ratio: float,
    norm: float | None = None,
) -> TensorDict:
    """:func:`check_global_dtypes` then :func:`check_update_size`: the tensors to install."""
    converted = check_global_dtypes(tensors, reference, where, codec)
    check_update_size(converted, reference, where, max_update_ratio, norm)
    return converted
