"""A DiLoCo node that is an FSDP group (``parallel.strategy: fsdp`` under torchrun).

The node's rooms (boundary, install, resume, the master's bootstrap) read and write whole
tensors through ``model.state_dict()``. Under FSDP each rank holds only its shards, so the
coordinator on rank 0 is given a :class:`FullStateView` instead of the sharded model: a module
of plain CPU tensors under the model's state-dict keys, filled from the shards at every sync
point and written back into every rank's shards after an install. Both moves are collectives
of the whole group, taken on the training thread at the same steps by every rank
(:class:`ShardedGroup`); the upload itself stays in the coordinator's lane.

Why gather the weights and not the delta: the baseline, the error-feedback residual, the
fragments and the pending upload of a resumed node are all kept whole by the node's state
(one codec, checkpointed by rank 0), so the pseudo-gradient is cut there, from the gathered
weights. The values are the same as a difference taken shard by shard and then gathered; the
traffic is the same too (one full copy of the model reaches rank 0 per sync point).
Ranks other than 0 never build a coordinator, so they never touch the store.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from speedtronic.fsdp import full_model_state, load_full_model_state

__all__ = ["FullStateView", "ShardedGroup"]


class FullStateView(nn.Module):
    """A module holding a full state dict as buffers under the same keys (``blocks.0.w``
    becomes buffer ``w`` of submodule ``blocks.0``): what the coordinator reads and installs
    into on rank 0 of an FSDP group. It has no forward. ``writes`` counts the
    ``load_state_dict`` calls (how a global is installed) since it was built."""

    def __init__(self, state: Mapping[str, torch.Tensor]) -> None:
        super().__init__()
        self.writes = 0
        for name, tensor in state.items():
            *path, leaf = name.split(".")
            owner: nn.Module = self
            for part in path:
                child = owner._modules.get(part)
                if child is None:
                    child = nn.Module()
                    owner.add_module(part, child)
                owner = child
            owner.register_buffer(leaf, tensor)

    def load_state_dict(
        self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False
    ) -> Any:
        """``nn.Module.load_state_dict``, counted in ``writes``."""
        self.writes += 1
        return super().load_state_dict(state_dict, strict=strict, assign=assign)

    def replace(self, state: Mapping[str, torch.Tensor]) -> None:
        """Take ``state``'s tensors as this view's (no copy; the keys must be the same; not
        counted as a write)."""
        nn.Module.load_state_dict(self, dict(state), strict=True, assign=True)


class ShardedGroup:
    """The FSDP group of one DiLoCo node, seen from one of its ranks: :meth:`gather` at a sync
    point (every rank: rank 0's :attr:`view` then holds the current weights), :meth:`scatter`
    after rank 0 changed the view (every rank: each keeps its shards of it). Building it
    gathers once (every rank)."""

    def __init__(self, model: nn.Module, is_main: bool) -> None:
        self.model = model
        self.is_main = is_main
        full = full_model_state(model, only_main=True)
        self.view: FullStateView | None = FullStateView(full) if is_main else None
        self._gathered_at = 0  # the view's write count when it last equalled the shards

    @property
    def written(self) -> bool:
        """Rank 0: whether something was installed into the view since the last
        :meth:`gather` (the shards then need :meth:`scatter`); False on the other ranks."""
        return self.view is not None and self.view.writes != self._gathered_at

    def gather(self) -> None:
        """Every rank: the model's shards, gathered whole into rank 0's view."""
        full = full_model_state(self.model, only_main=True)
        if self.view is not None:
            self.view.replace(full)
            self._gathered_at = self.view.writes

    def scatter(self) -> None:
        """Every rank: rank 0's view broadcast and loaded into each rank's shards."""
        state = dict(self.view.state_dict()) if self.view is not None else {}
        load_full_model_state(self.model, state, from_main=True)
        if self.view is not None:
            self._gathered_at = self.view.writes
