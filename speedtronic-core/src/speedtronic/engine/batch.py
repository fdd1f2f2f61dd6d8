"""What the loop needs to know about a batch and a model's output, from shapes and types only.

Any ``nn.Module`` that maps a batch to a loss works: a tensor, ``{"loss": ...}``, or
``(loss, ...)``. Dict batches are passed as keyword arguments and tuple batches as
``(inputs, labels)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from speedtronic.errors import SpeedtronicError

__all__ = [
    "aux_metrics",
    "batch_size_and_tokens",
    "call_model",
    "label_mode",
    "labels_as_inputs",
    "loss_of",
    "move_to",
    "shifts_internally",
]


def loss_of(output: Any) -> torch.Tensor:
    """Pick the scalar loss out of a model's output (tensor, ``{"loss"}`` mapping, or tuple)."""
    loss = _pick_loss(output)
    if loss.numel() != 1:
        raise SpeedtronicError(
            f"the model's loss must be a scalar, got a tensor of shape {list(loss.shape)}; "
            "reduce it (e.g. .mean()) inside the model"
        )
    return loss.reshape(())


def _pick_loss(output: Any) -> torch.Tensor:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, dict):
        if "loss" not in output:
            raise SpeedtronicError(
                "the model returned a dict without a 'loss' key; return a loss tensor, "
                "{'loss': ...}, or (loss, ...)"
            )
        return output["loss"]
    if isinstance(output, (tuple, list)) and output and isinstance(output[0], torch.Tensor):
        return output[0]
    raise SpeedtronicError(
        f"the model returned {type(output).__name__}; expected a loss tensor, {{'loss': ...}} "
        "or (loss, ...)"
    )


def call_model(model: Any, batch: Any) -> Any:
    """Dict batches go in as kwargs, (inputs, labels) tuples positionally, tensors as is."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, (tuple, list)):
        return model(*batch[:2])
    return model(batch)


def move_to(batch: Any, device: torch.device) -> Any:
    """``batch`` (tensor, or dict/list/tuple of them) on ``device``; other values unchanged."""
    non_blocking = device.type == "cuda"
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {k: move_to(v, device) for k, v in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(move_to(v, device) for v in batch)
    return batch


def batch_size_and_tokens(batch: Any) -> tuple[int, int]:
    """Samples and token positions in a micro-batch, from shapes only (no device sync)."""
    first = batch.get("input_ids") if isinstance(batch, dict) else None
    if first is None:
        if isinstance(batch, dict):
            first = next((v for v in batch.values() if isinstance(v, torch.Tensor)), None)
        elif isinstance(batch, (tuple, list)):
            first = batch[0]
        else:
            first = batch
    if not isinstance(first, torch.Tensor) or first.ndim == 0:
        return 1, 1
    return int(first.shape[0]), int(first.numel())


def shifts_internally(model: Any) -> bool:
    """True for a Hugging Face ``PreTrainedModel`` (found by class name, without importing
    transformers): such models shift ``labels`` themselves."""
    return any(
        cls.__name__ == "PreTrainedModel" and cls.__module__.startswith("transformers")
        for cls in type(model).__mro__
    )


def label_mode(configured: str | None, model: Any) -> str:
    """``data.labels``, or the model's natural choice when it is unset."""
    if configured is not None:
        return configured
    return "inputs" if shifts_internally(model) else "shifted"


def labels_as_inputs(batch: Any) -> Any:
    """A ``{"input_ids", "labels"}`` batch with ``labels = input_ids`` (the model shifts)."""
    if isinstance(batch, dict) and "input_ids" in batch and "labels" in batch:
        return {**batch, "labels": batch["input_ids"]}
    return batch


def aux_metrics(output: Any) -> dict[str, torch.Tensor]:
    """The model's extra scalars: 0-dim tensor entries of a mapping output besides ``loss``,
    and the entries of a ``metrics`` mapping inside it (tensors or numbers), detached and
    still on the device (no host sync)."""
    if not isinstance(output, Mapping):
        return {}
    found: dict[str, torch.Tensor] = {}
    for key, value in output.items():
        if key in ("loss", "metrics"):
            continue
        if isinstance(value, torch.Tensor) and value.ndim == 0:
            found[str(key)] = value.detach().float()
    extra = output.get("metrics")
    if isinstance(extra, Mapping):
        for key, value in extra.items():
            if isinstance(value, torch.Tensor) and value.numel() == 1:
                found[str(key)] = value.detach().float().reshape(())
            elif isinstance(value, (int, float)) and not isinstance(value, bool):
                found[str(key)] = torch.tensor(float(value))
    return found
