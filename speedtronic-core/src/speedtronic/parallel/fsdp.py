"""Sharded data parallel inside one machine: ``parallel.strategy: fsdp`` with PyTorch's FSDP2.

The engine is torch's own (:func:`torch.distributed.fsdp.fully_shard`, DTensor parameters);
this module only decides what it is applied to and how the trainer talks to it:

- :func:`find_units` picks the modules that become FSDP units of their own (``units: auto`` =
  the classes a model's ``_no_split_modules`` names, the Hugging Face convention the reference
  model follows too, else the class repeated in a ``ModuleList``);
- :func:`shard_model` applies activation checkpointing per unit, then ``fully_shard`` on
  every unit and on the root, over a one-dimensional mesh of all ranks (``compile`` is then
  applied per unit by :class:`speedtronic.engine.compile.CompiledModel`);
- :class:`ShardedRun` is what the trainer holds: gradient sync and resharding around
  accumulation micro-batches, and the global gradient norm over sharded gradients.

:func:`full_model_state` and :func:`load_full_model_state` move between a model (single
process, DDP or FSDP alike) and a plain full state dict on the CPU: what a DiLoCo node needs to
compute a pseudo-gradient and to install a global. :func:`state_bytes_per_rank` estimates what
``speedtronic validate`` reports.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from speedtronic.errors import ConfigError

__all__ = [
    "DTYPES",
    "ShardedRun",
    "StateBytes",
    "find_units",
    "full_model_state",
    "is_sharded",
    "load_full_model_state",
    "load_optimizer_state",
    "meta_shadow",
    "mixed_precision",
    "optimizer_state_by_name",
    "shard_model",
    "state_bytes_per_rank",
]

log = logging.getLogger("speedtronic.parallel")

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}
_UNITS_FIELD = "parallel.fsdp.units"


def is_sharded(model: nn.Module) -> bool:
    """True when ``fully_shard`` was applied to ``model`` (its parameters are DTensors)."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(model, FSDPModule)


def find_units(model: nn.Module, units: str | list[str] = "auto") -> list[nn.Module]:
    """The submodules of ``model`` that become FSDP units, innermost first (the order
    ``fully_shard`` must see them in). ``units`` is ``auto`` or a list of class names; a name
    that matches no module of ``model`` is a :class:`ConfigError`. ``auto`` finds nothing in a
    model without repeated blocks: then the root alone is one unit."""
    if units == "auto":
        names = _declared_units(model) or _repeated_block_classes(model)
        if not names:
            log.warning(
                "parallel.fsdp.units: auto found no transformer blocks in %s; the whole model "
                "is one FSDP unit (list its block classes in parallel.fsdp.units)",
                type(model).__name__,
            )
            return []
    else:
        names = list(units)
    present = {type(module).__name__ for module in model.modules()}
    missing = [name for name in names if name not in present]
    if units != "auto" and missing:
        shown = ", ".join(sorted(present)[:12])
        raise ConfigError(
            f"{', '.join(missing)} {'is' if len(missing) == 1 else 'are'} not a module class "
            f"of {type(model).__name__} (its classes: {shown})",
            _UNITS_FIELD,
        )
    wanted = set(names)
    found = [m for m in model.modules() if m is not model and type(m).__name__ in wanted]
    return list(reversed(found))


def _declared_units(model: nn.Module) -> list[str]:
    declared = getattr(model, "_no_split_modules", None)
    if isinstance(declared, (list, tuple, set)) and all(isinstance(n, str) for n in declared):
        return list(declared)
    return []


def _repeated_block_classes(model: nn.Module) -> list[str]:
    """Class names of the children of each ``ModuleList`` whose children share one class and
    hold parameters: the layer stack of most models."""
    names: list[str] = []
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) >= 1:
            kinds = {type(child) for child in module}
            if len(kinds) == 1 and any(True for _ in module[0].parameters()):
                name = next(iter(kinds)).__name__
                if name not in names:
                    names.append(name)
    return names


def mixed_precision(fsdp_config: Any, compute_dtype: torch.dtype | None) -> Any:
    """The ``MixedPrecisionPolicy`` for ``parallel.fsdp``: each unset dtype follows the run's
    precision (``compute_dtype`` None = fp32)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    default = compute_dtype or torch.float32
    param = DTYPES[fsdp_config.param_dtype] if fsdp_config.param_dtype else default
    reduce = DTYPES[fsdp_config.reduce_dtype] if fsdp_config.reduce_dtype else default
    # None keeps the sharded fp32 master weights as they are (no cast at all).
    return MixedPrecisionPolicy(
        param_dtype=None if param == torch.float32 else param,
        reduce_dtype=None if reduce == param else reduce,
    )


def shard_model(
    model: nn.Module,
    fsdp_config: Any,
    *,
    device: torch.device,
    world_size: int,
    compute_dtype: torch.dtype | None = None,
    activation_checkpointing: bool = False,
) -> list[nn.Module]:
    """Apply FSDP2 to ``model`` in place: per unit (see :func:`find_units`) activation
    checkpointing when asked, then ``fully_shard``; finally ``fully_shard`` on the root. Needs
    the process group to exist. Returns the units."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, fully_shard

    units = find_units(model, fsdp_config.units)
    kinds = ", ".join(sorted({type(u).__name__ for u in units})) or "none"
    if activation_checkpointing:
        from torch.distributed._composable import checkpoint

        for unit in units:
            checkpoint(unit)  # recompute each unit's activations in backward; FQNs unchanged
        if not units:
            log.warning("gradient_checkpointing: no FSDP units to recompute; training without")
    offload = None
    if fsdp_config.cpu_offload:
        if device.type == "cuda":
            offload = CPUOffloadPolicy()
        else:
            log.warning("parallel.fsdp.cpu_offload applies to CUDA only; ignored on %s", device)
    mesh = init_device_mesh(device.type, (world_size,))
    options: dict[str, Any] = {
        "mesh": mesh,
        "reshard_after_forward": fsdp_config.reshard_after_forward,
        "mp_policy": mixed_precision(fsdp_config, compute_dtype),
    }
    if offload is not None:
        options["offload_policy"] = offload
    for unit in units:
        fully_shard(unit, **options)
    fully_shard(model, **options)
    log.info(
        "fsdp: %d unit%s (%s) + root over %d ranks",
        len(units),
        "" if len(units) == 1 else "s",
        kinds,
        world_size,
    )
    return units


def meta_shadow(model: nn.Module) -> nn.Module | None:
    """A deep copy of ``model`` on the meta device (shapes only, nothing allocated), or None
    when it cannot be copied. Taken before :func:`shard_model`, it is what the FLOP count at
    train start runs on: the sharded model's forward gathers each unit's shards, a collective
    the counter's own copy of the model cannot take part in."""
    memo: dict[int, Any] = {}
    for param in model.parameters():
        meta = torch.empty_like(param, device="meta")
        memo[id(param)] = nn.Parameter(meta, requires_grad=param.requires_grad)
    for buffer in model.buffers():
        memo[id(buffer)] = torch.empty_like(buffer, device="meta")
    try:
        return copy.deepcopy(model, memo=memo)
    except Exception as exc:
        log.debug("no meta copy of %s to count FLOPs on: %s", type(model).__name__, exc)
        return None


@dataclass
class ShardedRun:
    """The trainer's handle on a sharded model: gradient sync across accumulation
    micro-batches and the gradient norm over shards. ``shadow`` is a meta-device copy of the
    model taken before it was sharded (:func:`meta_shadow`): what the FLOP count at train
    start runs on."""

    model: nn.Module
    units: list[nn.Module]
    shadow: nn.Module | None = None

    def before_backward(self, last: bool) -> None:
        """Before a micro-batch's backward: only the last one of an optimizer step
        reduce-scatters; before it, gradients accumulate unsharded and the gathered
        parameters stay gathered (no resharding between micro-batches)."""
        self.model.set_requires_gradient_sync(last)  # type: ignore[operator]
        self.model.set_reshard_after_backward(last)  # type: ignore[operator]

    @staticmethod
    def clip_grad_norm(parameters: Iterable[torch.Tensor], max_norm: float) -> torch.Tensor:
        """Clip to ``max_norm`` by the global L2 norm of every rank's gradient shards; returns
        that norm (a plain tensor, the same on every rank)."""
        params = [p for p in parameters if p.grad is not None]
        if not params:
            return torch.zeros(())
        norm = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
        if hasattr(norm, "full_tensor"):  # a DTensor of each rank's partial norm: sum them
            norm = norm.full_tensor()
        if max_norm != float("inf"):
            torch.nn.utils.clip_grads_with_norm_(params, max_norm, norm)
        return norm


def full_model_state(model: nn.Module, *, only_main: bool = False) -> dict[str, torch.Tensor]:
    """The whole model's state dict on the CPU: plain tensors, detached copies, the same keys
    as the unsharded model's ``state_dict()``. Works for a single-process, DDP or FSDP model
    alike; under FSDP every rank must call it (each tensor is all-gathered in turn, so the
    device holds at most one full tensor at a time). With ``only_main`` ranks other than 0 take
    part in the gathering but keep nothing and get ``{}`` (host memory for one copy only)."""
    import torch.distributed as dist

    keep = not only_main or not dist.is_initialized() or dist.get_rank() == 0
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if hasattr(tensor, "full_tensor"):
            tensor = tensor.full_tensor()
        if keep:
            out[name] = tensor.detach().to("cpu", copy=True)
    return out


def load_full_model_state(
    model: nn.Module, state: Mapping[str, torch.Tensor], *, from_main: bool = False
) -> None:
    """Load a full state dict (as :func:`full_model_state` returns) into ``model``, sharded or
    not; under FSDP every rank calls it and keeps only its shards. With ``from_main`` only rank
    0's ``state`` is read (others may pass ``{}``) and broadcast to the other ranks."""
    if not is_sharded(model):
        if from_main and torch.distributed.is_initialized():
            holder = [dict(state) if torch.distributed.get_rank() == 0 else None]
            torch.distributed.broadcast_object_list(holder, src=0)
            state = holder[0] or {}
        model.load_state_dict(dict(state))
        return
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(
        model,
        dict(state),
        options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=from_main),
    )


def load_optimizer_state(model: nn.Module, optimizer: torch.optim.Optimizer, state: Any) -> None:
    """Load an optimizer state dict with full tensors into ``optimizer``, whichever form it is
    in (``torch.optim``'s numbered parameters, or parameter names as a sharded checkpoint read
    whole gives) and whether ``model`` is sharded or not."""
    groups = state.get("param_groups") or [] if isinstance(state, Mapping) else []
    named = any(isinstance(p, str) for group in groups for p in group.get("params", []))
    if not named and not is_sharded(model):
        optimizer.load_state_dict(state)
        return
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_optimizer_state_dict,
    )

    if not named:
        state = optimizer_state_by_name(optimizer, model, state)
    set_optimizer_state_dict(
        model,
        optimizer,
        state,
        options=StateDictOptions(full_state_dict=is_sharded(model)),
    )


def optimizer_state_by_name(optimizer: torch.optim.Optimizer, model: nn.Module, state: Any) -> Any:
    """A ``torch.optim`` state dict (parameters numbered in the optimizer's order) with
    parameter names instead of numbers: the form ``set_optimizer_state_dict`` takes, so a
    checkpoint of a single-process or DDP run loads into a sharded one."""
    names = {id(p): n for n, p in model.named_parameters(remove_duplicate=False)}
    ordered = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    by_index = dict(enumerate(ordered))
    return {
        "state": {by_index[int(i)]: value for i, value in state.get("state", {}).items()},
        "param_groups": [
            {**group, "params": [by_index[int(i)] for i in group["params"]]}
            for group in state.get("param_groups", [])
        ],
    }


@dataclass(frozen=True)
class StateBytes:
    """Estimated bytes of training state one rank holds between steps, and the parameters it
    gathers for a while during forward and backward under FSDP (not part of ``total``)."""

    params: int
    grads: int
    optimizer: int
    gathered: int = 0

    @property
    def total(self) -> int:
        """Parameters + gradients + optimizer state."""
        return self.params + self.grads + self.optimizer


def state_bytes_per_rank(
    model: nn.Module,
    world_size: int,
    strategy: str,
    *,
    optimizer_slots: int = 2,
    units: list[nn.Module] | None = None,
) -> StateBytes:
    """What one rank holds of parameters, gradients and optimizer state (the parameters' own
    dtype, ``optimizer_slots`` tensors of that size per parameter: 2 for AdamW). ``ddp`` (or
    one rank): everything, on every rank. ``fsdp``: each tensor's dim-0 shard (FSDP2 pads dim
    0 up to a multiple of the world size); ``gathered`` adds the root's parameters and the two
    largest units (the one running and the one prefetched), unsharded for a while. Works on a
    model built on the meta device."""
    tensors = [p for p in model.parameters() if p.requires_grad]
    full = sum(p.numel() * p.element_size() for p in tensors)
    if strategy != "fsdp" or world_size <= 1:
        return StateBytes(full, full, full * optimizer_slots)
    shard = sum(_shard_numel(p, world_size) * p.element_size() for p in tensors)
    groups = units if units is not None else find_units(model, "auto")
    sizes = sorted(
        (sum(p.numel() * p.element_size() for p in unit.parameters()) for unit in groups),
        reverse=True,
    )
    gathered = full - sum(sizes) + sum(sizes[:2])
    return StateBytes(shard, shard, shard * optimizer_slots, gathered)


def _shard_numel(tensor: torch.Tensor, world_size: int) -> int:
    if tensor.dim() == 0:
        return tensor.numel()
    rows = -(-tensor.shape[0] // world_size)
    return rows * (tensor.numel() // max(tensor.shape[0], 1))
