"""``optimizer.name: muon``: Muon on the hidden weight matrices, AdamW on everything else.

Muon (Keller Jordan, 2024; ``torch.optim.Muon`` since torch 2.9) replaces each 2-D update by an
approximately orthogonal matrix (Newton-Schulz iterations on the momentum), which treats a
weight matrix as a linear map rather than a bag of numbers. That only makes sense for the
matrices *inside* the network. Embeddings and the output head are looked up (or scored) one row
per token, so their rows are separate vectors; norms and biases are 1-D. Those stay with AdamW,
with their own learning rate (``optimizer.lr``) next to Muon's (``optimizer.muon.lr``).

Who goes where, by shape and role:

- Muon: trainable 2-D parameters not owned by an ``nn.Embedding`` and not the output head.
- AdamW: everything else, grouped for weight decay exactly as with ``optimizer.name: adamw``.

The output head is ``model.output_weight`` when the model has that attribute (a tied head is
the embedding anyway) and any module named ``lm_head``, ``head``, ``output``, ``output_head`` or
``classifier``. A custom model overrides all of this with ``optimizer_param_groups(config)``:
its groups go to Muon when they carry ``"optimizer": "muon"`` and to AdamW otherwise. The split
is logged at startup, one line per group with the first parameter names (all names at DEBUG).
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from torch import nn

from speedtronic.config import OptimizerConfig
from speedtronic.errors import ConfigError, SpeedtronicError
from speedtronic.optim.adamw import build_adamw, decay_groups, embedding_param_ids, log_groups
from speedtronic.optim.combined import CombinedOptimizer

__all__ = [
    "build_muon_optimizer",
    "is_hidden_matrix",
    "muon_class",
    "muon_param_groups",
    "output_head_param_ids",
]

log = logging.getLogger("speedtronic.optim")

MUON_MIN_TORCH = "2.9"
HEAD_MODULE_NAMES = frozenset({"lm_head", "head", "output", "output_head", "classifier"})


def muon_class() -> type[torch.optim.Optimizer]:
    """``torch.optim.Muon``, or a :class:`ConfigError` naming the torch version it needs."""
    muon = getattr(torch.optim, "Muon", None)
    if muon is None:
        raise ConfigError(
            f"needs torch >= {MUON_MIN_TORCH} (torch.optim.Muon); this is torch "
            f"{torch.__version__}. Upgrade torch or use `optimizer.name: adamw`",
            "optimizer.name",
        )
    return muon


def output_head_param_ids(model: nn.Module) -> set[int]:
    """ids of the output head's parameters: ``model.output_weight`` and head-named modules."""
    ids: set[int] = set()
    head = getattr(model, "output_weight", None)
    if isinstance(head, torch.Tensor):
        ids.add(id(head))
    for name, module in model.named_modules():
        if name and name.rsplit(".", 1)[-1] in HEAD_MODULE_NAMES:
            ids.update(id(p) for p in module.parameters())
    return ids


def is_hidden_matrix(param: torch.Tensor, excluded: set[int]) -> bool:
    """True for a trainable 2-D parameter outside the embeddings and output head."""
    return param.requires_grad and param.ndim == 2 and id(param) not in excluded


def muon_param_groups(model: nn.Module, config: OptimizerConfig) -> list[dict[str, Any]]:
    """AdamW's decay groups minus the hidden matrices, then one ``muon`` group holding those.

    Every group has ``"optimizer"`` (``"adamw"`` or ``"muon"``), ``"group"`` (a label) and
    ``"param_names"``.
    """
    excluded = embedding_param_ids(model) | output_head_param_ids(model)
    named = [(n, p) for n, p in model.named_parameters() if is_hidden_matrix(p, excluded)]
    muon_ids = {id(p) for _, p in named}
    groups: list[dict[str, Any]] = []
    for group in decay_groups(model, config):
        kept = [
            (n, p)
            for n, p in zip(group["param_names"], group["params"], strict=True)
            if id(p) not in muon_ids
        ]
        if kept:
            groups.append(
                {
                    **group,
                    "params": [p for _, p in kept],
                    "param_names": [n for n, _ in kept],
                    "optimizer": "adamw",
                }
            )
    if named:
        groups.append(
            {
                "params": [p for _, p in named],
                "param_names": [n for n, _ in named],
                "group": "muon",
                "optimizer": "muon",
            }
        )
    return groups


def _check_muon_group(group: dict[str, Any]) -> None:
    names = group.get("param_names") or [f"#{i}" for i in range(len(group["params"]))]
    for name, param in zip(names, group["params"], strict=False):
        if param.ndim != 2:
            raise SpeedtronicError(
                f"optimizer_param_groups put parameter {name} (shape {list(param.shape)}) in a "
                "Muon group; Muon takes 2-D matrices only"
            )


def build_muon_optimizer(
    model: nn.Module, config: OptimizerConfig, device: torch.device
) -> CombinedOptimizer:
    """Muon over the hidden matrices plus AdamW over the rest, as one optimizer."""
    muon = muon_class()
    custom = getattr(model, "optimizer_param_groups", None)
    groups = custom(config) if callable(custom) else muon_param_groups(model, config)
    muon_groups = [g for g in groups if g.get("optimizer") == "muon"]
    adamw_groups = [g for g in groups if g.get("optimizer") != "muon"]
    parts: dict[str, torch.optim.Optimizer] = {}
    if adamw_groups:
        parts["adamw"] = build_adamw(adamw_groups, config, device)
    if muon_groups:
        for group in muon_groups:
            _check_muon_group(group)
        options = config.muon
        parts["muon"] = muon(
            muon_groups,
            lr=options.lr,
            momentum=options.momentum,
            nesterov=options.nesterov,
            ns_steps=options.ns_steps,
            weight_decay=options.weight_decay,
            adjust_lr_fn=options.adjust_lr_fn,
        )
    else:
        log.warning(
            "optimizer.name is muon but no parameter qualifies for Muon (%s); every parameter "
            "uses AdamW",
            "no group of optimizer_param_groups() has 'optimizer': 'muon'"
            if callable(custom)
            else "no trainable 2-D matrix outside the embeddings and output head",
        )
    for part in parts.values():
        log_groups(part)
        for group in part.param_groups:
            log.debug(
                "%s group %s: %s",
                type(part).__name__,
                group.get("group", "?"),
                ", ".join(group.get("param_names") or []),
            )
    return CombinedOptimizer(parts)
