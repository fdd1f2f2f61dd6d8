"""Cautious masking around any optimizer (Liang et al., "Cautious Optimizers", 2024).

After the base optimizer has stepped, each parameter's update ``delta = new - old`` is compared
with the gradient it was computed from. A component that moves *with* the gradient (``delta *
grad >= 0``: uphill, or no information) is undone; the components that move against it (downhill)
are kept and multiplied by ``numel / kept`` (one over the kept fraction, floored at 1e-3), so the
update's overall size per tensor stays about what the base optimizer intended.

Weight decay: for ``torch.optim.AdamW`` and ``torch.optim.Muon`` (also inside a
:class:`~speedtronic.optim.combined.CombinedOptimizer`) the wrapper applies their decoupled
weight decay itself, outside the mask, as the paper does. Any other optimizer is a black box: the
mask sees its *complete* update, decoupled weight decay included, so decay can be masked (and
rescaled) with the gradient step. The wrapper assumes minimisation (no ``maximize=True``).

The wrapper keeps no state of its own: ``state_dict`` is the base optimizer's, so a checkpoint
saved with ``optimizer.cautious`` off resumes with it on and the other way round.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from speedtronic.optim.combined import CombinedOptimizer, closure_loss, reset_optimizer_state

__all__ = ["CautiousOptimizer", "cautious_mask_"]

# Floor of the kept fraction: a tensor where almost everything is masked gets at most this
# much amplification of what is left.
MIN_KEPT_FRACTION = 1e-3


def _decoupled_decay_types() -> tuple[type, ...]:
    """Optimizers whose weight decay is ``p *= 1 - lr * wd`` before a decay-free update."""
    muon = getattr(torch.optim, "Muon", None)
    return (torch.optim.AdamW,) if muon is None else (torch.optim.AdamW, muon)


def cautious_mask_(
    param: torch.Tensor, before: torch.Tensor, grad: torch.Tensor, decay: Any = None
) -> None:
    """Replace ``param``'s update since ``before`` by its cautious version, in place.

    ``decay`` (a factor like ``1 - lr * wd``) scales ``before`` outside the mask. ``before`` is
    consumed (it becomes the result). No host synchronisation.
    """
    delta = param - before
    keep = (delta * grad) < 0
    kept_fraction = keep.float().mean().clamp_min(MIN_KEPT_FRACTION)
    delta.mul_(keep).div_(kept_fraction)
    if decay is not None:
        before.mul_(decay)
    param.copy_(before.add_(delta))


class CautiousOptimizer(torch.optim.Optimizer):
    """``base`` with cautious masking applied to every step (see the module docstring)."""

    def __init__(self, base: torch.optim.Optimizer) -> None:
        if not isinstance(base, torch.optim.Optimizer):
            raise TypeError(f"CautiousOptimizer wraps a torch.optim.Optimizer, got {type(base)}")
        self.base = base
        # The base owns param groups and state; __setstate__ installs defaults and hook tables
        # without giving this wrapper a second copy of either.
        super().__setstate__({"defaults": base.defaults})

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """The base optimizer's groups (live: a scheduler's lr writes reach the base)."""
        return self.base.param_groups

    @property
    def state(self) -> Any:  # type: ignore[override]
        """The base optimizer's per-parameter state."""
        return self.base.state

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group to the base optimizer."""
        self.base.add_param_group(param_group)

    def _leaves(self) -> Iterator[torch.optim.Optimizer]:
        if isinstance(self.base, CombinedOptimizer):
            yield from self.base.optimizers.values()
        else:
            yield self.base

    def _take_decay(self) -> list[tuple[dict[str, Any], Any]]:
        """Zero the weight decay of groups whose decay this wrapper applies itself."""
        taken = []
        known = _decoupled_decay_types()
        for leaf in self._leaves():
            if type(leaf) not in known:
                continue
            for group in leaf.param_groups:
                if group.get("weight_decay"):
                    taken.append((group, group["weight_decay"]))
                    group["weight_decay"] = 0.0
        return taken

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Step the base optimizer, then mask and rescale the update per tensor."""
        loss = closure_loss(closure)
        # The grads are held by reference: torch's optimizers do not modify p.grad in place.
        tracked = [
            (p, p.detach().clone(), p.grad)
            for group in self.param_groups
            for p in group["params"]
            if p.grad is not None
        ]
        taken = self._take_decay()
        try:
            self.base.step()
        finally:
            for group, weight_decay in taken:
                group["weight_decay"] = weight_decay
        # The decay these optimizers would have applied before their update, outside the mask.
        decay = {
            id(p): 1 - group["lr"] * weight_decay
            for group, weight_decay in taken
            for p in group["params"]
        }
        for param, before, grad in tracked:
            cautious_mask_(param, before, grad, decay.get(id(param)))
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or drop) the base optimizer's gradients."""
        self.base.zero_grad(set_to_none=set_to_none)

    def reset_state(self) -> None:
        """Forget the base optimizer's per-parameter state."""
        reset_optimizer_state(self.base)

    def state_dict(self) -> dict[str, Any]:
        """The base optimizer's state dict (the wrapper has no state)."""
        return self.base.state_dict()

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore the base optimizer's state."""
        self.base.load_state_dict(state_dict)  # type: ignore[arg-type]

    def __repr__(self) -> str:
        return f"CautiousOptimizer({self.base!r})"
