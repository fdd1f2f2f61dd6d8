"""Several optimizers over disjoint parameters, driven as one ``torch.optim.Optimizer``.

The trainer, ``LambdaLR`` and ``GradScaler`` each expect a single optimizer with
``param_groups``, ``state``, ``step``, ``zero_grad`` and ``state_dict``. Muon, for example, only
takes 2-D matrices, so a Muon run is Muon for the hidden matrices plus AdamW for the rest; this
class makes that pair look like one optimizer.

``param_groups`` is the live concatenation of the parts' groups (the same dict objects), so a
scheduler that writes ``group["lr"]`` reaches the part that owns the group, and each group is
scheduled relative to its own initial lr. The state dict nests each part's own state dict under
its name, so it round-trips exactly through the checkpoint codec.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, MutableMapping
from typing import Any

import torch

from speedtronic.errors import CheckpointError

__all__ = ["CombinedOptimizer", "PartsState", "closure_loss", "reset_optimizer_state"]

_FORMAT = "combined_optimizer"


def closure_loss(closure: Callable[[], Any] | None) -> Any:
    """The loss of an optimizer ``step``'s closure, evaluated with gradients on (``step`` runs
    under ``no_grad``), or None without one: what every optimizer here does first."""
    if closure is None:
        return None
    with torch.enable_grad():
        return closure()


class PartsState(MutableMapping):
    """The per-parameter state of every part, seen as one mapping (what ``.state`` returns)."""

    def __init__(self, parts: Mapping[str, torch.optim.Optimizer]) -> None:
        self._parts = parts

    def _owner(self, param: Any) -> torch.optim.Optimizer:
        for part in self._parts.values():
            if param in part.state or any(
                param is p for group in part.param_groups for p in group["params"]
            ):
                return part
        raise KeyError(param)

    def __getitem__(self, param: Any) -> Any:
        return self._owner(param).state[param]

    def __setitem__(self, param: Any, value: Any) -> None:
        self._owner(param).state[param] = value

    def __delitem__(self, param: Any) -> None:
        for part in self._parts.values():
            if param in part.state:
                del part.state[param]
                return
        raise KeyError(param)

    def __iter__(self) -> Iterator[Any]:
        for part in self._parts.values():
            yield from list(part.state)

    def __len__(self) -> int:
        return sum(len(part.state) for part in self._parts.values())

    def clear(self) -> None:
        """Forget every part's state."""
        for part in self._parts.values():
            part.state.clear()


def reset_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Forget per-parameter state (Adam moments, step counts, momentum buffers), through the
    optimizer's ``reset_state`` if it has one."""
    reset = getattr(optimizer, "reset_state", None)
    if callable(reset):
        reset()
    else:
        optimizer.state.clear()


class CombinedOptimizer(torch.optim.Optimizer):
    """Named optimizers over disjoint parameters, stepped, zeroed and saved together.

    ``optimizers`` maps a stable name (it keys the state dict) to each part, in the order their
    groups appear in ``param_groups``.
    """

    def __init__(self, optimizers: Mapping[str, torch.optim.Optimizer]) -> None:
        if not optimizers:
            raise ValueError("CombinedOptimizer needs at least one optimizer")
        seen: set[int] = set()
        for name, part in optimizers.items():
            for group in part.param_groups:
                for param in group["params"]:
                    if id(param) in seen:
                        raise ValueError(f"a parameter is in two parts (again in {name!r})")
                    seen.add(id(param))
        self.optimizers: dict[str, torch.optim.Optimizer] = dict(optimizers)
        # Optimizer.__init__ would give this object param groups and state of its own; the
        # parts own those. __setstate__ installs the rest (defaults, hook tables, step hooks).
        super().__setstate__({"defaults": {}})

    @property
    def param_groups(self) -> list[dict[str, Any]]:  # type: ignore[override]
        """Every part's groups, in part order (live: writes reach the parts)."""
        return [group for part in self.optimizers.values() for group in part.param_groups]

    @property
    def state(self) -> PartsState:  # type: ignore[override]
        """Every part's per-parameter state, as one mapping."""
        return PartsState(self.optimizers)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Not supported here: add the group to the part that should own it."""
        raise TypeError(
            "add a parameter group to one of CombinedOptimizer.optimizers, not to the combination"
        )

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """One step of every part (the closure, if any, is evaluated once)."""
        loss = closure_loss(closure)
        for part in self.optimizers.values():
            part.step()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero (or drop) the gradients of every part's parameters."""
        for part in self.optimizers.values():
            part.zero_grad(set_to_none=set_to_none)

    def reset_state(self) -> None:
        """Forget every part's per-parameter state (moments, momentum buffers, step counts)."""
        for part in self.optimizers.values():
            reset_optimizer_state(part)

    def state_dict(self) -> dict[str, Any]:
        """``{"format": ..., "parts": {name: part.state_dict()}}``."""
        return {
            "format": _FORMAT,
            "parts": {name: part.state_dict() for name, part in self.optimizers.items()},
        }

    def load_state_dict(self, state_dict: Mapping[str, Any]) -> None:
        """Restore a state from :meth:`state_dict`; the part names must match."""
        if not isinstance(state_dict, Mapping) or state_dict.get("format") != _FORMAT:
            raise CheckpointError(
                "the saved optimizer state is not a combined optimizer's (was the run saved "
                "with another optimizer.name?); it cannot be restored into "
                f"{' + '.join(self.optimizers)}"
            )
        saved = state_dict["parts"]
        if set(saved) != set(self.optimizers):
            raise CheckpointError(
                f"the saved optimizer has parts {sorted(saved)}, this one has "
                f"{sorted(self.optimizers)}; the parameter grouping changed since the checkpoint"
            )
        for name, part in self.optimizers.items():
            part.load_state_dict(saved[name])

    def __repr__(self) -> str:
        inner = ", ".join(f"{name}={type(p).__name__}" for name, p in self.optimizers.items())
        return f"CombinedOptimizer({inner})"
